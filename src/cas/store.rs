//! The [`ObjectStore`] trait and its embedded RocksDB implementation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rocksdb::WriteOptions;

use super::object::{decode_stored, encode_stored_into, MAX_OBJECT_LEN};
use super::rocks::{Database, OBJECTS_CF};
use super::{CasError, CasResult, Hash, ObjectId};

thread_local! {
    static ENCODE_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// What a `put` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOutcome {
    pub id: ObjectId,
    /// False when the store already held the object (deduplicated).
    pub new: bool,
    /// Bytes written to the store (after compression); 0 when not new.
    pub stored_len: u64,
}

/// A content-addressed object store. Keys are blake3 hashes of the objects' bytes;
/// every read is verified against its key.
pub trait ObjectStore: Send + Sync {
    /// Stores `data` under its hash, unless already present.
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome>;

    /// Reads and verifies an object. `what` names its type for the not-found error.
    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>>;

    /// Whether the object is present (not verified).
    fn contains(&self, id: &ObjectId) -> CasResult<bool>;

    /// Makes every object stored so far durable. Until it returns, objects written since
    /// the last sync may be lost in a crash, so nothing may refer to them before.
    fn sync(&self) -> CasResult<()>;
}

/// Objects in the `objects` column family of the store's RocksDB.
pub struct RocksObjectStore {
    db: Arc<Database>,
    /// Whether objects were written without the write-ahead log since the last sync.
    unlogged: AtomicBool,
}

/// Objects at least this large (the size from which RocksDB keeps values in blob files)
/// skip the write-ahead log: they are written once, when the
/// memtable is flushed, instead of twice. Smaller ones go through the log, so a capture
/// of a few small changes syncs the log instead of flushing a memtable.
const UNLOGGED_MIN: usize = 4 << 10;

/// At a sync, flush anyway when the memtable holds more than this, so the next open does
/// not replay a long log.
const FLUSH_AT_SYNC_BYTES: u64 = 16 << 20;

impl RocksObjectStore {
    pub fn new(db: Arc<Database>) -> Self {
        RocksObjectStore {
            db,
            unlogged: AtomicBool::new(false),
        }
    }

    pub fn database(&self) -> &Arc<Database> {
        &self.db
    }
}

impl ObjectStore for RocksObjectStore {
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome> {
        if data.len() > MAX_OBJECT_LEN {
            return Err(CasError::Invalid(format!(
                "object of {} bytes exceeds the limit of {MAX_OBJECT_LEN}",
                data.len()
            )));
        }
        let id = ObjectId(Hash::of(data));
        if self.contains(&id)? {
            return Ok(PutOutcome {
                id,
                new: false,
                stored_len: 0,
            });
        }
        let cf = self.db.cf(OBJECTS_CF);
        let mut opts = WriteOptions::default();
        if data.len() >= UNLOGGED_MIN {
            // Written once, to a blob file, when the memtable is flushed; `sync` flushes
            // before anything may refer to it.
            opts.disable_wal(true);
            self.unlogged.store(true, Ordering::SeqCst);
        }
        let stored_len = ENCODE_BUF.with(|b| {
            let mut buf = b.borrow_mut();
            encode_stored_into(data, &mut buf);
            let r = self.db.raw().put_cf_opt(cf, id.0.as_bytes(), &*buf, &opts);
            let len = buf.len() as u64;
            if buf.capacity() > 4 << 20 {
                *buf = Vec::new();
            }
            r.map(|()| len)
        });
        Ok(PutOutcome {
            id,
            new: true,
            stored_len: stored_len.map_err(|e| self.db.err(e))?,
        })
    }

    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        let cf = self.db.cf(OBJECTS_CF);
        let stored = self
            .db
            .raw()
            .get_pinned_cf(cf, id.0.as_bytes())
            .map_err(|e| self.db.err(e))?
            .ok_or(CasError::NotFound { what, id: id.0 })?;
        decode_stored(&id.0, &stored)
    }

    fn contains(&self, id: &ObjectId) -> CasResult<bool> {
        let cf = self.db.cf(OBJECTS_CF);
        let key = id.0.as_bytes();
        if !self.db.raw().key_may_exist_cf(cf, key) {
            return Ok(false);
        }
        Ok(self
            .db
            .raw()
            .get_pinned_cf(cf, key)
            .map_err(|e| self.db.err(e))?
            .is_some())
    }

    fn sync(&self) -> CasResult<()> {
        let cf = self.db.cf(OBJECTS_CF);
        let pending = self
            .db
            .raw()
            .property_int_value_cf(cf, "rocksdb.cur-size-active-mem-table")
            .map_err(|e| self.db.err(e))?
            .unwrap_or(0);
        if self.unlogged.swap(false, Ordering::SeqCst) || pending > FLUSH_AT_SYNC_BYTES {
            self.db.raw().flush_cf(cf).map_err(|e| self.db.err(e))?;
        }
        self.db.sync()
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
}
