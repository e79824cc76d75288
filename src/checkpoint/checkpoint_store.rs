//! The [`CheckpointStore`] trait: checkpoints, thread heads and writer leases.

use std::time::Duration;

use super::{
    Checkpoint, CheckpointId, CheckpointResult, LeaseRecord, NewCheckpoint, ThreadId, WriterLease,
};

/// Where checkpoints, heads and leases live. The embedded default is RocksDB
/// ([`super::RocksCheckpointStore`]); fleet backends implement the same contract.
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
                Err(super::CheckpointError::NotFound(_))
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
}

/// A checkpoint prefix as typed, checked and lowercased: 4 to 64 hex digits.
pub(crate) fn checked_prefix(prefix: &str) -> CheckpointResult<String> {
    let p = prefix.to_ascii_lowercase();
    if p.len() < 4 || p.len() > 64 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(super::CheckpointError::Invalid(format!(
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
    let lost = |detail: String| super::CheckpointError::LeaseLost {
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
        Some((cur, false)) => Err(super::CheckpointError::LeaseExpired {
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
    let lost = |detail: String| super::CheckpointError::LeaseLost {
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
        return Err(super::CheckpointError::Invalid(format!(
            "lease is for thread {:?}, checkpoint for {:?}",
            lease.thread, new.thread_id
        )));
    }
    Ok(())
}

/// A lease TTL a store accepts: more than 0, at most 24 hours.
pub(crate) fn check_ttl(ttl: std::time::Duration) -> CheckpointResult<()> {
    if ttl.is_zero() || ttl > std::time::Duration::from_secs(24 * 3600) {
        return Err(super::CheckpointError::Invalid(format!(
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
            Err(super::CheckpointError::LeaseHeld {
                thread: thread.clone(),
                until: cur.expires_at(),
                holder: cur.holder,
            })
        }
        _ => Ok(()),
    }
}
