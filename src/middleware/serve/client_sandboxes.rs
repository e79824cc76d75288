//! The sandboxes clients made through the API, by key: each with its thread, its file
//! events and their watcher, and where its processes may go; and the lock a key's
//! sandbox is made under.

use crate::sys::Locked;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::event_ring::EventRing;
use crate::checkpoint::ThreadId;
use crate::middleware::events::{FileEvents, Watcher};
use crate::middleware::provider::live::{KeyGuard, KeyLocks};
use crate::middleware::provider::{SandboxHandle, WeakSandboxHandle};

/// A sandbox made through the API: its thread and its file events.
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
    pub(super) network: Option<Vec<crate::middleware::isolate::proxy::Allowed>>,
}

impl Drop for ApiSandbox {
    fn drop(&mut self) {
        self.gone.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// The API's sandboxes, by key.
#[derive(Default)]
pub(super) struct ApiSandboxes {
    map: Mutex<HashMap<String, ApiSandbox>>,
    /// Held while a sandbox of the key is being made or taken by a run, so that a
    /// `DELETE` at that moment waits for it rather than finding it held.
    making: KeyLocks,
}

impl ApiSandboxes {
    /// Where sandbox `key`'s processes may go, when it narrowed the server's list.
    pub(super) fn network(
        &self,
        key: &str,
    ) -> Option<Vec<crate::middleware::isolate::proxy::Allowed>> {
        self.lock().get(key).and_then(|a| a.network.clone())
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ApiSandbox>> {
        self.map.locked()
    }

    /// Waits until no sandbox of `key` is being made, and keeps others from making one
    /// until the guard is dropped.
    pub(super) fn making(&self, key: &str) -> KeyGuard<'_> {
        self.making.lock(key)
    }

    /// Forgets sandboxes that are no longer live (reaped, destroyed by a run's end);
    /// their watchers stop.
    pub(super) fn retain_live(&self, live: &[SandboxHandle]) {
        let gone: Vec<ApiSandbox> = {
            let mut m = self.lock();
            let keys: Vec<String> = m
                .keys()
                .filter(|k| !live.iter().any(|h| &h.key == *k))
                .cloned()
                .collect();
            keys.into_iter().filter_map(|k| m.remove(&k)).collect()
        };
        // Watchers are joined outside the lock.
        drop(gone);
    }

    pub(super) fn contains(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    pub(super) fn clear(&self) {
        let all: Vec<ApiSandbox> = self.lock().drain().map(|(_, v)| v).collect();
        drop(all);
    }
}
