//! Checkpoint references, as people and programs write them: a full id, a prefix of at
//! least 4 hex digits, or `@thread` (the thread's head), each optionally followed by
//! `~N` (N parents back). The command line and `casfs serve` accept the same.

use super::checkpoint_store::CheckpointStore;
use super::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};

/// The checkpoint `r` names in `cps`.
pub fn resolve(cps: &dyn CheckpointStore, r: &str) -> CheckpointResult<CheckpointId> {
    let (base, up) = match r.rsplit_once('~') {
        Some((b, n)) => (
            b,
            n.parse::<usize>().map_err(|_| {
                CheckpointError::Invalid(format!(
                    "checkpoint reference {r:?}: '~' must be followed by a number"
                ))
            })?,
        ),
        None => (r, 0),
    };
    let mut id = if let Some(t) = base.strip_prefix('@') {
        let thread = ThreadId::new(t)?;
        cps.head(&thread)?
            .ok_or(CheckpointError::EmptyThread(thread))?
    } else {
        cps.resolve_prefix(base)?
    };
    for i in 0..up {
        id = cps.get(&id)?.body.parent_id.ok_or_else(|| {
            CheckpointError::NotFound(format!(
                "{r:?}: {} has no parent ({i} of {up} steps taken)",
                id.short()
            ))
        })?;
    }
    Ok(id)
}

/// The reference a command given a thread and/or an explicit reference means: the
/// reference if given, else the thread's head; `None` if neither is given.
pub fn thread_or_at(thread: Option<&str>, at: Option<&str>) -> Option<String> {
    match (thread, at) {
        (_, Some(r)) => Some(r.to_string()),
        (Some(t), None) => Some(format!("@{t}")),
        (None, None) => None,
    }
}
