//! The one primitive the portable stores need of a backend: a transaction over a flat
//! key space, serialized with every other transaction of the same store name, seeing
//! its own writes, committed at once or not at all. RocksDB (the embedded default: a
//! lock per store name in the one [`RocksPortable`] of the process that holds the
//! store's lock, and one synced batch) and PostgreSQL (a fleet: an advisory transaction
//! lock on the store's name, and one transaction) give it; the stores' rules are
//! written once, over [`KvTx`], in `middleware::portable`, which knows nothing of the
//! backend.
//!
//! The serialization lives in the backend value, so a casfs store has exactly one
//! (`Store::portable_kv` hands out clones of it): a second `RocksPortable` over the same
//! database would have locks of its own and let two transactions of one name
//! interleave.

use crate::sys::Locked;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use super::ids::CheckpointResult;
use crate::cas::{Batch, Database};

/// The column family the portable stores live in (RocksDB).
pub const PORTABLE_CF: &str = "portable";

/// Reads and writes inside one transaction.
pub trait KvTx {
    fn get(&mut self, key: &[u8]) -> CheckpointResult<Option<Vec<u8>>>;
    fn put(&mut self, key: &[u8], value: &[u8]);
    fn delete(&mut self, key: &[u8]);
    /// Every key starting with `prefix`, in byte order, with its value (this
    /// transaction's writes included).
    fn scan(&mut self, prefix: &[u8]) -> CheckpointResult<Vec<(Vec<u8>, Vec<u8>)>>;
}

/// A backend of the portable stores.
pub trait PortableKv: Send + Sync {
    /// Runs `f` in a transaction of store `name`: serialized with every other of that
    /// name, committed (durably) when `f` returns `Ok(true)`, discarded when it returns
    /// `Ok(false)` (the rules refused: the caller keeps why) or an error.
    fn transact(
        &self,
        name: &str,
        f: &mut dyn FnMut(&mut dyn KvTx) -> CheckpointResult<bool>,
    ) -> CheckpointResult<()>;
}

/// How many locks a [`RocksPortable`] spreads store names over: transactions of two
/// names sharing one wait for each other, which is safe (only slower).
const LOCKS: usize = 64;

/// The embedded backend: the store's RocksDB, this process alone having it open. Make
/// one per open database and share it: its locks are what serializes transactions.
pub struct RocksPortable {
    db: std::sync::Arc<Database>,
    locks: [Mutex<()>; LOCKS],
}

impl RocksPortable {
    pub fn new(db: std::sync::Arc<Database>) -> RocksPortable {
        RocksPortable {
            db,
            locks: std::array::from_fn(|_| Mutex::new(())),
        }
    }

    /// The lock of store `name`.
    fn lock_of(&self, name: &str) -> &Mutex<()> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        &self.locks[(h.finish() % LOCKS as u64) as usize]
    }
}

/// Writes buffered over the database: reads see them first.
struct RocksTx<'a> {
    db: &'a Database,
    pending: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

impl KvTx for RocksTx<'_> {
    fn get(&mut self, key: &[u8]) -> CheckpointResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        Ok(self.db.column(PORTABLE_CF).get(key)?)
    }

    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.pending.insert(key.to_vec(), Some(value.to_vec()));
    }

    fn delete(&mut self, key: &[u8]) {
        self.pending.insert(key.to_vec(), None);
    }

    fn scan(&mut self, prefix: &[u8]) -> CheckpointResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = self
            .db
            .column(PORTABLE_CF)
            .prefixed(prefix)?
            .into_iter()
            .collect();
        for (k, v) in self.pending.range(prefix.to_vec()..) {
            if !k.starts_with(prefix) {
                break;
            }
            match v {
                Some(v) => merged.insert(k.clone(), v.clone()),
                None => merged.remove(k),
            };
        }
        Ok(merged.into_iter().collect())
    }
}

impl PortableKv for RocksPortable {
    fn transact(
        &self,
        name: &str,
        f: &mut dyn FnMut(&mut dyn KvTx) -> CheckpointResult<bool>,
    ) -> CheckpointResult<()> {
        // One transaction of a name at a time in the process, from its first read to
        // its synced write; the store's lock keeps every other process out of the
        // database.
        let _g = self.lock_of(name).locked();
        let mut tx = RocksTx {
            db: &self.db,
            pending: BTreeMap::new(),
        };
        if !f(&mut tx)? || tx.pending.is_empty() {
            return Ok(());
        }
        let col = self.db.column(PORTABLE_CF);
        let mut batch = Batch::default();
        for (k, v) in &tx.pending {
            match v {
                Some(v) => batch.put(&col, k, v),
                None => batch.delete(&col, k),
            }
        }
        self.db.write(batch, true)?;
        Ok(())
    }
}
