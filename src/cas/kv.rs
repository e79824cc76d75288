//! The embedded RocksDB database that holds a store's column families.
//!
//! One [`Database`] is shared by the object store and the layers above it; each layer
//! names the column families it needs when the database is opened. Objects get their own
//! tuning: no RocksDB compression (objects are compressed already) and large values kept
//! in blob files so compaction does not rewrite file contents.
//!
//! Layers above reach their column families through [`Column`] (get, put, ordered
//! scans) and write several keys at once with a [`Batch`]; the RocksDB handle itself
//! stays inside `cas`.

use crate::sys::Locked;
use std::path::{Path, PathBuf};

use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DBCompressionType, Options, DB,
};

use super::error::{CasError, CasResult};

/// The column family holding content-addressed objects.
pub const OBJECTS_CF: &str = "objects";

/// The column family holding what is known of trees ([`super::tree::TreeFacts`]), by tree id.
pub const TREE_FACTS_CF: &str = "tree_facts";

/// A RocksDB database with its column families created at open.
pub struct Database {
    db: DB,
    path: PathBuf,
    /// Opened with [`Database::open_read_only`].
    read_only: bool,
    /// For a database opened read-only: the same database opened again after a file
    /// it named was gone (see [`Database::reading`]); later reads use it.
    reopened: std::sync::Mutex<Option<std::sync::Arc<Database>>>,
    space: SpaceGuard,
    /// Every column family opened.
    cf_names: Vec<String>,
}

/// Keeps writes from filling the database's filesystem: RocksDB (Debian's build, at
/// least) does not come back from a write that fails for lack of space (the database
/// stops taking writes, or an assertion ends the process), so casfs refuses a write
/// that would leave less than a reserve free, with ENOSPC, before RocksDB sees it.
///
/// The reserve is a twentieth of the filesystem, at least 8 MiB and at most 1 GiB
/// (`CASFS_SPACE_RESERVE`, in bytes, overrides it). Free space is read with statvfs at
/// most every 50 ms, and every time when close to the reserve.
struct SpaceGuard {
    reserve: u64,
    /// (when read, free bytes then)
    last: std::sync::Mutex<(std::time::Instant, u64)>,
}

fn statvfs_bytes(path: &Path) -> Option<(u64, u64)> {
    let s = rustix::fs::statvfs(path).ok()?;
    let frsize = s.f_frsize;
    Some((s.f_blocks * frsize, s.f_bavail * frsize))
}

impl SpaceGuard {
    fn new(path: &Path) -> SpaceGuard {
        let (total, free) = statvfs_bytes(path).unwrap_or((u64::MAX, u64::MAX));
        let reserve = std::env::var("CASFS_SPACE_RESERVE")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| (total / 20).clamp(8 << 20, 1 << 30));
        SpaceGuard {
            reserve,
            last: std::sync::Mutex::new((std::time::Instant::now(), free)),
        }
    }

    fn has_room(&self, path: &Path, need: u64) -> bool {
        if self.reserve == 0 {
            return true;
        }
        let mut last = self.last.locked();
        if last.0.elapsed() > std::time::Duration::from_millis(50) {
            if let Some((_, free)) = statvfs_bytes(path) {
                *last = (std::time::Instant::now(), free);
            }
        }
        last.1 >= self.reserve.saturating_add(need)
    }

    fn check(&self, path: &Path, need: u64) -> CasResult<()> {
        if self.reserve == 0 {
            return Ok(());
        }
        let mut last = self.last.locked();
        let near = last.1 < self.reserve.saturating_add(need).saturating_add(64 << 20);
        if near || last.0.elapsed() > std::time::Duration::from_millis(50) {
            if let Some((_, free)) = statvfs_bytes(path) {
                *last = (std::time::Instant::now(), free);
            }
        }
        let free = last.1;
        if free < self.reserve.saturating_add(need) {
            return Err(CasError::NoSpace {
                path: path.to_path_buf(),
                need,
                free,
                reserve: self.reserve,
            });
        }
        // Count what is about to be written, until the next reading.
        last.1 = free - need;
        Ok(())
    }
}

impl Database {
    /// Opens (creating if needed) the database at `path` with the objects and tree facts
    /// column families and the extra ones named.
    pub fn open(path: &Path, extra_cfs: &[&str]) -> CasResult<Database> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_max_background_jobs(2);
        opts.set_keep_log_file_num(3);
        opts.set_compression_type(DBCompressionType::None);
        // Opening is on every command's path: don't start 16 threads per column family
        // to open a handful of files, and don't read every file's statistics.
        opts.set_max_file_opening_threads(1);
        opts.set_skip_stats_update_on_db_open(true);
        opts.set_stats_dump_period_sec(0);
        // A new MANIFEST (a snapshot of the live files) at every change of the file
        // set, the old one deleted: the MANIFEST names each table file's first and last
        // key, and after `purge_deleted` none of a deleted record may stay on disk.
        // It holds a few hundred bytes per table file: cheap to write.
        opts.set_max_manifest_file_size(1);

