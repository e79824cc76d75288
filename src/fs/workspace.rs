//! The writable workspace: an overlay of clean nodes (content in the object store) and
//! dirty nodes (content in a local upper file), with a persistent dirty set, an
//! O(dirty) snapshot and an O(1) root swap.
//!
//! One mutex guards the inode table; file data moves outside it (reads of clean files
//! through the chunk cache, reads and writes of upper files with pread/pwrite, or by the
//! kernel itself through FUSE passthrough). Every metadata change writes the nodes it
//! touched to the dirty set in the same step, so a killed daemon loses nothing the
//! kernel had been told was done.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, Notifier, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::dirty::{DirtyStore, Kind, MountMeta, NodeRecord, Override};
use super::{reply_getxattr, reply_listxattr, ChunkReader, Mounted};
use crate::cas::file::{
    load_chunk_list, read_chunk, store_bytes, store_changed_chunks, store_reader_over, ChunkList,
    CHUNK_SIZE,
};
use crate::cas::tree::{MAX_NAME_LEN, MAX_SYMLINK_LEN, MAX_XATTR_NAME_LEN, MAX_XATTR_VALUE_LEN};
use crate::cas::{
    load_tree, store_tree, CasError, ChunkId, EntryContent, FileRef, ObjectStore, StoreStats, Tree,
    TreeEntry, TreeId,
};

/// How long the kernel may trust attributes and entries. Every change passes through
/// the kernel (which updates its caches itself); the one change that does not, a root
/// swap, invalidates the root's entries explicitly, and the old inodes are unreachable.
const TTL: Duration = Duration::from_secs(60);

const ROOT: u64 = 1;

/// Clean files at least this large get a local copy when opened with passthrough
/// available, so the kernel reads them itself; smaller ones go through the chunk cache.
const MATERIALIZE_MIN: u64 = 256 << 10;

/// A file at least this large that is opened for writing (without `O_TRUNC`) is
/// written through the daemon instead of passthrough, so that the daemon sees every
/// write and a checkpoint reads and hashes only the chunks written, not the whole file.
const TRACK_WRITES_MIN: u64 = 16 << 20;

/// The extended attribute holding a file's capabilities: a write removes it.
const FILE_CAPS: &[u8] = b"security.capability";

/// More changed chunks than this are not listed: the snapshot reads the file whole.
const MAX_CHANGED_CHUNKS: u64 = 1 << 16;

/// How many first-read files a workspace remembers between checkpoints.
const MAX_READS_KEPT: usize = 8192;

/// Free space (beyond the database's reserve) below which handles that may write are
/// served by the daemon, which enforces the reserve, instead of through passthrough.
const PASSTHROUGH_WRITE_ROOM: u64 = 1 << 30;

/// How a workspace is served.
#[derive(Debug, Clone)]
pub struct WorkspaceOptions {
    pub chunk_cache_bytes: usize,
    pub threads: usize,
    pub allow_other: bool,
    /// Use FUSE passthrough for files with a local copy when the kernel offers it.
    pub passthrough: bool,
    /// At most this many bytes of local copies of clean files are kept (oldest unused
    /// evicted).
    pub local_copies_bytes: u64,
}

impl Default for WorkspaceOptions {
    fn default() -> Self {
        WorkspaceOptions {
            local_copies_bytes: 2 << 30,
            chunk_cache_bytes: 64 << 20,
            threads: 4,
            allow_other: false,
            passthrough: true,
        }
    }
}

/// Errors of the workspace's own operations (the FUSE side answers with errno).
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error(transparent)]
    Cas(#[from] CasError),
    #[error(
        "{count} uncaptured change(s) (for example {example}); checkpoint them first or force"
    )]
    Uncaptured { count: usize, example: String },
    #[error("{0}")]
    Io(String),
    /// A [`SnapshotFilter`] refused an entry.
    #[error("refused: {0}")]
    Refused(String),
}

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    atime: i64,
    mtime: i64,
    ctime: i64,
    size: u64,
    /// Allocated 512-byte blocks of a local copy (0: derived from the size).
    blocks: u64,
}

impl Meta {
    /// Size, times and blocks from the stat of a local copy. A clean node's copy was
    /// made when it was first opened: its change time is not the file's.
    fn absorb(&mut self, st: &libc::stat, dirty: bool) {
        self.size = st.st_size as u64;
        self.mtime = st.st_mtime * 1_000_000_000 + st.st_mtime_nsec;
        self.atime = st.st_atime * 1_000_000_000 + st.st_atime_nsec;
        if dirty {
            self.ctime = self
                .ctime
                .max(st.st_ctime * 1_000_000_000 + st.st_ctime_nsec);
        }
        self.blocks = st.st_blocks as u64;
    }
}

enum Body {
    Dir {
        tree: Option<TreeId>,
        children: Option<BTreeMap<Vec<u8>, u64>>,
    },
    File {
        clean: Option<FileRef>,
        /// The local copy; kept open only while handles are, so that a tree of many
        /// dirty files does not hold a descriptor each.
        upper: Option<Upper>,
        chunks: Option<Arc<ChunkList>>,
    },
    Symlink(Vec<u8>),
    Other,
}

#[derive(Clone)]
enum Upper {
    Open(Arc<File>),
    Closed,
}

struct Node {
    kind: Kind,
    meta: Meta,
    nlink: u32,
    /// Where it is linked: (directory, name). A directory has exactly one.
    links: Vec<(u64, Vec<u8>)>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    body: Body,
    /// In the dirty set: it (or something below it) differs from the base.
    dirty: bool,
    /// The stored entry this node equals while it is not dirty.
    base: Option<Arc<TreeEntry>>,
    /// Open handles served by the daemon, and by passthrough.
    open_plain: u32,
    open_passthrough: u32,
    writers: u32,
    /// Handles that may write through passthrough, behind the daemon's back.
    pass_writers: u32,
    /// Which chunks of its upper file may differ from `clean` (besides its length):
    /// every write to the upper file since it last equalled `clean` went through the
    /// daemon, which noted the chunks it touched, so a snapshot reads only those.
    /// `None` when that is not known (a passthrough writer, a remount): the snapshot
    /// reads the whole file. Whatever shortens the file notes everything it cut, so
    /// the zeros a later write past the end leaves lie in noted chunks or beyond
    /// `clean` (chunks the snapshot reads anyway): writes note only what they write.
    changed_chunks: Option<BTreeSet<u64>>,
    backing: Option<Arc<BackingId>>,
}

impl Node {
    fn parent(&self) -> u64 {
        self.links.first().map(|l| l.0).unwrap_or(ROOT)
    }

    /// Takes size, times and blocks from the stat of its local copy.
    fn absorb(&mut self, st: &libc::stat) {
        let dirty = self.dirty;
        self.meta.absorb(st, dirty);
    }

    /// Set-id bits or file capabilities, which a write must clear: passthrough writes
    /// would not reach the daemon that clears them.
    fn has_privs(&self) -> bool {
        self.meta.mode & (libc::S_ISUID | libc::S_ISGID) != 0
            || self.xattrs.iter().any(|(k, _)| k == FILE_CAPS)
    }

    /// Notes that bytes `from..to` of its upper file may have changed.
    fn note_changed(&mut self, from: u64, to: u64) {
        let Some(set) = &mut self.changed_chunks else {
            return;
        };
        if from >= to {
            return;
        }
        let c = CHUNK_SIZE as u64;
        let (first, end) = (from / c, to.div_ceil(c));
        if end - first > MAX_CHANGED_CHUNKS || set.len() as u64 > MAX_CHANGED_CHUNKS {
            // Mostly changed anyway: the snapshot reads it whole.
            self.changed_chunks = None;
            return;
        }
        set.extend(first..end);
    }

    /// Closes its local copy (no handle needs it), keeping what its stat says: a closed
    /// copy changes only through the daemon, which updates the node itself.
    fn close_upper(&mut self) {
        let st = match &self.body {
            Body::File {
                upper: Some(Upper::Open(f)),
                ..
            } => fstat(f).ok(),
            _ => return,
        };
        if let Some(st) = st {
            self.absorb(&st);
        }
        if let Body::File { upper: Some(u), .. } = &mut self.body {
            *u = Upper::Closed;
        }
    }
}

/// What a file handle reads when its node is gone (after a root swap).
#[derive(Clone)]
enum Src {
    Upper(Arc<File>),
    Clean(FileRef),
    None,
}

struct Handle {
    ino: u64,
    /// Opened for writing (counted in its node's `writers`).
    write: bool,
    src: Src,
    backing: Option<Arc<BackingId>>,
}

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    base: TreeId,
    tag: serde_json::Value,
    dirty: BTreeSet<u64>,
    events: Events,
    copies: Copies,
}

/// Local copies of clean files (made for passthrough reads, or left by a checkpoint
/// of a written file) that no handle has open: kept for the next open, evicted oldest
/// first beyond the workspace's limit (reads then come from the store again).
#[derive(Default)]
struct Copies {
    /// (inode, generation), oldest first; entries whose generation is not the one in
    /// `sizes` are stale.
    order: std::collections::VecDeque<(u64, u64)>,
    /// inode -> (size, generation)
    sizes: HashMap<u64, (u64, u64)>,
    bytes: u64,
    generation: u64,
}

/// Subscribers to the workspace's changes, and the last sequence number given out.
#[derive(Default)]
struct Events {
    seq: u64,
    subscribers: Vec<std::sync::mpsc::Sender<FsEvent>>,
}

/// A change to the workspace as the mount saw it. Sequence numbers grow by one per
/// event in the order the changes were made.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FsEvent {
    pub seq: u64,
    pub kind: FsEventKind,
    /// Relative to the workspace root; for a rename, where it was.
    pub path: String,
    /// For a rename, where it is now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    pub is_dir: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FsEventKind {
    Create,
    /// Content changed: a handle that was open for writing was closed (writes through
    /// passthrough never reach the daemon, the close does), or a file was truncated by
    /// path (a truncate through a writing handle is announced by its close).
    Modify,
    Delete,
    Rename,
}

/// Counts of what a snapshot did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SnapshotStats {
    pub files_hashed: u64,
    pub bytes_hashed: u64,
    pub dirs_written: u64,
    pub new_objects: u64,
    pub new_bytes: u64,
    pub reused_objects: u64,
    /// Sockets left out (they cannot be stored).
    pub skipped: u64,
    /// Files (and other non-directories) added or modified.
    pub changed_paths: Vec<String>,
    /// Entries of the previous tree that are gone (a removed directory counts once).
    pub removed_paths: Vec<String>,
}

/// What a snapshot keeps of the changed entries, and in what form: the middleware's
/// capture policy (globs, sizes) and secret scrubbing. Entries it leaves out or stores
/// in another form stay dirty, so the workspace keeps showing them as they are and the
/// next snapshot looks at them again.
pub trait SnapshotFilter: Sync {
    /// Whether the changed entry at `path` (relative, '/'-separated) goes in. `size` is
    /// a file's length (0 for the rest).
    fn keep(&self, path: &str, kind: EntryKind, size: u64) -> bool;

    /// The content to store for the changed regular file at `path` instead of what
    /// `file` holds (read from its start), or `None` to store it as it is. An error
    /// fails the snapshot.
    fn transform(&self, path: &str, file: &mut File, size: u64) -> Result<Option<Vec<u8>>, String>;

    /// Vets an entry of a changed directory (`dir`, relative) before the directory's
    /// tree is stored: its name, symlink target and extended attributes. An error fails
    /// the snapshot, and no tree naming the entry has been stored.
    fn vet(&self, _dir: &str, _entry: &TreeEntry) -> Result<(), String> {
        Ok(())
    }
}

/// What a snapshot's walk carries along.
struct BuildCx<'a> {
    stats: &'a mut SnapshotStats,
    /// Nodes written, with their new entries.
    done: Vec<(u64, Arc<TreeEntry>)>,
    /// Nodes the filter left out or stored in another form: they stay dirty.
    keep_dirty: Vec<u64>,
    filter: Option<&'a dyn SnapshotFilter>,
}

/// The kind of a changed entry, as a [`SnapshotFilter`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Special,
}

