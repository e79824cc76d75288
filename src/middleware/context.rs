//! What a run is: its thread, id, tenant, owner and cancellation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::checkpoint::ThreadId;
use crate::fs::Owner;

/// A run's cancellation flag, shared with whoever may cancel it.
#[derive(Debug, Clone, Default)]
pub struct Cancellation(Arc<AtomicBool>);

impl Cancellation {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One agent run on a conversation thread.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub thread: ThreadId,
    pub run_id: String,
    pub tenant: Option<String>,
    /// Whose workspace a sandbox this run makes is (its files and root theirs, the
    /// mount open to them): `casfs serve` names the caller on its Unix socket. None:
    /// this process's own user.
    pub owner: Option<Owner>,
    pub cancel: Cancellation,
}

impl RunContext {
    pub fn new(thread: ThreadId, run_id: impl Into<String>) -> RunContext {
        RunContext {
            thread,
            run_id: run_id.into(),
            tenant: None,
            owner: None,
            cancel: Cancellation::default(),
        }
    }
}
