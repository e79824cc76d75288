//! [`CheckpointStore`] on the store's embedded RocksDB.
//!
//! Column families: `checkpoints` (id -> canonical JSON record), `heads` (thread -> id),
//! `leases` (thread -> live lease, its owner secret as a hash), `fencing` (thread -> last token handed out, never
//! decreasing). The store directory's lock file keeps other processes out while this
//! one has the database open; within the process a mutex makes each read-check-write a
//! single step, and every change is one [`Batch`] through the write-ahead log.
//!
//! Appends (and forks, fencing resets) are synced. Lease records (take, renew, release)
//! are not: they survive a killed process (the log is in the kernel's hands) and are
//! made durable by the next synced write, which the log orders after them; a machine
//! that crashes before that loses only leases whose holders died with it. A lost take
//! can hand its fencing token out again, but nothing durable ever carried it (an append
//! would have synced it), and a lost release leaves a lease whose holder's pid is gone,
//! which the next writer on this host takes over at once. Two syncs fewer per capture.

use crate::sys::Locked;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::checkpoint_store::CheckpointStore;
use super::checkpoint_store::{check_leases, Bookkeeping};
use super::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use super::lease::millis;
use super::lease::{LeaseRecord, OwnerToken, WriterLease};
use super::record::{Checkpoint, NewCheckpoint};
use crate::cas::{decode_hex, Batch, Database, Hash};

pub const CHECKPOINTS_CF: &str = "checkpoints";
pub const HEADS_CF: &str = "heads";
pub const LEASES_CF: &str = "leases";
pub const FENCING_CF: &str = "fencing";
/// Checkpoints removed by retention: id -> JSON `{thread, pruned_at_ms}`, so a log
/// stops at them and fsck tells a pruned parent from a lost one.
pub const PRUNED_CF: &str = "pruned";

/// The column families this store needs opened.
pub const COLUMN_FAMILIES: &[&str] = &[CHECKPOINTS_CF, HEADS_CF, LEASES_CF, FENCING_CF, PRUNED_CF];

pub struct RocksCheckpointStore {
    db: Arc<Database>,
    lock: Mutex<()>,
}

impl RocksCheckpointStore {
    pub fn new(db: Arc<Database>) -> Self {
        RocksCheckpointStore {
            db,
            lock: Mutex::new(()),
        }
    }

    fn get_raw(&self, cf: &str, key: &[u8]) -> CheckpointResult<Option<Vec<u8>>> {
        Ok(self.db.column(cf).get(key)?)
    }

    fn write(&self, batch: Batch) -> CheckpointResult<()> {
        self.write_opt(batch, true)
    }

    /// A lease change: through the log, not synced (see the module's notes).
    fn write_lease(&self, batch: Batch) -> CheckpointResult<()> {
        self.write_opt(batch, false)
    }

    fn write_opt(&self, batch: Batch, sync: bool) -> CheckpointResult<()> {
        Ok(self.db.write(batch, sync)?)
    }

