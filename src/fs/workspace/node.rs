//! Nodes of the inode table: what a node is (clean: its content in the object store;
//! dirty: its content in a local upper file), its attributes, its open handles, and how
//! nodes are made from tree entries and written to the dirty set.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{BackingId, Errno, FileType};
use rustix::fs::{Timespec, Timestamps};

use crate::cas::file::{ChunkList, CHUNK_SIZE};
use crate::cas::tree::MAX_NAME_LEN;
use crate::cas::{CasError, EntryContent, FileRef, TreeEntry, TreeId};
use crate::fs::dirty::{Kind, NodeRecord};

/// The root directory's inode number.
pub(super) const ROOT: u64 = 1;

/// The extended attribute holding a file's capabilities: a write removes it.
pub(super) const FILE_CAPS: &[u8] = b"security.capability";

/// More changed chunks than this are not listed: the snapshot reads the file whole.
pub(super) const MAX_CHANGED_CHUNKS: u64 = 1 << 16;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Meta {
    pub(super) mode: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    /// Its link count (a directory: 2 + its subdirectories).
    pub(super) nlink: u32,
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
    pub(super) fn absorb(&mut self, st: &Stat, dirty: bool) {
        self.size = st.st_size as u64;
        self.mtime = mtime_ns(st);
        self.atime = stat_ns(st.st_atime, st.st_atime_nsec);
        if dirty {
            self.ctime = self.ctime.max(stat_ns(st.st_ctime, st.st_ctime_nsec));
        }
        self.blocks = st.st_blocks as u64;
    }
}

/// A name in the inode table: up to 16 bytes inline (most file names), longer ones on
/// the heap. A node's link and its directory's map each hold one, so that a million
/// nodes the kernel knows are not two million small allocations.
pub(super) type Name = smallvec::SmallVec<[u8; 16]>;

/// A node's extended attributes, sorted by name.
pub(super) type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// Where a node is linked, (directory, name): one link inline (all but hard links).
pub(super) type Links = smallvec::SmallVec<[(u64, Name); 1]>;

/// A loaded directory's children by name. A sorted vector while small: 32 bytes an
/// entry, where a B-tree's nodes cost about 60 for a 20-entry directory (its
/// half-empty leaves and their parent); a B-tree beyond [`SORTED_MAX`], so that adding
/// to a huge directory stays O(log n).
pub(super) enum Children {
    Sorted(Vec<(Name, u64)>),
    /// Boxed so that `Option<Children>` stays 24 bytes (the vector's capacity holds the
    /// tags); a B-tree is rare and large.
    #[allow(clippy::box_collection)]
    Tree(Box<BTreeMap<Name, u64>>),
}

/// Most children kept in a sorted vector: inserting moves at most 16 KiB.
const SORTED_MAX: usize = 512;

impl Default for Children {
    fn default() -> Children {
        Children::Sorted(Vec::new())
    }
}

impl Children {
    /// From entries sorted by name, each name once (a tree's entries are).
    pub(super) fn from_sorted(v: Vec<(Name, u64)>) -> Children {
        debug_assert!(v.windows(2).all(|w| w[0].0 < w[1].0), "children not sorted");
        if v.len() > SORTED_MAX {
            Children::Tree(Box::new(v.into_iter().collect()))
        } else {
            Children::Sorted(v)
        }
    }

    pub(super) fn get(&self, name: &[u8]) -> Option<&u64> {
        match self {
            Children::Sorted(v) => v
                .binary_search_by(|(k, _)| k[..].cmp(name))
                .ok()
                .map(|i| &v[i].1),
            Children::Tree(t) => t.get(name),
        }
    }

    /// Adds or replaces `name`, returning the inode it named before.
    pub(super) fn insert(&mut self, name: Name, ino: u64) -> Option<u64> {
        match self {
            Children::Sorted(v) => match v.binary_search_by(|(k, _)| k[..].cmp(&name[..])) {
                Ok(i) => Some(std::mem::replace(&mut v[i].1, ino)),
                Err(i) => {
                    v.insert(i, (name, ino));
                    if v.len() > SORTED_MAX {
                        *self = Children::Tree(Box::new(std::mem::take(v).into_iter().collect()));
                    }
                    None
                }
            },
            Children::Tree(t) => t.insert(name, ino),
        }
    }

