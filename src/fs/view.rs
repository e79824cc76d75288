//! A read-only FUSE view of a stored tree: the inode table answers each request and
//! loads what it needs from the object store on demand.
//!
//! Inode numbers are handed out, to all of a directory's entries at once and in order,
//! the first time its tree is loaded, and stay stable for the life of the mount (same
//! parent and name, same number): a lookup of one name numbers its whole directory, a node
//! of about 50 bytes per entry. Directories'
//! trees and large files' chunk lists are loaded once and kept with their inode; chunk
//! contents go through a bounded [`ChunkCache`]. Content never changes under a view, so
//! the kernel may cache attributes and pages freely.

use crate::sys::{Locked, ReadWriteLocked};
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, Notifier, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};

use super::chunk_cache::ChunkReader;
use super::mounted::Mounted;
use super::reply::{reply_getxattr, reply_listxattr};
use crate::cas::file::{load_chunk_list, ChunkList};
use crate::cas::{load_tree, CasError, EntryContent, ObjectStore, Tree, TreeEntry, TreeId};

/// How a view is served.
#[derive(Debug, Clone)]
pub struct ViewOptions {
    pub chunk_cache_bytes: usize,
    pub threads: usize,
    /// Let other users in (as `allow_other`); permissions are still enforced.
    pub allow_other: bool,
    /// Read the tree's directories ahead in the background, up to this many entries
    /// (0: none): a first listing then finds its tree decoded and verified already
    /// instead of reading it from the store (the overlay's lower).
    pub read_ahead_dirs: usize,
    /// Ask the kernel for FUSE over io_uring (see [`crate::fs::transport::FuseTransport`]).
    pub fuse_uring: bool,
    /// Where the files opened are noted (the overlay's lower: what a run read).
    pub reads: Option<std::sync::Arc<crate::fs::reads::ReadLog>>,
    /// Who every file belongs to.
    pub owner: crate::fs::owner::Owner,
}

impl Default for ViewOptions {
    fn default() -> Self {
        ViewOptions {
            chunk_cache_bytes: 64 << 20,
            threads: 4,
            allow_other: false,
            read_ahead_dirs: 0,
            fuse_uring: super::transport::default_uring(),
            reads: None,
            owner: crate::fs::owner::Owner::current(),
        }
    }
}

/// Immutable content: the kernel may keep attributes and entries as long as it likes
/// (a year here: fuser converts the TTL to the kernel's seconds + nanoseconds).
const TTL: Duration = Duration::from_secs(365 * 24 * 3600);

struct Node {
    parent: u64,
    place: Place,
    /// What was loaded for it: a directory's tree or a large file's chunk list.
    loaded: Option<Loaded>,
}

/// Where a node's entry is.
enum Place {
    /// At this index in its parent's tree (loaded before the node was numbered).
    In(u32),
    /// Its own: the root's, and the files of the objects view (in no tree).
    Own(Arc<TreeEntry>),
}

#[derive(Clone)]
enum Loaded {
    /// A directory's tree and the inode of its first entry: its entries are numbered
    /// together, in order, when it is loaded (one step per directory, not a hash of
    /// each name).
    Tree(Arc<Tree>, u64),
    Chunks(Arc<ChunkList>),
}

/// A node's entry, shared with the tree that holds it.
enum EntryRef {
    In(Arc<Tree>, usize),
    Own(Arc<TreeEntry>),
}

impl std::ops::Deref for EntryRef {
    type Target = TreeEntry;

    fn deref(&self) -> &TreeEntry {
        match self {
            EntryRef::In(t, i) => &t.entries()[*i],
            EntryRef::Own(e) => e,
        }
    }
}

#[derive(Default)]
struct Inodes {
    /// Index `ino - 1`.
    nodes: Vec<Node>,
    /// The objects view's files looked up, by name.
    objects: HashMap<Vec<u8>, u64>,
}

