//! The base of a workspace and how it moves: a snapshot (begin, publish, finish: the
//! dirty set becomes the new base) and a root swap (restore).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use fuser::INodeNo;

use super::node::{fstat, mtime_ns, Body, Name, ROOT};
use super::shared::{Workspace, WorkspaceError};
use super::state::Copies;
use super::table::Tx;
use crate::cas::file::{
    load_chunk_list, store_bytes, store_changed_chunks, store_reader_over, CHUNK_SIZE,
};
use crate::cas::{
    load_tree, store_tree, EntryContent, FileRef, StoreStats, Tree, TreeEntry, TreeId,
};
use crate::fs::dirty::{Kind, MountMeta, Tag};
use crate::sys::ReadWriteLocked;

/// Counts of what a snapshot did.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotStats {
    /// Files whose content was read and hashed for this snapshot, and the bytes read.
    pub files_hashed: u64,
    pub bytes_hashed: u64,
    /// Of `files_hashed`, those read ahead of it (an overlay mount reads what a killed
    /// daemon left when it picks the upper up, to tell it from its base).
    #[serde(default)]
    pub hashed_ahead: u64,
    pub dirs_written: u64,
    pub new_objects: u64,
    pub new_bytes: u64,
    pub reused_objects: u64,
    /// Sockets left out (they cannot be stored).
    pub skipped: u64,
    /// Files (and other non-directories) added or modified since the base (the
    /// checkpoint before), a moved directory's files at their new paths.
    pub changed_paths: Vec<String>,
    /// Entries of the base's tree that are gone (a removed directory counts once).
    pub removed_paths: Vec<String>,
}

/// What a snapshot keeps of the changed entries, and in what form (a capture policy:
/// globs, sizes, values replaced), given by the caller. Entries it leaves out or stores
/// in another form stay dirty, so the workspace keeps showing them as they are and the
/// next snapshot looks at them again.
pub trait SnapshotFilter: Sync {
    /// Whether the changed entry at `path` (relative, '/'-separated) goes in. `size` is
    /// a file's length (0 for the rest).
    fn keep(&self, path: &str, kind: EntryKind, size: u64) -> bool;

    /// The content to store for the changed regular file at `path` instead of what
    /// `file` holds (read from its start), or `None` to store it as it is. An error
    /// fails the snapshot.
    fn transform(
        &self,
        path: &str,
        file: &mut File,
        size: u64,
    ) -> Result<Option<Vec<u8>>, FilterError>;

    /// Vets an entry of a changed directory (`dir`, relative) before the directory's
    /// tree is stored: its name, symlink target and extended attributes. An error fails
    /// the snapshot, and no tree naming the entry has been stored.
    fn vet(&self, _dir: &str, _entry: &TreeEntry) -> Result<(), FilterError> {
        Ok(())
    }
}

/// Why a [`SnapshotFilter`] stopped a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// The filter's rules refuse it (an oversize file under a failing policy, a secret in
    /// a name): nothing of the snapshot is published.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl FilterError {
    /// The error with the path of the entry it is about.
    fn at(self, path: &str) -> WorkspaceError {
        match self {
            FilterError::Refused(why) => WorkspaceError::Refused(format!("{path}: {why}")),
            FilterError::Io(e) => WorkspaceError::Io(format!("{path}: {e}")),
        }
    }
}

impl From<FilterError> for WorkspaceError {
    fn from(e: FilterError) -> WorkspaceError {
        match e {
            FilterError::Refused(why) => WorkspaceError::Refused(why),
            FilterError::Io(e) => WorkspaceError::Io(e.to_string()),
        }
    }
}

/// What a snapshot's walk carries along.
pub(super) struct BuildCx<'a> {
    pub(super) stats: &'a mut SnapshotStats,
    /// Nodes written, with their new entries.
    pub(super) done: Vec<(u64, Arc<TreeEntry>)>,
    /// Nodes the filter left out or stored in another form: they stay dirty.
    pub(super) keep_dirty: Vec<u64>,
    pub(super) filter: Option<&'a dyn SnapshotFilter>,
    /// How deep the directory being built is below the root.
    pub(super) depth: usize,
}

/// The kind of a changed entry, as a [`SnapshotFilter`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Special,
}

