//! Capture of a plain directory (no mount) into trees, and its append to a thread.
//!
//! Directories are walked in parallel (rayon), bottom-up: each directory's tree is
//! stored once its children are. A stat cache, kept in the store per captured
//! directory, remembers each file's (dev, inode, size, mode, mtime, ctime) and content
//! id, so a re-capture reads only files whose stat changed. An entry is cached only when
//! its ctime is older than the capture's start by more than the timestamp granularity,
//! so a file changed within the same clock tick as its capture is read again next time
//! (git's "racily clean" problem).

use std::collections::HashMap;
use std::fs::{self, File, Metadata};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use rocksdb::WriteBatch;

use super::{
    xattr, CaptureStats, Checkpoint, CheckpointError, CheckpointId, CheckpointResult,
    NewCheckpoint, Store, ThreadId, WriterLease,
};
use crate::cas::file::{store_bytes, store_reader};
use crate::cas::{
    store_tree, CasError, EntryContent, FileId, Hash, StoreStats, Tree, TreeEntry, TreeId,
    CHUNK_SIZE,
};

/// Column family of the stat cache: `scope(16) ++ relative path` -> [`StatEntry`].
pub const STATCACHE_CF: &str = "statcache";

/// Files whose ctime is this close to the capture's start are not cached.
const RACY_MARGIN: Duration = Duration::from_millis(100);

/// Counters a progress display can read while a capture runs.
#[derive(Debug, Default)]
pub struct CaptureProgress {
    pub files: AtomicU64,
    pub bytes_hashed: AtomicU64,
}

#[derive(Default)]
pub struct CaptureOptions<'a> {
    /// Skip the stat cache and read every file.
    pub no_stat_cache: bool,
    pub progress: Option<&'a CaptureProgress>,
}

/// The result of capturing a directory.
#[derive(Debug, Clone)]
pub struct Captured {
    pub root: TreeId,
    pub stats: CaptureStats,
    pub warnings: Vec<String>,
}

/// What the stat cache remembers of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatEntry {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub id: FileId,
}

const STAT_ENTRY_LEN: usize = 8 * 5 + 4 + 32;

impl StatEntry {
    pub fn of(m: &Metadata, id: FileId) -> StatEntry {
        StatEntry {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mode: m.mode(),
            mtime_ns: mtime_ns(m),
            ctime_ns: ctime_ns(m),
            id,
        }
    }

