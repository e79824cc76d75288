//! Capture of a plain directory (no mount) into trees, and its append to a thread.
//!
//! Directories are walked in parallel (rayon) through directory file descriptors
//! (`openat`, `fstatat`: no path is resolved twice and no symlink followed), bottom-up:
//! each directory's tree is stored once its children are. The directory cache
//! ([`super::dircache`]) lets a re-capture skip every file whose fingerprint (inode,
//! size, mode, mtime, ctime) is unchanged, and every directory whose entries all are.

use crate::sys::Locked;
use std::fs;
use std::io::{Read, Seek};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;

use super::dircache::{DirCache, DirCacheSet};
use super::watch::{self, Changes};
use super::{cstr, open_dir};
use crate::cas::file::{store_bytes, store_reader};
use crate::cas::{
    store_tree_over, CasError, EntryContent, StoreStats, Tree, TreeEntry, TreeId, CHUNK_SIZE,
};
use crate::checkpoint::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use crate::checkpoint::keeper::LeaseKeeper;
use crate::checkpoint::record::{CaptureStats, Checkpoint, NewCheckpoint, RootMeta};
use crate::checkpoint::store::Store;
use crate::fs::{EntryKind, FilterError, SnapshotFilter};
use crate::sys::dirfd::{
    child, fstat, list_dir, lstat_at, vanished, Entry, Fingerprint, Meta, Replaced,
};
use crate::sys::xattr;

/// Files whose ctime is this close to the capture's start are not trusted next time.
const RACY_MARGIN: Duration = Duration::from_millis(100);

/// Counters a progress display can read while a capture runs.
#[derive(Debug, Default)]
pub struct CaptureProgress {
    pub files: AtomicU64,
    pub bytes_hashed: AtomicU64,
}

#[derive(Default)]
pub struct CaptureOptions<'a> {
    /// Ignore the directory cache and read every file.
    pub no_stat_cache: bool,
    pub progress: Option<&'a CaptureProgress>,
    /// What goes in and in what form (a capture policy, values replaced). With a
    /// filter every file is read (the directory cache is not used: a cached entry would
    /// skip the filter).
    pub filter: Option<&'a dyn SnapshotFilter>,
}

/// The result of capturing a directory.
#[derive(Debug, Clone)]
pub struct Captured {
    pub root: TreeId,
    /// The directory's own mode and mtime, taken before the walk.
    pub root_meta: RootMeta,
    pub stats: CaptureStats,
    pub warnings: Vec<String>,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i64
}

#[derive(Default)]
struct Counters {
    files: AtomicU64,
    dirs: AtomicU64,
    symlinks: AtomicU64,
    special: AtomicU64,
    bytes: AtomicU64,
    files_hashed: AtomicU64,
    bytes_hashed: AtomicU64,
    files_skipped: AtomicU64,
    unsupported: AtomicU64,
    dirs_reused: AtomicU64,
}

struct Ctx<'a> {
    store: &'a Store,
    cache: DirCacheSet<'a>,
    racy_after_ns: i64,
    progress: Option<&'a CaptureProgress>,
    n: Counters,
    objects: Mutex<StoreStats>,
    warnings: Mutex<Vec<String>>,
    filter: Option<&'a dyn SnapshotFilter>,
    /// What a running watcher says changed since the last capture.
    changes: Option<Changes>,
}