impl<'a> Tx<'a> {
    /// Builds and stores the tree of dirty directory `ino`; returns its id.
    pub(super) fn build(
        &mut self,
        ino: u64,
        cx: &mut BuildCx<'_>,
    ) -> Result<TreeId, WorkspaceError> {
        self.load_dir(ino)
            .map_err(|e| WorkspaceError::Io(format!("loading {}: {e:?}", self.path_of(ino))))?;
        let (children, base_tree): (Vec<(Name, u64)>, Option<TreeId>) =
            match &self.st.nodes[&ino].body {
                Body::Dir {
                    children: Some(c),
                    tree,
                } => (c.iter().map(|(k, v)| (k.clone(), *v)).collect(), *tree),
                _ => unreachable!("loaded above"),
            };
        let mut entries = Vec::with_capacity(children.len());
        let mut cas = StoreStats::default();
        // The directory's base tree, read at the first clean child: a clean node is the
        // entry of its name there (re-linking a node anywhere makes it dirty).
        let mut base: Option<Tree> = None;
        for (name, child) in children {
            let n = &self.st.nodes[&child];
            if !n.dirty {
                if base.is_none() {
                    let t = base_tree.ok_or_else(|| {
                        WorkspaceError::Io(format!(
                            "{}: a clean entry in a directory with no base tree",
                            self.entry_path(ino, &name)
                        ))
                    })?;
                    base = Some(load_tree(self.ws.objects.as_ref(), &t)?);
                }
                let e = base.as_ref().and_then(|b| b.get(&name)).ok_or_else(|| {
                    WorkspaceError::Io(format!(
                        "{}: clean but not in its directory's base tree",
                        self.entry_path(ino, &name)
                    ))
                })?;
                entries.push(e.clone());
                continue;
            }
            let meta = n.meta;
            let xattrs = n.xattrs().clone();
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
                    if cx.depth >= crate::cas::MAX_TREE_DEPTH {
                        return Err(WorkspaceError::Refused(format!(
                            "{}: more than {} directories deep; casfs stores no deeper tree",
                            self.path_of(child),
                            crate::cas::MAX_TREE_DEPTH
                        )));
                    }
                    cx.depth += 1;
                    let built = self.build(child, cx);
                    cx.depth -= 1;
                    let id = built?;
                    (EntryContent::Dir(id), 0, meta.mtime, meta.mode)
                }
                Kind::File => {
                    let (clean, upper) = match &n.body {
                        Body::File { clean, upper, .. } => (*clean, upper.clone()),
                        _ => unreachable!(),
                    };
                    let changed = n.extra().changed_chunks.clone();
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
                                    .map_err(|e| e.at(&rel))?,
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
                            let mtime = mtime_ns(&st);
                            (fref, mtime)
                        }
                        (None, Some(c)) => (c, meta.mtime),
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
                    let t = match &n.body {
                        Body::Symlink(t) => t.clone(),
                        _ => unreachable!(),
                    };
                    let len = t.len() as u64;
                    (EntryContent::Symlink(t), len, meta.mtime, 0o777)
                }
                Kind::Fifo => (EntryContent::Fifo, 0, meta.mtime, meta.mode),
                Kind::CharDev => (
                    EntryContent::CharDevice { rdev: n.rdev() },
                    0,
                    meta.mtime,
                    meta.mode,
                ),
                Kind::BlockDev => (
                    EntryContent::BlockDevice { rdev: n.rdev() },
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
                name: name.to_vec(),
                content,
                mode,
                mtime_ns: mtime,
                size,
                xattrs,
            };
            cx.done.push((child, Arc::new(e.clone())));
            entries.push(e);
        }
        if let Some(f) = cx.filter {
            // Before the tree is stored: a refused entry leaves no object naming it.
            let dir = self.path_of(ino);
            for e in &entries {
                f.vet(&dir, e).map_err(WorkspaceError::from)?;
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

/// A snapshot being taken ([`Workspace::begin_snapshot`]): writes are held off and every
/// dirty file and directory is stored; [`Snapshot::root`] and [`Snapshot::stats`] say
/// what it made. [`Snapshot::finish`] makes it the workspace's base; dropping the guard
/// instead leaves the workspace as it was (what was stored stays unnamed, for garbage
/// collection), as jj's `LockedWorkingCopy` does.
pub struct Snapshot<'a> {
    ws: &'a Workspace,
    // Dropped in this order: the table, then the write barrier.
    tx: Tx<'a>,
    _barrier: std::sync::RwLockWriteGuard<'a, ()>,
    root: TreeId,
    stats: SnapshotStats,
    /// Nodes written, with their new entries.
    done: Vec<(u64, Arc<TreeEntry>)>,
    /// Nodes left out or stored in another form: they stay dirty.
    keep_dirty: Vec<u64>,
}

impl Workspace {
    /// Begins a snapshot: holds writes off, stores every dirty file and directory (what
    /// `filter` keeps, in the form it says) and syncs the object store, so the root can
    /// be published before [`Snapshot::finish`].
    pub fn begin_snapshot<'a>(
        &'a self,
        filter: Option<&dyn SnapshotFilter>,
    ) -> Result<Snapshot<'a>, WorkspaceError> {
        let barrier = self.barrier.write_locked();
        let mut tx = self.tx();
        let mut stats = SnapshotStats::default();
        let root_dirty = tx.st.nodes[&ROOT].dirty;
        let mut cx = BuildCx {
            stats: &mut stats,
            done: Vec::new(),
            keep_dirty: Vec::new(),
            filter,
            depth: 0,
        };
        let root = if root_dirty {
            tx.build(ROOT, &mut cx)?
        } else {
            tx.st.base
        };
        let (done, keep_dirty) = (cx.done, cx.keep_dirty);
        // What changed is told against the base, tree by tree: a file that stayed dirty
        // (open for writing, or stored in another form by the filter) but holds what the
        // base holds is no change, and a moved directory's files are changes at their new
        // paths. An entry the filter left out is not in the tree: removed, if the base
        // had it.
        crate::cas::paths_between(
            self.objects.as_ref(),
            Some(tx.st.base),
            root,
            "",
            &mut stats.changed_paths,
            &mut stats.removed_paths,
            &mut 0,
        )?;
        self.objects.sync()?;
        Ok(Snapshot {
            ws: self,
            tx,
            _barrier: barrier,
            root,
            stats,
            done,
            keep_dirty,
        })
    }

    /// Makes `root` the workspace's content: the inode table is replaced (files open
    /// now keep what they had open), the kernel's caches are invalidated, nothing is
    /// copied. Refused while uncaptured changes exist unless `force`.
    pub fn swap_root(&self, root: TreeId, tag: Tag, force: bool) -> Result<(), WorkspaceError> {
        // The new root must be readable before anything is dropped.
        load_tree(self.objects.as_ref(), &root)?;
        let _barrier = self.barrier.write_locked();
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
            } => c.keys().map(|k| k.to_vec()).collect(),
            _ => Vec::new(),
        };
        if let Ok(t) = load_tree(self.objects.as_ref(), &root) {
            old_names.extend(t.into_entries().into_iter().map(|e| e.name));
        }
        // The old table goes whole: the nodes with open handles stay, detached (their
        // handles keep working until they close); the rest is dropped, and their upper
        // files removed, on a thread of its own. O(open handles) here at any size.
        let mut old = std::mem::take(&mut tx.st.nodes);
        let open: Vec<u64> = tx.st.open.iter().copied().collect();
        for ino in open {
            if let Some(mut n) = old.remove(&ino) {
                n.links.clear();
                n.meta.nlink = 0;
                n.dirty = false;
                tx.st.nodes.insert(ino, n);
            }
        }
        let reaper = self.reaper.clone();
        let dropped = std::thread::Builder::new()
            .name("casfs-old-table".into())
            .spawn(move || {
                // A million nodes take a core for a while.
                crate::fs::mounted::low_priority();
                for n in old.into_nodes() {
                    if let Body::File { upper: Some(_), .. } = n.body {
                        let _ = reaper.send(n.ino);
                    }
                }
            });
        if let Err(e) = dropped {
            tracing::warn!("dropping the old inode table: {e}");
        }
        let root_node = self.root_node(root);
        tx.st.nodes.insert(ROOT, Box::new(root_node));
        tx.st.dirty.clear();
        tx.st.copies = Copies::default();
        tx.st.unloaded = HashMap::new();
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
                // Expired, not invalidated: invalidating prunes the entry's whole cached
                // subtree now (O(what the kernel looked up)); expired, the next walk
                // through it looks it up again and the old subtree goes then.
                let _ = n.expire_entry(INodeNo(ROOT), OsStr::from_bytes(&name));
            }
            let _ = n.inval_inode(INodeNo(ROOT), 0, 0);
        }
        Ok(())
    }
}

