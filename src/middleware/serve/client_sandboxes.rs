//! What the API keeps with a sandbox a client made (`POST /v1/sandboxes`): its thread,
//! its file events, their watcher and the requests waiting for them, and where its
//! processes may go ([`ApiSandbox`]). It is attached to the provider's live entry of
//! the sandbox, the one owner of its lifetime (`provider::live`), not kept in a map of
//! the server's: whatever ends the sandbox (a `DELETE`, a run's end, eviction, reaping,
//! the server stopping) drops it too, which stops its watcher and wakes its waiters.
//! Beside it, the lock a key's sandbox is made under ([`ApiSandboxes::making`]).

use crate::sys::Locked;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::event_ring::EventRing;
use crate::checkpoint::ThreadId;
use crate::middleware::events::{FileEvents, Watcher};
use crate::middleware::provider::live::{KeyGuard, KeyLocks};
use crate::middleware::provider::{SandboxHandle, SandboxProvider, WeakSandboxHandle};

/// What the API keeps with a sandbox made through it: its thread and its file events.
pub(super) struct ApiSandbox {
    pub(super) thread: ThreadId,
    pub(super) events: Arc<Mutex<EventRing>>,
    /// Woken at every event, and when the sandbox goes, for requests waiting.
    pub(super) notify: Arc<tokio::sync::Notify>,
    /// Set when the sandbox is gone (destroyed, evicted, the server stopping).
    pub(super) gone: Arc<AtomicBool>,
    /// The sandbox watched (weak: watching keeps no sandbox in use).
    pub(super) handle: WeakSandboxHandle,
    /// Where its events go.
    pub(super) cfg: FileEvents,
    /// Its watcher, once started (at creation, or at the first events request).
    pub(super) watcher: Arc<Mutex<Option<Watcher>>>,
    /// Where its processes may go, when it asked for less than the server allows.
    pub(super) network: Mutex<Option<Vec<crate::middleware::isolate::proxy::Allowed>>>,
}

/// Runs when the sandbox's entry goes (or, had it gone during a create that attached
/// this, when that create lets go of it).
impl Drop for ApiSandbox {
    fn drop(&mut self) {
        self.gone.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// The API's sandboxes: what it attached to the provider's entries, found by key.
pub(super) struct ApiSandboxes {
    provider: Arc<dyn SandboxProvider>,
    /// Held while a sandbox of the key is being made or taken by a run, so that a
    /// `DELETE` at that moment waits for it rather than finding it held.
    making: KeyLocks,
}

impl ApiSandboxes {
    pub(super) fn new(provider: Arc<dyn SandboxProvider>) -> ApiSandboxes {
        ApiSandboxes {
            provider,
            making: KeyLocks::default(),
        }
    }

    /// `f` of what the API keeps with live sandbox `key`, if it was made through the
    /// API: run under the provider's lock, so `f` only takes copies of parts. Nothing
    /// but the sandbox's entry holds the whole, so it goes (its watcher joined, its
    /// waiters woken) where the sandbox ends, never in a request that looked at it.
    pub(super) fn with<R>(&self, key: &str, f: impl FnOnce(&ApiSandbox) -> R) -> Option<R> {
        let mut f = Some(f);
        let mut out = None;
        self.provider.with_attached(key, &mut |x| {
            if let (Some(a), Some(f)) = (x.downcast_ref::<ApiSandbox>(), f.take()) {
                out = Some(f(a));
            }
        });
        out
    }

    /// What the API keeps with live sandbox `h`: what it kept already (resumed), or
    /// what `make` makes, attached now. None: the sandbox went meanwhile. (For a
    /// blocking caller: should the sandbox end meanwhile, its drop may fall to it.)
    pub(super) fn attach(
        &self,
        h: &SandboxHandle,
        make: impl FnOnce() -> ApiSandbox,
    ) -> Option<Arc<ApiSandbox>> {
        let mut make = Some(make);
        let mut made =
            || -> crate::middleware::Extras { Arc::new(make.take().expect("made once")()) };
        self.provider.attach(h, &mut made)?.downcast().ok()
    }

    /// Where sandbox `key`'s processes may go, when it narrowed the server's list.
    pub(super) fn network(
        &self,
        key: &str,
    ) -> Option<Vec<crate::middleware::isolate::proxy::Allowed>> {
        self.with(key, |a| a.network.locked().clone()).flatten()
    }

    /// The keys of the live sandboxes made through the API.
    pub(super) fn keys(&self) -> HashSet<String> {
        self.provider.attached_keys()
    }

    /// Waits until no sandbox of `key` is being made, and keeps others from making one
    /// until the guard is dropped.
    pub(super) fn making(&self, key: &str) -> KeyGuard<'_> {
        self.making.lock(key)
    }
}