        let mut names: Vec<String> = std::iter::once(TREE_FACTS_CF)
            .chain(extra_cfs.iter().copied())
            .map(String::from)
            .collect();
        // Column families a store already has must be opened too (RocksDB refuses to open
        // a database otherwise), even ones this version does not use.
        if let Ok(existing) = DB::list_cf(&opts, path) {
            for name in existing {
                if name != OBJECTS_CF && !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        let cache = shared_cache()?;
        let mut cfs = vec![ColumnFamilyDescriptor::new(
            OBJECTS_CF,
            objects_options(&cache),
        )];
        let mut cf_names = vec![OBJECTS_CF.to_string()];
        for name in names {
            let mut o = Options::default();
            o.set_compression_type(DBCompressionType::None);
            o.set_block_based_table_factory(&table_options(&cache, false));
            // Records, not contents: small memtables, so that the memory a server
            // holds for them stops growing early (the default is 64 MiB each).
            o.set_write_buffer_size(4 << 20);
            cf_names.push(name.clone());
            cfs.push(ColumnFamilyDescriptor::new(name, o));
        }
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|source| CasError::Db {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Database {
            db,
            space: SpaceGuard::new(path),
            path: path.to_path_buf(),
            read_only: false,
            reopened: Default::default(),
            cf_names,
        })
    }

    /// Opens an existing database read-only: no lock is taken, so this works while
    /// another process has it open for writing, and sees what was durable at open.
    pub fn open_read_only(path: &Path) -> CasResult<Database> {
        let mut opts = Options::default();
        opts.set_max_file_opening_threads(1);
        opts.set_skip_stats_update_on_db_open(true);
        let err = |source| CasError::Db {
            path: path.to_path_buf(),
            source,
        };
        // A writer may rotate and delete a log file between our listing and our
        // opening of it: try again a few times.
        let mut attempt = 0;
        loop {
            let names = DB::list_cf(&opts, path).map_err(err)?;
            let cf_names = names.clone();
            let cache = shared_cache()?;
            let cfs = names.into_iter().map(|name| {
                let o = if name == OBJECTS_CF {
                    objects_options(&cache)
                } else {
                    Options::default()
                };
                ColumnFamilyDescriptor::new(name, o)
            });
            match DB::open_cf_descriptors_read_only(&opts, path, cfs, false) {
                Ok(db) => {
                    return Ok(Database {
                        db,
                        space: SpaceGuard::new(path),
                        path: path.to_path_buf(),
                        read_only: true,
                        reopened: Default::default(),
                        cf_names,
                    })
                }
                Err(e) if attempt < 5 && e.to_string().contains("No such file") => {
                    attempt += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
                }
                Err(e) => return Err(err(e)),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opened with [`Database::open_read_only`].
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Runs the read `f` on this database. One opened read-only beside a writer sees
    /// the files that were live when it opened, and RocksDB opens a file only when a
    /// read first needs it: the writer's compaction may have deleted it since (its
    /// records moved to a newer file). Such a read is made again on the database
    /// opened anew, which later reads then use: content-addressed objects never
    /// change, so the newer view answers as rightly (an object a collection deleted
    /// since is not found).
    pub fn reading<T>(&self, f: impl Fn(&Database) -> CasResult<T>) -> CasResult<T> {
        if !self.read_only {
            return f(self);
        }
        let lock = || self.reopened.locked();
        let newest = lock().clone();
        let mut db: &Database = newest.as_deref().unwrap_or(self);
        let mut fresh;
        let mut attempt = 0;
        loop {
            match f(db) {
                Err(e) if attempt < 3 && e.is_vanished_file() => {
                    attempt += 1;
                    tracing::debug!("reopening {} to read: {e}", self.path.display());
                    fresh = std::sync::Arc::new(Database::open_read_only(&self.path)?);
                    *lock() = Some(fresh.clone());
                    db = &fresh;
                }
                r => return r,
            }
        }
    }

    /// The raw RocksDB handle (the object store's; other layers use [`Column`]).
    pub(in crate::cas) fn raw(&self) -> &DB {
        &self.db
    }

    /// Column family `name`, which was named at open.
    pub fn column(&self, name: &str) -> Column<'_> {
        Column {
            db: self,
            cf: self.cf(name),
        }
    }

    /// Applies `batch` atomically through the write-ahead log; `durable` syncs the log
    /// first (the write survives a power cut), otherwise it survives a process crash.
    pub fn write(&self, batch: Batch, durable: bool) -> CasResult<()> {
        let mut o = rocksdb::WriteOptions::default();
        o.set_sync(durable);
        self.db.write_opt(batch.0, &o).map_err(|e| self.err(e))
    }

    /// Whether column family `name` was opened.
    pub fn has_column(&self, name: &str) -> bool {
        self.cf_names.iter().any(|n| n == name)
    }

    /// Every column family opened.
    pub fn cf_names(&self) -> &[String] {
        &self.cf_names
    }

    /// A column family that was named at open.
    pub(in crate::cas) fn cf(&self, name: &str) -> &ColumnFamily {
        self.db
            .cf_handle(name)
            .unwrap_or_else(|| panic!("column family {name} was not opened"))
    }

    /// Wraps a RocksDB error with the database path.
    pub fn err(&self, source: rocksdb::Error) -> CasError {
        CasError::Db {
            path: self.path.clone(),
            source,
        }
    }

    /// Refuses (with [`CasError::NoSpace`]) a write of `need` bytes to the database's
    /// filesystem that would leave less than the reserve free.
    pub fn ensure_space(&self, need: u64) -> CasResult<()> {
        self.space.check(&self.path, need)
    }

    /// Whether `need` bytes could be written leaving the reserve free (a hint: nothing
    /// is counted).
    pub fn has_room(&self, need: u64) -> bool {
        self.space.has_room(&self.path, need)
    }

    /// Makes every write so far durable (syncs the write-ahead log).
    pub fn sync(&self) -> CasResult<()> {
        self.db.flush_wal(true).map_err(|e| self.err(e))
    }

    /// Purges deleted records from the files of the database, so that no byte of them
    /// stays on disk once this returns (for records that held secrets): every column
    /// family's memtable is flushed, so no write-ahead log file holding them is needed
    /// any more and RocksDB deletes those files; then column family `cf` is compacted
    /// down to its last level, which drops the deleted records from its table files.
    /// Costs a flush of every column family: for rare use.
    pub fn purge_deleted(&self, cf: &str) -> CasResult<()> {
        let mut fo = rocksdb::FlushOptions::default();
        fo.set_wait(true);
        for name in &self.cf_names {
            self.db
                .flush_cf_opt(self.cf(name), &fo)
                .map_err(|e| self.err(e))?;
        }
        let mut co = rocksdb::CompactOptions::default();
        co.set_exclusive_manual_compaction(true);
        co.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
        self.db
            .compact_range_cf_opt(self.cf(cf), None::<&[u8]>, None::<&[u8]>, &co);
        Ok(())
    }
}

static DEFAULT_BLOCK_CACHE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(32 << 20);

/// Sets the block cache size of databases this process opens from now on, unless
/// `CASFS_BLOCK_CACHE` says otherwise. A mount daemon takes 8 MiB: it decodes the
/// trees it reads into its inode table and the kernel caches what it serves, so a
/// larger cache only kept 24 MiB more resident after the kernel forgot a million nodes.
pub fn set_default_block_cache(bytes: usize) {
    DEFAULT_BLOCK_CACHE.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

/// The block cache all column families share: data blocks and the index and filter
/// blocks of every table file count against it, so the memory the database holds for
/// reading is bounded whatever the number of table files (with one cache per column
/// family and index blocks outside it, a server's resident memory grew by megabytes
/// per thousand runs as files accumulated: `cargo bench --bench soak`).
/// `CASFS_BLOCK_CACHE` (bytes) overrides the default: 32 MiB, or what
/// [`set_default_block_cache`] set.
fn shared_cache() -> CasResult<Cache> {
    let bytes = std::env::var("CASFS_BLOCK_CACHE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_BLOCK_CACHE.load(std::sync::atomic::Ordering::Relaxed));
    Cache::new_lru_cache(bytes).map_err(|e| CasError::Invalid(format!("block cache: {e}")))
}

fn table_options(cache: &Cache, bloom: bool) -> BlockBasedOptions {
    let mut t = BlockBasedOptions::default();
    if bloom {
        t.set_bloom_filter(10.0, false);
    }
    t.set_block_cache(cache);
    t.set_cache_index_and_filter_blocks(true);
    // The newest files' index and filter blocks stay in the cache: every read looks at
    // them first.
    t.set_pin_l0_filter_and_index_blocks_in_cache(true);
    t
}

fn objects_options(cache: &Cache) -> Options {
    let mut o = Options::default();
    o.set_compression_type(DBCompressionType::None);
    o.set_enable_blob_files(true);
    o.set_min_blob_size(4096);
    o.set_blob_compression_type(DBCompressionType::None);
    o.set_enable_blob_gc(true);
    o.set_write_buffer_size(128 << 20);
    // Every put first asks whether the object is there; a new one (all of them on a
    // first capture) is then ruled out by a filter, not a walk of the memtable's list.
    o.set_memtable_prefix_bloom_ratio(0.02);
    o.set_memtable_whole_key_filtering(true);
    o.set_block_based_table_factory(&table_options(cache, true));
    o
}

/// One column family of a [`Database`]: ordered keys and values.
#[derive(Clone, Copy)]
pub struct Column<'a> {
    db: &'a Database,
    cf: &'a ColumnFamily,
}

/// Entries of a column family in key order, from a [`Column`].
pub struct Entries<'a> {
    db: &'a Database,
    it: rocksdb::DBIteratorWithThreadMode<'a, DB>,
}

impl Iterator for Entries<'_> {
    type Item = CasResult<(Box<[u8]>, Box<[u8]>)>;

    fn next(&mut self) -> Option<Self::Item> {
        self.it.next().map(|r| r.map_err(|e| self.db.err(e)))
    }
}

impl<'a> Column<'a> {
    pub fn get(&self, key: &[u8]) -> CasResult<Option<Vec<u8>>> {
        self.db.db.get_cf(self.cf, key).map_err(|e| self.db.err(e))
    }

    /// `f` of the value of `key`, read in place (no copy: for values decoded at once on
    /// a hot path, as the directory cache's during a capture).
    pub fn read<T>(&self, key: &[u8], f: impl FnOnce(&[u8]) -> T) -> CasResult<Option<T>> {
        let v = self
            .db
            .db
            .get_pinned_cf(self.cf, key)
            .map_err(|e| self.db.err(e))?;
        Ok(v.map(|v| f(&v)))
    }

    /// Writes one key; `durable` as in [`Database::write`].
    pub fn put(&self, key: &[u8], value: &[u8], durable: bool) -> CasResult<()> {
        let mut b = Batch::default();
        b.put(self, key, value);
        self.db.write(b, durable)
    }

    /// Deletes one key; `durable` as in [`Database::write`].
    pub fn delete(&self, key: &[u8], durable: bool) -> CasResult<()> {
        let mut b = Batch::default();
        b.delete(self, key);
        self.db.write(b, durable)
    }

    /// Writes the column family's memtable to a table file (and its large values to
    /// blob files).
    pub fn flush(&self) -> CasResult<()> {
        self.db.db.flush_cf(self.cf).map_err(|e| self.db.err(e))
    }

    /// Every entry, in key order.
    pub fn entries(&self) -> Entries<'a> {
        Entries {
            db: self.db,
            it: self
                .db
                .db
                .iterator_cf(self.cf, rocksdb::IteratorMode::Start),
        }
    }

    /// The entries from `start` on, in key order.
    pub fn entries_from(&self, start: &[u8]) -> Entries<'a> {
        Entries {
            db: self.db,
            it: self.db.db.iterator_cf(
                self.cf,
                rocksdb::IteratorMode::From(start, rocksdb::Direction::Forward),
            ),
        }
    }

