//! [`ObjectStore`] on the store's embedded RocksDB: the `objects` column family,
//! objects zstd-compressed when that saves space, large ones in blob files.

use crate::sys::ReadWriteLocked;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rocksdb::{BottommostLevelCompaction, CompactOptions, WriteBatch, WriteOptions};

use super::error::{CasError, CasResult};
use super::fence::{Collecting, Fence};
use super::hash::{Hash, ObjectId, TreeId};
use super::kv::{Database, OBJECTS_CF, TREE_FACTS_CF};
use super::object::{decode_stored, encode_stored_into, MAX_OBJECT_LEN};
use super::store::{ObjectStore, PutOutcome, SweepReport};
use super::tree::TreeFacts;

thread_local! {
    static ENCODE_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Threads that read ahead for [`ObjectStore::prefetch`]: more than the CPUs, since
/// they wait on the disk, not on the CPU. None if they could not be started.
fn prefetch_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .thread_name(|i| format!("casfs-prefetch-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Objects in the `objects` column family of the store's RocksDB.
pub struct RocksObjectStore {
    db: Arc<Database>,
    /// Whether objects were written without the write-ahead log since the last sync.
    unlogged: AtomicBool,
    /// Bytes of objects written through the log since the last sync.
    logged: std::sync::atomic::AtomicU64,
    /// Bytes of objects put since the last flush: in memory, not yet in files, so the
    /// filesystem's free space does not show them yet.
    unflushed: std::sync::atomic::AtomicU64,
    fence: Fence,
    /// Open while the store is: a read ahead reads only under it, so that once the
    /// store is dropped no background read holds the database.
    ahead_gate: Arc<std::sync::RwLock<bool>>,
}

impl Drop for RocksObjectStore {
    /// Waits for the reads ahead under way (one object each) and stops the rest.
    fn drop(&mut self) {
        *self.ahead_gate.write_locked() = false;
    }
}

/// The first MiB of objects put between two syncs goes through the write-ahead log: a
/// checkpoint of a few changed files then syncs the log it syncs anyway, instead of
/// flushing a memtable (a table file, a blob file and the manifest, each synced). The
/// rest skips the log: written once, when the memtable is flushed (which that sync then
/// does), instead of twice. (A capture of 100k small files spent 4% of its CPU writing
/// the log of objects it flushed anyway.)
const LOGGED_BUDGET: u64 = 1 << 20;

/// At a sync, flush anyway when the memtable holds more than this, so the next open does
/// not replay a long log.
const FLUSH_AT_SYNC_BYTES: u64 = 16 << 20;

impl RocksObjectStore {
    pub fn new(db: Arc<Database>) -> Self {
        RocksObjectStore {
            db,
            unlogged: AtomicBool::new(false),
            logged: std::sync::atomic::AtomicU64::new(0),
            unflushed: std::sync::atomic::AtomicU64::new(0),
            fence: Fence::default(),
            ahead_gate: Arc::new(std::sync::RwLock::new(true)),
        }
    }

    pub fn database(&self) -> &Arc<Database> {
        &self.db
    }

    /// An object's stored encoding (header byte, raw or zstd), unverified.
    pub fn get_stored(&self, id: &Hash) -> CasResult<Option<Vec<u8>>> {
        self.db.reading(|db| {
            db.raw()
                .get_cf(db.cf(OBJECTS_CF), id.as_bytes())
                .map_err(|e| db.err(e))
        })
    }

    /// Keeps an object fetched from elsewhere in its stored encoding (the caller has
    /// verified it against `id`).
    pub fn put_stored(&self, id: &Hash, stored: &[u8]) -> CasResult<()> {
        self.db.ensure_space(2 * stored.len() as u64)?;
        let cf = self.db.cf(OBJECTS_CF);
        self.db
            .raw()
            .put_cf(cf, id.as_bytes(), stored)
            .map_err(|e| self.db.err(e))
    }

    pub fn fence_ref(&self) -> &Fence {
        &self.fence
    }

    /// Deletes every object not in `keep` (nor put since `collecting` began), or with
    /// `dry_run` only counts them. The space comes back with [`Self::reclaim`], which
    /// needs no fence.
    pub fn sweep(
        &self,
        keep: &HashSet<Hash>,
        collecting: &Collecting<'_>,
        dry_run: bool,
    ) -> CasResult<SweepReport> {
        let cf = self.db.cf(OBJECTS_CF);
        let mut report = SweepReport::default();
        let mut dead: Vec<(Hash, u64)> = Vec::new();
        let mut it = self.db.raw().raw_iterator_cf(cf);
        it.seek_to_first();
        while it.valid() {
            let key = it.key().expect("valid iterator");
            report.objects_total += 1;
            match Hash::from_slice(key) {
                Some(h) if keep.contains(&h) => report.objects_kept += 1,
                Some(h) => dead.push((h, it.value().map_or(0, |v| v.len() as u64))),
                // Not an object key: nothing of ours, left alone.
                None => report.objects_kept += 1,
            }
            it.next();
        }
        it.status().map_err(|e| self.db.err(e))?;
        drop(it);
        for batch in dead.chunks(4096) {
            collecting.with_touched(|touched| -> CasResult<()> {
                let mut b = WriteBatch::default();
                for (h, len) in batch {
                    if touched.contains(h) {
                        report.kept_new += 1;
                        report.objects_kept += 1;
                        continue;
                    }
                    report.objects_freed += 1;
                    report.bytes_freed += len;
                    b.delete_cf(cf, h.as_bytes());
                }
                if !dry_run && !b.is_empty() {
                    let mut o = WriteOptions::default();
                    o.set_sync(true);
                    self.db.raw().write_opt(b, &o).map_err(|e| self.db.err(e))?;
                    crate::crashpoint("gc.swept");
                }
                Ok(())
            })?;
        }
        if !dry_run {
            self.forget_facts(keep, collecting)?;
        }
        Ok(report)
    }

    /// Deletes the facts of trees not in `keep` (the ones this collection deleted, and
    /// any an earlier one left behind, by a crash between the two deletes), except
    /// those of trees put since it began, which may be stored again with their facts.
    fn forget_facts(&self, keep: &HashSet<Hash>, collecting: &Collecting<'_>) -> CasResult<()> {
        if !self.db.has_column(TREE_FACTS_CF) {
            return Ok(());
        }
        let cf = self.db.cf(TREE_FACTS_CF);
        let mut gone: Vec<Hash> = Vec::new();
        let mut it = self.db.raw().raw_iterator_cf(cf);
        it.seek_to_first();
        while it.valid() {
            match Hash::from_slice(it.key().expect("valid iterator")) {
                Some(h) if !keep.contains(&h) => gone.push(h),
                _ => {}
            }
            it.next();
        }
        it.status().map_err(|e| self.db.err(e))?;
        drop(it);
        for batch in gone.chunks(4096) {
            collecting.with_touched(|touched| {
                let mut b = WriteBatch::default();
                for h in batch.iter().filter(|h| !touched.contains(*h)) {
                    b.delete_cf(cf, h.as_bytes());
                }
                if b.is_empty() {
                    return Ok(());
                }
                self.db.raw().write(b).map_err(|e| self.db.err(e))
            })?;
        }
        Ok(())
    }

    /// Compacts the objects column family with blob garbage collection over every
    /// blob file, so deleted objects' space returns to the filesystem.
    pub fn reclaim(&self) -> CasResult<()> {
        crate::crashpoint("gc.compact");
        let cf = self.db.cf(OBJECTS_CF);
        let raw = self.db.raw();
        raw.flush_cf(cf).map_err(|e| self.db.err(e))?;
        raw.set_options_cf(cf, &[("blob_garbage_collection_age_cutoff", "1.0")])
            .map_err(|e| self.db.err(e))?;
        let mut o = CompactOptions::default();
        o.set_bottommost_level_compaction(BottommostLevelCompaction::Force);
        raw.compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &o);
        raw.set_options_cf(cf, &[("blob_garbage_collection_age_cutoff", "0.25")])
            .map_err(|e| self.db.err(e))?;
        Ok(())
    }

    /// [`ObjectStore::put`], handing `keep` the stored (encoded) bytes when the object
    /// is new here, so a caller that ships them on (a remote's next upload) need not
    /// read them back.
    pub fn put_keeping(
        &self,
        data: &[u8],
        keep: impl FnOnce(&Hash, &[u8]),
    ) -> CasResult<PutOutcome> {
        if data.len() > MAX_OBJECT_LEN {
            return Err(CasError::Invalid(format!(
                "object of {} bytes exceeds the limit of {MAX_OBJECT_LEN}",
                data.len()
            )));
        }
        let id = ObjectId(Hash::of(data));
        self.fence.note_put(&id.0);
        if self.contains(&id)? {
            return Ok(PutOutcome {
                id,
                new: false,
                stored_len: 0,
            });
        }
        crate::crashpoint("objects.put");
        let cf = self.db.cf(OBJECTS_CF);
        let mut opts = WriteOptions::default();
        // Written once, to a table or blob file, when the memtable is flushed; `sync`
        // flushes before anything may refer to it.
        let unlogged = self
            .logged
            .fetch_add(data.len() as u64, Ordering::Relaxed)
            .saturating_add(data.len() as u64)
            > LOGGED_BUDGET;
        opts.disable_wal(unlogged);
        let stored_len = ENCODE_BUF.with(|b| {
            let mut buf = b.borrow_mut();
            encode_stored_into(data, &mut buf);
            // The value goes to the log or a memtable, then to a file; and what earlier
            // puts left in memory is still to be written.
            let mut pending = self.unflushed.fetch_add(buf.len() as u64, Ordering::SeqCst);
            if pending > 64 << 20 {
                // RocksDB flushes full memtables by itself: count what is still in them.
                if let Ok(Some(n)) = self
                    .db
                    .raw()
                    .property_int_value_cf(cf, "rocksdb.cur-size-all-mem-tables")
                {
                    self.unflushed.store(n + buf.len() as u64, Ordering::SeqCst);
                    pending = n;
                }
            }
            if let Err(e) = self.db.ensure_space(2 * buf.len() as u64 + pending) {
                self.unflushed.fetch_sub(buf.len() as u64, Ordering::SeqCst);
                return Err(e);
            }
            let r = self.db.raw().put_cf_opt(cf, id.0.as_bytes(), &*buf, &opts);
            if r.is_ok() {
                // Told after the write: a sync that sees it flushes a memtable that
                // holds the object (told before, a sync could flush between the two
                // and the next one would not know to).
                if unlogged {
                    self.unlogged.store(true, Ordering::SeqCst);
                }
                keep(&id.0, &buf);
            }
            let len = buf.len() as u64;
            if buf.capacity() > 4 << 20 {
                *buf = Vec::new();
            }
            r.map(|()| len).map_err(|e| self.db.err(e))
        });
        Ok(PutOutcome {
            id,
            new: true,
            stored_len: stored_len?,
        })
    }
}

impl ObjectStore for RocksObjectStore {
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.put_keeping(data, |_, _| {})
    }

    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        self.db.reading(|db| {
            let stored = db
                .raw()
                .get_pinned_cf(db.cf(OBJECTS_CF), id.0.as_bytes())
                .map_err(|e| db.err(e))?
                .ok_or(CasError::NotFound { what, id: id.0 })?;
            decode_stored(&id.0, &stored)
        })
    }

    /// Reads `ids` many at a time and drops them: the pages they bring in (the block
    /// cache's and the kernel's) make the reads that follow, one at a time, memory
    /// reads. A cold directory listing otherwise waits on its subdirectories' trees
    /// one after another.
    fn prefetch(&self, ids: &[ObjectId]) {
        use rayon::prelude::*;
        if ids.len() < 2 {
            return;
        }
        let Some(pool) = prefetch_pool() else { return };
        pool.install(|| {
            ids.par_iter().for_each(|id| {
                let _ = self.db.reading(|db| {
                    db.raw()
                        .get_pinned_cf(db.cf(OBJECTS_CF), id.0.as_bytes())
                        .map(|_| ())
                        .map_err(|e| db.err(e))
                });
            })
        });
    }

    /// On the reader threads, without waiting. Each read holds the database only for
    /// itself, and only while this store is open: dropping the store waits for the
    /// reads under way and ends the rest, so the database closes with its owners.
    fn read_ahead(&self, ids: Vec<ObjectId>) {
        use rayon::prelude::*;
        if ids.is_empty() {
            return;
        }
        let Some(pool) = prefetch_pool() else { return };
        let db = Arc::downgrade(&self.db);
        let gate = self.ahead_gate.clone();
        pool.spawn(move || {
            ids.par_iter().for_each(|id| {
                let open = gate.read_locked();
                if !*open {
                    return;
                }
                let Some(db) = db.upgrade() else { return };
                let _ = db.reading(|db| {
                    db.raw()
                        .get_pinned_cf(db.cf(OBJECTS_CF), id.0.as_bytes())
                        .map(|_| ())
                        .map_err(|e| db.err(e))
                });
            })
        });
    }

    /// From the `tree_facts` column family (absent from a store no version that keeps
    /// facts has opened for writing: then nothing is known).
    fn tree_facts(&self, id: &TreeId) -> Option<TreeFacts> {
        self.db
            .reading(|db| {
                if !db.has_column(TREE_FACTS_CF) {
                    return Ok(None);
                }
                db.raw()
                    .get_pinned_cf(db.cf(TREE_FACTS_CF), id.0.as_bytes())
                    .map(|v| v.and_then(|v| TreeFacts::decode(&v)))
                    .map_err(|e| db.err(e))
            })
            .ok()
            .flatten()
    }

    /// Through the write-ahead log, not synced: facts lost to a crash are only not
    /// known (and a tree lost with them is stored again with them).
    fn note_tree_facts(&self, id: &TreeId, facts: TreeFacts) {
        if self.db.is_read_only() || !self.db.has_column(TREE_FACTS_CF) {
            return;
        }
        // Below the space reserve nothing optional is written.
        if self.db.ensure_space(64).is_err() {
            return;
        }
        let cf = self.db.cf(TREE_FACTS_CF);
        if let Err(e) = self.db.raw().put_cf(cf, id.0.as_bytes(), facts.encode()) {
            tracing::debug!("noting the facts of tree {}: {e}", id.0);
        }
    }

    fn contains(&self, id: &ObjectId) -> CasResult<bool> {
        let key = id.0.as_bytes();
        self.db.reading(|db| {
            let cf = db.cf(OBJECTS_CF);
            if !db.raw().key_may_exist_cf(cf, key) {
                return Ok(false);
            }
            Ok(db
                .raw()
                .get_pinned_cf(cf, key)
                .map_err(|e| db.err(e))?
                .is_some())
        })
    }

    fn sync(&self) -> CasResult<()> {
        let cf = self.db.cf(OBJECTS_CF);
        let pending = self
            .db
            .raw()
            .property_int_value_cf(cf, "rocksdb.cur-size-active-mem-table")
            .map_err(|e| self.db.err(e))?
            .unwrap_or(0);
        // The next puts start a new budget of logged bytes.
        self.logged.store(0, Ordering::Relaxed);
        if self.unlogged.swap(false, Ordering::SeqCst) || pending > FLUSH_AT_SYNC_BYTES {
            self.db.raw().flush_cf(cf).map_err(|e| self.db.err(e))?;
            self.unflushed.store(0, Ordering::SeqCst);
        }
        self.db.sync()
    }

    fn fence(&self) -> Option<&Fence> {
        Some(&self.fence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_get_dedup_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::open(&dir.path().join("db"), &[]).unwrap());
        let store = RocksObjectStore::new(db.clone());
        let data = b"some content ".repeat(1000);
        let a = store.put(&data).unwrap();
        assert!(a.new);
        assert!(a.stored_len < data.len() as u64);
        let b = store.put(&data).unwrap();
        assert!(!b.new);
        assert_eq!(a.id, b.id);
        assert_eq!(store.get(&a.id, "blob").unwrap(), data);

        let missing = ObjectId(Hash::of(b"nope"));
        let err = store.get(&missing, "blob").unwrap_err();
        assert!(matches!(err, CasError::NotFound { .. }), "{err}");

        // Flip a byte of the stored value: the read is an integrity error naming the hash.
        let cf = db.cf(OBJECTS_CF);
        let mut raw = db.raw().get_cf(cf, a.id.0.as_bytes()).unwrap().unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        db.raw().put_cf(cf, a.id.0.as_bytes(), &raw).unwrap();
        let err = store.get(&a.id, "blob").unwrap_err();
        assert!(err.is_integrity(), "{err}");
        assert!(err.to_string().contains(&a.id.to_hex()));
    }

    /// Reads ahead hold the database only while the store is open: a store closed with
    /// a long read-ahead queued can be opened again at once (its lock released), and
    /// what was read ahead reads back unchanged.
    #[test]
    fn a_read_ahead_keeps_no_store_open_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let db = Arc::new(Database::open(&path, &[]).unwrap());
        let store = RocksObjectStore::new(db.clone());
        let objects: Vec<(ObjectId, Vec<u8>)> = (0..2000u32)
            .map(|i| {
                let data = format!("object {i} ").repeat(50).into_bytes();
                (store.put(&data).unwrap().id, data)
            })
            .collect();
        db.raw().flush_cf(db.cf(OBJECTS_CF)).unwrap();
        let ids: Vec<ObjectId> = objects.iter().map(|(id, _)| *id).collect();
        // Missing objects are skipped without a word.
        let mut with_missing = ids.clone();
        with_missing.push(ObjectId(Hash::of(b"not stored")));
        for _ in 0..20 {
            store.read_ahead(with_missing.clone());
        }
        store.read_ahead(Vec::new());
        drop(store);
        drop(db);
        let db = Arc::new(Database::open(&path, &[]).expect("reopened while reading ahead"));
        let store = RocksObjectStore::new(db);
        store.read_ahead(ids);
        for (id, data) in &objects {
            assert_eq!(&store.get(id, "blob").unwrap(), data);
        }
    }

    /// A reader opened read-only beside a writer, whose compaction then moves objects
    /// out of a blob file and deletes it, still reads every object (before: "IO error:
    /// No such file or directory: while stat a file for size: .../000013.blob").
    #[test]
    fn a_read_only_reader_reads_past_a_blob_file_compaction_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let db = Arc::new(Database::open(&path, &[]).unwrap());
        let store = RocksObjectStore::new(db.clone());
        let cf = db.cf(OBJECTS_CF);
        let blob_files = || {
            let mut v: Vec<String> = std::fs::read_dir(&path)
                .unwrap()
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".blob"))
                .collect();
            v.sort();
            v
        };
        // Four flushes, four blob files of incompressible 8 KiB objects; the reader
        // opens after the first.
        let mut objects = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut reader = None;
        for round in 0..4 {
            for _ in 0..20 {
                let data: Vec<u8> = (0..8192)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                objects.push((store.put(&data).unwrap().id, data));
            }
            db.raw().flush_cf(cf).unwrap();
            if round == 0 {
                let ro = Database::open_read_only(&path).unwrap();
                reader = Some(RocksObjectStore::new(Arc::new(ro)));
            }
        }
        let reader = reader.unwrap();
        let first = blob_files();
        // Blob garbage collection rewrites the oldest file's objects and deletes it.
        let mut co = rocksdb::CompactOptions::default();
        co.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
        db.raw()
            .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &co);
        let after = blob_files();
        assert!(!after.contains(&first[0]), "{first:?} -> {after:?}");
        // What the reader saw at its open, and (opened anew) what came after.
        for (id, data) in &objects {
            assert!(reader.contains(id).unwrap());
            assert_eq!(&reader.get(id, "object").unwrap(), data);
        }
        let stored = reader.get_stored(&objects[0].0 .0).unwrap().unwrap();
        assert_eq!(
            decode_stored(&objects[0].0 .0, &stored).unwrap(),
            objects[0].1
        );
    }
}