    fn current_lease(&self, thread: &ThreadId) -> CheckpointResult<Option<LeaseRecord>> {
        match self.get_raw(LEASES_CF, thread.as_str().as_bytes())? {
            None => Ok(None),
            Some(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| CheckpointError::Corrupt {
                        id: format!("lease of thread {thread:?}"),
                        detail: e.to_string(),
                    })
            }
        }
    }

    fn last_token(&self, thread: &ThreadId) -> CheckpointResult<u64> {
        match self.get_raw(FENCING_CF, thread.as_str().as_bytes())? {
            None => Ok(0),
            Some(b) => <[u8; 8]>::try_from(b.as_slice())
                .map(u64::from_be_bytes)
                .map_err(|_| CheckpointError::Corrupt {
                    id: format!("fencing token of thread {thread:?}"),
                    detail: format!("{} bytes", b.len()),
                }),
        }
    }

    /// Checks that `lease` is the thread's live, current lease; returns its record.
    fn check_lease(&self, lease: &WriterLease, now: SystemTime) -> CheckpointResult<LeaseRecord> {
        let current = self.current_lease(&lease.thread)?.map(|c| {
            let live = !c.is_expired_at(now);
            (c, live)
        });
        super::checkpoint_store::check_current(lease, current.clone())?;
        Ok(current.expect("checked to be there").0)
    }

    fn put_lease(&self, batch: &mut Batch, lease: &LeaseRecord) {
        batch.put(
            &self.db.column(LEASES_CF),
            lease.thread.as_str().as_bytes(),
            serde_json::to_vec(lease).expect("a lease serializes"),
        );
    }

    fn put_checkpoint(&self, batch: &mut Batch, cp: &Checkpoint) {
        batch.put(
            &self.db.column(CHECKPOINTS_CF),
            cp.id.0.as_bytes(),
            cp.encode(),
        );
        batch.put(
            &self.db.column(HEADS_CF),
            cp.body.thread_id.as_str().as_bytes(),
            cp.id.0.as_bytes(),
        );
    }

    fn expect_head(
        &self,
        thread: &ThreadId,
        expected: Option<CheckpointId>,
    ) -> CheckpointResult<()> {
        let actual = self.head(thread)?;
        if actual != expected {
            return Err(CheckpointError::HeadMismatch {
                thread: thread.clone(),
                expected,
                actual,
            });
        }
        Ok(())
    }
}

impl CheckpointStore for RocksCheckpointStore {
    fn acquire_writer(
        &self,
        thread: &ThreadId,
        holder: &str,
        ttl: Duration,
    ) -> CheckpointResult<WriterLease> {
        super::checkpoint_store::check_ttl(ttl)?;
        let _g = self.lock.locked();
        let now = SystemTime::now();
        let current = self.current_lease(thread)?;
        super::checkpoint_store::check_free(
            thread,
            current.map(|c| {
                let live = !c.is_expired_at(now);
                (c, live)
            }),
        )?;
        let token = self.last_token(thread)? + 1;
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let lease = WriterLease {
            thread: thread.clone(),
            holder: holder.to_string(),
            token,
            acquired_at_ms: millis(now),
            expires_at_ms: millis(now) + ttl_ms,
            ttl_ms,
            owner_token: OwnerToken::generate(),
        };
        let mut batch = Batch::default();
        self.put_lease(&mut batch, &LeaseRecord::of(&lease));
        batch.put(
            &self.db.column(FENCING_CF),
            thread.as_str().as_bytes(),
            token.to_be_bytes(),
        );
        self.write_lease(batch)?;
        Ok(lease)
    }

    fn renew(&self, lease: &WriterLease) -> CheckpointResult<WriterLease> {
        let _g = self.lock.locked();
        let now = SystemTime::now();
        let mut record = self.check_lease(lease, now)?;
        record.expires_at_ms = millis(now) + record.ttl_ms;
        let mut batch = Batch::default();
        self.put_lease(&mut batch, &record);
        self.write_lease(batch)?;
        Ok(record.to_lease(&lease.owner_token))
    }

    fn release(&self, lease: &WriterLease) -> CheckpointResult<()> {
        let _g = self.lock.locked();
        let current = self.current_lease(&lease.thread)?;
        let last = self.last_token(&lease.thread)?;
        if super::checkpoint_store::release_deletes(lease, current.as_ref(), last)? {
            let mut batch = Batch::default();
            batch.delete(&self.db.column(LEASES_CF), lease.thread.as_str().as_bytes());
            self.write_lease(batch)?;
        }
        Ok(())
    }

    fn head(&self, thread: &ThreadId) -> CheckpointResult<Option<CheckpointId>> {
        match self.get_raw(HEADS_CF, thread.as_str().as_bytes())? {
            None => Ok(None),
            Some(b) => Hash::from_slice(&b)
                .map(|h| Some(CheckpointId(h)))
                .ok_or_else(|| CheckpointError::Corrupt {
                    id: format!("head of thread {thread:?}"),
                    detail: format!("{} bytes", b.len()),
                }),
        }
    }