/// The filesystem: a stored tree, its inode table and a chunk cache.
pub struct TreeView {
    objects: Arc<dyn ObjectStore>,
    inodes: RwLock<Inodes>,
    /// Directory trees read ahead (`ViewOptions::read_ahead_dirs`), by id.
    ahead: Arc<RwLock<HashMap<TreeId, Arc<Tree>>>>,
    reader: ChunkReader,
    uid: u32,
    gid: u32,
    /// The root is the object directory of [`mount_objects`]: its names are file
    /// contents (`<id>-<size>`), found by lookup only.
    objects_root: bool,
    want_uring: bool,
    reads: Option<Arc<crate::fs::reads::ReadLog>>,
    listings: Listings,
    /// No entry of the tree has extended attributes ([`crate::cas::TreeFacts`]): the
    /// view says it has no xattr support, and the kernel asks no more (overlayfs asks a
    /// lower for its own attributes of every directory and file it looks up, `ls -l`
    /// for `security.selinux`: a round trip each). `getxattr` and `listxattr` are then
    /// ENOTSUP instead of ENODATA and an empty list.
    no_xattrs: bool,
}

/// Whether listings carry their files' attributes.
///
/// A `READDIRPLUS` entry with attributes makes the kernel build an inode and a dentry
/// for it; one without (`nodeid` 0) is only a name, looked up if a path walk needs it.
/// A walk that only lists (`find`, overlayfs reading the lower) is then faster cold by
/// what instantiating an inode per file costs the kernel, and one that looks at every
/// file (`ls -l`, `git status`, `rm -rf`, `grep -r`) pays a lookup per file. So a view
/// starts by listing directories with their attributes and files by name only, counts
/// the lookups that land in a directory so listed, and once there are
/// [`SPARSE_LOOKUPS`] of them lists everything with attributes and has the kernel drop
/// the listings it holds (a cached listing is not asked for again), so that the next
/// walk of a directory brings its entries in one request again.
#[derive(Default)]
struct Listings {
    /// Every entry with its attributes from now on.
    full: AtomicBool,
    /// While not `full`: the directories listed with files by name only, and how many
    /// lookups found an entry of one.
    sparse: Mutex<(HashSet<u64>, u32)>,
    /// The session's, to drop listings the kernel caches.
    notifier: Arc<OnceLock<Notifier>>,
}

/// Lookups into directories listed without their files' attributes after which a view
/// lists everything with attributes (see [`Listings`]): a workload that looks at every
/// file reaches it within a directory or two; a few `cat`s after a `find` do not.
const SPARSE_LOOKUPS: u32 = 64;

impl Listings {
    /// Whether the entries of directory `ino` now listed carry their attributes; if not,
    /// `ino` is noted.
    fn full_for(&self, ino: u64) -> bool {
        if self.full.load(Ordering::Relaxed) {
            return true;
        }
        let mut sparse = self.sparse.locked();
        // Switched meanwhile: the directories noted are gone to be dropped already.
        if self.full.load(Ordering::Relaxed) {
            return true;
        }
        sparse.0.insert(ino);
        false
    }

    /// A lookup found an entry of directory `parent`.
    fn looked_up(&self, parent: u64) {
        if self.full.load(Ordering::Relaxed) {
            return;
        }
        let mut sparse = self.sparse.locked();
        let (dirs, lookups) = &mut *sparse;
        if !dirs.contains(&parent) {
            return;
        }
        *lookups += 1;
        if *lookups < SPARSE_LOOKUPS {
            return;
        }
        self.full.store(true, Ordering::Relaxed);
        let dirs = std::mem::take(dirs);
        drop(sparse);
        let Some(n) = self.notifier.get().cloned() else {
            return;
        };
        tracing::debug!(
            "view: lookups after listings, {} listings dropped",
            dirs.len()
        );
        // Not from the request's thread: the kernel may wait on this very request to
        // drop a listing's pages. A listing answered by name only after its drop stays
        // cached so: its files cost a lookup each, nothing worse.
        let _ = std::thread::Builder::new()
            .name("casfs-listings".into())
            .spawn(move || {
                for ino in dirs {
                    // ENOENT: the kernel holds no inode of it (forgotten).
                    let _ = n.inval_inode(INodeNo(ino), 0, 0);
                }
            });
    }
}

