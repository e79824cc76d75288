//! The shared core of a workspace: the [`Workspace`] that the FUSE side and the
//! control side both hold, how it opens (the inode table built from the base and the
//! persisted dirty set), its options, errors and limits, and the steps that touch it
//! whole (status, forgetting nodes, releasing handles, subscriptions).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;

use fuser::{Errno, FileAttr, INodeNo, Notifier, Request};
use rustix::fs::AtFlags;

use super::events::{Events, FsEvent, FsEventKind};
use super::node::{
    file_type, fstat, now_ns, to_time, Body, Handle, Links, Meta, Node, Upper, ROOT,
};
use super::nodes::Nodes;
use super::state::{Copies, State};
use crate::cas::{CasError, FileRef, ObjectStore, TreeId};
use crate::fs::chunk_cache::ChunkReader;
use crate::fs::dirty::{DirtyStore, Kind, MountMeta, NodeRecord, Tag};
use crate::sys::Locked;

/// How long the kernel may trust attributes and entries. Every change passes through
/// the kernel (which updates its caches itself); the one change that does not, a root
/// swap, invalidates the root's entries explicitly, and the old inodes are unreachable.
pub(super) const TTL: Duration = Duration::from_secs(60);

/// Clean files at least this large get a local copy when opened with passthrough
/// available, so the kernel reads them itself; smaller ones go through the chunk cache.
pub(super) const MATERIALIZE_MIN: u64 = 256 << 10;

/// A file at least this large that is opened for writing (without `O_TRUNC`) is
/// written through the daemon instead of passthrough, so that the daemon sees every
/// write and a checkpoint reads and hashes only the chunks written, not the whole file.
pub(super) const TRACK_WRITES_MIN: u64 = 16 << 20;

/// Free space (beyond the database's reserve) below which handles that may write are
/// served by the daemon, which enforces the reserve, instead of through passthrough.
pub(super) const PASSTHROUGH_WRITE_ROOM: u64 = 1 << 30;

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
    /// Ask the kernel for FUSE over io_uring (see [`crate::fs::transport::FuseTransport`]).
    pub fuse_uring: bool,
    /// Who the files the workspace did not see made belong to (the base's, restored
    /// ones, its root); someone other than this process is let into the mount
    /// (`allow_other`).
    pub owner: crate::fs::owner::Owner,
    /// An overlay mount of a tree with no metadata image yet builds one before it
    /// mounts (O(entries) once; lookups never reach casfs after), or (false) mounts
    /// the tree's view at once, O(1): what a sandbox restored at a new checkpoint
    /// wants, since the next run's tree is another.
    pub build_lower_image: bool,
    /// The mount's uncaptured work (upper files, an overlay's uppers) lives in a file
    /// system of this many bytes of its own, and a write past it fails with ENOSPC
    /// (`crate::mount::disk`); none: in the store's directory, bounded by its file
    /// system only.
    pub disk_bytes: Option<u64>,
}