    pub(super) fn remove(&mut self, name: &[u8]) -> Option<u64> {
        match self {
            Children::Sorted(v) => v
                .binary_search_by(|(k, _)| k[..].cmp(name))
                .ok()
                .map(|i| v.remove(i).1),
            Children::Tree(t) => t.remove(name),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Children::Sorted(v) => v.len(),
            Children::Tree(t) => t.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (name, inode) in name order.
    pub(super) fn iter(&self) -> Box<dyn Iterator<Item = (&Name, &u64)> + '_> {
        match self {
            Children::Sorted(v) => Box::new(v.iter().map(|(k, i)| (k, i))),
            Children::Tree(t) => Box::new(t.iter()),
        }
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &Name> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &u64> + '_ {
        self.iter().map(|(_, i)| i)
    }
}

pub(super) enum Body {
    Dir {
        tree: Option<TreeId>,
        children: Option<Children>,
    },
    File {
        clean: Option<FileRef>,
        /// The local copy; kept open only while handles are, so that a tree of many
        /// dirty files does not hold a descriptor each.
        upper: Option<Upper>,
    },
    Symlink(Vec<u8>),
    /// A fifo, socket or device, with its device number (0 but for devices).
    Other {
        rdev: u64,
    },
}

#[derive(Clone)]
pub(super) enum Upper {
    Open(Arc<File>),
    Closed,
}

pub(super) struct Node {
    /// Its inode number, set when the inode table takes the node in.
    pub(super) ino: u64,
    pub(super) kind: Kind,
    pub(super) meta: Meta,
    /// Where it is linked: (directory, name). A directory has exactly one.
    pub(super) links: Links,
    pub(super) body: Body,
    /// In the dirty set: it (or something below it) differs from the base.
    pub(super) dirty: bool,
    /// Its xattrs, handles and what its writers changed; `None` (no box) for the many
    /// nodes that have none of these (see [`Extra`]).
    pub(super) extra: Option<Box<Extra>>,
    /// The kernel's lookup count (FUSE `nlookup`): entries handed to it by lookup,
    /// create, mkdir, mknod, symlink, link and readdirplus, less what it forgot. A
    /// clean node the kernel no longer knows may be unloaded (see `Tx::unload`).
    /// 32 bits, so that a node fits 192 bytes: a count that reaches `u32::MAX` stays
    /// there (the node is then never unloaded) instead of wrapping.
    pub(super) lookups: u32,
}

/// What most nodes lack: xattrs, open handles and what writes noted. Boxed in the node
/// and only there when needed, so that the million nodes a `find` makes the kernel
/// know cost nothing for it.
#[derive(Default)]
pub(super) struct Extra {
    /// Sorted by name.
    pub(super) xattrs: Xattrs,
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
    /// A large clean file's chunk list, loaded by its first read (a cache: it goes
    /// when the last handle does).
    pub(super) chunks: Option<Arc<ChunkList>>,
}

/// The extra of a node without any.
static NONE: Extra = Extra {
    xattrs: Vec::new(),
    open_plain: 0,
    open_passthrough: 0,
    writers: 0,
    pass_writers: 0,
    changed_chunks: None,
    backing: None,
    chunks: None,
};

impl Extra {
    /// Nothing but a cache in it: the box may go.
    fn is_idle(&self) -> bool {
        self.xattrs.is_empty()
            && self.open_plain + self.open_passthrough + self.writers + self.pass_writers == 0
            && self.changed_chunks.is_none()
            && self.backing.is_none()
    }
}

impl Node {
    /// Its xattrs, handles and noted writes (none: the empty default).
    pub(super) fn extra(&self) -> &Extra {
        self.extra.as_deref().unwrap_or(&NONE)
    }

    pub(super) fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    pub(super) fn xattrs(&self) -> &Xattrs {
        &self.extra().xattrs
    }

    /// Its xattrs to change (call [`Node::settle_extra`] after removing the last).
    pub(super) fn xattrs_mut(&mut self) -> &mut Xattrs {
        &mut self.extra_mut().xattrs
    }

