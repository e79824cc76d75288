//! `LeaseKeeper`: a writer lease renewed in the background, through any
//! [`CheckpointStore`].

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::SystemTime;

use super::checkpoint_store::CheckpointStore;
use super::ids::{CheckpointError, CheckpointResult, ThreadId};
use super::lease::WriterLease;
use crate::sys::Locked;

/// A writer lease renewed in the background at its `renew_after` until closed: the one
/// lease renewer of casfs (captures, mount checkpoints, agent runs). Renewal that fails
/// means another writer may have the thread: the lease is then lost, and reported as
/// such every time it is asked for, never silently renewed again.
pub struct LeaseKeeper {
    shared: Arc<(Mutex<KeeperState>, Condvar)>,
    store: Arc<dyn CheckpointStore>,
    renewer: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct KeeperState {
    lease: Option<WriterLease>,
    /// Closed by its owner: it will not be used to publish.
    closed: bool,
    /// Renewal failed: someone else may have the thread now.
    lost: Option<Lost>,
    /// Renewal stopped as if the process had stalled ([`LeaseKeeper::stall`]).
    stalled: bool,
}

/// A lease that could not be renewed, kept to report it as often as it is asked for.
#[derive(Clone)]
struct Lost {
    thread: ThreadId,
    token: u64,
    detail: String,
}

impl Lost {
    fn error(&self) -> CheckpointError {
        CheckpointError::LeaseLost {
            thread: self.thread.clone(),
            token: self.token,
            detail: self.detail.clone(),
        }
    }
}

/// What a [`LeaseKeeper`] holds now.
pub enum LeaseStatus {
    /// The lease, as last renewed.
    Held(WriterLease),
    /// Closed by its owner (released, or about to be).
    Closed,
    /// Renewal failed: the error saying so (`LeaseLost`).
    Lost(CheckpointError),
}

impl LeaseKeeper {
    /// Starts renewing `lease` (taken from `store`).
    pub fn start(store: Arc<dyn CheckpointStore>, lease: WriterLease) -> LeaseKeeper {
        let shared = Arc::new((
            Mutex::new(KeeperState {
                lease: Some(lease),
                ..KeeperState::default()
            }),
            Condvar::new(),
        ));
        let (sh, st) = (shared.clone(), store.clone());
        let renewer = std::thread::Builder::new()
            .name("casfs-lease".into())
            .spawn(move || renew_loop(&sh, st.as_ref()))
            .expect("spawning the lease renewer");
        LeaseKeeper {
            shared,
            store,
            renewer: Mutex::new(Some(renewer)),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KeeperState> {
        self.shared.0.locked()
    }

    pub fn status(&self) -> LeaseStatus {
        let st = self.state();
        if let Some(lost) = &st.lost {
            return LeaseStatus::Lost(lost.error());
        }
        match (&st.lease, st.closed) {
            (Some(l), false) => LeaseStatus::Held(l.clone()),
            _ => LeaseStatus::Closed,
        }
    }

    /// The lease to append with: an error if it was lost or closed.
    pub fn held(&self) -> CheckpointResult<WriterLease> {
        match self.status() {
            LeaseStatus::Held(l) => Ok(l),
            LeaseStatus::Lost(e) => Err(e),
            LeaseStatus::Closed => Err(CheckpointError::Invalid(
                "the writer lease was closed".into(),
            )),
        }
    }

    /// Stops renewing without giving the lease up, as a stalled process (a paused VM, a
    /// long GC) would: once its TTL has passed, another writer may take the thread and
    /// an append with it is refused. For failure drills and tests.
    pub fn stall(&self) {
        self.stop_renewing(|st| st.stalled = true);
    }

    /// Marks the state (closed, stalled), wakes the renewer so it sees that, and waits
    /// for it to end.
    fn stop_renewing(&self, mark: impl FnOnce(&mut KeeperState)) {
        mark(&mut self.state());
        self.shared.1.notify_all();
        let renewer = self.renewer.locked().take();
        if let Some(t) = renewer {
            let _ = t.join();
        }
    }

    /// Stops renewing and releases the lease (once; later calls do nothing). A lease
    /// that was lost is not released (it is someone else's) and is the error.
    pub fn close(&self) -> CheckpointResult<()> {
        // After the renewer stopped, the state holds the freshest lease.
        self.stop_renewing(|st| st.closed = true);
        let (lease, lost) = {
            let mut st = self.state();
            (st.lease.take(), st.lost.clone())
        };
        if let Some(lost) = lost {
            return Err(lost.error());
        }
        match lease {
            Some(l) => self.store.release(&l),
            None => Ok(()),
        }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!("releasing the writer lease: {e}");
        }
    }
}

fn renew_loop(shared: &(Mutex<KeeperState>, Condvar), store: &dyn CheckpointStore) {
    let (lock, cvar) = shared;
    let mut st = lock.locked();
    loop {
        let Some(lease) = st.lease.clone() else {
            return;
        };
        if st.closed || st.stalled {
            return;
        }
        let wait = lease
            .renew_after()
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        if !wait.is_zero() {
            st = cvar
                .wait_timeout(st, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        drop(st);
        let renewed = store.renew(&lease);
        st = lock.locked();
        if st.closed {
            // Closed while renewing: leave the freshest lease to release.
            if let Ok(l) = renewed {
                st.lease = Some(l);
            }
            return;
        }
        match renewed {
            Ok(l) => st.lease = Some(l),
            Err(e) => {
                tracing::warn!(thread = %lease.thread, "writer lease lost: {e}");
                st.lost = Some(Lost {
                    thread: lease.thread.clone(),
                    token: lease.token,
                    detail: format!("renewing it failed: {e}"),
                });
                st.lease = None;
                return;
            }
        }
    }
}