fn eio(e: CasError) -> Errno {
    tracing::error!("{e}");
    Errno::EIO
}

fn kind_of(c: &EntryContent) -> FileType {
    match c {
        EntryContent::File(_) => FileType::RegularFile,
        EntryContent::Dir(_) => FileType::Directory,
        EntryContent::Symlink(_) => FileType::Symlink,
        EntryContent::Fifo => FileType::NamedPipe,
        EntryContent::CharDevice { .. } => FileType::CharDevice,
        EntryContent::BlockDevice { .. } => FileType::BlockDevice,
    }
}

impl TreeView {
    pub fn new(objects: Arc<dyn ObjectStore>, root: TreeId, opts: &ViewOptions) -> TreeView {
        let root_entry = TreeEntry {
            name: Vec::new(),
            content: EntryContent::Dir(root),
            mode: 0o755,
            mtime_ns: 0,
            size: 0,
            xattrs: Vec::new(),
        };
        let inodes = Inodes {
            nodes: vec![Node {
                parent: 1,
                place: Place::Own(Arc::new(root_entry)),
                loaded: None,
            }],
            objects: HashMap::new(),
        };
        let no_xattrs = objects.tree_facts(&root).is_some_and(|f| !f.xattrs);
        let ahead = Arc::new(RwLock::new(HashMap::new()));
        if opts.read_ahead_dirs > 0 {
            read_ahead(objects.clone(), root, ahead.clone(), opts.read_ahead_dirs);
        }
        TreeView {
            reader: ChunkReader::new(Arc::clone(&objects), opts.chunk_cache_bytes),
            objects,
            inodes: RwLock::new(inodes),
            ahead,
            uid: opts.owner.uid,
            gid: opts.owner.gid,
            objects_root: false,
            want_uring: opts.fuse_uring,
            reads: opts.reads.clone(),
            listings: Listings::default(),
            no_xattrs,
        }
    }

    /// A view whose root holds every file content of the store by name
    /// ([`crate::fs::erofs::data_path`]), listed as empty.
    pub fn objects(objects: Arc<dyn ObjectStore>, opts: &ViewOptions) -> TreeView {
        let empty = Tree::default();
        let mut v = TreeView::new(objects, empty.id(), opts);
        let g = v.inodes.get_mut().unwrap_or_else(|p| p.into_inner());
        g.nodes[0].loaded = Some(Loaded::Tree(Arc::new(empty), 2));
        v.objects_root = true;
        // Its files are contents: none has extended attributes.
        v.no_xattrs = true;
        v
    }

    fn entry(&self, ino: u64) -> Result<(EntryRef, u64), Errno> {
        let g = self.inodes.read_locked();
        let n = g
            .nodes
            .get((ino as usize).wrapping_sub(1))
            .ok_or(Errno::ENOENT)?;
        let e = match &n.place {
            Place::Own(e) => EntryRef::Own(e.clone()),
            Place::In(i) => match &g.nodes[n.parent as usize - 1].loaded {
                Some(Loaded::Tree(t, _)) => EntryRef::In(t.clone(), *i as usize),
                // Numbered only once its parent's tree is loaded.
                _ => return Err(Errno::EIO),
            },
        };
        Ok((e, n.parent))
    }

