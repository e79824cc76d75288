//! The [`CheckpointStore`] trait: checkpoints, thread heads and writer leases.

use std::time::Duration;

use super::ids::{CheckpointId, CheckpointResult, ThreadId};
use super::lease::{LeaseRecord, WriterLease};
use super::record::{Checkpoint, NewCheckpoint};

/// Where checkpoints, heads and leases live. The embedded default is RocksDB
/// ([`super::rocks_store::RocksCheckpointStore`]); fleet backends implement the same contract.
pub trait CheckpointStore: Send + Sync {
    /// Takes the thread's writer lease for `ttl`, or fails with `LeaseHeld` naming the
    /// current holder while a live lease exists.
    fn acquire_writer(
        &self,
        thread: &ThreadId,
        holder: &str,
        ttl: Duration,
    ) -> CheckpointResult<WriterLease>;

    /// Extends a live lease by the TTL it was taken with. A lease that expired or was
    /// taken over is lost; one presented without its owner secret is `LeaseLost` too.
    /// Only the lease's thread, token and owner secret are read: the answer is the
    /// store's record (holder, TTL), renewed.
    fn renew(&self, lease: &WriterLease) -> CheckpointResult<WriterLease>;

    /// Gives the lease up. Releasing a lease another writer has since taken, or without
    /// its owner secret, is `LeaseLost`.
    fn release(&self, lease: &WriterLease) -> CheckpointResult<()>;

    fn head(&self, thread: &ThreadId) -> CheckpointResult<Option<CheckpointId>>;

    fn get(&self, id: &CheckpointId) -> CheckpointResult<Checkpoint>;

    /// In one atomic step: checks that `lease` is live and current for the thread (its
    /// token and owner secret are the current lease's) and that the head equals `expected_head`, then stores the checkpoint (its parent is
    /// `expected_head`) and moves the head to it.
    fn append(
        &self,
        new: NewCheckpoint,
        expected_head: Option<CheckpointId>,
        lease: &WriterLease,
    ) -> CheckpointResult<Checkpoint>;

    /// The thread's history, newest first, following parents (across forks), at most
    /// `limit` records; it ends at a checkpoint retention removed.
    fn log(&self, thread: &ThreadId, limit: usize) -> CheckpointResult<Vec<Checkpoint>> {
        let mut out = Vec::new();
        let mut next = self.head(thread)?;
        while let Some(id) = next {
            if out.len() >= limit {
                break;
            }
            let cp = match self.get(&id) {
                Err(super::ids::CheckpointError::NotFound(_))
                    if !out.is_empty() && self.is_pruned(&id)? =>
                {
                    break
                }
                r => r?,
            };
            next = cp.body.parent_id;
            out.push(cp);
        }
        Ok(out)
    }

    /// Whether retention removed this checkpoint (stores without retention: never).
    fn is_pruned(&self, _id: &CheckpointId) -> CheckpointResult<bool> {
        Ok(false)
    }

    /// Starts `new_thread` with a checkpoint whose parent is `from` and whose content is
    /// `from`'s. The new thread must not exist.
    fn fork(&self, new_thread: &ThreadId, from: &CheckpointId) -> CheckpointResult<Checkpoint>;

    /// Every thread with its head.
    fn threads(&self) -> CheckpointResult<Vec<(ThreadId, CheckpointId)>>;

    /// Resolves a unique hex prefix (at least 4 digits) to a checkpoint id.
    fn resolve_prefix(&self, prefix: &str) -> CheckpointResult<CheckpointId>;

    /// Every checkpoint record, each decoded (and checked against its id) or why it
    /// does not decode: what retention ranks and a collection marks from.
    fn all_records(&self) -> CheckpointResult<Vec<(CheckpointId, CheckpointResult<Checkpoint>)>>;

    /// Removes checkpoint records (retention), leaving a tombstone for each so
    /// [`CheckpointStore::is_pruned`] tells them from lost ones. A record that is a
    /// thread's head when the removal runs is kept whatever the caller decided. Returns
    /// how many were removed. A record some mount pins is kept too.
    fn remove_records(&self, doomed: &[(CheckpointId, ThreadId)]) -> CheckpointResult<usize>;

