//! The [`CheckpointStore`] trait: checkpoints, thread heads and writer leases.

use std::time::Duration;

use super::{Checkpoint, CheckpointId, CheckpointResult, NewCheckpoint, ThreadId, WriterLease};

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

    /// Extends a live lease by its TTL. A lease that expired or was taken over is lost.
    fn renew(&self, lease: &WriterLease) -> CheckpointResult<WriterLease>;

    /// Gives the lease up. Releasing a lease another writer has since taken is `LeaseLost`.
    fn release(&self, lease: &WriterLease) -> CheckpointResult<()>;

    fn head(&self, thread: &ThreadId) -> CheckpointResult<Option<CheckpointId>>;

    fn get(&self, id: &CheckpointId) -> CheckpointResult<Checkpoint>;

    /// In one atomic step: checks that `lease` is live and current for the thread and
    /// that the head equals `expected_head`, then stores the checkpoint (its parent is
    /// `expected_head`) and moves the head to it.
    fn append(
        &self,
        new: NewCheckpoint,
        expected_head: Option<CheckpointId>,
        lease: &WriterLease,
    ) -> CheckpointResult<Checkpoint>;

    /// The thread's history, newest first, following parents (across forks), at most
    /// `limit` records.
    fn log(&self, thread: &ThreadId, limit: usize) -> CheckpointResult<Vec<Checkpoint>>;

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