impl Ctx<'_> {
    fn add_objects(&self, s: &StoreStats) {
        self.objects.locked().add(s);
    }

    fn warn(&self, w: String) {
        tracing::warn!("{w}");
        self.warnings.locked().push(w);
    }

    fn count_file(&self, size: u64) {
        self.n.files.fetch_add(1, Ordering::Relaxed);
        self.n.bytes.fetch_add(size, Ordering::Relaxed);
        if let Some(p) = self.progress {
            p.files.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A file taken from the directory cache without reading it.
    fn file_unchanged(&self, size: u64) {
        self.n.files_skipped.fetch_add(1, Ordering::Relaxed);
        self.count_file(size);
    }

    /// A fingerprint to remember, if the entry is old enough to be trusted.
    fn trusted(&self, st: &Meta) -> Option<Fingerprint> {
        (st.ctime_ns < self.racy_after_ns).then(|| Fingerprint::of(st))
    }
}

fn join_rel(parent: &[u8], name: &[u8]) -> Vec<u8> {
    if parent.is_empty() {
        return name.to_vec();
    }
    let mut r = Vec::with_capacity(parent.len() + 1 + name.len());
    r.extend_from_slice(parent);
    r.push(b'/');
    r.extend_from_slice(name);
    r
}

/// Captures the directory `dir` into trees in the store.
pub fn capture_dir(
    store: &Store,
    dir: &Path,
    opts: &CaptureOptions<'_>,
) -> CheckpointResult<Captured> {
    let start = Instant::now();
    // Objects put here are named by nothing until the caller appends: garbage
    // collection must wait (callers that append hold the session across both).
    let _session = crate::cas::write_session(store.objects());
    let dir = fs::canonicalize(dir).map_err(|e| CheckpointError::io(dir, e))?;
    let fd = open_dir(&dir)?;
    let cache = DirCacheSet::new(store, &dir, !opts.no_stat_cache && opts.filter.is_none());
    // Asked before the walk: whatever changes from now on is in its next answer.
    let (changes, watcher) = ask_watcher(store, &dir, &cache)?;
    let own = fstat(fd.as_fd()).map_err(|e| CheckpointError::io(&dir, e))?;
    let root_meta = RootMeta {
        mode: own.perm(),
        mtime_ns: own.mtime_ns,
    };
    let ctx = Ctx {
        store,
        cache,
        changes,
        filter: opts.filter,
        racy_after_ns: now_ns() - RACY_MARGIN.as_nanos() as i64,
        progress: opts.progress,
        n: Counters::default(),
        objects: Mutex::new(StoreStats::default()),
        warnings: Mutex::new(Vec::new()),
    };
    let root = crate::on_deep_pool(|| capture_tree(&ctx, fd.as_fd(), &dir, b""))?;
    store.objects().sync()?;
    let o = *ctx.objects.locked();
    let n = &ctx.n;
    let stats = CaptureStats {
        files: n.files.load(Ordering::Relaxed),
        dirs: n.dirs.load(Ordering::Relaxed),
        symlinks: n.symlinks.load(Ordering::Relaxed),
        special: n.special.load(Ordering::Relaxed),
        bytes: n.bytes.load(Ordering::Relaxed),
        files_hashed: n.files_hashed.load(Ordering::Relaxed),
        bytes_hashed: n.bytes_hashed.load(Ordering::Relaxed),
        files_skipped: n.files_skipped.load(Ordering::Relaxed),
        unsupported: n.unsupported.load(Ordering::Relaxed),
        dirs_reused: n.dirs_reused.load(Ordering::Relaxed),
        watcher,
        // A capture of a plain directory counts its totals, not what changed.
        changed: None,
        removed: None,
        new_objects: o.new_objects,
        new_bytes: o.new_bytes,
        reused_objects: o.reused_objects,
        duration_ms: start.elapsed().as_millis() as u64,
    };
    let warnings = ctx.warnings.into_inner().unwrap_or_else(|p| p.into_inner());
    ctx.cache.save()?;
    Ok(Captured {
        root,
        root_meta,
        stats,
        warnings,
    })
}

/// What the watcher of `dir`, if one runs, says changed since the token `cache` holds
/// (`None`: look at everything), and how the capture's stats name its answer. Its new
/// token goes into `cache`, recorded when the cache is saved.
fn ask_watcher(
    store: &Store,
    dir: &Path,
    cache: &DirCacheSet<'_>,
) -> CheckpointResult<(Option<Changes>, Option<String>)> {
    if !cache.reads() {
        return Ok((None, None));
    }
    let Some(answer) = watch::ask(store.root(), dir, cache.token()?) else {
        return Ok((None, None));
    };
    cache.set_token(answer.token());
    Ok(match answer {
        watch::Answer::Changes { dirs, new, .. } => {
            (Some(Changes::new(dirs, new)), Some("changes".into()))
        }
        watch::Answer::Full { why, .. } => {
            tracing::info!("the watcher asks for a full look: {why}");
            (None, Some(format!("full: {why}")))
        }
    })
}

/// Captures the open directory `fd` (at `path`, `rel` below the root); returns its tree.
fn capture_tree(
    ctx: &Ctx<'_>,
    fd: BorrowedFd<'_>,
    path: &Path,
    rel: &[u8],
) -> CheckpointResult<TreeId> {
    if !rel.is_empty() && rel.iter().filter(|b| **b == b'/').count() >= crate::cas::MAX_TREE_DEPTH {
        return Err(CheckpointError::Refused(format!(
            "{}: more than {} directories deep; casfs stores no deeper tree",
            String::from_utf8_lossy(rel),
            crate::cas::MAX_TREE_DEPTH
        )));
    }
    let cached = ctx.cache.get(rel)?;
    let results: Vec<Option<Seen>> = match (&ctx.changes, &cached) {
        // The watcher saw nothing change here or below: as cached.
        (Some(ch), Some(c)) if ch.untouched(rel) => {
            ctx.n.dirs_reused.fetch_add(1, Ordering::Relaxed);
            return Ok(c.tree_id);
        }
        // Its entries are as cached; only those on the way to a change are looked at.
        (Some(ch), Some(c)) if !ch.changed(rel) => c
            .tree
            .entries()
            .par_iter()
            .enumerate()
            .map(|(i, e)| {
                let fp = c.fingerprints[i];
                match (fp, e.tree_id()) {
                    (Some(fp), Some(_)) if ch.untouched(&join_rel(rel, &e.name)) => {
                        ctx.n.dirs_reused.fetch_add(1, Ordering::Relaxed);
                        Ok(Some(Seen::Cached(i, fp)))
                    }
                    (Some(fp), None) => {
                        if e.file_ref().is_some() {
                            ctx.file_unchanged(e.size);
                        }
                        Ok(Some(Seen::Cached(i, fp)))
                    }
                    _ => capture_entry(ctx, fd, path, rel, &e.name, Some(c)),
                }
            })
            .collect::<CheckpointResult<_>>()?,
        _ => {
            let names = list_dir(fd).map_err(|e| CheckpointError::io(path, e))?;
            names
                .par_iter()
                .with_min_len(4)
                .map(|name| capture_entry(ctx, fd, path, rel, name, cached.as_ref()))
                .collect::<CheckpointResult<_>>()?
        }
    };
    let results: Vec<Seen> = results.into_iter().flatten().collect();
    if let Some(c) = &cached {
        // Every entry as cached, in the same places: the tree is the same.
        let unchanged = results.len() == c.tree.len()
            && results
                .iter()
                .enumerate()
                .all(|(i, r)| matches!(r, Seen::Cached(j, _) if *j == i));
        if unchanged {
            let fps: Vec<_> = results.iter().map(|r| r.fingerprint()).collect();
            if fps != c.fingerprints {
                ctx.cache.put(
                    rel,
                    &DirCache {
                        fingerprints: fps,
                        ..c.clone()
                    },
                );
            }
            return Ok(c.tree_id);
        }
    }
    let mut entries = Vec::with_capacity(results.len());
    let mut fingerprints = Vec::with_capacity(results.len());
    for r in results {
        fingerprints.push(r.fingerprint());
        entries.push(match r {
            Seen::Cached(i, _) => cached.as_ref().expect("a cache hit").tree.entries()[i].clone(),
            Seen::New(e, _) => e,
        });
    }
    if let Some(f) = ctx.filter {
        // Before the tree is stored: a refused entry leaves no object naming it.
        let dir = String::from_utf8_lossy(rel);
        for e in &entries {
            f.vet(&dir, e).map_err(|e| match e {
                FilterError::Refused(why) => CheckpointError::Refused(why),
                FilterError::Io(e) => CheckpointError::io(path, e),
            })?;
        }
    }
    let tree = Tree::from_sorted_entries(entries).map_err(|d| CheckpointError::path(path, d))?;
    if let Some(c) = &cached {
        // Directories that disappeared (or stopped being directories) lose their cache.
        for e in c.tree.entries() {
            if e.tree_id().is_some() && tree.get(&e.name).and_then(|n| n.tree_id()).is_none() {
                ctx.cache.forget_subtree(&join_rel(rel, &e.name));
            }
        }
    }
    let base = cached.as_ref().map(|c| (&c.tree_id, &c.tree));
    let (id, put) = store_tree_over(ctx.store.objects(), &tree, base)?;
    let mut s = StoreStats::default();
    s.record(&put);
    ctx.add_objects(&s);
    ctx.cache.put(
        rel,
        &DirCache {
            tree_id: id,
            tree,
            fingerprints,
        },
    );
    Ok(id)
}

/// An entry as a capture found it: the same as the cached entry at an index, or new.
enum Seen {
    Cached(usize, Fingerprint),
    New(TreeEntry, Option<Fingerprint>),
}

impl Seen {
    fn fingerprint(&self) -> Option<Fingerprint> {
        match self {
            Seen::Cached(_, f) => Some(*f),
            Seen::New(_, f) => *f,
        }
    }
}

/// One entry of a directory: from the cache if its fingerprint is unchanged, else read
/// from the entry opened (its `fstat` is what is stored). An entry replaced by another
/// while it is read is read again (three tries).
fn capture_entry(
    ctx: &Ctx<'_>,
    dir: BorrowedFd<'_>,
    dir_path: &Path,
    dir_rel: &[u8],
    name: &[u8],
    cached: Option<&DirCache>,
) -> CheckpointResult<Option<Seen>> {
    let path = child(dir_path, name);
    for _ in 0..3 {
        match capture_entry_once(ctx, dir, &path, dir_rel, name, cached)? {
            Attempt::Done(seen) => return Ok(seen),
            Attempt::Changed => continue,
        }
    }
    Err(CheckpointError::path(
        &path,
        "replaced by another file each time it was read",
    ))
}

/// What one look at an entry gave.
enum Attempt {
    Done(Option<Seen>),
    /// Replaced by another file while it was read: look again.
    Changed,
}

/// A read of an entry: `Changed` where it was replaced meanwhile, `None` where removed.
fn attempt<T>(r: std::io::Result<T>, path: &Path) -> CheckpointResult<Result<T, Attempt>> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(e) if e.get_ref().is_some_and(|x| x.is::<Replaced>()) => Ok(Err(Attempt::Changed)),
        Err(e) if vanished(&e) => Ok(Err(Attempt::Done(None))),
        Err(e) => Err(CheckpointError::io(path, e)),
    }
}