    /// Records that the mount `holder` (a name unique in the fleet: store and mount)
    /// reads from `ids`, added to what it recorded before or replacing it (`replace`).
    /// Retention keeps every checkpoint some mount pins, and a record pinned before
    /// [`CheckpointStore::remove_records`] runs is not removed: a mount pins a
    /// checkpoint before it reads it, and a read after its pin is answered (the
    /// record) or refused (retention removed it first). The default is for stores
    /// whose mounts all live on this host, where each mount's dirty set says it.
    fn pin(&self, _holder: &str, _ids: &[CheckpointId], _replace: bool) -> CheckpointResult<()> {
        Ok(())
    }

    /// Drops every pin of `holder` (its mount was discarded).
    fn unpin(&self, _holder: &str) -> CheckpointResult<()> {
        Ok(())
    }

    /// Every pin: holder and checkpoint.
    fn pins(&self) -> CheckpointResult<Vec<(String, CheckpointId)>> {
        Ok(Vec::new())
    }

    /// Reads the store's own bookkeeping for `fsck`: every head as stored, and every
    /// lease against its thread's fencing token (`check_leases`). With `repair`, a
    /// fencing token below a lease's is raised to it and a lease that does not decode
    /// is dropped.
    fn bookkeeping(&self, repair: bool) -> CheckpointResult<Bookkeeping>;
}

/// A checkpoint store's heads, leases and fencing tokens as `fsck` sees them.
#[derive(Debug, Default)]
pub struct Bookkeeping {
    /// Every stored head: the thread's name as stored, and its checkpoint or why the
    /// stored value is not an id.
    pub heads: Vec<(String, Result<CheckpointId, String>)>,
    /// Damage: a lease beyond its fencing token, a token that does not decode.
    pub errors: Vec<String>,
    /// Harmless: a lease record that does not decode (it is only dropped).
    pub leftovers: Vec<String>,
    /// What `repair` did.
    pub repaired: Vec<String>,
}

/// What a repair changes in a store's leases: fencing tokens to raise (thread, token)
/// and undecodable leases to drop (thread).
#[derive(Debug, Default)]
pub(crate) struct LeaseFixes {
    pub raise: Vec<(String, u64)>,
    pub drop: Vec<String>,
}

/// The lease rule every backend's `fsck` applies: a lease's token is never beyond its
/// thread's fencing token (the next writer would be handed a token already used).
/// `tokens` holds each thread's fencing token, `leases` each lease's token or why the
/// record does not decode. Reports into `out`; returns the fixes when `repair`.
pub(crate) fn check_leases(
    tokens: &std::collections::BTreeMap<String, u64>,
    leases: Vec<(String, Result<u64, String>)>,
    repair: bool,
    out: &mut Bookkeeping,
) -> LeaseFixes {
    let mut fixes = LeaseFixes::default();
    for (name, lease) in leases {
        match lease {
            Err(e) => {
                out.leftovers
                    .push(format!("lease of thread {name:?} does not decode: {e}"));
                if repair {
                    out.repaired
                        .push(format!("dropped the undecodable lease of thread {name:?}"));
                    fixes.drop.push(name);
                }
            }
            Ok(token) => {
                let t = tokens.get(&name).copied().unwrap_or(0);
                if token <= t {
                    continue;
                }
                if repair {
                    out.repaired.push(format!(
                        "raised the fencing token of thread {name:?} to {token}"
                    ));
                    fixes.raise.push((name, token));
                } else {
                    out.errors.push(format!(
                        "lease of thread {name:?} has token {token} beyond the fencing token {t}"
                    ));
                }
            }
        }
    }
    fixes
}