    /// The tree of directory `ino` and the inode of its first entry; on first use
    /// loaded (and verified) without the table locked, and its entries numbered.
    fn dir_tree(&self, ino: u64) -> Result<(Arc<Tree>, u64), Errno> {
        let i = (ino as usize).wrapping_sub(1);
        let known = |g: &Inodes| match g.nodes.get(i).map(|n| &n.loaded) {
            Some(Some(Loaded::Tree(t, first))) => Some((t.clone(), *first)),
            _ => None,
        };
        if let Some(t) = known(&self.inodes.read_locked()) {
            return Ok(t);
        }
        let (entry, _) = self.entry(ino)?;
        let EntryContent::Dir(id) = entry.content else {
            return Err(Errno::ENOTDIR);
        };
        let ahead = self.ahead.read_locked().get(&id).cloned();
        let tree = match ahead {
            Some(t) => t,
            None => Arc::new(load_tree(self.objects.as_ref(), &id).map_err(eio)?),
        };
        let mut g = self.inodes.write_locked();
        // Loaded by another request meanwhile.
        if let Some(t) = known(&g) {
            return Ok(t);
        }
        let first = g.nodes.len() as u64 + 1;
        g.nodes.extend((0..tree.len()).map(|k| Node {
            parent: ino,
            place: Place::In(k as u32),
            loaded: None,
        }));
        g.nodes[i].loaded = Some(Loaded::Tree(tree.clone(), first));
        Ok((tree, first))
    }

    /// The inode of the objects view's file `entry`, numbered on first sight.
    fn object_file(&self, entry: TreeEntry) -> u64 {
        let g = self.inodes.read_locked();
        if let Some(&ino) = g.objects.get(&entry.name) {
            return ino;
        }
        drop(g);
        let mut g = self.inodes.write_locked();
        if let Some(&ino) = g.objects.get(&entry.name) {
            return ino;
        }
        let name = entry.name.clone();
        g.nodes.push(Node {
            parent: 1,
            place: Place::Own(Arc::new(entry)),
            loaded: None,
        });
        let ino = g.nodes.len() as u64;
        g.objects.insert(name, ino);
        ino
    }