impl Default for WorkspaceOptions {
    fn default() -> Self {
        WorkspaceOptions {
            local_copies_bytes: 2 << 30,
            chunk_cache_bytes: 64 << 20,
            threads: 4,
            allow_other: false,
            passthrough: true,
            fuse_uring: crate::fs::transport::default_uring(),
            owner: crate::fs::owner::Owner::current(),
            build_lower_image: true,
            disk_bytes: None,
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
    /// A [`SnapshotFilter`](super::SnapshotFilter) refused an entry.
    #[error("refused: {0}")]
    Refused(String),
}

/// How reads of files reach their data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadMode {
    /// The kernel reads local copies itself (FUSE passthrough): no daemon round trip.
    Passthrough,
    /// Every read is a request to the daemon.
    Fuse,
    /// The kernel's overlayfs serves the workspace: changed files from a local upper
    /// directory, the rest through a read-only casfs view (the overlay backend).
    Overlay,
    /// As `Overlay`, with the base's metadata in an EROFS image served by the kernel:
    /// only file contents come from casfs (its object view, overlayfs's data layer).
    #[serde(rename = "overlay-image")]
    OverlayImage,
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
    pub read_mode: ReadMode,
}

/// The shared core of a mounted workspace: the FUSE side and the control side both
/// hold it.
pub struct Workspace {
    pub(super) objects: Arc<dyn ObjectStore>,
    pub(super) dirty: DirtyStore,
    pub(super) upper_dir: PathBuf,
    pub(super) upper_fd: OwnedFd,
    pub(super) reaper: std::sync::mpsc::Sender<u64>,
    pub(super) state: Mutex<State>,
    /// Writes hold it shared; a snapshot holds it exclusively.
    pub(super) barrier: RwLock<()>,
    pub(super) reader: ChunkReader,
    pub(super) handles: Mutex<HashMap<u64, Handle>>,
    pub(super) next_fh: AtomicU64,
    pub(super) next_tmp: AtomicU64,
    pub(super) want_passthrough: bool,
    pub(super) want_uring: bool,
    pub(super) passthrough: AtomicBool,
    pub(super) notifier: OnceLock<Notifier>,
    pub(super) owner: (u32, u32),
    pub(super) mounted_at: i64,
    /// Limit of [`Copies`] in bytes.
    pub(super) copies_limit: u64,
    /// Changed nodes at most (with a bounded disk): a directory, symlink or special
    /// file is a row of the database rather than a file of the disk, so their number
    /// is bounded as the disk's inodes are, one per 8 KiB.
    pub(super) max_dirty: usize,
    /// Clean files may get a local copy to be read through passthrough: not on a
    /// bounded disk, where the room is the workspace's writes'.
    pub(super) read_copies: bool,
    /// Nodes unloaded since freed memory was last given back to the system.
    pub(super) unloaded_since_trim: AtomicU64,
    /// Clean files opened since the last checkpoint, in first-open order.
    pub(super) reads: crate::fs::reads::ReadLog,
}

/// How long the reaper lets removals of upper files gather between batches.
pub(super) const REAP_PAUSE: Duration = Duration::from_millis(20);

/// Unloaded nodes after which freed memory is given back ([`crate::memory::give_back`]):
/// about a megabyte, so that what the last forgets of a burst freed is not left behind
/// (jemalloc's decay runs only when something allocates).
pub(super) const TRIM_AFTER_UNLOADED: u64 = 4_096;

/// Most links a file may have (ext4's figure): `link` refuses one more with EMLINK.
pub(super) const LINK_MAX: u32 = 65_000;

impl Workspace {
    /// Opens the workspace of mount `key`: picks up its dirty set if it has one (its base
    /// wins over `base`; [`Workspace::base`] tells), else starts clean at `base`.
    pub fn open(
        objects: Arc<dyn ObjectStore>,
        db: Arc<crate::cas::Database>,
        key: [u8; 8],
        upper_dir: &Path,
        base: TreeId,
        tag: Tag,
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
        let owner = (opts.owner.uid, opts.owner.gid);
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
                        let _ = rustix::fs::unlinkat(&reaper_fd, &name, AtFlags::empty());
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
                nodes: Nodes::default(),
                next_ino: 2,
                base,
                tag,
                dirty: BTreeSet::new(),
                events: Events::default(),
                copies: Copies::default(),
                open: HashSet::new(),
                unloaded: HashMap::new(),
            }),
            copies_limit: opts.local_copies_bytes,
            read_copies: opts.disk_bytes.is_none(),
            max_dirty: opts.disk_bytes.map_or(usize::MAX, |b| {
                usize::try_from(b / 8192).unwrap_or(usize::MAX)
            }),
            reads: crate::fs::reads::ReadLog::default(),
            unloaded_since_trim: AtomicU64::new(0),
            barrier: RwLock::new(()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_tmp: AtomicU64::new(1),
            want_passthrough: opts.passthrough && crate::fs::mounted::passthrough_permitted(),
            want_uring: opts.fuse_uring,
            passthrough: AtomicBool::new(false),
            notifier: OnceLock::new(),
            owner,
            mounted_at: t,
        };
        ws.load(base, records)?;
        Ok(ws)
    }

    pub(super) fn root_node(&self, base: TreeId) -> Node {
        Node {
            ino: 0,
            kind: Kind::Dir,
            meta: Meta {
                mode: 0o755,
                uid: self.owner.0,
                gid: self.owner.1,
                nlink: 2,
                atime: self.mounted_at,
                mtime: self.mounted_at,
                ctime: self.mounted_at,
                size: 0,
                blocks: 0,
            },
            links: Links::new(),
            body: Body::Dir {
                tree: Some(base),
                children: None,
            },
            dirty: false,
            extra: None,
            lookups: 0,
        }
    }

    /// Builds the inode table from the base and the persisted records, and removes
    /// upper files no record needs.
    pub(super) fn load(
        &self,
        base: TreeId,
        records: Vec<(u64, NodeRecord)>,
    ) -> Result<(), WorkspaceError> {
        let mut st = self.lock();
        st.nodes.insert(ROOT, Box::new(self.root_node(base)));
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
                    }
                }
                Kind::Symlink => Body::Symlink(r.target.clone().unwrap_or_default()),
                _ => Body::Other { rdev: r.rdev },
            };
            let mut node = Node {
                ino: 0,
                kind: r.kind,
                meta: Meta {
                    mode: r.mode,
                    uid: r.uid,
                    gid: r.gid,
                    nlink: r.nlink,
                    atime: r.atime_ns,
                    mtime: r.mtime_ns,
                    ctime: r.ctime_ns,
                    size: r.size,
                    blocks: 0,
                },
                links: Links::new(),
                body,
                dirty: true,
                extra: None,
                lookups: 0,
            };
            if !r.xattrs.is_empty() {
                *node.xattrs_mut() = r.xattrs.clone();
            }
            if let Some(st) = upper_st {
                node.absorb(&st);
            }
            if ino == ROOT {
                let root = st.nodes.get_mut(&ROOT).expect("root");
                root.meta = node.meta;
                *root.xattrs_mut() = node.xattrs().clone();
                root.settle_extra();
                root.dirty = true;
                if let (Body::Dir { tree, .. }, Body::Dir { tree: t, .. }) =
                    (&mut root.body, node.body)
                {
                    *tree = t;
                }
            } else {
                st.nodes.insert(ino, Box::new(node));
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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// The content of the regular file at `path` in the base tree (the checkpoint the
    /// workspace started from), if there is one.
    pub fn base_file(&self, path: &str) -> Result<Option<Vec<u8>>, WorkspaceError> {
        let base = self.lock().base;
        Ok(crate::cas::file_at(self.objects.as_ref(), &base, path)?)
    }

    pub(super) fn note_read(&self, f: FileRef) {
        self.reads.note(f);
    }

    /// The clean files opened since the last call, in the order first opened (at most
    /// the first 8192): what a run read, for another host to fetch first.
    pub fn take_reads(&self) -> Vec<FileRef> {
        self.reads.take()
    }

    pub(super) fn attr_of(&self, ino: u64, n: &Node) -> FileAttr {
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
            nlink: m.nlink,
            uid: m.uid,
            gid: m.gid,
            rdev: n.rdev() as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    /// The current base tree and the tag kept with it.
    pub fn base(&self) -> (TreeId, Tag) {
        let st = self.lock();
        (st.base, st.tag.clone())
    }

    /// Whether reads of local copies go through FUSE passthrough (known once mounted).
    pub fn read_mode(&self) -> ReadMode {
        if self.passthrough.load(Ordering::Relaxed) {
            ReadMode::Passthrough
        } else {
            ReadMode::Fuse
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

    /// Gives the workspace the channel for cache invalidations (after mounting).
    pub fn set_notifier(&self, n: Notifier) {
        let _ = self.notifier.set(n);
    }

    pub(super) fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// After a write through the daemon of bytes `from..to` of `ino`: notes the chunks,
    /// and clears what a write clears (set-id bits only if `kill_suidgid` names the
    /// writer: one without `CAP_FSETID`).
    pub(super) fn written(
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

    /// The kernel forgot these lookups (inode, count): the clean nodes it no longer
    /// knows are unloaded (`Tx::unload`), so memory follows what is in use.
    pub(super) fn forget(&self, forgotten: impl IntoIterator<Item = (u64, u64)>) {
        let mut tx = self.tx();
        let mut queue = Vec::new();
        for (ino, count) in forgotten {
            tx.forget(ino, count, &mut queue);
        }
        let dropped = if queue.is_empty() {
            0
        } else {
            tx.unload(queue)
        };
        drop(tx);
        // Freed nodes go back to the system in bulk, not one trim per forget.
        let since = self
            .unloaded_since_trim
            .fetch_add(dropped as u64, Ordering::Relaxed);
        if since + dropped as u64 >= TRIM_AFTER_UNLOADED {
            self.unloaded_since_trim.store(0, Ordering::Relaxed);
            crate::memory::give_back();
        }
    }

    pub(super) fn release_handle(&self, fh: u64) {
        let h = self.handles.locked().remove(&fh);
        let Some(h) = h else { return };
        let mut tx = self.tx();
        if h.announce_at_release && tx.watched() && tx.st.nodes.contains_key(&h.ino) {
            let path = tx.path_of(h.ino);
            tx.events.push((FsEventKind::Modify, path, None, false));
        }
        if let Some(n) = tx.st.nodes.get_mut(&h.ino) {
            let u = n.extra_mut();
            if h.write {
                u.writers = u.writers.saturating_sub(1);
                if h.backing.is_some() {
                    u.pass_writers = u.pass_writers.saturating_sub(1);
                }
            }
            if h.backing.is_some() {
                u.open_passthrough = u.open_passthrough.saturating_sub(1);
                if u.open_passthrough == 0 {
                    u.backing = None;
                }
            } else {
                u.open_plain = u.open_plain.saturating_sub(1);
            }
            let closed = !n.is_open();
            if closed {
                n.close_upper();
            }
            n.settle_extra();
            if closed {
                tx.st.open.remove(&h.ino);
            }
        }
        tx.note_copy(h.ino);
        tx.maybe_free(h.ino);
        let _ = tx.commit();
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
}
