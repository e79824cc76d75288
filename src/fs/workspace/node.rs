//! Nodes of the inode table: what a node is (clean: its content in the object store;
//! dirty: its content in a local upper file), its attributes, its open handles, and how
//! nodes are made from tree entries and written to the dirty set.

use super::*;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Meta {
    pub(super) mode: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) rdev: u64,
    pub(super) atime: i64,
    pub(super) mtime: i64,
    pub(super) ctime: i64,
    pub(super) size: u64,
    /// Allocated 512-byte blocks of a local copy (0: derived from the size).
    pub(super) blocks: u64,
}

impl Meta {
    /// Size, times and blocks from the stat of a local copy. A clean node's copy was
    /// made when it was first opened: its change time is not the file's.
    pub(super) fn absorb(&mut self, st: &libc::stat, dirty: bool) {
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

pub(super) enum Body {
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
pub(super) enum Upper {
    Open(Arc<File>),
    Closed,
}

pub(super) struct Node {
    pub(super) kind: Kind,
    pub(super) meta: Meta,
    pub(super) nlink: u32,
    /// Where it is linked: (directory, name). A directory has exactly one.
    pub(super) links: Vec<(u64, Vec<u8>)>,
    pub(super) xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub(super) body: Body,
    /// In the dirty set: it (or something below it) differs from the base.
    pub(super) dirty: bool,
    /// Open handles served by the daemon, and by passthrough.
    pub(super) open_plain: u32,
    pub(super) open_passthrough: u32,
    pub(super) writers: u32,
    /// Handles that may write through passthrough, behind the daemon's back.
    pub(super) pass_writers: u32,
    /// Which chunks of its upper file may differ from `clean` (besides its length):
    /// every write to the upper file since it last equalled `clean` went through the
    /// daemon, which noted the chunks it touched, so a snapshot reads only those.
    /// `None` when that is not known (a passthrough writer, a remount): the snapshot
    /// reads the whole file. Whatever shortens the file notes everything it cut, so
    /// the zeros a later write past the end leaves lie in noted chunks or beyond
    /// `clean` (chunks the snapshot reads anyway): writes note only what they write.
    pub(super) changed_chunks: Option<BTreeSet<u64>>,
    pub(super) backing: Option<Arc<BackingId>>,
    /// The kernel's lookup count (FUSE `nlookup`): entries handed to it by lookup,
    /// create, mkdir, mknod, symlink, link and readdirplus, less what it forgot. A
    /// clean node the kernel no longer knows may be unloaded (see `Tx::unload`).
    pub(super) lookups: u64,
}

impl Node {
    pub(super) fn parent(&self) -> u64 {
        self.links.first().map(|l| l.0).unwrap_or(ROOT)
    }

    /// Takes size, times and blocks from the stat of its local copy.
    pub(super) fn absorb(&mut self, st: &libc::stat) {
        let dirty = self.dirty;
        self.meta.absorb(st, dirty);
    }

    /// Set-id bits or file capabilities, which a write must clear: passthrough writes
    /// would not reach the daemon that clears them.
    pub(super) fn has_privs(&self) -> bool {
        self.meta.mode & (libc::S_ISUID | libc::S_ISGID) != 0
            || self.xattrs.iter().any(|(k, _)| k == FILE_CAPS)
    }

    /// Notes that bytes `from..to` of its upper file may have changed.
    pub(super) fn note_changed(&mut self, from: u64, to: u64) {
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
    pub(super) fn close_upper(&mut self) {
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
pub(super) enum Src {
    Upper(Arc<File>),
    Clean(FileRef),
    None,
}

pub(super) struct Handle {
    pub(super) ino: u64,
    /// Opened for writing (counted in its node's `writers`).
    pub(super) write: bool,
    pub(super) src: Src,
    pub(super) backing: Option<Arc<BackingId>>,
}

pub(super) fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

pub(super) fn to_time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

pub(super) fn time_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

pub(super) fn eio(e: CasError) -> Errno {
    if e.is_no_space() {
        tracing::warn!("{e}");
        return Errno::ENOSPC;
    }
    tracing::error!("{e}");
    Errno::EIO
}

pub(super) fn io_errno(e: std::io::Error) -> Errno {
    Errno::from(e)
}

pub(super) fn file_type(k: Kind) -> FileType {
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

pub(super) fn kind_of_mode(mode: u32) -> Option<Kind> {
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

pub(super) fn fstat(f: &File) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-parameter for fstat on an open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(f.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

pub(super) fn set_file_times(
    f: &File,
    atime: Option<i64>,
    mtime: Option<i64>,
) -> std::io::Result<()> {
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

pub(super) fn check_name(name: &[u8]) -> Result<(), Errno> {
    if name.len() > MAX_NAME_LEN {
        return Err(Errno::ENAMETOOLONG);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

pub(super) fn node_from_entry(e: &TreeEntry, dir: u64, owner: (u32, u32)) -> Node {
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
        open_plain: 0,
        open_passthrough: 0,
        lookups: 0,
        writers: 0,
        pass_writers: 0,
        changed_chunks: None,
        backing: None,
    }
}

pub(super) fn record_of(n: &Node) -> NodeRecord {
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