/// The dirty set at a glance.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkspaceStatus {
    pub base: TreeId,
    pub dirty_nodes: usize,
    pub dirty_files: usize,
    pub dirty_bytes: u64,
    pub dirty_paths: Vec<String>,
    pub nodes_loaded: usize,
    pub read_mode: &'static str,
}

/// The shared core of a mounted workspace: the FUSE side and the control side both
/// hold it.
pub struct Workspace {
    objects: Arc<dyn ObjectStore>,
    dirty: DirtyStore,
    upper_dir: PathBuf,
    upper_fd: OwnedFd,
    reaper: std::sync::mpsc::Sender<u64>,
    state: Mutex<State>,
    /// Writes hold it shared; a snapshot holds it exclusively.
    barrier: RwLock<()>,
    reader: ChunkReader,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    next_tmp: AtomicU64,
    want_passthrough: bool,
    passthrough: AtomicBool,
    notifier: OnceLock<Notifier>,
    owner: (u32, u32),
    mounted_at: i64,
    /// Limit of [`Copies`] in bytes.
    copies_limit: u64,
    /// Clean files opened since the last checkpoint, in first-open order.
    reads: Mutex<(std::collections::HashSet<crate::cas::FileId>, Vec<FileRef>)>,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn to_time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

fn time_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

fn eio(e: CasError) -> Errno {
    if e.is_no_space() {
        tracing::warn!("{e}");
        return Errno::ENOSPC;
    }
    tracing::error!("{e}");
    Errno::EIO
}

fn io_errno(e: std::io::Error) -> Errno {
    Errno::from(e)
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
        Kind::Socket => FileType::Socket,
    }
}

fn kind_of_mode(mode: u32) -> Option<Kind> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => Some(Kind::File),
        libc::S_IFDIR => Some(Kind::Dir),
        libc::S_IFLNK => Some(Kind::Symlink),
        libc::S_IFIFO => Some(Kind::Fifo),
        libc::S_IFCHR => Some(Kind::CharDev),
        libc::S_IFBLK => Some(Kind::BlockDev),
        libc::S_IFSOCK => Some(Kind::Socket),
        _ => None,
    }
}