    /// Open by a handle (the daemon's or passthrough).
    pub(super) fn is_open(&self) -> bool {
        let u = self.extra();
        u.open_plain + u.open_passthrough > 0
    }

    /// Gives back the extra's box once nothing but a cache is in it.
    pub(super) fn settle_extra(&mut self) {
        if self.extra.as_ref().is_some_and(|u| u.is_idle()) {
            self.extra = None;
        }
    }

    /// Sets what is known of the chunks its writers changed (see [`Extra`]).
    pub(super) fn set_changed_chunks(&mut self, c: Option<BTreeSet<u64>>) {
        if c.is_some() || self.extra.is_some() {
            self.extra_mut().changed_chunks = c;
        }
    }

    /// Its device number (0 but for devices).
    pub(super) fn rdev(&self) -> u64 {
        match self.body {
            Body::Other { rdev } => rdev,
            _ => 0,
        }
    }

    /// The kernel was handed one more entry of it.
    pub(super) fn looked_up(&mut self) {
        self.lookups = self.lookups.saturating_add(1);
    }

    /// The kernel forgot `count` of its entries. A saturated count is kept: what the
    /// kernel holds is not known any more.
    pub(super) fn forgot(&mut self, count: u64) {
        if self.lookups != u32::MAX {
            self.lookups = self
                .lookups
                .saturating_sub(count.min(u32::MAX as u64) as u32);
        }
    }

    pub(super) fn parent(&self) -> u64 {
        self.links.first().map(|l| l.0).unwrap_or(ROOT)
    }

    /// Takes size, times and blocks from the stat of its local copy.
    pub(super) fn absorb(&mut self, st: &Stat) {
        let dirty = self.dirty;
        self.meta.absorb(st, dirty);
    }

    /// Set-id bits or file capabilities, which a write must clear: passthrough writes
    /// would not reach the daemon that clears them.
    pub(super) fn has_privs(&self) -> bool {
        self.meta.mode & (libc::S_ISUID | libc::S_ISGID) != 0
            || self.xattrs().iter().any(|(k, _)| k == FILE_CAPS)
    }