    fn get(&self, id: &CheckpointId) -> CheckpointResult<Checkpoint> {
        let Some(bytes) = self.get_raw(CHECKPOINTS_CF, id.0.as_bytes())? else {
            let pruned = self.is_pruned(id)?;
            return Err(CheckpointError::NotFound(if pruned {
                format!("{} (removed by retention)", id.to_hex())
            } else {
                id.to_hex()
            }));
        };
        Checkpoint::decode(id, &bytes)
    }

    fn append(
        &self,
        new: NewCheckpoint,
        expected_head: Option<CheckpointId>,
        lease: &WriterLease,
    ) -> CheckpointResult<Checkpoint> {
        super::checkpoint_store::check_lease_thread(&new, lease)?;
        let _g = self.lock.locked();
        let now = SystemTime::now();
        self.check_lease(lease, now)?;
        self.expect_head(&new.thread_id, expected_head)?;
        if let Some(parent) = expected_head {
            self.get(&parent)?;
        }
        let cp = Checkpoint::from_new(new, expected_head, now);
        let mut batch = Batch::default();
        self.put_checkpoint(&mut batch, &cp);
        crate::crashpoint("append.before");
        self.write(batch)?;
        crate::crashpoint("append.after");
        Ok(cp)
    }

    fn is_pruned(&self, id: &CheckpointId) -> CheckpointResult<bool> {
        Ok(self.get_raw(PRUNED_CF, id.0.as_bytes())?.is_some())
    }

    fn fork(&self, new_thread: &ThreadId, from: &CheckpointId) -> CheckpointResult<Checkpoint> {
        let _g = self.lock.locked();
        if self.head(new_thread)?.is_some() {
            return Err(CheckpointError::ThreadExists(new_thread.clone()));
        }
        if let Some(cur) = self.current_lease(new_thread)? {
            if !cur.is_expired_at(SystemTime::now()) {
                return Err(CheckpointError::LeaseHeld {
                    thread: new_thread.clone(),
                    until: cur.expires_at(),
                    holder: cur.holder,
                });
            }
        }
        let src = self.get(from)?;
        let new = NewCheckpoint::fork_of(new_thread, &src);
        let cp = Checkpoint::from_new(new, Some(*from), SystemTime::now());
        let mut batch = Batch::default();
        self.put_checkpoint(&mut batch, &cp);
        self.write(batch)?;
        Ok(cp)
    }

    fn threads(&self) -> CheckpointResult<Vec<(ThreadId, CheckpointId)>> {
        let mut out = Vec::new();
        for item in self.db.column(HEADS_CF).entries() {
            let (k, v) = item?;
            let name = String::from_utf8_lossy(&k).into_owned();
            let thread = ThreadId::new(&name)?;
            let id = Hash::from_slice(&v).ok_or_else(|| CheckpointError::Corrupt {
                id: format!("head of thread {name:?}"),
                detail: format!("{} bytes", v.len()),
            })?;
            out.push((thread, CheckpointId(id)));
        }
        Ok(out)
    }

    fn resolve_prefix(&self, prefix: &str) -> CheckpointResult<CheckpointId> {
        let p = super::checkpoint_store::checked_prefix(prefix)?;
        if let Some(h) = Hash::from_hex(&p) {
            let id = CheckpointId(h);
            self.get(&id)?;
            return Ok(id);
        }
        let even = decode_hex(&p[..p.len() / 2 * 2]).unwrap_or_default();
        let mut candidates = Vec::new();
        let iter = self.db.column(CHECKPOINTS_CF).entries_from(&even);
        for item in iter {
            let (k, _) = item?;
            if !k.starts_with(&even) {
                break;
            }
            if let Some(h) = Hash::from_slice(&k) {
                if h.to_hex().starts_with(&p) {
                    candidates.push(CheckpointId(h));
                    if candidates.len() > 8 {
                        break;
                    }
                }
            }
        }
        match candidates.len() {
            0 => Err(CheckpointError::NotFound(prefix.to_string())),
            1 => Ok(candidates[0]),
            _ => Err(CheckpointError::Ambiguous {
                prefix: prefix.to_string(),
                candidates,
            }),
        }
    }