fn capture_entry_once(
    ctx: &Ctx<'_>,
    dir: BorrowedFd<'_>,
    path: &Path,
    dir_rel: &[u8],
    name: &[u8],
    cached: Option<&DirCache>,
) -> CheckpointResult<Attempt> {
    let cname = cstr(name, path)?;
    let listed = match lstat_at(dir, &cname) {
        Ok(Some(st)) => st,
        Ok(None) => return Ok(Attempt::Done(None)),
        Err(e) => return Err(CheckpointError::io(path, e)),
    };
    let found = cached.and_then(|c| c.find(name));
    let hit_of = |st: &Meta| {
        let fp = Fingerprint::of(st);
        found
            .filter(|(_, _, f)| *f == Some(fp))
            .map(|(i, e, _)| (i, e))
    };
    // Unchanged since the cache saw it: nothing is read.
    if let Some((i, e)) = hit_of(&listed) {
        let fp = Fingerprint::of(&listed);
        let same = match listed.kind() {
            libc::S_IFREG => e.file_ref().is_some(),
            libc::S_IFLNK => matches!(e.content, EntryContent::Symlink(_)),
            libc::S_IFIFO => e.content == EntryContent::Fifo,
            libc::S_IFCHR => e.content == EntryContent::CharDevice { rdev: listed.rdev },
            libc::S_IFBLK => e.content == EntryContent::BlockDevice { rdev: listed.rdev },
            _ => false,
        };
        if same {
            match listed.kind() {
                libc::S_IFREG => ctx.file_unchanged(e.size),
                libc::S_IFLNK => {
                    ctx.n.symlinks.fetch_add(1, Ordering::Relaxed);
                }
                _ => {
                    ctx.n.special.fetch_add(1, Ordering::Relaxed);
                }
            }
            return Ok(Attempt::Done(Some(Seen::Cached(i, fp))));
        }
    }
    // Whatever is read is read from the entry opened: its metadata is its fstat.
    let entry = match attempt(Entry::open(dir, &cname), path)? {
        Ok(e) => e,
        Err(a) => return Ok(a),
    };
    let st = entry.meta;
    let fp = Fingerprint::of(&st);
    let hit = hit_of(&st);
    let kind = st.kind();
    let rel = join_rel(dir_rel, name);
    if let Some(f) = ctx.filter {
        let (k, size) = match kind {
            libc::S_IFREG => (EntryKind::File, st.size),
            libc::S_IFDIR => (EntryKind::Dir, 0),
            libc::S_IFLNK => (EntryKind::Symlink, 0),
            _ => (EntryKind::Special, 0),
        };
        if !f.keep(&String::from_utf8_lossy(&rel), k, size) {
            return Ok(Attempt::Done(None));
        }
    }
    let entry_of = |content, size, xattrs| TreeEntry {
        name: name.to_vec(),
        content,
        mode: st.perm(),
        mtime_ns: st.mtime_ns,
        size,
        xattrs,
    };
    let e = match kind {
        libc::S_IFREG => return capture_file(ctx, &entry, path, &rel, name),
        libc::S_IFDIR => {
            let sub = match attempt(entry.open_dir(), path)? {
                Ok(f) => f,
                Err(a) => return Ok(a),
            };
            let id = capture_tree(ctx, sub.as_fd(), path, &rel)?;
            ctx.n.dirs.fetch_add(1, Ordering::Relaxed);
            match hit.filter(|(_, e)| e.tree_id().is_some()) {
                Some((i, e))
                    if e.tree_id() == Some(id)
                        && e.mode == st.perm()
                        && e.mtime_ns == st.mtime_ns =>
                {
                    return Ok(Attempt::Done(Some(Seen::Cached(i, fp))));
                }
                Some((_, e)) => entry_of(EntryContent::Dir(id), 0, e.xattrs.clone()),
                None => {
                    let x =
                        xattr::flist(sub.as_raw_fd()).map_err(|e| CheckpointError::io(path, e))?;
                    entry_of(EntryContent::Dir(id), 0, x)
                }
            }
        }
        libc::S_IFLNK => {
            ctx.n.symlinks.fetch_add(1, Ordering::Relaxed);
            let target = match attempt(entry.readlink(), path)? {
                Ok(t) => t,
                Err(a) => return Ok(a),
            };
            let xattrs = match attempt(xattr::list_at(dir, &cname, &st), path)? {
                Ok(x) => x,
                Err(a) => return Ok(a),
            };
            let len = target.len() as u64;
            entry_of(EntryContent::Symlink(target), len, xattrs)
        }
        libc::S_IFIFO | libc::S_IFCHR | libc::S_IFBLK => {
            ctx.n.special.fetch_add(1, Ordering::Relaxed);
            let content = match kind {
                libc::S_IFIFO => EntryContent::Fifo,
                libc::S_IFCHR => EntryContent::CharDevice { rdev: st.rdev },
                _ => EntryContent::BlockDevice { rdev: st.rdev },
            };
            let xattrs = match attempt(xattr::list_at(dir, &cname, &st), path)? {
                Ok(x) => x,
                Err(a) => return Ok(a),
            };
            entry_of(content, 0, xattrs)
        }
        _ => {
            ctx.n.unsupported.fetch_add(1, Ordering::Relaxed);
            ctx.warn(format!(
                "{}: a socket cannot be stored; left out",
                path.display()
            ));
            return Ok(Attempt::Done(None));
        }
    };
    Ok(Attempt::Done(Some(Seen::New(e, ctx.trusted(&st)))))
}