    /// Whether `m` describes the file this entry was made from, unchanged.
    pub fn matches(&self, m: &Metadata) -> bool {
        self.dev == m.dev()
            && self.ino == m.ino()
            && self.size == m.size()
            && self.mode == m.mode()
            && self.mtime_ns == mtime_ns(m)
            && self.ctime_ns == ctime_ns(m)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(STAT_ENTRY_LEN);
        v.extend_from_slice(&self.dev.to_le_bytes());
        v.extend_from_slice(&self.ino.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.mtime_ns.to_le_bytes());
        v.extend_from_slice(&self.ctime_ns.to_le_bytes());
        v.extend_from_slice(&self.mode.to_le_bytes());
        v.extend_from_slice(self.id.0.as_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Option<StatEntry> {
        if b.len() != STAT_ENTRY_LEN {
            return None;
        }
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Some(StatEntry {
            dev: u(0),
            ino: u(8),
            size: u(16),
            mtime_ns: u(24) as i64,
            ctime_ns: u(32) as i64,
            mode: u32::from_le_bytes(b[40..44].try_into().unwrap()),
            id: FileId(Hash::from_slice(&b[44..76])?),
        })
    }
}

pub fn mtime_ns(m: &Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

pub fn ctime_ns(m: &Metadata) -> i64 {
    m.ctime() * 1_000_000_000 + m.ctime_nsec()
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i64
}

/// The stat cache of one captured (or restored) directory.
pub struct StatCache {
    scope: [u8; 16],
    entries: HashMap<Vec<u8>, (StatEntry, AtomicBool)>,
    updates: Mutex<Vec<(Vec<u8>, StatEntry)>>,
    enabled: bool,
}

impl StatCache {
    /// Loads the cache of the directory `dir` (an absolute, canonical path).
    pub fn load(store: &Store, dir: &Path, enabled: bool) -> CheckpointResult<StatCache> {
        let mut scope = [0u8; 16];
        scope.copy_from_slice(&Hash::of(dir.as_os_str().as_bytes()).0[..16]);
        let mut entries = HashMap::new();
        if enabled {
            let db = store.database();
            let iter = db.raw().iterator_cf(
                db.cf(STATCACHE_CF),
                rocksdb::IteratorMode::From(&scope, rocksdb::Direction::Forward),
            );
            for item in iter {
                let (k, v) = item.map_err(|e| CheckpointError::Cas(db.err(e)))?;
                if !k.starts_with(&scope) {
                    break;
                }
                if let Some(e) = StatEntry::decode(&v) {
                    entries.insert(k[16..].to_vec(), (e, AtomicBool::new(false)));
                }
            }
        }
        Ok(StatCache {
            scope,
            entries,
            updates: Mutex::new(Vec::new()),
            enabled,
        })
    }

    /// The cached content id of `rel` if `m` shows it unchanged.
    pub fn lookup(&self, rel: &[u8], m: &Metadata) -> Option<FileId> {
        let (e, seen) = self.entries.get(rel)?;
        seen.store(true, Ordering::Relaxed);
        e.matches(m).then_some(e.id)
    }

    /// Marks `rel` as still present without a usable entry.
    fn touch(&self, rel: &[u8]) {
        if let Some((_, seen)) = self.entries.get(rel) {
            seen.store(true, Ordering::Relaxed);
        }
    }

    pub fn record(&self, rel: &[u8], entry: StatEntry) {
        if self.enabled {
            self.updates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((rel.to_vec(), entry));
        }
    }

    /// Writes new entries and drops entries of paths that were not seen.
    pub fn save(self, store: &Store, forget_unseen: bool) -> CheckpointResult<()> {
        if !self.enabled {
            return Ok(());
        }
        let db = store.database();
        let cf = db.cf(STATCACHE_CF);
        let mut batch = WriteBatch::default();
        let key = |rel: &[u8]| {
            let mut k = self.scope.to_vec();
            k.extend_from_slice(rel);
            k
        };
        let updates = self.updates.into_inner().unwrap_or_else(|p| p.into_inner());
        if forget_unseen {
            for (rel, (_, seen)) in &self.entries {
                if !seen.load(Ordering::Relaxed) {
                    batch.delete_cf(cf, key(rel));
                }
            }
        }
        for (rel, e) in &updates {
            batch.put_cf(cf, key(rel), e.encode());
        }
        db.raw()
            .write(batch)
            .map_err(|e| CheckpointError::Cas(db.err(e)))
    }
}

struct Ctx<'a> {
    store: &'a Store,
    cache: StatCache,
    racy_after_ns: i64,
    progress: Option<&'a CaptureProgress>,
    files: AtomicU64,
    dirs: AtomicU64,
    symlinks: AtomicU64,
    special: AtomicU64,
    bytes: AtomicU64,
    files_hashed: AtomicU64,
    bytes_hashed: AtomicU64,
    files_skipped: AtomicU64,
    unsupported: AtomicU64,
    objects: Mutex<StoreStats>,
    warnings: Mutex<Vec<String>>,
}

impl Ctx<'_> {
    fn add_objects(&self, s: &StoreStats) {
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(s);
    }

    fn warn(&self, w: String) {
        tracing::warn!("{w}");
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(w);
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

fn vanished(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
}

/// Captures the directory `dir` into trees in the store.
pub fn capture_dir(
    store: &Store,
    dir: &Path,
    opts: &CaptureOptions<'_>,
) -> CheckpointResult<Captured> {
    let start = Instant::now();
    let dir = fs::canonicalize(dir).map_err(|e| CheckpointError::io(dir, e))?;
    let meta = fs::metadata(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
    if !meta.is_dir() {
        return Err(CheckpointError::path(&dir, "not a directory"));
    }
    let ctx = Ctx {
        store,
        cache: StatCache::load(store, &dir, !opts.no_stat_cache)?,
        racy_after_ns: now_ns() - RACY_MARGIN.as_nanos() as i64,
        progress: opts.progress,
        files: AtomicU64::new(0),
        dirs: AtomicU64::new(0),
        symlinks: AtomicU64::new(0),
        special: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        files_hashed: AtomicU64::new(0),
        bytes_hashed: AtomicU64::new(0),
        files_skipped: AtomicU64::new(0),
        unsupported: AtomicU64::new(0),
        objects: Mutex::new(StoreStats::default()),
        warnings: Mutex::new(Vec::new()),
    };
    let root = capture_tree(&ctx, &dir, b"")?;
    store.objects().sync()?;
    let o = *ctx.objects.lock().unwrap_or_else(|p| p.into_inner());
    let stats = CaptureStats {
        files: ctx.files.into_inner(),
        dirs: ctx.dirs.into_inner(),
        symlinks: ctx.symlinks.into_inner(),
        special: ctx.special.into_inner(),
        bytes: ctx.bytes.into_inner(),
        files_hashed: ctx.files_hashed.into_inner(),
        bytes_hashed: ctx.bytes_hashed.into_inner(),
        files_skipped: ctx.files_skipped.into_inner(),
        unsupported: ctx.unsupported.into_inner(),
        new_objects: o.new_objects,
        new_bytes: o.new_bytes,
        reused_objects: o.reused_objects,
        duration_ms: start.elapsed().as_millis() as u64,
    };
    ctx.cache.save(store, true)?;
    Ok(Captured {
        root,
        stats,
        warnings: ctx.warnings.into_inner().unwrap_or_else(|p| p.into_inner()),
    })
}

fn capture_tree(ctx: &Ctx<'_>, abs: &Path, rel: &[u8]) -> CheckpointResult<TreeId> {
    let mut names = Vec::new();
    for item in fs::read_dir(abs).map_err(|e| CheckpointError::io(abs, e))? {
        let item = item.map_err(|e| CheckpointError::io(abs, e))?;
        names.push(item.file_name());
    }
    let entries: Vec<Option<TreeEntry>> = names
        .par_iter()
        .map(|name| {
            let path = abs.join(name);
            let child_rel = join_rel(rel, name.as_bytes());
            capture_entry(ctx, &path, &child_rel, name.as_bytes())
        })
        .collect::<CheckpointResult<_>>()?;
    let tree = Tree::from_entries(entries.into_iter().flatten().collect())
        .map_err(|detail| CheckpointError::path(abs, detail))?;
    let (id, put) = store_tree(ctx.store.objects(), &tree)?;
    let mut s = StoreStats::default();
    s.record(&put);
    ctx.add_objects(&s);
    Ok(id)
}

fn capture_entry(
    ctx: &Ctx<'_>,
    path: &Path,
    rel: &[u8],
    name: &[u8],
) -> CheckpointResult<Option<TreeEntry>> {
    let m = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if vanished(&e) => return Ok(None),
        Err(e) => return Err(CheckpointError::io(path, e)),
    };
    let ft = m.file_type();
    let (content, size, m) = if ft.is_file() {
        match capture_file(ctx, path, rel, &m)? {
            Some((id, m)) => (EntryContent::File(id), m.size(), m),
            None => return Ok(None),
        }
    } else if ft.is_dir() {
        let id = capture_tree(ctx, path, rel)?;
        ctx.dirs.fetch_add(1, Ordering::Relaxed);
        (EntryContent::Dir(id), 0, m)
    } else if ft.is_symlink() {
        let target = match fs::read_link(path) {
            Ok(t) => t,
            Err(e) if vanished(&e) => return Ok(None),
            Err(e) => return Err(CheckpointError::io(path, e)),
        };
        ctx.symlinks.fetch_add(1, Ordering::Relaxed);
        let t = target.as_os_str().as_bytes().to_vec();
        let len = t.len() as u64;
        (EntryContent::Symlink(t), len, m)
    } else if ft.is_fifo() {
        ctx.special.fetch_add(1, Ordering::Relaxed);
        (EntryContent::Fifo, 0, m)
    } else if ft.is_char_device() {
        ctx.special.fetch_add(1, Ordering::Relaxed);
        (EntryContent::CharDevice { rdev: m.rdev() }, 0, m)
    } else if ft.is_block_device() {
        ctx.special.fetch_add(1, Ordering::Relaxed);
        (EntryContent::BlockDevice { rdev: m.rdev() }, 0, m)
    } else {
        ctx.unsupported.fetch_add(1, Ordering::Relaxed);
        ctx.warn(format!(
            "{}: a socket cannot be stored; left out",
            path.display()
        ));
        return Ok(None);
    };
    let xattrs = match xattr::list(path) {
        Ok(x) => x,
        Err(e) if vanished(&e) => return Ok(None),
        Err(e) => return Err(CheckpointError::io(path, e)),
    };
    Ok(Some(TreeEntry {
        name: name.to_vec(),
        content,
        mode: m.mode() & 0o7777,
        mtime_ns: mtime_ns(&m),
        size,
        xattrs,
    }))
}

/// Hashes and stores a regular file, or takes it from the stat cache. Returns the
/// content id and the metadata the content belongs to; `None` if the file vanished.
fn capture_file(
    ctx: &Ctx<'_>,
    path: &Path,
    rel: &[u8],
    lstat: &Metadata,
) -> CheckpointResult<Option<(FileId, Metadata)>> {
    let count = |size: u64| {
        ctx.files.fetch_add(1, Ordering::Relaxed);
        ctx.bytes.fetch_add(size, Ordering::Relaxed);
        if let Some(p) = ctx.progress {
            p.files.fetch_add(1, Ordering::Relaxed);
        }
    };
    if let Some(id) = ctx.cache.lookup(rel, lstat) {
        ctx.files_skipped.fetch_add(1, Ordering::Relaxed);
        count(lstat.size());
        return Ok(Some((id, lstat.clone())));
    }
    ctx.cache.touch(rel);
    let mut file = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if vanished(&e) => return Ok(None),
        Err(e) => return Err(CheckpointError::io(path, e)),
    };
    let before = file.metadata().map_err(|e| CheckpointError::io(path, e))?;
    if !before.is_file() {
        return Err(CheckpointError::path(path, "changed type during capture"));
    }
    let mut stats = StoreStats::default();
    let fref = read_and_store(ctx, &mut file, path, &before, &mut stats)?;
    let after = file.metadata().map_err(|e| CheckpointError::io(path, e))?;
    ctx.add_objects(&stats);
    ctx.files_hashed.fetch_add(1, Ordering::Relaxed);
    ctx.bytes_hashed.fetch_add(fref.1, Ordering::Relaxed);
    if let Some(p) = ctx.progress {
        p.bytes_hashed.fetch_add(fref.1, Ordering::Relaxed);
    }
    count(fref.1);
    let entry = StatEntry::of(&before, fref.0);
    if entry.matches(&after) && entry.ctime_ns < ctx.racy_after_ns && fref.1 == before.size() {
        ctx.cache.record(rel, entry);
    } else if !entry.matches(&after) {
        ctx.warn(format!(
            "{}: changed while it was being captured; stored as read",
            path.display()
        ));
    }
    Ok(Some((fref.0, before)))
}

fn read_and_store(
    ctx: &Ctx<'_>,
    file: &mut File,
    path: &Path,
    meta: &Metadata,
    stats: &mut StoreStats,
) -> CheckpointResult<(FileId, u64)> {
    let objects = ctx.store.objects();
    if meta.size() <= CHUNK_SIZE as u64 {
        let mut buf = Vec::with_capacity(meta.size() as usize + 1);
        file.read_to_end(&mut buf)
            .map_err(|e| CheckpointError::io(path, e))?;
        if buf.len() <= CHUNK_SIZE {
            let f = store_bytes(objects, &buf, stats)?;
            return Ok((f.id, f.size));
        }
        // It grew since the stat: store what we read.
        let f = store_bytes(objects, &buf, stats)?;
        return Ok((f.id, f.size));
    }
    let f = store_reader(objects, file, path, stats).map_err(|e| match e {
        CasError::Io { path, source } => CheckpointError::io(path, source),
        other => other.into(),
    })?;
    Ok((f.id, f.size))
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
    let result = with_renewed_lease(store, lease.clone(), |lease| {
        let expected = match append.expected {
            ExpectedHead::Current => cps.head(&append.thread)?,
            ExpectedHead::Exactly(h) => h,
        };
        let captured = capture_dir(store, dir, opts)?;
        let mut new = NewCheckpoint::new(append.thread.clone(), captured.root, &append.reason);
        new.stats = captured.stats;
        let cp = cps.append(
            new,
            expected,
            &lease.lock().unwrap_or_else(|p| p.into_inner()),
        )?;
        Ok((cp, captured.warnings))
    });
    let current = result.1;
    if let Err(e) = cps.release(&current) {
        if result.0.is_ok() {
            tracing::warn!("releasing the writer lease after capture: {e}");
        } else {
            tracing::warn!("releasing the writer lease after a failed capture: {e}");
        }
    }
    result.0
}

/// Runs `f` while a background thread renews `lease` at its `renew_after`. Returns the
/// result and the latest lease.
pub fn with_renewed_lease<T>(
    store: &Store,
    lease: WriterLease,
    f: impl FnOnce(&Mutex<WriterLease>) -> CheckpointResult<T>,
) -> (CheckpointResult<T>, WriterLease) {
    let shared = Mutex::new(lease);
    let shared_ref = &shared;
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let result = std::thread::scope(|s| {
        s.spawn(move || loop {
            let current = shared_ref.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let wait = current
                .renew_after()
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            match stop_rx.recv_timeout(wait) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            match store.checkpoints().renew(&current) {
                Ok(renewed) => *shared_ref.lock().unwrap_or_else(|p| p.into_inner()) = renewed,
                Err(e) => {
                    tracing::warn!("renewing the writer lease: {e}");
                    return;
                }
            }
        });
        let r = f(&shared);
        let _ = stop_tx.send(());
        r
    });
    let lease = shared.into_inner().unwrap_or_else(|p| p.into_inner());
    (result, lease)
}
