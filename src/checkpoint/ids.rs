//! What names a thread and a checkpoint (`ThreadId`, `CheckpointId`, tenants' names),
//! and the errors of the checkpoint layer, each naming the thread, checkpoint or lease
//! involved: the vocabulary every other module of the layer uses.

use std::fmt;
use std::path::PathBuf;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::cas::CasError;

crate::typed_id!(
    /// A checkpoint: the blake3 hash of its record's canonical JSON (without the id).
    CheckpointId,
    "checkpoint"
);

/// A thread: a line of checkpoints with one head (for example one conversation).
///
/// A thread is the store's administrators' (`main`), or a tenant's (`alice/main`: the
/// tenant, one '/', the name): `casfs serve` puts every thread a tenant names in the
/// tenant's space, so no tenant reaches another's (docs/middleware.md, "Trust model").
/// A name itself never holds a '/', so the two kinds never meet.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ThreadId(String);

/// The longest tenant name.
pub const MAX_TENANT_LEN: usize = 64;

/// Checks a tenant's name: 1 to 64 of `A-Z a-z 0-9 _ . -`, not starting with '.' or
/// '-' (a Unix user's name, or the name a TCP token is given).
pub fn check_tenant_name(name: &str) -> CheckpointResult<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TENANT_LEN
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CheckpointError::Invalid(format!(
            "tenant name {name:?}: use 1 to {MAX_TENANT_LEN} of A-Z a-z 0-9 _ . -, not starting \
             with '.' or '-'"
        )))
    }
}

impl ThreadId {
    /// The longest name (a tenant's thread adds the tenant and a '/').
    pub const MAX_LEN: usize = 200;

    /// A thread: a name (1 to 200 bytes of printable characters, no whitespace, '/'
    /// or '~', not starting with '@'), or `tenant/name`, a tenant's thread.
    pub fn new(name: &str) -> CheckpointResult<ThreadId> {
        match name.split_once('/') {
            Some((tenant, local)) => ThreadId::in_tenant(tenant, local),
            None => {
                check_name(name)?;
                Ok(ThreadId(name.to_string()))
            }
        }
    }

    /// Thread `name` of tenant `tenant` (`tenant/name`); `name` is a plain name.
    pub fn in_tenant(tenant: &str, name: &str) -> CheckpointResult<ThreadId> {
        check_tenant_name(tenant)?;
        check_name(name)?;
        Ok(ThreadId(format!("{tenant}/{name}")))
    }

    /// The tenant whose thread this is (None: the administrators').
    pub fn tenant(&self) -> Option<&str> {
        self.0.split_once('/').map(|(t, _)| t)
    }

    /// The name without its tenant.
    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or(&self.0, |(_, n)| n)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn check_name(name: &str) -> CheckpointResult<()> {
    let ok = !name.is_empty()
        && name.len() <= ThreadId::MAX_LEN
        && !name.starts_with('@')
        && name
            .chars()
            .all(|c| !c.is_control() && !c.is_whitespace() && c != '/' && c != '~');
    if ok {
        Ok(())
    } else {
        Err(CheckpointError::Invalid(format!(
            "thread name {name:?}: use 1 to {} printable characters without whitespace, '/', '~' or a leading '@'",
            ThreadId::MAX_LEN
        )))
    }
}

impl TryFrom<String> for ThreadId {
    type Error = CheckpointError;
    fn try_from(s: String) -> CheckpointResult<ThreadId> {
        ThreadId::new(&s)
    }
}

impl From<ThreadId> for String {
    fn from(t: ThreadId) -> String {
        t.0
    }
}

impl fmt::Display for ThreadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ThreadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

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