    fn all_records(&self) -> CheckpointResult<Vec<(CheckpointId, CheckpointResult<Checkpoint>)>> {
        let mut out = Vec::new();
        for item in self.db.column(CHECKPOINTS_CF).entries() {
            let (k, v) = item?;
            let Some(h) = Hash::from_slice(&k) else {
                let id = CheckpointId(Hash::of(&k));
                out.push((
                    id,
                    Err(CheckpointError::Corrupt {
                        id: format!("key {:?}", String::from_utf8_lossy(&k)),
                        detail: format!("a checkpoint key of {} bytes", k.len()),
                    }),
                ));
                continue;
            };
            let id = CheckpointId(h);
            out.push((id, Checkpoint::decode(&id, &v)));
        }
        Ok(out)
    }

    fn remove_records(&self, doomed: &[(CheckpointId, ThreadId)]) -> CheckpointResult<usize> {
        let _g = self.lock.locked();
        let heads: std::collections::HashSet<CheckpointId> =
            self.threads()?.into_iter().map(|(_, id)| id).collect();
        let now = millis(SystemTime::now());
        let mut batch = Batch::default();
        let mut n = 0;
        for (id, thread) in doomed {
            if heads.contains(id) {
                continue;
            }
            let tomb = serde_json::json!({"thread": thread, "pruned_at_ms": now});
            batch.put(
                &self.db.column(PRUNED_CF),
                id.0.as_bytes(),
                serde_json::to_vec(&tomb).expect("json"),
            );
            batch.delete(&self.db.column(CHECKPOINTS_CF), id.0.as_bytes());
            n += 1;
        }
        crate::crashpoint("prune.before");
        self.write(batch)?;
        Ok(n)
    }

    fn bookkeeping(&self, repair: bool) -> CheckpointResult<Bookkeeping> {
        let _g = self.lock.locked();
        let mut out = Bookkeeping::default();
        for item in self.db.column(HEADS_CF).entries() {
            let (k, v) = item?;
            let id = Hash::from_slice(&v)
                .map(CheckpointId)
                .ok_or_else(|| format!("{} bytes, not an id", v.len()));
            out.heads
                .push((String::from_utf8_lossy(&k).into_owned(), id));
        }
        let mut tokens = BTreeMap::new();
        for item in self.db.column(FENCING_CF).entries() {
            let (k, v) = item?;
            let name = String::from_utf8_lossy(&k).into_owned();
            match <[u8; 8]>::try_from(&*v) {
                Ok(b) => {
                    tokens.insert(name, u64::from_be_bytes(b));
                }
                Err(_) => out.errors.push(format!(
                    "fencing token of thread {name:?}: {} bytes",
                    v.len()
                )),
            }
        }
        let mut leases = Vec::new();
        for item in self.db.column(LEASES_CF).entries() {
            let (k, v) = item?;
            let token = serde_json::from_slice::<LeaseRecord>(&v)
                .map(|l| l.token)
                .map_err(|e| e.to_string());
            leases.push((String::from_utf8_lossy(&k).into_owned(), token));
        }
        let fixes = check_leases(&tokens, leases, repair, &mut out);
        let mut batch = Batch::default();
        for (thread, token) in &fixes.raise {
            batch.put(
                &self.db.column(FENCING_CF),
                thread.as_bytes(),
                token.to_be_bytes(),
            );
        }
        for thread in &fixes.drop {
            batch.delete(&self.db.column(LEASES_CF), thread.as_bytes());
        }
        if !batch.is_empty() {
            self.write(batch)?;
        }
        Ok(out)
    }
}