    /// The entries whose keys start with `prefix`, in key order.
    pub fn prefixed(&self, prefix: &[u8]) -> CasResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        for item in self.entries_from(prefix) {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            out.push((k.into_vec(), v.into_vec()));
        }
        Ok(out)
    }

    /// The first key at or after `key`.
    pub fn key_at_or_after(&self, key: &[u8]) -> CasResult<Option<Vec<u8>>> {
        let mut it = self.db.db.raw_iterator_cf(self.cf);
        it.seek(key);
        if it.valid() {
            return Ok(it.key().map(<[u8]>::to_vec));
        }
        it.status().map_err(|e| self.db.err(e))?;
        Ok(None)
    }
}

/// Writes to several keys of any column families, applied at once by
/// [`Database::write`].
#[derive(Default)]
pub struct Batch(rocksdb::WriteBatch);

impl Batch {
    pub fn put(&mut self, col: &Column<'_>, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) {
        self.0.put_cf(col.cf, key, value);
    }

    pub fn delete(&mut self, col: &Column<'_>, key: impl AsRef<[u8]>) {
        self.0.delete_cf(col.cf, key);
    }

    /// Deletes the keys from `from` (included) to `to` (excluded).
    pub fn delete_range(&mut self, col: &Column<'_>, from: &[u8], to: &[u8]) {
        self.0.delete_range_cf(col.cf, from, to);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