/// A checkpoint prefix as typed, checked and lowercased: 4 to 64 hex digits.
pub(crate) fn checked_prefix(prefix: &str) -> CheckpointResult<String> {
    let p = prefix.to_ascii_lowercase();
    if p.len() < 4 || p.len() > 64 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(super::ids::CheckpointError::Invalid(format!(
            "checkpoint {prefix:?}: expected at least 4 hex digits"
        )));
    }
    Ok(p)
}

/// The rules every store applies to a writer's lease, given the thread's current lease
/// and whether it is live by the store's clock: `lease` must be it (its token and its
/// owner secret), and live.
pub(crate) fn check_current(
    lease: &WriterLease,
    current: Option<(LeaseRecord, bool)>,
) -> CheckpointResult<()> {
    let lost = |detail: String| super::ids::CheckpointError::LeaseLost {
        thread: lease.thread.clone(),
        token: lease.token,
        detail,
    };
    match current {
        None => Err(lost(
            "no lease is held (released or expired and cleared)".into(),
        )),
        Some((cur, _)) if cur.token != lease.token => Err(lost(format!(
            "taken over by {:?} with token {}",
            cur.holder, cur.token
        ))),
        Some((cur, _)) if !cur.owned_by(lease) => Err(lost(NOT_THE_OWNER.into())),
        Some((cur, false)) => Err(super::ids::CheckpointError::LeaseExpired {
            thread: lease.thread.clone(),
            token: lease.token,
            expired_at: cur.expires_at(),
        }),
        Some(_) => Ok(()),
    }
}

/// Why a lease presented with a wrong owner secret is refused.
const NOT_THE_OWNER: &str =
    "the owner token is not this lease's: only the writer that took the lease may use it";

/// Whether releasing `lease` deletes the current lease (`true`), is a harmless repeat
/// (`false`), or is refused because a later writer took the thread or the owner secret
/// is wrong.
pub(crate) fn release_deletes(
    lease: &WriterLease,
    current: Option<&LeaseRecord>,
    last_token: u64,
) -> CheckpointResult<bool> {
    let lost = |detail: String| super::ids::CheckpointError::LeaseLost {
        thread: lease.thread.clone(),
        token: lease.token,
        detail,
    };
    match current {
        Some(cur) if cur.token == lease.token && cur.owned_by(lease) => Ok(true),
        Some(cur) if cur.token == lease.token => Err(lost(NOT_THE_OWNER.into())),
        Some(cur) => Err(lost(format!(
            "taken over by {:?} with token {}",
            cur.holder, cur.token
        ))),
        None if last_token == lease.token => Ok(false),
        None => Err(lost("a later writer took and released the thread".into())),
    }
}

/// An append must be on the thread its lease is for.
pub(crate) fn check_lease_thread(new: &NewCheckpoint, lease: &WriterLease) -> CheckpointResult<()> {
    if lease.thread != new.thread_id {
        return Err(super::ids::CheckpointError::Invalid(format!(
            "lease is for thread {:?}, checkpoint for {:?}",
            lease.thread, new.thread_id
        )));
    }
    Ok(())
}

/// A lease TTL a store accepts: more than 0, at most 24 hours.
pub(crate) fn check_ttl(ttl: std::time::Duration) -> CheckpointResult<()> {
    if ttl.is_zero() || ttl > std::time::Duration::from_secs(24 * 3600) {
        return Err(super::ids::CheckpointError::Invalid(format!(
            "lease TTL {ttl:?}: use more than 0 and at most 24 hours"
        )));
    }
    Ok(())
}

/// Refuses a new lease while the thread's current one (live by the store's clock) is
/// held by a process that still exists.
pub(crate) fn check_free(
    thread: &ThreadId,
    current: Option<(LeaseRecord, bool)>,
) -> CheckpointResult<()> {
    match current {
        Some((cur, true)) if !super::lease::holder_is_dead(&cur.holder) => {
            Err(super::ids::CheckpointError::LeaseHeld {
                thread: thread.clone(),
                until: cur.expires_at(),
                holder: cur.holder,
            })
        }
        _ => Ok(()),
    }
}