    fn attr(&self, ino: u64, e: &TreeEntry) -> FileAttr {
        let mtime = if e.mtime_ns >= 0 {
            UNIX_EPOCH + Duration::from_nanos(e.mtime_ns as u64)
        } else {
            UNIX_EPOCH - Duration::from_nanos(e.mtime_ns.unsigned_abs())
        };
        let rdev = match e.content {
            EntryContent::CharDevice { rdev } | EntryContent::BlockDevice { rdev } => rdev as u32,
            _ => 0,
        };
        let dir = matches!(e.content, EntryContent::Dir(_));
        FileAttr {
            ino: INodeNo(ino),
            size: e.size,
            blocks: e.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind: kind_of(&e.content),
            perm: e.mode as u16,
            nlink: if dir { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev,
            blksize: 4096,
            flags: 0,
        }
    }

    /// The chunk list of large file `ino`.
    /// Loaded (and verified) on first use, without the table locked.
    fn chunk_list(&self, ino: u64, e: &TreeEntry) -> Result<Arc<ChunkList>, Errno> {
        let fref = e.file_ref().ok_or(Errno::EISDIR)?;
        let i = ino as usize - 1;
        let known = |g: &Inodes| match &g.nodes[i].loaded {
            Some(Loaded::Chunks(c)) => Ok(Some(c.clone())),
            Some(Loaded::Tree(..)) => Err(Errno::EISDIR),
            None => Ok(None),
        };
        if let Some(c) = known(&self.inodes.read_locked())? {
            return Ok(c);
        }
        let list = Arc::new(load_chunk_list(self.objects.as_ref(), &fref).map_err(eio)?);
        let mut g = self.inodes.write_locked();
        if let Some(c) = known(&g)? {
            return Ok(c);
        }
        g.nodes[i].loaded = Some(Loaded::Chunks(list.clone()));
        Ok(list)
    }

    /// Up to `size` bytes of file `ino` from `offset`.
    fn read_range(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        let (e, _) = self.entry(ino)?;
        let fref = e.file_ref().ok_or(Errno::EISDIR)?;
        let mut err = None;
        let list = || {
            self.chunk_list(ino, &e).map_err(|e| {
                err = Some(e);
                CasError::Invalid("chunk list".into())
            })
        };
        match self.reader.read(&fref, list, offset, size) {
            Ok(d) => Ok(d),
            Err(e) => Err(err.unwrap_or_else(|| eio(e))),
        }
    }

    /// Lists directory `ino` from `offset` (`.` and `..` first): `add` gets each
    /// entry's inode, the offset after it, its name and its entry, and returns true
    /// once the reply is full.
    fn list(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(u64, u64, &[u8], &TreeEntry) -> bool,
    ) -> Result<(), Errno> {
        let (tree, first) = self.dir_tree(ino)?;
        let (own, parent) = self.entry(ino)?;
        let parent_entry = self.entry(parent)?.0;
        let dots = [(ino, &b"."[..], &*own), (parent, b"..", &*parent_entry)];
        for (i, (child, name, e)) in dots.into_iter().enumerate().skip(offset as usize) {
            if add(child, i as u64 + 1, name, e) {
                return Ok(());
            }
        }
        let skip = (offset as usize).saturating_sub(2);
        for (i, e) in tree.entries().iter().enumerate().skip(skip) {
            if add(first + i as u64, i as u64 + 3, &e.name, e) {
                break;
            }
        }
        Ok(())
    }
}

impl Filesystem for TreeView {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Every listing as READDIRPLUS (not adaptively): which entries carry their
        // attributes is the view's choice (`Listings`).
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
        super::transport::ask_for_uring(config, self.want_uring);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if name.len() > crate::cas::tree::MAX_NAME_LEN {
            return reply.error(Errno::ENAMETOOLONG);
        }
        let parent = parent.0;
        if self.objects_root && parent == 1 {
            let Some(f) = super::erofs::parse_data_name(name.as_bytes()) else {
                return reply.error(Errno::ENOENT);
            };
            let e = TreeEntry {
                name: name.as_bytes().to_vec(),
                content: EntryContent::File(f.id),
                mode: 0o444,
                mtime_ns: 0,
                size: f.size,
                xattrs: Vec::new(),
            };
            let attr = self.attr(self.object_file(e.clone()), &e);
            return reply.entry(&TTL, &attr, Generation(0));
        }
        let result = self.dir_tree(parent).and_then(|(tree, first)| {
            let k = tree.position(name.as_bytes()).ok_or(Errno::ENOENT)?;
            Ok(self.attr(first + k as u64, &tree.entries()[k]))
        });
        if result.is_ok() {
            self.listings.looked_up(parent);
        }
        match result {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.entry(ino.0) {
            Ok((e, _)) => reply.attr(&TTL, &self.attr(ino.0, &e)),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.entry(ino.0) {
            Ok((e, _)) => match &e.content {
                EntryContent::Symlink(t) => reply.data(t),
                _ => reply.error(Errno::EINVAL),
            },
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        match self.entry(ino.0) {
            // Content never changes under a view: let the kernel keep its pages.
            Ok((e, _)) => {
                if let (Some(log), EntryContent::File(id)) = (&self.reads, &e.content) {
                    log.note(crate::cas::FileRef {
                        id: *id,
                        size: e.size,
                    });
                }
                reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE)
            }
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.read_range(ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = self.list(ino.0, offset, |child, next, name, e| {
            reply.add(
                INodeNo(child),
                next,
                kind_of(&e.content),
                OsStr::from_bytes(name),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    /// No opendir: the kernel then sends neither opendir nor releasedir and keeps every
    /// listing in its page cache (FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE): a view never
    /// changes, so a directory is listed through the daemon once.
    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.entry(ino.0) {
            Ok((e, _)) if matches!(e.content, EntryContent::Dir(_)) => reply.error(Errno::ENOSYS),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(e),
        }
    }

    /// A listing with its entries' attributes: one request per directory instead of
    /// one lookup per name (a cold `find`, overlayfs's readdir of the lower). Files'
    /// attributes only once lookups show they are wanted ([`Listings`]).
    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let full = self.listings.full_for(ino.0);
        let r = self.list(ino.0, offset, |child, next, name, e| {
            if !full && !matches!(e.content, EntryContent::Dir(_)) {
                let kind = kind_of(&e.content);
                return reply.add_name_only(INodeNo(child), next, kind, OsStr::from_bytes(name));
            }
            let attr = self.attr(child, e);
            reply.add(
                INodeNo(child),
                next,
                OsStr::from_bytes(name),
                &TTL,
                &attr,
                Generation(0),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = self.inodes.read_locked().nodes.len() as u64;
        reply.statfs(0, 0, 0, files, 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        // ENOSYS: the kernel answers ENOTSUP itself from now on.
        if self.no_xattrs {
            return reply.error(Errno::ENOSYS);
        }
        match self.entry(ino.0) {
            Ok((e, _)) => reply_getxattr(&e.xattrs, name, size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        if self.no_xattrs {
            return reply.error(Errno::ENOSYS);
        }
        match self.entry(ino.0) {
            Ok((e, _)) => reply_listxattr(&e.xattrs, size, reply),
            Err(e) => reply.error(e),
        }
    }
}

/// Reads the directories of `root` breadth-first into `ahead` on a thread of its own,
/// until `limit` entries are held. A tree that fails to load is left to the request that
/// needs it (which reports the error).
fn read_ahead(
    objects: Arc<dyn ObjectStore>,
    root: TreeId,
    ahead: Arc<RwLock<HashMap<TreeId, Arc<Tree>>>>,
    limit: usize,
) {
    let _ = std::thread::Builder::new()
        .name("casfs-read-ahead".into())
        .spawn(move || {
            // Background work: a restore (which mounts a new view) or the workspace's
            // own requests come first.
            crate::fs::mounted::low_priority();
            let mut queue = std::collections::VecDeque::from([root]);
            let mut held = 0usize;
            while let Some(id) = queue.pop_front() {
                // The view is gone (unmounted): stop.
                if Arc::strong_count(&ahead) == 1 {
                    return;
                }
                let Ok(tree) = load_tree(objects.as_ref(), &id) else {
                    continue;
                };
                held += tree.len();
                queue.extend(tree.entries().iter().filter_map(|e| e.tree_id()));
                ahead.write_locked().insert(id, Arc::new(tree));
                if held >= limit {
                    return;
                }
            }
        });
}

/// A mounted view; unmounted when dropped or by [`Mounted::unmount`].
pub type MountedTree = Mounted;

/// Mounts the tree `root` read-only at `mountpoint`, served by background threads.
pub fn mount_tree(
    objects: Arc<dyn ObjectStore>,
    root: TreeId,
    mountpoint: &Path,
    opts: &ViewOptions,
) -> std::io::Result<MountedTree> {
    serve(TreeView::new(objects, root, opts), mountpoint, opts)
}

/// Mounts the store's file contents read-only at `mountpoint`, each at
/// `/<id>-<size>` (the data-only layer under an EROFS image of a tree,
/// [`crate::fs::erofs`]). A name that is no stored content is ENOENT; a content that
/// is named but missing or damaged is EIO when read, as in any view.
pub fn mount_objects(
    objects: Arc<dyn ObjectStore>,
    mountpoint: &Path,
    opts: &ViewOptions,
) -> std::io::Result<MountedTree> {
    serve(TreeView::objects(objects, opts), mountpoint, opts)
}

fn serve(view: TreeView, mountpoint: &Path, opts: &ViewOptions) -> std::io::Result<MountedTree> {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("casfs".into()),
        MountOption::Subtype("casfs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        // A tree is workspace content: set-id bits and devices are data, inert.
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    if opts.allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(opts.threads.max(1));
    let notifier = view.listings.notifier.clone();
    let session = fuser::spawn_mount(view, mountpoint, &config)?;
    let _ = notifier.set(session.notifier());
    Ok(Mounted::new(session, mountpoint))
}
