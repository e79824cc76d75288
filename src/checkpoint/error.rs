//! Errors of the checkpoint layer: each names the thread, checkpoint or lease involved.

use std::path::PathBuf;
use std::time::SystemTime;

use super::{CheckpointId, ThreadId};
use crate::cas::CasError;

fn show_head(h: &Option<CheckpointId>) -> String {
    h.map(|h| h.short()).unwrap_or_else(|| "none".into())
}

fn show_time(t: &SystemTime) -> String {
    humantime::format_rfc3339_millis(*t).to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {0} not found")]
    NotFound(String),

    #[error("thread {0:?} has no checkpoints")]
    EmptyThread(ThreadId),

    #[error("thread {0:?} already exists")]
    ThreadExists(ThreadId),

    #[error("checkpoint prefix {prefix:?} is ambiguous: {} match", candidates.len())]
    Ambiguous {
        prefix: String,
        candidates: Vec<CheckpointId>,
    },

    #[error(
        "head of thread {thread:?} moved: expected {}, found {}",
        show_head(expected),
        show_head(actual)
    )]
    HeadMismatch {
        thread: ThreadId,
        expected: Option<CheckpointId>,
        actual: Option<CheckpointId>,
    },

    #[error(
        "thread {thread:?} is held by writer {holder:?} until {}",
        show_time(until)
    )]
    LeaseHeld {
        thread: ThreadId,
        holder: String,
        until: SystemTime,
    },

    #[error("writer lease on thread {thread:?} (token {token}) was lost: {detail}")]
    LeaseLost {
        thread: ThreadId,
        token: u64,
        detail: String,
    },

    #[error(
        "writer lease on thread {thread:?} (token {token}) expired at {}",
        show_time(expired_at)
    )]
    LeaseExpired {
        thread: ThreadId,
        token: u64,
        expired_at: SystemTime,
    },

    #[error("corrupt checkpoint record {id}: {detail}")]
    Corrupt { id: String, detail: String },

    #[error("invalid input: {0}")]
    Invalid(String),

    /// A capture filter refused what it was given (a secret in a name, say).
    #[error("capture refused: {0}")]
    Refused(String),

    #[error("{path}: {detail}")]
    Path { path: PathBuf, detail: String },

    #[error(transparent)]
    Cas(#[from] CasError),
}

impl CheckpointError {
    pub fn io(path: impl Into<PathBuf>, e: std::io::Error) -> CheckpointError {
        CheckpointError::Cas(CasError::io(path, e))
    }

    pub fn path(path: impl Into<PathBuf>, detail: impl Into<String>) -> CheckpointError {
        CheckpointError::Path {
            path: path.into(),
            detail: detail.into(),
        }
    }
}

pub type CheckpointResult<T> = Result<T, CheckpointError>;