impl Snapshot<'_> {
    /// The root tree of the snapshot.
    pub fn root(&self) -> TreeId {
        self.root
    }

    pub fn stats(&self) -> &SnapshotStats {
        &self.stats
    }

    /// Makes the snapshot the workspace's base, kept with `tag`: the dirty set empties,
    /// except for files still open for writing and entries the filter left out or
    /// stored in another form.
    pub fn finish(self, tag: Tag) -> Result<SnapshotStats, WorkspaceError> {
        let Snapshot {
            ws: this,
            mut tx,
            _barrier,
            root,
            stats,
            done,
            keep_dirty,
        } = self;
        let written: Vec<u64> = done.iter().map(|(ino, _)| *ino).collect();
        // The new base: every node written becomes clean, but a file open for writing
        // may change behind the daemon's back (passthrough) and stays dirty.
        let other_form: HashSet<u64> = keep_dirty.iter().copied().collect();
        let mut still = keep_dirty;
        for (ino, entry) in done {
            let n = tx.st.nodes.get_mut(&ino).expect("built");
            if let EntryContent::File(id) = entry.content {
                if let Body::File { clean, .. } = &mut n.body {
                    *clean = Some(FileRef {
                        id,
                        size: entry.size,
                    });
                }
                if let Some(u) = n.extra.as_deref_mut() {
                    u.chunks = None;
                }
                // Its upper file now holds `clean` exactly, unless it was stored in
                // another form or a passthrough writer may have changed it since.
                let exact = n.extra().pass_writers == 0 && !other_form.contains(&ino);
                n.set_changed_chunks(exact.then(BTreeSet::new));
            }
            if let EntryContent::Dir(id) = entry.content {
                if let Body::Dir { tree, .. } = &mut n.body {
                    *tree = Some(id);
                }
            }
            n.dirty = false;
            if n.extra().writers > 0 {
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
                if n.kind == Kind::Socket {
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
        this.dirty.clear(&mut tx.batch);
        this.dirty
            .put_meta(&mut tx.batch, &MountMeta { base: root, tag });
        for ino in still {
            let _ = tx.persist(ino);
        }
        tx.commit()
            .map_err(|_| WorkspaceError::Io("writing the dirty set".into()))?;
        this.dirty.sync()?;
        Ok(stats)
    }
}
