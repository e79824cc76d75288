//! The middleware's errors: each names what it is about.

use crate::checkpoint::{CheckpointError, CheckpointId, ThreadId};

pub type MiddlewareResult<T> = Result<T, MiddlewareError>;

fn show(id: &Option<CheckpointId>) -> String {
    id.map(|i| i.short()).unwrap_or_else(|| "none".into())
}

#[derive(Debug, thiserror::Error)]
pub enum MiddlewareError {
    /// The middleware or run was set up wrong (a missing store, persistence wired to
    /// another instance, a bad glob, a secret too short to look for).
    #[error("invalid middleware configuration: {0}")]
    Config(String),

    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),

    #[error("thread {thread:?} names checkpoint {id} as its head, but it is not in the store")]
    HeadMissing { thread: ThreadId, id: CheckpointId },

    #[error(
        "checkpoint {checkpoint} was made for workspace definition {recorded}, this workspace is \
         {current}; restoring it is refused unless the policy allows a different workspace"
    )]
    WorkspaceMismatch {
        checkpoint: CheckpointId,
        recorded: String,
        current: String,
    },

    #[error("sandbox {key:?}: {detail}")]
    Sandbox { key: String, detail: String },

    /// A writer would publish a sandbox that shows another checkpoint than the head it
    /// expects (the sandbox fell behind, or the writer read another head).
    #[error(
        "sandbox {key:?} shows checkpoint {}, not {}, the head the writer expects; resume \
         it to show the thread's head first",
        show(shows),
        show(expected)
    )]
    SandboxBehind {
        key: String,
        shows: Option<CheckpointId>,
        expected: Option<CheckpointId>,
    },

    /// The sandbox is in use by processes that keep it from being torn down.
    #[error("sandbox {key:?} is busy: {detail}")]
    SandboxBusy { key: String, detail: String },

    /// A limit of the host was reached (live sandboxes, concurrent runs): try later.
    #[error("at capacity: {limit} {what} are in use; try again later")]
    AtCapacity { what: &'static str, limit: usize },

    /// A tenant holds its most sandboxes, none of them idle: end a run or destroy one.
    #[error(
        "tenant {tenant} holds {limit} sandboxes, its most, and none is idle: destroy one \
         (or end its run) first"
    )]
    TenantAtCapacity { tenant: String, limit: usize },

    #[error("capture policy: {0}")]
    Policy(String),

    #[error("persistence: {0}")]
    Persistence(String),

    #[error("run {0:?} was cancelled")]
    Cancelled(String),
}