    /// Notes that bytes `from..to` of its upper file may have changed.
    pub(super) fn note_changed(&mut self, from: u64, to: u64) {
        let Some(uses) = self.extra.as_deref_mut() else {
            return;
        };
        let Some(set) = &mut uses.changed_chunks else {
            return;
        };
        if from >= to {
            return;
        }
        let c = CHUNK_SIZE as u64;
        let (first, end) = (from / c, to.div_ceil(c));
        if end - first > MAX_CHANGED_CHUNKS || set.len() as u64 > MAX_CHANGED_CHUNKS {
            // Mostly changed anyway: the snapshot reads it whole.
            uses.changed_chunks = None;
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
    /// A writer opened with `FOPEN_NOFLUSH` (nobody listened for changes then): its
    /// close is announced when it is released, as `flush` announces the others'.
    pub(super) announce_at_release: bool,
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

/// What `fstat` says of an open file.
pub(super) type Stat = rustix::fs::Stat;

pub(super) fn fstat(f: &File) -> std::io::Result<Stat> {
    rustix::fs::fstat(f).map_err(std::io::Error::from)
}

/// A time of a [`Stat`] (seconds and nanoseconds, of types that differ between
/// architectures) in nanoseconds.
fn stat_ns(sec: impl Into<i64>, nsec: impl TryInto<i64>) -> i64 {
    sec.into() * 1_000_000_000 + nsec.try_into().unwrap_or(0)
}

/// The modification time of a [`Stat`], in nanoseconds.
pub(super) fn mtime_ns(st: &Stat) -> i64 {
    stat_ns(st.st_mtime, st.st_mtime_nsec)
}

pub(super) fn set_file_times(
    f: &File,
    atime: Option<i64>,
    mtime: Option<i64>,
) -> std::io::Result<()> {
    let ts = |t: Option<i64>| match t {
        Some(ns) => Timespec {
            tv_sec: ns.div_euclid(1_000_000_000),
            tv_nsec: ns.rem_euclid(1_000_000_000) as _,
        },
        None => Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
    };
    let times = Timestamps {
        last_access: ts(atime),
        last_modification: ts(mtime),
    };
    rustix::fs::futimens(f, &times).map_err(std::io::Error::from)
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
    let (kind, body) = match &e.content {
        EntryContent::File(_) => (
            Kind::File,
            Body::File {
                clean: e.file_ref(),
                upper: None,
            },
        ),
        EntryContent::Dir(t) => (
            Kind::Dir,
            Body::Dir {
                tree: Some(*t),
                children: None,
            },
        ),
        EntryContent::Symlink(t) => (Kind::Symlink, Body::Symlink(t.clone())),
        EntryContent::Fifo => (Kind::Fifo, Body::Other { rdev: 0 }),
        EntryContent::CharDevice { rdev } => (Kind::CharDev, Body::Other { rdev: *rdev }),
        EntryContent::BlockDevice { rdev } => (Kind::BlockDev, Body::Other { rdev: *rdev }),
    };
    let mut node = Node {
        ino: 0,
        kind,
        meta: Meta {
            mode: e.mode,
            uid: owner.0,
            gid: owner.1,
            nlink: if kind == Kind::Dir { 2 } else { 1 },
            atime: e.mtime_ns,
            mtime: e.mtime_ns,
            ctime: e.mtime_ns,
            size: e.size,
            blocks: 0,
        },
        links: smallvec::smallvec![(dir, Name::from_slice(&e.name))],
        body,
        dirty: false,
        extra: None,
        lookups: 0,
    };
    if !e.xattrs.is_empty() {
        *node.xattrs_mut() = e.xattrs.clone();
    }
    node
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
        Body::Other { .. } => (None, None, false, None),
    };
    NodeRecord {
        kind: n.kind,
        mode: n.meta.mode,
        uid: n.meta.uid,
        gid: n.meta.gid,
        rdev: n.rdev(),
        atime_ns: n.meta.atime,
        mtime_ns: n.meta.mtime,
        ctime_ns: n.meta.ctime,
        size: n.meta.size,
        nlink: n.meta.nlink,
        xattrs: n.xattrs().clone(),
        tree,
        clean,
        upper,
        target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A million nodes the kernel knows must fit the 300 MB: a node is one
    /// 192-byte allocation (jemalloc's size class), a name of up to 16 bytes is inline.
    #[test]
    fn a_node_fits_its_size_class() {
        assert!(
            std::mem::size_of::<Node>() <= 192,
            "{}",
            std::mem::size_of::<Node>()
        );
        assert_eq!(std::mem::size_of::<Name>(), 24);
        assert_eq!(std::mem::size_of::<Option<Children>>(), 24);
        assert!(!Name::from_slice(b"file123456.rs").spilled());
    }

    #[test]
    fn children_stay_sorted_across_the_change_of_form() {
        let mut c = Children::default();
        // Inserted in a scrambled order, past the vector's limit and back.
        let names: Vec<Vec<u8>> = (0..SORTED_MAX as u64 * 2)
            .map(|i| format!("n{:05}", (i * 7919) % (SORTED_MAX as u64 * 2)).into_bytes())
            .collect();
        for (i, n) in names.iter().enumerate() {
            assert_eq!(c.insert(Name::from_slice(n), i as u64), None);
            if i == SORTED_MAX - 1 {
                assert!(matches!(c, Children::Sorted(_)));
            }
        }
        assert!(matches!(c, Children::Tree(_)));
        assert_eq!(c.len(), names.len());
        let keys: Vec<&Name> = c.keys().collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(c.get(&names[3]), Some(&3));
        assert_eq!(c.insert(Name::from_slice(&names[3]), 99), Some(3));
        assert_eq!(c.remove(&names[3]), Some(99));
        assert_eq!(c.get(&names[3]), None);
        let mut small = Children::from_sorted(vec![
            (Name::from_slice(b"a"), 1),
            (Name::from_slice(b"c"), 3),
        ]);
        assert_eq!(small.insert(Name::from_slice(b"b"), 2), None);
        assert_eq!(small.values().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(small.remove(b"zz"), None);
        assert!(!small.is_empty());
    }
}