fn fstat(f: &File) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-parameter for fstat on an open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(f.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

fn set_file_times(f: &File, atime: Option<i64>, mtime: Option<i64>) -> std::io::Result<()> {
    let ts = |t: Option<i64>| match t {
        Some(ns) => libc::timespec {
            tv_sec: ns.div_euclid(1_000_000_000),
            tv_nsec: ns.rem_euclid(1_000_000_000),
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    };
    let times = [ts(atime), ts(mtime)];
    // SAFETY: a valid fd and two timespecs.
    if unsafe { libc::futimens(f.as_raw_fd(), times.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How long the reaper lets removals of upper files gather between batches.
const REAP_PAUSE: Duration = Duration::from_millis(20);

/// Most links a file may have (ext4's figure): `link` refuses one more with EMLINK.
const LINK_MAX: u32 = 65_000;

fn check_name(name: &[u8]) -> Result<(), Errno> {
    if name.len() > MAX_NAME_LEN {
        return Err(Errno::ENAMETOOLONG);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

fn node_from_entry(e: &TreeEntry, dir: u64, owner: (u32, u32)) -> Node {
    let (kind, body, rdev) = match &e.content {
        EntryContent::File(_) => (
            Kind::File,
            Body::File {
                clean: e.file_ref(),
                upper: None,
                chunks: None,
            },
            0,
        ),
        EntryContent::Dir(t) => (
            Kind::Dir,
            Body::Dir {
                tree: Some(*t),
                children: None,
            },
            0,
        ),
        EntryContent::Symlink(t) => (Kind::Symlink, Body::Symlink(t.clone()), 0),
        EntryContent::Fifo => (Kind::Fifo, Body::Other, 0),
        EntryContent::CharDevice { rdev } => (Kind::CharDev, Body::Other, *rdev),
        EntryContent::BlockDevice { rdev } => (Kind::BlockDev, Body::Other, *rdev),
    };
    Node {
        kind,
        meta: Meta {
            mode: e.mode,
            uid: owner.0,
            gid: owner.1,
            rdev,
            atime: e.mtime_ns,
            mtime: e.mtime_ns,
            ctime: e.mtime_ns,
            size: e.size,
            blocks: 0,
        },
        nlink: if kind == Kind::Dir { 2 } else { 1 },
        links: vec![(dir, e.name.clone())],
        xattrs: e.xattrs.clone(),
        body,
        dirty: false,
        base: Some(Arc::new(e.clone())),
        open_plain: 0,
        open_passthrough: 0,
        writers: 0,
        pass_writers: 0,
        changed_chunks: None,
        backing: None,
    }
}

fn record_of(n: &Node) -> NodeRecord {
    let (tree, clean, upper, target) = match &n.body {
        Body::Dir { tree, .. } => (*tree, None, false, None),
        Body::File { clean, upper, .. } => (
            None,
            if upper.is_some() {
                None
            } else {
                clean.map(|c| c.id)
            },
            upper.is_some(),
            None,
        ),
        Body::Symlink(t) => (None, None, false, Some(t.clone())),
        Body::Other => (None, None, false, None),
    };
    NodeRecord {
        kind: n.kind,
        mode: n.meta.mode,
        uid: n.meta.uid,
        gid: n.meta.gid,
        rdev: n.meta.rdev,
        atime_ns: n.meta.atime,
        mtime_ns: n.meta.mtime,
        ctime_ns: n.meta.ctime,
        size: n.meta.size,
        nlink: n.nlink,
        xattrs: n.xattrs.clone(),
        tree,
        clean,
        upper,
        target,
    }
}

/// A locked state with what it needs to persist changes.
struct Tx<'a> {
    ws: &'a Workspace,
    st: MutexGuard<'a, State>,
    batch: crate::cas::Batch,
    /// Changes to announce once the batch is written.
    events: Vec<(FsEventKind, String, Option<String>, bool)>,
}

impl<'a> Tx<'a> {
    fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.st.nodes.get(&ino).ok_or(Errno::ESTALE)
    }

    fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.st.nodes.get_mut(&ino).ok_or(Errno::ESTALE)
    }

    fn alloc(&mut self, node: Node) -> u64 {
        let ino = self.st.next_ino;
        self.st.next_ino += 1;
        self.st.nodes.insert(ino, node);
        ino
    }

    /// The children of directory `ino`, loaded from its tree and overrides on first use.
    fn children(&mut self, ino: u64) -> Result<&BTreeMap<Vec<u8>, u64>, Errno> {
        self.load_dir(ino)?;
        match &self.node(ino)?.body {
            Body::Dir {
                children: Some(c), ..
            } => Ok(c),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn load_dir(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node(ino)?;
        let (tree, dirty) = match &n.body {
            Body::Dir {
                children: Some(_), ..
            } => return Ok(()),
            Body::Dir { tree, .. } => (*tree, n.dirty),
            _ => return Err(Errno::ENOTDIR),
        };
        let mut children = BTreeMap::new();
        if let Some(t) = tree {
            let tree = load_tree(self.ws.objects.as_ref(), &t).map_err(eio)?;
            for e in tree.into_entries() {
                let node = node_from_entry(&e, ino, self.ws.owner);
                let child = self.alloc(node);
                children.insert(e.name, child);
            }
        }
        if dirty {
            for (name, o) in self.ws.dirty.entries(ino).map_err(eio)? {
                if let Some(old) = children.remove(&name) {
                    self.st.nodes.remove(&old);
                }
                if let Override::Node(c) = o {
                    match self.st.nodes.get_mut(&c) {
                        Some(child) => {
                            if !child.links.iter().any(|l| l.0 == ino && l.1 == name) {
                                child.links.push((ino, name.clone()));
                            }
                            children.insert(name, c);
                        }
                        None => tracing::error!(
                            "dirty set: entry {:?} of directory {ino} names missing node {c}",
                            String::from_utf8_lossy(&name)
                        ),
                    }
                }
            }
        }
        let subdirs = children
            .values()
            .filter(|c| self.st.nodes.get(c).is_some_and(|n| n.kind == Kind::Dir))
            .count() as u32;
        let n = self.node_mut(ino)?;
        n.nlink = 2 + subdirs;
        if let Body::Dir { children: c, .. } = &mut n.body {
            *c = Some(children);
        }
        Ok(())
    }

    /// Whether directory `dir` is `ancestor` or below it.
    fn is_within(&self, dir: u64, ancestor: u64) -> Result<bool, Errno> {
        let mut cur = dir;
        loop {
            if cur == ancestor {
                return Ok(true);
            }
            if cur == ROOT {
                return Ok(false);
            }
            cur = self.node(cur)?.parent();
        }
    }

    fn lookup(&mut self, parent: u64, name: &[u8]) -> Result<Option<u64>, Errno> {
        Ok(self.children(parent)?.get(name).copied())
    }

    /// Writes node `ino`'s record and makes sure every directory that links it is dirty
    /// and points at it.
    fn persist(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node(ino)?;
        let rec = record_of(n);
        let was_dirty = n.dirty;
        let links = n.links.clone();
        self.ws.dirty.put_node(&mut self.batch, ino, &rec);
        if was_dirty {
            return Ok(());
        }
        self.node_mut(ino)?.dirty = true;
        self.st.dirty.insert(ino);
        for (dir, name) in links {
            self.ws
                .dirty
                .put_entry(&mut self.batch, dir, &name, Override::Node(ino));
            if !self.node(dir)?.dirty {
                self.persist(dir)?;
            }
        }
        Ok(())
    }

    /// Marks directory `dir`'s content changed now and persists it.
    fn touch_dir(&mut self, dir: u64) -> Result<(), Errno> {
        let t = now_ns();
        let n = self.node_mut(dir)?;
        n.meta.mtime = t;
        n.meta.ctime = t;
        self.persist(dir)
    }

    fn attach(&mut self, dir: u64, name: &[u8], child: u64) -> Result<(), Errno> {
        let is_dir = self.node(child)?.kind == Kind::Dir;
        {
            let c = self.node_mut(child)?;
            c.links.push((dir, name.to_vec()));
        }
        let d = self.node_mut(dir)?;
        if let Body::Dir {
            children: Some(ch), ..
        } = &mut d.body
        {
            ch.insert(name.to_vec(), child);
            if is_dir {
                d.nlink += 1;
            }
        }
        if self.node(child)?.dirty {
            self.ws
                .dirty
                .put_entry(&mut self.batch, dir, name, Override::Node(child));
        }
        self.touch_dir(dir)?;
        self.persist(child)
    }

    /// Removes entry `name` from `dir` (the node stays in the table).
    fn detach(&mut self, dir: u64, name: &[u8]) -> Result<u64, Errno> {
        let child = self.lookup(dir, name)?.ok_or(Errno::ENOENT)?;
        let is_dir = self.node(child)?.kind == Kind::Dir;
        let d = self.node_mut(dir)?;
        if let Body::Dir {
            children: Some(ch), ..
        } = &mut d.body
        {
            ch.remove(name);
            if is_dir {
                d.nlink -= 1;
            }
        }
        let c = self.node_mut(child)?;
        c.links.retain(|l| !(l.0 == dir && l.1 == name));
        self.ws
            .dirty
            .put_entry(&mut self.batch, dir, name, Override::Whiteout);
        self.touch_dir(dir)?;
        Ok(child)
    }

    /// Drops a node that no directory links any more, unless it is open.
    /// Counts `ino`'s local copy among the unused ones, if it has one and is clean and
    /// closed; evicts the oldest beyond the limit.
    fn note_copy(&mut self, ino: u64) {
        let Some(n) = self.st.nodes.get(&ino) else {
            return;
        };
        let size = match &n.body {
            Body::File {
                clean: Some(c),
                upper: Some(_),
                ..
            } if !n.dirty && n.open_plain + n.open_passthrough == 0 => c.size,
            _ => return,
        };
        let copies = &mut self.st.copies;
        if !copies.sizes.contains_key(&ino) {
            copies.generation += 1;
            copies.sizes.insert(ino, (size, copies.generation));
            copies.bytes += size;
            copies.order.push_back((ino, copies.generation));
        }
        while self.st.copies.bytes > self.ws.copies_limit {
            let Some((old, generation)) = self.st.copies.order.pop_front() else {
                break;
            };
            match self.st.copies.sizes.get(&old) {
                Some(&(sz, g)) if g == generation => {
                    self.st.copies.sizes.remove(&old);
                    self.st.copies.bytes -= sz;
                }
                _ => continue,
            }
            let Some(n) = self.st.nodes.get_mut(&old) else {
                continue;
            };
            let idle = !n.dirty && n.open_plain + n.open_passthrough == 0;
            if let Body::File {
                clean: Some(_),
                upper,
                ..
            } = &mut n.body
            {
                if idle && upper.is_some() {
                    *upper = None;
                    self.ws.remove_upper(old);
                }
            }
        }
    }

    /// `ino`'s copy is in use, changed or gone: no longer an unused copy.
    fn forget_copy(&mut self, ino: u64) {
        if let Some((sz, _)) = self.st.copies.sizes.remove(&ino) {
            self.st.copies.bytes -= sz;
        }
        // Its place in `order` goes stale (a later note gets a new generation).
        let c = &mut self.st.copies;
        if c.order.len() > 64 && c.order.len() > 4 * c.sizes.len() {
            let sizes = &c.sizes;
            c.order
                .retain(|(i, g)| sizes.get(i).is_some_and(|&(_, g2)| g2 == *g));
        }
    }

    fn maybe_free(&mut self, ino: u64) {
        let Some(n) = self.st.nodes.get(&ino) else {
            return;
        };
        if !n.links.is_empty() || n.open_plain + n.open_passthrough > 0 {
            return;
        }
        self.forget_copy(ino);
        let n = self.st.nodes.remove(&ino).expect("present");
        if n.dirty {
            self.ws.dirty.delete_node(&mut self.batch, ino);
        }
        self.st.dirty.remove(&ino);
        if let Body::File { upper: Some(_), .. } = n.body {
            self.ws.remove_upper(ino);
        }
        if let Body::Dir {
            children: Some(ch), ..
        } = n.body
        {
            // An empty directory has no children; a replaced tree's clean nodes go too.
            for c in ch.values() {
                self.st.nodes.remove(c);
            }
        }
    }

    /// Node `ino`'s metadata changed at `t`: it no longer equals its base entry, and its
    /// record (with its links) is written.
    fn changed(&mut self, ino: u64, t: i64) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        n.meta.ctime = t;
        n.base = None;
        self.persist(ino)
    }

    /// What a write or truncate does to a file, as the kernel's VFS does it (the daemon
    /// does it here: FUSE_HANDLE_KILLPRIV_V2). By a caller without `CAP_FSETID`
    /// (`by: Some(request)`): setuid goes, and setgid if the group may execute or the
    /// caller is not in the file's group. File capabilities go in any case. Persists
    /// only a change.
    fn kill_privs(&mut self, ino: u64, by: Option<&Request>) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        if n.kind != Kind::File {
            return Ok(());
        }
        let before = (n.meta.mode, n.xattrs.len());
        if let Some(req) = by {
            n.meta.mode &= !libc::S_ISUID;
            if n.meta.mode & libc::S_ISGID != 0
                && (n.meta.mode & libc::S_IXGRP != 0 || !in_group(req, n.meta.gid))
            {
                n.meta.mode &= !libc::S_ISGID;
            }
        }
        n.xattrs.retain(|(k, _)| k != FILE_CAPS);
        if (n.meta.mode, n.xattrs.len()) != before {
            self.changed(ino, now_ns())?;
        }
        Ok(())
    }

    /// One name of `ino` was detached: a directory is gone, a file loses a link and goes
    /// with its last one (once closed).
    fn drop_link(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        n.nlink = if n.kind == Kind::Dir {
            0
        } else {
            n.nlink.saturating_sub(1)
        };
        let t = now_ns();
        n.meta.ctime = t;
        if n.nlink > 0 {
            self.changed(ino, t)?;
        }
        self.maybe_free(ino);
        Ok(())
    }

    /// Closes the upper file of `ino` if no handle needs it open.
    fn close_if_idle(&mut self, ino: u64) {
        if let Some(n) = self.st.nodes.get_mut(&ino) {
            if n.open_plain + n.open_passthrough == 0 {
                n.close_upper();
            }
        }
    }

    fn commit(mut self) -> Result<(), Errno> {
        if !self.batch.is_empty() {
            let batch = std::mem::take(&mut self.batch);
            self.ws.dirty.commit(batch).map_err(eio)?;
        }
        // Sent while the table is held: subscribers see changes in the order made.
        let events = std::mem::take(&mut self.events);
        let ev = &mut self.st.events;
        for (kind, path, to, is_dir) in events {
            ev.seq += 1;
            let e = FsEvent {
                seq: ev.seq,
                kind,
                path,
                to,
                is_dir,
            };
            ev.subscribers.retain(|s| s.send(e.clone()).is_ok());
        }
        Ok(())
    }

    /// Whether anyone listens for changes (paths are worked out only then).
    fn watched(&self) -> bool {
        !self.st.events.subscribers.is_empty()
    }

    /// The path of entry `name` of directory `dir`.
    fn entry_path(&self, dir: u64, name: &[u8]) -> String {
        let d = self.path_of(dir);
        let n = String::from_utf8_lossy(name);
        if d.is_empty() {
            n.into_owned()
        } else {
            format!("{d}/{n}")
        }
    }

    /// Announces that entry `n1` of `p` becomes entry `n2` of `np`.
    fn rename_event(&mut self, p: u64, n1: &[u8], np: u64, n2: &[u8], is_dir: bool) {
        if self.watched() {
            let (from, to) = (self.entry_path(p, n1), self.entry_path(np, n2));
            self.events
                .push((FsEventKind::Rename, from, Some(to), is_dir));
        }
    }

    /// Announces a change to entry `name` of `dir` when the transaction commits.
    fn event(&mut self, kind: FsEventKind, dir: u64, name: &[u8], is_dir: bool) {
        if self.watched() {
            let path = self.entry_path(dir, name);
            self.events.push((kind, path, None, is_dir));
        }
    }

    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        Ok(self.ws.attr_of(ino, self.node(ino)?))
    }

    /// Gives file `ino` an upper file holding its current content.
    fn copy_up(&mut self, ino: u64, truncate: bool) -> Result<Arc<File>, Errno> {
        self.forget_copy(ino);
        let n = self.node(ino)?;
        let dirty = n.dirty;
        let existing = match &n.body {
            Body::File { upper: Some(u), .. } => Some(u.clone()),
            _ => None,
        };
        if let Some(u) = existing {
            let u = self.ws.upper_file(ino, &u).map_err(io_errno)?;
            // Open now: whoever changes it closes it (handle release, or close_if_idle),
            // which takes its new size and times.
            if let Body::File { upper, .. } = &mut self.node_mut(ino)?.body {
                *upper = Some(Upper::Open(u.clone()));
            }
            if truncate {
                let old = fstat(&u).map_err(io_errno)?.st_size as u64;
                u.set_len(0).map_err(io_errno)?;
                self.node_mut(ino)?.note_changed(0, old);
            }
            if !dirty {
                self.persist(ino)?;
            }
            return Ok(u);
        }
        let n = self.node(ino)?;
        let (clean, mtime, atime) = match &n.body {
            Body::File { clean, .. } => (*clean, n.meta.mtime, n.meta.atime),
            Body::Dir { .. } => return Err(Errno::EISDIR),
            _ => return Err(Errno::EINVAL),
        };
        let f = self.ws.create_upper(ino).map_err(io_errno)?;
        if let (Some(c), false) = (clean, truncate) {
            self.ws.fill_upper(&f, &c)?;
        }
        if !truncate {
            set_file_times(&f, Some(atime), Some(mtime)).map_err(io_errno)?;
        }
        let f = Arc::new(f);
        // `clean` stays: the content the copy started from, whose chunks the next
        // snapshot need not store again.
        if let Body::File { upper, .. } = &mut self.node_mut(ino)?.body {
            *upper = Some(Upper::Open(f.clone()));
        }
        let n = self.node_mut(ino)?;
        // Equal to `clean` until something writes it; emptied, it differs everywhere.
        n.changed_chunks = Some(BTreeSet::new());
        if let (Some(c), true) = (clean, truncate) {
            n.note_changed(0, c.size);
        }
        n.base = None;
        if truncate {
            n.meta.ctime = now_ns();
        }
        // The record changes even when already dirty: it now has an upper file.
        self.persist(ino)?;
        Ok(f)
    }

    fn make_node(&self, kind: Kind, mode: u32, req: &Request, parent: u64, body: Body) -> Node {
        let t = now_ns();
        let pm = self
            .st
            .nodes
            .get(&parent)
            .map(|p| p.meta)
            .unwrap_or_default();
        let mut mode = mode & 0o7777;
        let gid = if pm.mode & libc::S_ISGID != 0 {
            if kind == Kind::Dir {
                mode |= libc::S_ISGID;
            }
            pm.gid
        } else {
            req.gid()
        };
        Node {
            kind,
            meta: Meta {
                mode,
                uid: req.uid(),
                gid,
                rdev: 0,
                atime: t,
                mtime: t,
                ctime: t,
                size: 0,
                blocks: 0,
            },
            nlink: if kind == Kind::Dir { 2 } else { 1 },
            links: Vec::new(),
            xattrs: Vec::new(),
            body,
            dirty: false,
            base: None,
            open_plain: 0,
            open_passthrough: 0,
            writers: 0,
            pass_writers: 0,
            changed_chunks: None,
            backing: None,
        }
    }

    fn path_of(&self, ino: u64) -> String {
        let mut parts = Vec::new();
        let mut cur = ino;
        let mut guard = 0;
        while cur != ROOT && guard < 4096 {
            let Some(n) = self.st.nodes.get(&cur) else {
                break;
            };
            let Some((p, name)) = n.links.first() else {
                return format!("(unlinked inode {ino})");
            };
            parts.push(String::from_utf8_lossy(name).into_owned());
            cur = *p;
            guard += 1;
        }
        parts.reverse();
        parts.join("/")
    }

    /// Builds and stores the tree of dirty directory `ino`; returns its id.
    fn build(&mut self, ino: u64, cx: &mut BuildCx<'_>) -> Result<TreeId, WorkspaceError> {
        self.load_dir(ino)
            .map_err(|e| WorkspaceError::Io(format!("loading {}: {e:?}", self.path_of(ino))))?;
        let children: Vec<(Vec<u8>, u64)> = match &self.st.nodes[&ino].body {
            Body::Dir {
                children: Some(c), ..
            } => c.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            _ => unreachable!("loaded above"),
        };
        let mut entries = Vec::with_capacity(children.len());
        let mut cas = StoreStats::default();
        for (name, child) in children {
            let n = &self.st.nodes[&child];
            if !n.dirty {
                let base = n.base.as_ref().expect("a clean node has a base entry");
                if base.name == name {
                    entries.push((**base).clone());
                } else {
                    let mut e = (**base).clone();
                    e.name = name;
                    entries.push(e);
                }
                continue;
            }
            let meta = n.meta;
            let xattrs = n.xattrs.clone();
            if let Some(f) = cx.filter {
                let kind = match n.kind {
                    Kind::Dir => EntryKind::Dir,
                    Kind::File => EntryKind::File,
                    Kind::Symlink => EntryKind::Symlink,
                    _ => EntryKind::Special,
                };
                // The upper file's own size: writes through passthrough reach the
                // node's attributes only when its handle is released, which the kernel
                // does not wait for.
                let size = match &n.body {
                    Body::File { upper: Some(_), .. } => {
                        std::fs::metadata(self.ws.upper_path(child)).map_or(meta.size, |m| m.len())
                    }
                    Body::File { .. } => meta.size,
                    _ => 0,
                };
                if !f.keep(&self.path_of(child), kind, size) {
                    cx.keep_dirty.push(child);
                    continue;
                }
            }
            let (content, size, mtime, mode) = match n.kind {
                Kind::Dir => {
                    let id = self.build(child, cx)?;
                    (EntryContent::Dir(id), 0, meta.mtime, meta.mode)
                }
                Kind::File => {
                    let (clean, upper) = match &n.body {
                        Body::File { clean, upper, .. } => (*clean, upper.clone()),
                        _ => unreachable!(),
                    };
                    let changed = n.changed_chunks.clone();
                    let (fref, mtime) = match (upper, clean) {
                        (Some(_), _) => {
                            let path = self.ws.upper_path(child);
                            let mut f = File::open(&path).map_err(|e| {
                                WorkspaceError::Io(format!("{}: {e}", path.display()))
                            })?;
                            let st = fstat(&f).map_err(|e| {
                                WorkspaceError::Io(format!("{}: {e}", path.display()))
                            })?;
                            let base = match clean {
                                Some(c) if c.is_chunked() => {
                                    load_chunk_list(self.ws.objects.as_ref(), &c).ok()
                                }
                                _ => None,
                            };
                            let rel = self.path_of(child);
                            let other = match cx.filter {
                                Some(filt) => filt
                                    .transform(&rel, &mut f, st.st_size as u64)
                                    .map_err(|e| WorkspaceError::Io(format!("{rel}: {e}")))?,
                                None => None,
                            };
                            let size = st.st_size as u64;
                            let (fref, hashed) = match (other, changed, &base) {
                                (Some(data), _, _) => {
                                    // Stored in another form: the workspace keeps its own.
                                    cx.keep_dirty.push(child);
                                    let r = store_bytes(self.ws.objects.as_ref(), &data, &mut cas)?;
                                    (r, data.len() as u64)
                                }
                                // Every write since it equalled `clean` was seen: read only
                                // the chunks they touched.
                                (None, Some(changed), Some(base)) if size > CHUNK_SIZE as u64 => {
                                    store_changed_chunks(
                                        self.ws.objects.as_ref(),
                                        &f,
                                        &path,
                                        size,
                                        base,
                                        &changed,
                                        &mut cas,
                                    )?
                                }
                                (None, _, _) => {
                                    use std::io::Seek;
                                    f.rewind().map_err(|e| {
                                        WorkspaceError::Io(format!("{}: {e}", path.display()))
                                    })?;
                                    let r = store_reader_over(
                                        self.ws.objects.as_ref(),
                                        &mut f,
                                        &path,
                                        base.as_ref(),
                                        &mut cas,
                                    )?;
                                    (r, r.size)
                                }
                            };
                            cx.stats.files_hashed += 1;
                            cx.stats.bytes_hashed += hashed;
                            cx.stats.changed_paths.push(self.path_of(child));
                            let mtime = st.st_mtime * 1_000_000_000 + st.st_mtime_nsec;
                            (fref, mtime)
                        }
                        (None, Some(c)) => {
                            cx.stats.changed_paths.push(self.path_of(child));
                            (c, meta.mtime)
                        }
                        (None, None) => {
                            return Err(WorkspaceError::Io(format!(
                                "{}: content lost (no upper file)",
                                self.path_of(child)
                            )))
                        }
                    };
                    (EntryContent::File(fref.id), fref.size, mtime, meta.mode)
                }
                Kind::Symlink => {
                    cx.stats.changed_paths.push(self.path_of(child));
                    let t = match &n.body {
                        Body::Symlink(t) => t.clone(),
                        _ => unreachable!(),
                    };
                    let len = t.len() as u64;
                    (EntryContent::Symlink(t), len, meta.mtime, 0o777)
                }
                Kind::Fifo => (EntryContent::Fifo, 0, meta.mtime, meta.mode),
                Kind::CharDev => (
                    EntryContent::CharDevice { rdev: meta.rdev },
                    0,
                    meta.mtime,
                    meta.mode,
                ),
                Kind::BlockDev => (
                    EntryContent::BlockDevice { rdev: meta.rdev },
                    0,
                    meta.mtime,
                    meta.mode,
                ),
                Kind::Socket => {
                    cx.stats.skipped += 1;
                    continue;
                }
            };
            let e = TreeEntry {
                name,
                content,
                mode,
                mtime_ns: mtime,
                size,
                xattrs,
            };
            cx.done.push((child, Arc::new(e.clone())));
            entries.push(e);
        }
        // What the previous tree of this directory had that is gone now.
        if let Some(Body::Dir {
            tree: Some(prev), ..
        }) = self.st.nodes.get(&ino).map(|n| &n.body)
        {
            let prev = load_tree(self.ws.objects.as_ref(), prev)?;
            let dir = self.path_of(ino);
            for e in prev.entries() {
                if entries
                    .binary_search_by(|x| x.name.as_slice().cmp(&e.name))
                    .is_err()
                {
                    let name = String::from_utf8_lossy(&e.name);
                    cx.stats.removed_paths.push(if dir.is_empty() {
                        name.into_owned()
                    } else {
                        format!("{dir}/{name}")
                    });
                }
            }
        }
        if let Some(f) = cx.filter {
            // Before the tree is stored: a refused entry leaves no object naming it.
            let dir = self.path_of(ino);
            for e in &entries {
                f.vet(&dir, e).map_err(WorkspaceError::Refused)?;
            }
        }
        let tree = Tree::from_sorted_entries(entries)
            .map_err(|e| WorkspaceError::Io(format!("directory {}: {e}", self.path_of(ino))))?;
        let (id, p) = store_tree(self.ws.objects.as_ref(), &tree)?;
        cas.record(&p);
        let stats = &mut *cx.stats;
        stats.dirs_written += 1;
        stats.new_objects += cas.new_objects;
        stats.new_bytes += cas.new_bytes;
        stats.reused_objects += cas.reused_objects;
        Ok(id)
    }
}

impl Workspace {
    /// Opens the workspace of mount `key`: picks up its dirty set if it has one (its base
    /// wins over `base`; [`Workspace::base`] tells), else starts clean at `base`.
    pub fn open(
        objects: Arc<dyn ObjectStore>,
        db: Arc<crate::cas::Database>,
        key: [u8; 8],
        upper_dir: &Path,
        base: TreeId,
        tag: serde_json::Value,
        opts: &WorkspaceOptions,
    ) -> Result<Workspace, WorkspaceError> {
        std::fs::create_dir_all(upper_dir)
            .map_err(|e| WorkspaceError::Io(format!("{}: {e}", upper_dir.display())))?;
        let upper_file = File::open(upper_dir)
            .map_err(|e| WorkspaceError::Io(format!("{}: {e}", upper_dir.display())))?;
        let dirty = DirtyStore::new(db, key);
        let meta = dirty.meta()?;
        let (base, tag, records) = match meta {
            Some(m) => (m.base, m.tag, dirty.nodes()?),
            None => {
                let mut b = dirty.batch();
                dirty.clear_all(&mut b);
                dirty.put_meta(
                    &mut b,
                    &MountMeta {
                        base,
                        tag: tag.clone(),
                    },
                );
                dirty.commit(b)?;
                (base, tag, Vec::new())
            }
        };
        // SAFETY: getuid and getgid cannot fail.
        let owner = unsafe { (libc::getuid(), libc::getgid()) };
        let t = now_ns();
        let upper_fd = OwnedFd::from(upper_file);
        let reaper_fd = upper_fd
            .try_clone()
            .map_err(|e| WorkspaceError::Io(format!("{}: {e}", upper_dir.display())))?;
        let (reaper, reap) = std::sync::mpsc::channel::<u64>();
        std::thread::Builder::new()
            .name("casfs-reaper".into())
            .spawn(move || {
                while let Ok(first) = reap.recv() {
                    let batch: Vec<u64> = std::iter::once(first).chain(reap.try_iter()).collect();
                    for ino in batch {
                        let name = Self::upper_cname(ino);
                        // SAFETY: a valid directory fd and NUL-terminated name.
                        unsafe { libc::unlinkat(reaper_fd.as_raw_fd(), name.as_ptr(), 0) };
                    }
                    // Let removals pile up: waking this thread for each file of an
                    // `rm -rf` cost more than the unlinks (a quarter of the daemon's time).
                    std::thread::sleep(REAP_PAUSE);
                }
            })
            .map_err(|e| WorkspaceError::Io(format!("starting the reaper thread: {e}")))?;
        let ws = Workspace {
            reader: ChunkReader::new(Arc::clone(&objects), opts.chunk_cache_bytes),
            objects,
            dirty,
            upper_dir: upper_dir.to_path_buf(),
            upper_fd,
            reaper,
            state: Mutex::new(State {
                nodes: HashMap::new(),
                next_ino: 2,
                base,
                tag,
                dirty: BTreeSet::new(),
                events: Events::default(),
                copies: Copies::default(),
            }),
            copies_limit: opts.local_copies_bytes,
            reads: Mutex::new((std::collections::HashSet::new(), Vec::new())),
            barrier: RwLock::new(()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_tmp: AtomicU64::new(1),
            want_passthrough: opts.passthrough,
            passthrough: AtomicBool::new(false),
            notifier: OnceLock::new(),
            owner,
            mounted_at: t,
        };
        ws.load(base, records)?;
        Ok(ws)
    }

    fn root_node(&self, base: TreeId) -> Node {
        Node {
            kind: Kind::Dir,
            meta: Meta {
                mode: 0o755,
                uid: self.owner.0,
                gid: self.owner.1,
                rdev: 0,
                atime: self.mounted_at,
                mtime: self.mounted_at,
                ctime: self.mounted_at,
                size: 0,
                blocks: 0,
            },
            nlink: 2,
            links: Vec::new(),
            xattrs: Vec::new(),
            body: Body::Dir {
                tree: Some(base),
                children: None,
            },
            dirty: false,
            base: None,
            open_plain: 0,
            open_passthrough: 0,
            writers: 0,
            pass_writers: 0,
            changed_chunks: None,
            backing: None,
        }
    }

    /// Builds the inode table from the base and the persisted records, and removes
    /// upper files no record needs.
    fn load(&self, base: TreeId, records: Vec<(u64, NodeRecord)>) -> Result<(), WorkspaceError> {
        let mut st = self.lock();
        st.nodes.insert(ROOT, self.root_node(base));
        let mut wanted = BTreeSet::new();
        for (ino, r) in records {
            let mut upper_st = None;
            let body = match r.kind {
                Kind::Dir => Body::Dir {
                    tree: r.tree,
                    children: None,
                },
                Kind::File => {
                    let upper = if r.upper {
                        wanted.insert(ino);
                        match self.upper_stat(ino, &Upper::Closed) {
                            Ok(st) => {
                                upper_st = Some(st);
                                Some(Upper::Closed)
                            }
                            Err(e) => {
                                tracing::error!(
                                    "upper file of inode {ino} ({}): {e}; its content is lost",
                                    self.upper_path(ino).display()
                                );
                                None
                            }
                        }
                    } else {
                        None
                    };
                    Body::File {
                        clean: r.clean.map(|id| FileRef { id, size: r.size }),
                        upper,
                        chunks: None,
                    }
                }
                Kind::Symlink => Body::Symlink(r.target.clone().unwrap_or_default()),
                _ => Body::Other,
            };
            let mut node = Node {
                kind: r.kind,
                meta: Meta {
                    mode: r.mode,
                    uid: r.uid,
                    gid: r.gid,
                    rdev: r.rdev,
                    atime: r.atime_ns,
                    mtime: r.mtime_ns,
                    ctime: r.ctime_ns,
                    size: r.size,
                    blocks: 0,
                },
                nlink: r.nlink,
                links: Vec::new(),
                xattrs: r.xattrs,
                body,
                dirty: true,
                base: None,
                open_plain: 0,
                open_passthrough: 0,
                writers: 0,
                pass_writers: 0,
                changed_chunks: None,
                backing: None,
            };
            if let Some(st) = upper_st {
                node.absorb(&st);
            }
            if ino == ROOT {
                let root = st.nodes.get_mut(&ROOT).expect("root");
                root.meta = node.meta;
                root.xattrs = node.xattrs;
                root.dirty = true;
                if let (Body::Dir { tree, .. }, Body::Dir { tree: t, .. }) =
                    (&mut root.body, node.body)
                {
                    *tree = t;
                }
            } else {
                st.nodes.insert(ino, node);
            }
            st.dirty.insert(ino);
            st.next_ino = st.next_ino.max(ino + 1);
        }
        drop(st);
        // Upper files of nodes that are gone (or never made it into a record).
        // Local copies that were being made when the daemon stopped.
        if let Ok(rd) = std::fs::read_dir(&self.upper_dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("tmp-") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        for shard in 0..256u32 {
            let dir = self.upper_dir.join(format!("{shard:02x}"));
            if let Ok(rd) = std::fs::read_dir(&dir) {
                for e in rd.flatten() {
                    let keep = e
                        .file_name()
                        .to_str()
                        .and_then(|s| s.parse::<u64>().ok())
                        .is_some_and(|i| wanted.contains(&i));
                    if !keep {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            } else {
                std::fs::create_dir_all(&dir)
                    .map_err(|e| WorkspaceError::Io(format!("{}: {e}", dir.display())))?;
            }
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Receives every change made from now on, in order, until the receiver is dropped;
    /// also returns the sequence number of the last change before.
    pub fn subscribe(&self) -> (std::sync::mpsc::Receiver<FsEvent>, u64) {
        let (tx, rx) = std::sync::mpsc::channel();
        (rx, self.subscribe_with(tx))
    }

    /// [`Workspace::subscribe`] into a channel of the caller's (who may send into it
    /// too); returns the sequence number of the last change before.
    pub fn subscribe_with(&self, tx: std::sync::mpsc::Sender<FsEvent>) -> u64 {
        let mut st = self.lock();
        st.events.subscribers.push(tx);
        st.events.seq
    }

    /// The sequence number of the last change announced.
    pub fn last_event(&self) -> u64 {
        self.lock().events.seq
    }

    /// The content of the regular file at `path` in the base tree (the checkpoint the
    /// workspace started from), if there is one.
    pub fn base_file(&self, path: &str) -> Result<Option<Vec<u8>>, WorkspaceError> {
        let base = self.lock().base;
        Ok(crate::cas::file_at(self.objects.as_ref(), &base, path)?)
    }

    fn tx(&self) -> Tx<'_> {
        Tx {
            ws: self,
            st: self.lock(),
            batch: crate::cas::Batch::default(),
            events: Vec::new(),
        }
    }

    /// Upper files are spread over 256 subdirectories: one directory of 100k files
    /// makes every create slower.
    fn upper_rel(ino: u64) -> String {
        upper_rel(ino)
    }

    fn note_read(&self, f: FileRef) {
        let mut r = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        if r.1.len() < MAX_READS_KEPT && r.0.insert(f.id) {
            r.1.push(f);
        }
    }

    /// The clean files opened since the last call, in the order first opened (at most
    /// the first 8192): what a run read, for another host to fetch first.
    pub fn take_reads(&self) -> Vec<FileRef> {
        let mut r = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        r.0.clear();
        std::mem::take(&mut r.1)
    }

    fn upper_path(&self, ino: u64) -> PathBuf {
        self.upper_dir.join(Self::upper_rel(ino))
    }

    fn upper_cname(ino: u64) -> CString {
        CString::new(Self::upper_rel(ino)).expect("no NUL")
    }

    /// Opens `name` (relative to the upper directory) read-write; `create` makes it new
    /// and empty (mode 0600).
    fn open_in_upper(&self, name: &CString, create: bool) -> std::io::Result<File> {
        let flags = if create {
            libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC
        } else {
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW
        };
        // SAFETY: a valid directory fd and NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                self.upper_fd.as_raw_fd(),
                name.as_ptr(),
                flags,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    fn open_upper(&self, ino: u64) -> std::io::Result<File> {
        self.open_in_upper(&Self::upper_cname(ino), false)
    }

    /// Inode numbers are never reused within a mount, and upper files no record names
    /// are removed at mount: there is nothing to clobber.
    fn create_upper(&self, ino: u64) -> std::io::Result<File> {
        self.open_in_upper(&Self::upper_cname(ino), true)
    }

    /// Removes an upper file in the background: freeing a large file's blocks takes
    /// time a request should not wait for, and a crash before leaves only an orphan
    /// that the next mount removes.
    fn remove_upper(&self, ino: u64) {
        let _ = self.reaper.send(ino);
    }

    /// Writes stored content `c` to a new temporary file in the upper directory (not
    /// holding the table), with the node's times. [`Workspace::install_upper`] gives it
    /// its inode's name.
    fn prepare_upper(&self, c: &FileRef, atime: i64, mtime: i64) -> Result<(CString, File), Errno> {
        self.dirty.database().ensure_space(c.size).map_err(eio)?;
        let n = self.next_tmp.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(format!("tmp-{n}")).expect("no NUL");
        let f = self.open_in_upper(&name, true).map_err(io_errno)?;
        let filled = self
            .fill_upper(&f, c)
            .and_then(|()| set_file_times(&f, Some(atime), Some(mtime)).map_err(io_errno));
        if let Err(e) = filled {
            self.discard_tmp(&name);
            return Err(e);
        }
        Ok((name, f))
    }

    fn install_upper(&self, tmp: &CString, ino: u64) -> std::io::Result<()> {
        let name = Self::upper_cname(ino);
        let fd = self.upper_fd.as_raw_fd();
        // SAFETY: valid directory fd and NUL-terminated names.
        if unsafe { libc::renameat(fd, tmp.as_ptr(), fd, name.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn discard_tmp(&self, tmp: &CString) {
        // SAFETY: as in install_upper.
        unsafe { libc::unlinkat(self.upper_fd.as_raw_fd(), tmp.as_ptr(), 0) };
    }

    /// The open upper file of `ino` (opened now if it is closed).
    fn upper_file(&self, ino: u64, u: &Upper) -> std::io::Result<Arc<File>> {
        match u {
            Upper::Open(f) => Ok(f.clone()),
            Upper::Closed => Ok(Arc::new(self.open_upper(ino)?)),
        }
    }

    fn upper_stat(&self, ino: u64, u: &Upper) -> std::io::Result<libc::stat> {
        match u {
            Upper::Open(f) => fstat(f),
            Upper::Closed => {
                let name = Self::upper_cname(ino);
                // SAFETY: zeroed stat is a valid out-parameter; fd and name are valid.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                let rc = unsafe {
                    libc::fstatat(
                        self.upper_fd.as_raw_fd(),
                        name.as_ptr(),
                        &mut st,
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(st)
            }
        }
    }

    /// Writes stored content `c` into fresh upper file `f`.
    fn fill_upper(&self, f: &File, c: &FileRef) -> Result<(), Errno> {
        if !c.is_chunked() {
            let data = self.reader.chunk(ChunkId(c.id.0), c.size).map_err(eio)?;
            f.write_all_at(&data, 0).map_err(io_errno)?;
            return Ok(());
        }
        let list = load_chunk_list(self.objects.as_ref(), c).map_err(eio)?;
        let mut off = 0u64;
        for (id, len) in &list.chunks {
            let data = read_chunk(self.objects.as_ref(), id, *len as u64).map_err(eio)?;
            f.write_all_at(&data, off).map_err(io_errno)?;
            off += *len as u64;
        }
        Ok(())
    }

    fn attr_of(&self, ino: u64, n: &Node) -> FileAttr {
        // An open local copy may be written behind the daemon's back (passthrough): ask
        // it; a closed one is described by the node.
        let mut m = n.meta;
        if let Body::File {
            upper: Some(Upper::Open(f)),
            ..
        } = &n.body
        {
            if let Ok(st) = fstat(f) {
                m.absorb(&st, n.dirty);
            }
        }
        let blocks = if m.blocks > 0 {
            m.blocks
        } else {
            m.size.div_ceil(512)
        };
        if let Body::Symlink(t) = &n.body {
            m.size = t.len() as u64;
        }
        FileAttr {
            ino: INodeNo(ino),
            size: if n.kind == Kind::Dir { 4096 } else { m.size },
            blocks,
            atime: to_time(m.atime),
            mtime: to_time(m.mtime),
            ctime: to_time(m.ctime),
            crtime: to_time(m.ctime),
            kind: file_type(n.kind),
            perm: (m.mode & 0o7777) as u16,
            nlink: n.nlink,
            uid: m.uid,
            gid: m.gid,
            rdev: m.rdev as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    fn read_clean(
        &self,
        ino: u64,
        fref: &FileRef,
        offset: u64,
        size: u32,
    ) -> Result<Vec<u8>, Errno> {
        // A large file's chunk list is loaded once and kept with its node.
        let list = || {
            let cached = match self.lock().nodes.get(&ino).map(|n| &n.body) {
                Some(Body::File {
                    chunks: Some(c),
                    clean: Some(cl),
                    ..
                }) if cl.id == fref.id => Some(c.clone()),
                _ => None,
            };
            if let Some(l) = cached {
                return Ok(l);
            }
            let l = Arc::new(load_chunk_list(self.objects.as_ref(), fref)?);
            if let Some(Body::File {
                chunks,
                clean: Some(cl),
                ..
            }) = self.lock().nodes.get_mut(&ino).map(|n| &mut n.body)
            {
                if cl.id == fref.id {
                    *chunks = Some(l.clone());
                }
            }
            Ok(l)
        };
        self.reader.read(fref, list, offset, size).map_err(eio)
    }

    /// The current base tree and the tag kept with it.
    pub fn base(&self) -> (TreeId, serde_json::Value) {
        let st = self.lock();
        (st.base, st.tag.clone())
    }

    /// Whether reads of local copies go through FUSE passthrough (known once mounted).
    pub fn read_mode(&self) -> &'static str {
        if self.passthrough.load(Ordering::Relaxed) {
            "passthrough"
        } else {
            "fuse"
        }
    }

    pub fn status(&self) -> WorkspaceStatus {
        let tx = self.tx();
        let mut files = 0;
        let mut bytes = 0;
        let mut paths = Vec::new();
        for ino in &tx.st.dirty {
            let Some(n) = tx.st.nodes.get(ino) else {
                continue;
            };
            if n.kind != Kind::Dir {
                files += 1;
                bytes += self.attr_of(*ino, n).size;
                if paths.len() < 100 {
                    paths.push(tx.path_of(*ino));
                }
            }
        }
        WorkspaceStatus {
            base: tx.st.base,
            dirty_nodes: tx.st.dirty.len(),
            dirty_files: files,
            dirty_bytes: bytes,
            dirty_paths: paths,
            nodes_loaded: tx.st.nodes.len(),
            read_mode: self.read_mode(),
        }
    }

    /// Takes a snapshot: with writes held off, stores every dirty file and directory and
    /// hands the new root to `publish`. If `publish` succeeds the snapshot becomes the
    /// base (with the tag it returns) and the dirty set empties, except for files still
    /// open for writing; if it fails nothing changes.
    pub fn snapshot<T, E>(
        &self,
        publish: impl FnOnce(TreeId, &SnapshotStats) -> Result<(T, serde_json::Value), E>,
    ) -> Result<Result<(T, SnapshotStats), E>, WorkspaceError> {
        self.snapshot_filtered(None, publish)
    }

    /// [`Workspace::snapshot`] with a filter deciding what of the changed entries goes
    /// in and in what form.
    pub fn snapshot_filtered<T, E>(
        &self,
        filter: Option<&dyn SnapshotFilter>,
        publish: impl FnOnce(TreeId, &SnapshotStats) -> Result<(T, serde_json::Value), E>,
    ) -> Result<Result<(T, SnapshotStats), E>, WorkspaceError> {
        let _barrier = self.barrier.write().unwrap_or_else(|p| p.into_inner());
        let mut tx = self.tx();
        let mut stats = SnapshotStats::default();
        let root_dirty = tx.st.nodes[&ROOT].dirty;
        let mut cx = BuildCx {
            stats: &mut stats,
            done: Vec::new(),
            keep_dirty: Vec::new(),
            filter,
        };
        let root = if root_dirty {
            tx.build(ROOT, &mut cx)?
        } else {
            tx.st.base
        };
        let (done, keep_dirty) = (cx.done, cx.keep_dirty);
        let written: Vec<u64> = done.iter().map(|(ino, _)| *ino).collect();
        self.objects.sync()?;
        let (out, tag) = match publish(root, &stats) {
            Ok(x) => x,
            Err(e) => return Ok(Err(e)),
        };
        // The new base: every node written becomes clean, but a file open for writing
        // may change behind the daemon's back (passthrough) and stays dirty.
        let other_form: HashSet<u64> = keep_dirty.iter().copied().collect();
        let mut still = keep_dirty;
        for (ino, entry) in done {
            let n = tx.st.nodes.get_mut(&ino).expect("built");
            if let EntryContent::File(id) = entry.content {
                if let Body::File { clean, chunks, .. } = &mut n.body {
                    *clean = Some(FileRef {
                        id,
                        size: entry.size,
                    });
                    *chunks = None;
                }
                // Its upper file now holds `clean` exactly, unless it was stored in
                // another form or a passthrough writer may have changed it since.
                n.changed_chunks =
                    (n.pass_writers == 0 && !other_form.contains(&ino)).then(BTreeSet::new);
            }
            if let EntryContent::Dir(id) = entry.content {
                if let Body::Dir { tree, .. } = &mut n.body {
                    *tree = Some(id);
                }
            }
            n.base = Some(entry);
            n.dirty = false;
            if n.writers > 0 {
                still.push(ino);
            }
        }
        if let Some(r) = tx.st.nodes.get_mut(&ROOT) {
            r.dirty = false;
            if let Body::Dir { tree, .. } = &mut r.body {
                *tree = Some(root);
            }
        }
        // Nodes in the set that the walk did not reach (sockets) stay as they are in
        // memory but leave the persisted set: the new base has no place for them.
        for ino in std::mem::take(&mut tx.st.dirty) {
            if let Some(n) = tx.st.nodes.get_mut(&ino) {
                n.dirty = false;
                if n.base.is_none() && n.kind == Kind::Socket {
                    // Keep sockets dirty so their directory is written again next time.
                    still.push(ino);
                }
            }
        }
        // Written files keep their upper files as local copies of their new content.
        for ino in written {
            tx.note_copy(ino);
        }
        tx.st.base = root;
        tx.st.tag = tag.clone();
        self.dirty.clear(&mut tx.batch);
        self.dirty
            .put_meta(&mut tx.batch, &MountMeta { base: root, tag });
        for ino in still {
            let _ = tx.persist(ino);
        }
        tx.commit()
            .map_err(|_| WorkspaceError::Io("writing the dirty set".into()))?;
        self.dirty.sync()?;
        Ok(Ok((out, stats)))
    }

    /// Makes `root` the workspace's content: the inode table is replaced (files open
    /// now keep what they had open), the kernel's caches are invalidated, nothing is
    /// copied. Refused while uncaptured changes exist unless `force`.
    pub fn swap_root(
        &self,
        root: TreeId,
        tag: serde_json::Value,
        force: bool,
    ) -> Result<(), WorkspaceError> {
        // The new root must be readable before anything is dropped.
        load_tree(self.objects.as_ref(), &root)?;
        let _barrier = self.barrier.write().unwrap_or_else(|p| p.into_inner());
        let mut tx = self.tx();
        // Any dirty node is uncaptured work: a changed file, or a directory that lost an
        // entry (a deletion leaves only its directory dirty).
        if !force && !tx.st.dirty.is_empty() {
            let files: Vec<u64> = tx
                .st
                .dirty
                .iter()
                .copied()
                .filter(|i| tx.st.nodes.get(i).is_some_and(|n| n.kind != Kind::Dir))
                .collect();
            let example = match files.first() {
                Some(&i) => tx.path_of(i),
                None => {
                    let deepest = tx.st.dirty.iter().copied().max_by_key(|&i| {
                        let p = tx.path_of(i);
                        p.matches('/').count() + usize::from(!p.is_empty())
                    });
                    let p = deepest.map(|i| tx.path_of(i)).unwrap_or_default();
                    format!("a change inside {}/", if p.is_empty() { "." } else { &p })
                }
            };
            return Err(WorkspaceError::Uncaptured {
                count: files.len().max(1),
                example,
            });
        }
        // The kernel's entries (and cached negative lookups) under the root: the old
        // names and the new ones.
        let mut old_names: Vec<Vec<u8>> = match &tx.st.nodes[&ROOT].body {
            Body::Dir {
                children: Some(c), ..
            } => c.keys().cloned().collect(),
            _ => Vec::new(),
        };
        if let Ok(t) = load_tree(self.objects.as_ref(), &root) {
            old_names.extend(t.into_entries().into_iter().map(|e| e.name));
        }
        let old: Vec<u64> = tx.st.nodes.keys().copied().filter(|&i| i != ROOT).collect();
        for ino in old {
            let n = tx.st.nodes.get_mut(&ino).expect("listed");
            if n.open_plain + n.open_passthrough > 0 {
                // Detached: open handles keep working on it until they close.
                n.links.clear();
                n.nlink = 0;
                n.dirty = false;
                continue;
            }
            let n = tx.st.nodes.remove(&ino).expect("listed");
            if let Body::File { upper: Some(_), .. } = n.body {
                self.remove_upper(ino);
            }
        }
        let root_node = self.root_node(root);
        tx.st.nodes.insert(ROOT, root_node);
        tx.st.dirty.clear();
        tx.st.copies = Copies::default();
        tx.st.base = root;
        tx.st.tag = tag.clone();
        self.dirty.clear(&mut tx.batch);
        self.dirty
            .put_meta(&mut tx.batch, &MountMeta { base: root, tag });
        tx.commit()
            .map_err(|_| WorkspaceError::Io("writing the dirty set".into()))?;
        self.dirty.sync()?;
        drop(_barrier);
        if let Some(n) = self.notifier.get() {
            for name in old_names {
                let _ = n.inval_entry(INodeNo(ROOT), OsStr::from_bytes(&name));
            }
            let _ = n.inval_inode(INodeNo(ROOT), 0, 0);
        }
        Ok(())
    }

    /// Gives the workspace the channel for cache invalidations (after mounting).
    pub fn set_notifier(&self, n: Notifier) {
        let _ = self.notifier.set(n);
    }

    fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// After a write through the daemon of bytes `from..to` of `ino`: notes the chunks,
    /// and clears what a write clears (set-id bits only if `kill_suidgid` names the
    /// writer: one without `CAP_FSETID`).
    fn written(
        &self,
        ino: u64,
        from: u64,
        to: u64,
        kill_suidgid: Option<&Request>,
    ) -> Result<(), Errno> {
        let mut tx = self.tx();
        let Some(n) = tx.st.nodes.get_mut(&ino) else {
            return Ok(());
        };
        n.note_changed(from, to);
        if n.has_privs() {
            tx.kill_privs(ino, kill_suidgid)?;
            tx.commit()?;
        }
        Ok(())
    }

    fn release_handle(&self, fh: u64) {
        let h = self
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&fh);
        let Some(h) = h else { return };
        let mut tx = self.tx();
        if let Some(n) = tx.st.nodes.get_mut(&h.ino) {
            if h.write {
                n.writers = n.writers.saturating_sub(1);
                if h.backing.is_some() {
                    n.pass_writers = n.pass_writers.saturating_sub(1);
                }
            }
            if h.backing.is_some() {
                n.open_passthrough = n.open_passthrough.saturating_sub(1);
                if n.open_passthrough == 0 {
                    n.backing = None;
                }
            } else {
                n.open_plain = n.open_plain.saturating_sub(1);
            }
            if n.open_plain + n.open_passthrough == 0 {
                n.close_upper();
            }
        }
        tx.note_copy(h.ino);
        tx.maybe_free(h.ino);
        let _ = tx.commit();
    }
}

/// Whether the caller of `req` is in group `gid` (its group, or one of its supplementary
/// groups as /proc tells).
fn in_group(req: &Request, gid: u32) -> bool {
    if req.gid() == gid {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", req.pid())) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
}

fn reply_empty(r: Result<(), Errno>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

/// The FUSE face of a [`Workspace`].
pub struct WorkspaceFs(pub Arc<Workspace>);

impl WorkspaceFs {
    fn ws(&self) -> &Workspace {
        &self.0
    }

    fn entry_reply(&self, r: Result<FileAttr, Errno>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    /// Creates node `name` in `parent`: a regular file gets an empty upper file, a
    /// directory an empty listing, a symlink `target`.
    #[allow(clippy::too_many_arguments)]
    fn create_node(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        kind: Kind,
        mode: u32,
        rdev: u64,
        target: Option<Vec<u8>>,
        keep_open: bool,
    ) -> Result<(u64, FileAttr), Errno> {
        let name = name.as_bytes();
        check_name(name)?;
        let mut tx = self.ws().tx();
        if tx.node(parent)?.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        if tx.lookup(parent, name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let mut node = tx.make_node(kind, mode, req, parent, Body::Other);
        node.meta.rdev = rdev;
        let ino = tx.alloc(node);
        let body = match kind {
            Kind::Dir => Body::Dir {
                tree: None,
                children: Some(BTreeMap::new()),
            },
            Kind::File => match self.ws().create_upper(ino) {
                Ok(f) => Body::File {
                    clean: None,
                    upper: Some(Upper::Open(Arc::new(f))),
                    chunks: None,
                },
                Err(e) => {
                    tx.st.nodes.remove(&ino);
                    return Err(io_errno(e));
                }
            },
            Kind::Symlink => {
                let t = target.unwrap_or_default();
                tx.node_mut(ino)?.meta.size = t.len() as u64;
                Body::Symlink(t)
            }
            _ => Body::Other,
        };
        tx.node_mut(ino)?.body = body;
        tx.attach(parent, name, ino)?;
        tx.event(FsEventKind::Create, parent, name, kind == Kind::Dir);
        // create() opens it right after (and keeps it open); mknod does not.
        if kind != Kind::File || !keep_open {
            tx.close_if_idle(ino);
        }
        let attr = tx.attr(ino)?;
        tx.commit()?;
        Ok((ino, attr))
    }

    /// Opens `ino` (copying up for writing) and returns the handle and, with
    /// passthrough, the backing to reply with.
    fn open_node(
        &self,
        ino: u64,
        flags: i32,
        make_backing: impl FnOnce(&File) -> std::io::Result<BackingId>,
    ) -> Result<(u64, Option<Arc<BackingId>>), Errno> {
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let trunc = flags & libc::O_TRUNC != 0 && write;
        let ws = self.ws();
        let _b = if write {
            Some(ws.barrier.read().unwrap_or_else(|p| p.into_inner()))
        } else {
            None
        };
        // A clean file about to be written, or read through passthrough, first gets a
        // local copy; the copy is made without holding the table.
        let wanted = {
            let st = ws.lock();
            let n = st.nodes.get(&ino).ok_or(Errno::ESTALE)?;
            match &n.body {
                Body::File {
                    clean: Some(c),
                    upper: None,
                    ..
                } if !(write && trunc)
                    && (write
                        || (ws.passthrough.load(Ordering::Relaxed)
                            && n.open_plain == 0
                            && c.size >= MATERIALIZE_MIN
                            // A local copy is an optimisation: not when space is short.
                            && ws.dirty.database().has_room(c.size + PASSTHROUGH_WRITE_ROOM))) =>
                {
                    Some((*c, n.meta.atime, n.meta.mtime))
                }
                _ => None,
            }
        };
        let prepared = match wanted {
            Some((c, atime, mtime)) => Some((c, ws.prepare_upper(&c, atime, mtime)?)),
            None => None,
        };
        let mut tx = ws.tx();
        // In use: not an idle copy while open (noted again, newest, at release).
        tx.forget_copy(ino);
        let n = tx.node(ino)?;
        match n.kind {
            Kind::File => {}
            Kind::Dir => return Err(Errno::EISDIR),
            _ => return Err(Errno::EINVAL),
        }
        if let Some((c, (tmp, f))) = prepared {
            let still =
                matches!(&n.body, Body::File { clean: Some(c2), upper: None, .. } if c2.id == c.id);
            if still {
                ws.install_upper(&tmp, ino).map_err(io_errno)?;
                let n = tx.node_mut(ino)?;
                n.changed_chunks = Some(BTreeSet::new());
                if let Body::File { upper, .. } = &mut n.body {
                    *upper = Some(Upper::Open(Arc::new(f)));
                }
            } else {
                ws.discard_tmp(&tmp);
            }
        }
        if write {
            tx.copy_up(ino, trunc)?;
            if trunc {
                let n = tx.node_mut(ino)?;
                n.meta.ctime = now_ns();
            }
        }
        let n = tx.node(ino)?;
        let (upper, clean) = match &n.body {
            Body::File { upper, clean, .. } => (upper.clone(), *clean),
            _ => unreachable!(),
        };
        if let (false, Some(c)) = (n.dirty, clean) {
            ws.note_read(c);
        }
        // While a handle is open the upper file stays open.
        let upper = match upper {
            Some(u) => {
                let f = ws.upper_file(ino, &u).map_err(io_errno)?;
                if let Body::File { upper, .. } = &mut tx.node_mut(ino)?.body {
                    *upper = Some(Upper::Open(f.clone()));
                }
                Some(f)
            }
            None => None,
        };
        let n = tx.node(ino)?;
        let mut backing = n.backing.clone();
        // Writes through passthrough never reach the daemon, so nothing keeps them
        // from using the space the store's database needs: a handle that may write
        // gets passthrough only while the filesystem has ample room. Nor does the
        // daemon see which chunks they change: a large file's writers go through the
        // daemon, so that its checkpoint reads only what they wrote.
        let may_pass = !write
            || (ws.dirty.database().has_room(PASSTHROUGH_WRITE_ROOM)
                && !n.has_privs()
                && (trunc || ws.attr_of(ino, n).size < TRACK_WRITES_MIN));
        if let (None, true, 0, Some(u), true) = (
            &backing,
            ws.passthrough.load(Ordering::Relaxed),
            n.open_plain,
            &upper,
            may_pass,
        ) {
            match make_backing(u) {
                Ok(b) => backing = Some(Arc::new(b)),
                Err(e) => tracing::debug!("passthrough unavailable for inode {ino}: {e}"),
            }
        }
        let n = tx.node_mut(ino)?;
        if write {
            n.writers += 1;
            if backing.is_some() {
                n.pass_writers += 1;
                n.changed_chunks = None;
            }
        }
        if backing.is_some() {
            n.open_passthrough += 1;
            n.backing = backing.clone();
        } else {
            n.open_plain += 1;
        }
        let src = match (upper, clean) {
            (Some(u), _) => Src::Upper(u),
            (None, Some(c)) => Src::Clean(c),
            (None, None) => Src::None,
        };
        tx.commit()?;
        let fh = ws.new_fh();
        ws.handles.lock().unwrap_or_else(|p| p.into_inner()).insert(
            fh,
            Handle {
                ino,
                write,
                src,
                backing: backing.clone(),
            },
        );
        Ok((fh, backing))
    }

    /// Directory `ino`'s entries from position `offset` (`.` and `..` first, then the
    /// children in name order).
    fn listing(&self, ino: u64, offset: u64) -> Result<Vec<(u64, FileType, Vec<u8>)>, Errno> {
        let mut tx = self.ws().tx();
        let parent = tx.node(ino)?.parent();
        let children: Vec<(Vec<u8>, u64)> = tx
            .children(ino)?
            .iter()
            .skip((offset as usize).saturating_sub(2))
            .take(1024)
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let mut out = Vec::with_capacity(children.len() + 2);
        if offset == 0 {
            out.push((ino, FileType::Directory, b".".to_vec()));
        }
        if offset <= 1 {
            out.push((parent, FileType::Directory, b"..".to_vec()));
        }
        for (name, c) in children {
            let k = tx.node(c).map(|n| file_type(n.kind))?;
            out.push((c, k, name));
        }
        Ok(out)
    }

    fn current_src(&self, ino: u64, fh: u64) -> Src {
        if let Some(n) = self.ws().lock().nodes.get_mut(&ino) {
            if let Body::File { upper, clean, .. } = &mut n.body {
                return match (upper, clean) {
                    (Some(u), _) => match self.ws().upper_file(ino, u) {
                        Ok(f) => {
                            *u = Upper::Open(f.clone());
                            Src::Upper(f)
                        }
                        Err(e) => {
                            tracing::error!("upper file of inode {ino}: {e}");
                            Src::None
                        }
                    },
                    (None, Some(c)) => Src::Clean(*c),
                    (None, None) => Src::None,
                };
            }
        }
        self.ws()
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&fh)
            .map(|h| h.src.clone())
            .unwrap_or(Src::None)
    }

    fn writable_upper(&self, ino: u64, fh: u64) -> Result<Arc<File>, Errno> {
        match self.current_src(ino, fh) {
            Src::Upper(u) => Ok(u),
            _ => {
                let mut tx = self.ws().tx();
                let u = tx.copy_up(ino, false)?;
                tx.commit()?;
                Ok(u)
            }
        }
    }
}

impl Filesystem for WorkspaceFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if self.ws().want_passthrough
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok()
        {
            self.ws().passthrough.store(true, Ordering::Relaxed);
        }
        let _ = config
            .add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        // The daemon clears set-id bits and file capabilities itself (see `kill_privs`).
        // Without it the kernel asks for `security.capability` before every write(2),
        // passthrough ones included, and for the attributes before every chown: a
        // round trip each.
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if name.len() > MAX_NAME_LEN {
            // The kernel leaves the check to us: every path call with such a component.
            return reply.error(Errno::ENAMETOOLONG);
        }
        let r = (|| {
            let mut tx = self.ws().tx();
            let Some(ino) = tx.lookup(parent.0, name.as_bytes())? else {
                return Ok(None);
            };
            if tx.node(ino)?.kind == Kind::Dir {
                tx.load_dir(ino)?;
            }
            tx.attr(ino).map(Some)
        })();
        match r {
            Ok(Some(a)) => reply.entry(&TTL, &a, Generation(0)),
            // A negative entry the kernel may cache: a create passes through the kernel,
            // which replaces it, and a root swap invalidates it.
            Ok(None) => {
                let mut a = self
                    .ws()
                    .attr_of(0, &self.ws().root_node(TreeId(crate::cas::Hash::of(b""))));
                a.ino = INodeNo(0);
                reply.entry(&TTL, &a, Generation(0))
            }
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let r = (|| {
            let mut tx = self.ws().tx();
            if tx.node(ino.0)?.kind == Kind::Dir {
                tx.load_dir(ino.0)?;
            }
            tx.attr(ino.0)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ino = ino.0;
        let r = (|| {
            let ws = self.ws();
            let _ = fh;
            let _b = ws.barrier.read().unwrap_or_else(|p| p.into_inner());
            let mut tx = ws.tx();
            let t = now_ns();
            let resolve = |x: TimeOrNow| match x {
                TimeOrNow::Now => t,
                TimeOrNow::SpecificTime(s) => time_ns(s),
            };
            if let Some(sz) = size {
                let kind = tx.node(ino)?.kind;
                if kind == Kind::Dir {
                    return Err(Errno::EISDIR);
                }
                if kind != Kind::File {
                    return Err(Errno::EINVAL);
                }
                let u = tx.copy_up(ino, sz == 0)?;
                let before = fstat(&u).map_err(io_errno)?.st_size as u64;
                u.set_len(sz).map_err(io_errno)?;
                tx.node_mut(ino)?
                    .note_changed(before.min(sz), before.max(sz));
                // A truncate clears set-id bits unless the caller has CAP_FSETID (fuser
                // does not pass on the kernel's FATTR_KILL_SUIDGID: root is taken for
                // the capability).
                tx.kill_privs(ino, (req.uid() != 0).then_some(req))?;
                tx.node_mut(ino)?.meta.ctime = t;
                // A truncate while the file is open for writing (a shell's `>`: the
                // kernel opens, then truncates without naming the handle) is announced
                // by the writer's close, with what was written after it: one change,
                // one event.
                if tx.watched() && tx.node(ino)?.writers == 0 {
                    let path = tx.path_of(ino);
                    tx.events.push((FsEventKind::Modify, path, None, false));
                }
            }
            let has_upper = matches!(tx.node(ino)?.body, Body::File { upper: Some(_), .. });
            if (atime.is_some() || mtime.is_some()) && has_upper {
                let u = match &tx.node(ino)?.body {
                    Body::File { upper: Some(u), .. } => u.clone(),
                    _ => unreachable!(),
                };
                let f = ws.upper_file(ino, &u).map_err(io_errno)?;
                set_file_times(&f, atime.map(resolve), mtime.map(resolve)).map_err(io_errno)?;
            }
            let n = tx.node_mut(ino)?;
            if let Some(m) = mode {
                n.meta.mode = m & 0o7777;
            }
            if let Some(u) = uid {
                n.meta.uid = u;
            }
            if let Some(g) = gid {
                n.meta.gid = g;
            }
            // chown clears setuid/setgid on files (as ext4 does for non-directories).
            if (uid.is_some() || gid.is_some()) && mode.is_none() && n.kind == Kind::File {
                n.meta.mode &= !(libc::S_ISUID | libc::S_ISGID);
            }
            if let Some(a) = atime {
                n.meta.atime = resolve(a);
            }
            if let Some(m) = mtime {
                n.meta.mtime = resolve(m);
            }
            tx.changed(ino, t)?;
            tx.close_if_idle(ino);
            let a = tx.attr(ino)?;
            tx.commit()?;
            Ok(a)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let tx = self.ws().tx();
        match tx.node(ino.0).map(|n| &n.body) {
            Ok(Body::Symlink(t)) => reply.data(t),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let kind = kind_of_mode(mode).ok_or(Errno::EINVAL)?;
            let perm = mode & !umask;
            if matches!(kind, Kind::Dir | Kind::Symlink) {
                return Err(Errno::EINVAL);
            }
            let rdev = if kind == Kind::File { 0 } else { rdev as u64 };
            let (_, a) = self.create_node(req, parent.0, name, kind, perm, rdev, None, false)?;
            Ok(a)
        })();
        self.entry_reply(r, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self
            .create_node(
                req,
                parent.0,
                name,
                Kind::Dir,
                mode & !umask,
                0,
                None,
                false,
            )
            .map(|x| x.1);
        self.entry_reply(r, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            let child = tx.lookup(parent.0, name.as_bytes())?.ok_or(Errno::ENOENT)?;
            if tx.node(child)?.kind == Kind::Dir {
                return Err(Errno::EISDIR);
            }
            tx.event(FsEventKind::Delete, parent.0, name.as_bytes(), false);
            tx.detach(parent.0, name.as_bytes())?;
            tx.drop_link(child)?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            if name.as_bytes() == b"." {
                return Err(Errno::EINVAL);
            }
            let child = tx.lookup(parent.0, name.as_bytes())?.ok_or(Errno::ENOENT)?;
            if tx.node(child)?.kind != Kind::Dir {
                return Err(Errno::ENOTDIR);
            }
            if !tx.children(child)?.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            tx.event(FsEventKind::Delete, parent.0, name.as_bytes(), true);
            tx.detach(parent.0, name.as_bytes())?;
            tx.drop_link(child)?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let t = target.as_os_str().as_bytes().to_vec();
        if t.len() > MAX_SYMLINK_LEN {
            return reply.error(Errno::ENAMETOOLONG);
        }
        let r = self
            .create_node(
                req,
                parent.0,
                link_name,
                Kind::Symlink,
                0o777,
                0,
                Some(t),
                false,
            )
            .map(|x| x.1);
        self.entry_reply(r, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let (p, np) = (parent.0, newparent.0);
            let (n1, n2) = (name.as_bytes(), newname.as_bytes());
            check_name(n2)?;
            if flags.contains(RenameFlags::RENAME_WHITEOUT) {
                return Err(Errno::EINVAL);
            }
            let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
            let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
            if exchange && noreplace {
                return Err(Errno::EINVAL);
            }
            let mut tx = self.ws().tx();
            if tx.node(np)?.kind != Kind::Dir {
                return Err(Errno::ENOTDIR);
            }
            let src = tx.lookup(p, n1)?.ok_or(Errno::ENOENT)?;
            let dst = tx.lookup(np, n2)?;
            let src_dir = tx.node(src)?.kind == Kind::Dir;
            // A directory cannot move below itself.
            if tx.is_within(np, src)? {
                return Err(Errno::EINVAL);
            }
            if exchange {
                let dst = dst.ok_or(Errno::ENOENT)?;
                if dst == src {
                    return Ok(());
                }
                if tx.node(dst)?.kind == Kind::Dir && tx.is_within(p, dst)? {
                    return Err(Errno::EINVAL);
                }
                let dst_dir = tx.node(dst)?.kind == Kind::Dir;
                tx.rename_event(p, n1, np, n2, src_dir);
                tx.rename_event(np, n2, p, n1, dst_dir);
                tx.detach(p, n1)?;
                tx.detach(np, n2)?;
                tx.attach(np, n2, src)?;
                tx.attach(p, n1, dst)?;
                let t = now_ns();
                tx.changed(src, t)?;
                tx.changed(dst, t)?;
                return tx.commit();
            }
            if let Some(d) = dst {
                if noreplace {
                    return Err(Errno::EEXIST);
                }
                if d == src {
                    return Ok(());
                }
                let dst_dir = tx.node(d)?.kind == Kind::Dir;
                if src_dir && !dst_dir {
                    return Err(Errno::ENOTDIR);
                }
                if !src_dir && dst_dir {
                    return Err(Errno::EISDIR);
                }
                if dst_dir && !tx.children(d)?.is_empty() {
                    return Err(Errno::ENOTEMPTY);
                }
                tx.detach(np, n2)?;
                tx.drop_link(d)?;
            }
            tx.rename_event(p, n1, np, n2, src_dir);
            tx.detach(p, n1)?;
            tx.attach(np, n2, src)?;
            tx.changed(src, now_ns())?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let name = newname.as_bytes();
            check_name(name)?;
            let mut tx = self.ws().tx();
            if tx.node(ino.0)?.kind == Kind::Dir {
                return Err(Errno::EPERM);
            }
            if tx.node(newparent.0)?.kind != Kind::Dir {
                return Err(Errno::ENOTDIR);
            }
            if tx.lookup(newparent.0, name)?.is_some() {
                return Err(Errno::EEXIST);
            }
            if tx.node(ino.0)?.nlink >= LINK_MAX {
                return Err(Errno::EMLINK);
            }
            // Every link of a linked node is an override, so that all of them follow
            // its content: make it dirty where it is first.
            tx.persist(ino.0)?;
            tx.node_mut(ino.0)?.nlink += 1;
            tx.attach(newparent.0, name, ino.0)?;
            tx.event(FsEventKind::Create, newparent.0, name, false);
            tx.changed(ino.0, now_ns())?;
            let a = tx.attr(ino.0)?;
            tx.commit()?;
            Ok(a)
        })();
        self.entry_reply(r, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = self.open_node(ino.0, flags.0, |f| reply.open_backing(f));
        match r {
            Ok((fh, Some(b))) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &b),
            Ok((fh, None)) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = match self.current_src(ino.0, fh.0) {
            Src::Upper(u) => {
                let mut buf = vec![0u8; size as usize];
                let mut n = 0;
                loop {
                    match u.read_at(&mut buf[n..], offset + n as u64) {
                        Ok(0) => break,
                        Ok(k) => {
                            n += k;
                            if n == buf.len() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return reply.error(io_errno(e)),
                    }
                }
                buf.truncate(n);
                Ok(buf)
            }
            Src::Clean(c) => self.ws().read_clean(ino.0, &c, offset, size),
            Src::None => Err(Errno::EIO),
        };
        match r {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let ws = self.ws();
        let _b = ws.barrier.read().unwrap_or_else(|p| p.into_inner());
        // Upper files share the store's filesystem: leave its database the reserve it
        // needs (a write that fails there for lack of space, it does not survive).
        let r = ws
            .dirty
            .database()
            .ensure_space(data.len() as u64)
            .map_err(eio)
            .and_then(|()| self.writable_upper(ino.0, fh.0))
            .and_then(|u| {
                u.write_all_at(data, offset).map_err(io_errno)?;
                let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
                ws.written(
                    ino.0,
                    offset,
                    offset + data.len() as u64,
                    kill.then_some(req),
                )
            });
        match r {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close() waits for the flush (not for the release): a change is announced
        // before the writer goes on.
        let ws = self.ws();
        let writes = ws
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&fh.0)
            .is_some_and(|h| h.write);
        if writes {
            let mut tx = ws.tx();
            if tx.watched() {
                let path = tx.path_of(ino.0);
                tx.events.push((FsEventKind::Modify, path, None, false));
            }
            let _ = tx.commit();
        }
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.ws().release_handle(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            if let Src::Upper(u) = self.current_src(ino.0, fh.0) {
                if datasync {
                    u.sync_data().map_err(io_errno)?;
                } else {
                    u.sync_all().map_err(io_errno)?;
                }
            }
            self.ws().dirty.sync().map_err(eio)
        })();
        reply_empty(r, reply);
    }

    /// No opendir: the kernel then sends neither opendir nor releasedir, and caches
    /// every listing (FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE by default). That is right here
    /// because every change to a directory goes through the kernel, which drops its
    /// cache, and a root swap invalidates the root.
    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.ws().tx().node(ino.0) {
            Ok(n) if n.kind == Kind::Dir => reply.error(Errno::ENOSYS),
            Ok(_) => reply.error(Errno::ENOTDIR),
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
        let entries = match self.listing(ino.0, offset) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (i, (child, kind, name)) in entries.into_iter().enumerate() {
            let next = offset + i as u64 + 1;
            if reply.add(INodeNo(child), next, kind, OsStr::from_bytes(&name)) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let entries = match self.listing(ino.0, offset) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        let mut tx = self.ws().tx();
        for (k, (child, kind, name)) in entries.into_iter().enumerate() {
            if kind == FileType::Directory && name != b"." && name != b".." {
                let _ = tx.load_dir(child);
            }
            let Ok(attr) = tx.attr(child) else { continue };
            let next = offset + k as u64 + 1;
            if reply.add(
                INodeNo(child),
                next,
                OsStr::from_bytes(&name),
                &TTL,
                &attr,
                Generation(0),
            ) {
                break;
            }
        }
        drop(tx);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.ws().dirty.sync() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(eio(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // SAFETY: zeroed statvfs is a valid out-parameter; the fd is open.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstatvfs(self.ws().upper_fd.as_raw_fd(), &mut s) } != 0 {
            return reply.error(io_errno(std::io::Error::last_os_error()));
        }
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            MAX_NAME_LEN as u32,
            s.f_frsize as u32,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let name = name.as_bytes();
            if name.len() > MAX_XATTR_NAME_LEN || name.is_empty() {
                return Err(Errno::ERANGE);
            }
            if value.len() > MAX_XATTR_VALUE_LEN {
                return Err(Errno::E2BIG);
            }
            // No POSIX ACLs or other system attributes: tools (cp -a, tar) then fall
            // back to plain modes, as on any filesystem without ACL support.
            if name.starts_with(b"system.") {
                return Err(Errno::EOPNOTSUPP);
            }
            let mut tx = self.ws().tx();
            let n = tx.node_mut(ino.0)?;
            let pos = n.xattrs.binary_search_by(|(k, _)| k.as_slice().cmp(name));
            match (pos, flags) {
                (Ok(_), f) if f & libc::XATTR_CREATE != 0 => return Err(Errno::EEXIST),
                (Err(_), f) if f & libc::XATTR_REPLACE != 0 => return Err(Errno::NO_XATTR),
                (Ok(i), _) => n.xattrs[i].1 = value.to_vec(),
                (Err(i), _) => n.xattrs.insert(i, (name.to_vec(), value.to_vec())),
            }
            tx.changed(ino.0, now_ns())?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let tx = self.ws().tx();
        match tx.node(ino.0) {
            Ok(n) => reply_getxattr(&n.xattrs, name, size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let tx = self.ws().tx();
        match tx.node(ino.0) {
            Ok(n) => reply_listxattr(&n.xattrs, size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            let n = tx.node_mut(ino.0)?;
            let pos = n
                .xattrs
                .binary_search_by(|(k, _)| k.as_slice().cmp(name.as_bytes()))
                .map_err(|_| Errno::NO_XATTR)?;
            n.xattrs.remove(pos);
            tx.changed(ino.0, now_ns())?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Permissions are checked by the kernel (default_permissions); this only says
        // whether the node exists.
        match self.ws().tx().node(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = self.create_node(
            req,
            parent.0,
            name,
            Kind::File,
            mode & !umask,
            0,
            None,
            true,
        );
        let (ino, attr) = match r {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        match self.open_node(ino, flags & !libc::O_TRUNC, |f| reply.open_backing(f)) {
            Ok((fh, Some(b))) => reply.created_passthrough(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::empty(),
                &b,
            ),
            Ok((fh, None)) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let ws = self.ws();
        let _b = ws.barrier.read().unwrap_or_else(|p| p.into_inner());
        let grows = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_COLLAPSE_RANGE) == 0;
        let space = if grows {
            ws.dirty.database().ensure_space(length).map_err(eio)
        } else {
            Ok(())
        };
        let r = space
            .and_then(|()| self.writable_upper(ino.0, fh.0))
            .and_then(|u| {
                let end = fstat(&u).map_err(io_errno)?.st_size as u64;
                // SAFETY: a valid fd; the kernel checks the range and mode.
                let rc =
                    unsafe { libc::fallocate(u.as_raw_fd(), mode, offset as i64, length as i64) };
                if rc != 0 {
                    return Err(io_errno(std::io::Error::last_os_error()));
                }
                let moves = libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE;
                // Collapse and insert move everything after `offset` (up to the old end,
                // so a collapse notes what it cut); the others change only their range.
                let to = if mode & moves != 0 {
                    end.max(offset.saturating_add(length))
                } else {
                    offset.saturating_add(length)
                };
                // As a write: set-id bits go unless the caller has CAP_FSETID (root is
                // taken for it, as for truncates), file capabilities go.
                ws.written(ino.0, offset, to, (req.uid() != 0).then_some(req))
            });
        reply_empty(r, reply);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let r = match self.current_src(ino.0, fh.0) {
            Src::Upper(u) => {
                // SAFETY: a valid fd; lseek on our own descriptor of the upper file.
                let rc = unsafe { libc::lseek(u.as_raw_fd(), offset, whence) };
                if rc < 0 {
                    Err(io_errno(std::io::Error::last_os_error()))
                } else {
                    Ok(rc)
                }
            }
            Src::Clean(c) => {
                let size = c.size as i64;
                match whence {
                    libc::SEEK_DATA if offset < size => Ok(offset),
                    libc::SEEK_HOLE if offset < size => Ok(size),
                    libc::SEEK_DATA | libc::SEEK_HOLE => Err(Errno::ENXIO),
                    _ => Err(Errno::EINVAL),
                }
            }
            Src::None => Err(Errno::EIO),
        };
        match r {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(e),
        }
    }
}

/// A mounted workspace; unmounted when dropped or by [`MountedWorkspace::unmount`].
pub struct MountedWorkspace {
    mounted: Mounted,
    pub workspace: Arc<Workspace>,
}

impl MountedWorkspace {
    pub fn unmount(self) -> std::io::Result<()> {
        self.mounted.unmount()
    }

    /// Unmounts; a busy mount stays mounted and served, and this may be tried again.
    pub fn try_unmount(&mut self) -> std::io::Result<()> {
        self.mounted.try_unmount()
    }

    pub fn is_finished(&self) -> bool {
        self.mounted.is_finished()
    }
}

/// Mounts `ws` at `mountpoint`, served by background threads.
pub fn mount_workspace(
    ws: Arc<Workspace>,
    mountpoint: &Path,
    opts: &WorkspaceOptions,
) -> std::io::Result<MountedWorkspace> {
    use fuser::{Config, MountOption};
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("casfs".into()),
        MountOption::Subtype("casfs".into()),
        MountOption::DefaultPermissions,
        MountOption::Suid,
        MountOption::Dev,
    ];
    if opts.allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(opts.threads.max(1));
    raise_fd_limit();
    let started = Instant::now();
    let session = fuser::spawn_mount(WorkspaceFs(ws.clone()), mountpoint, &config)?;
    ws.set_notifier(session.notifier());
    tracing::debug!("mounted in {:?}", started.elapsed());
    Ok(MountedWorkspace {
        mounted: Mounted::new(session, mountpoint),
        workspace: ws,
    })
}

/// Open files (passthrough backings, upper files of open handles) count against the
/// descriptor limit: take the hard limit.
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Mount key of a mountpoint: the first 8 bytes of the blake3 of its canonical path.
/// Where the upper file of inode `ino` lives, relative to the mount's upper directory.
pub fn upper_rel(ino: u64) -> String {
    format!("{:02x}/{ino}", ino % 256)
}

pub fn mount_key(mountpoint: &Path) -> [u8; 8] {
    let h = blake3::hash(mountpoint.as_os_str().as_bytes());
    h.as_bytes()[..8].try_into().expect("8 bytes")
}