thread_local! {
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads, hashes and stores a regular file: the file opened, reopened for reading (its
/// fstat before is what the walk stored; one fstat after tells whether it stayed the
/// same meanwhile).
fn capture_file(
    ctx: &Ctx<'_>,
    entry: &Entry,
    path: &Path,
    rel: &[u8],
    name: &[u8],
) -> CheckpointResult<Attempt> {
    let mut file = match attempt(entry.open_read(), path)? {
        Ok(f) => f,
        Err(a) => return Ok(a),
    };
    let before = &entry.meta;
    let mut stats = StoreStats::default();
    let objects = ctx.store.objects();
    let other = match ctx.filter {
        Some(f) => f
            .transform(&String::from_utf8_lossy(rel), &mut file, before.size)
            .map_err(|e| match e {
                FilterError::Refused(why) => {
                    CheckpointError::Refused(format!("{}: {why}", path.display()))
                }
                FilterError::Io(e) => CheckpointError::io(path, e),
            })?,
        None => None,
    };
    let fref = if let Some(data) = other {
        store_bytes(objects, &data, &mut stats)?
    } else if before.size <= CHUNK_SIZE as u64 {
        READ_BUF.with(|b| -> CheckpointResult<_> {
            let mut buf = b.borrow_mut();
            buf.clear();
            buf.reserve(before.size as usize + 1);
            file.rewind().map_err(|e| CheckpointError::io(path, e))?;
            file.read_to_end(&mut buf)
                .map_err(|e| CheckpointError::io(path, e))?;
            let f = store_bytes(objects, &buf, &mut stats)?;
            // Don't keep a large buffer around per thread.
            if buf.capacity() > 4 * CHUNK_SIZE {
                *buf = Vec::new();
            }
            Ok(f)
        })?
    } else {
        file.rewind().map_err(|e| CheckpointError::io(path, e))?;
        store_reader(objects, &mut file, path, &mut stats).map_err(|e| match e {
            CasError::Io { path, source } => CheckpointError::io(path, source),
            other => other.into(),
        })?
    };
    let xattrs = xattr::flist(file.as_raw_fd()).map_err(|e| CheckpointError::io(path, e))?;
    let after = fstat(file.as_fd()).map_err(|e| CheckpointError::io(path, e))?;
    ctx.add_objects(&stats);
    ctx.n.files_hashed.fetch_add(1, Ordering::Relaxed);
    ctx.n.bytes_hashed.fetch_add(fref.size, Ordering::Relaxed);
    if let Some(p) = ctx.progress {
        p.bytes_hashed.fetch_add(fref.size, Ordering::Relaxed);
    }
    ctx.count_file(fref.size);
    let steady = Fingerprint::of(before) == Fingerprint::of(&after) && fref.size == before.size;
    if !steady {
        ctx.warn(format!(
            "{}: changed while it was being captured; stored as read",
            path.display()
        ));
    }
    let entry = TreeEntry {
        name: name.to_vec(),
        content: EntryContent::File(fref.id),
        mode: before.perm(),
        mtime_ns: before.mtime_ns,
        size: fref.size,
        xattrs,
    };
    let fp = if steady { ctx.trusted(before) } else { None };
    Ok(Attempt::Done(Some(Seen::New(entry, fp))))
}

/// Which head an append must find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedHead {
    /// The head read right after the writer lease was taken.
    Current,
    /// Exactly this head (`None`: the thread must be empty).
    Exactly(Option<CheckpointId>),
}

/// How a capture is published.
pub struct AppendOptions {
    pub thread: ThreadId,
    pub reason: String,
    pub expected: ExpectedHead,
    pub holder: String,
    pub lease_ttl: Duration,
}

/// Takes the thread's writer lease (renewing it in the background), captures `dir` and
/// appends the checkpoint, then releases the lease. A capture or append error wins over
/// a release error, which is logged.
pub fn capture_to_thread(
    store: &Store,
    dir: &Path,
    opts: &CaptureOptions<'_>,
    append: &AppendOptions,
) -> CheckpointResult<(Checkpoint, Vec<String>)> {
    let cps = store.checkpoints();
    let lease = cps.acquire_writer(&append.thread, &append.holder, append.lease_ttl)?;
    let keeper = LeaseKeeper::start(store.checkpoints_shared(), lease);
    // From the first object put to the append that names it, no collection may run.
    let session = crate::cas::write_session(store.objects());
    let result = (|| {
        let expected = match append.expected {
            ExpectedHead::Current => cps.head(&append.thread)?,
            ExpectedHead::Exactly(h) => h,
        };
        let captured = capture_dir(store, dir, opts)?;
        crate::crashpoint("capture.stored");
        let mut new = NewCheckpoint::new(append.thread.clone(), captured.root, &append.reason);
        new.stats = captured.stats;
        new.root_meta = Some(captured.root_meta);
        let cp = cps.append(new, expected, &keeper.held()?)?;
        Ok((cp, captured.warnings))
    })();
    drop(session);
    if let Err(e) = keeper.close() {
        if result.is_ok() {
            tracing::warn!("releasing the writer lease after capture: {e}");
        } else {
            tracing::warn!("releasing the writer lease after a failed capture: {e}");
        }
    }
    result
}
