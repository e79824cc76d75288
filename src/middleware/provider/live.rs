//! The live sandboxes of a provider: each with when a run last took it, and limits on
//! how many there may be, in all and of one tenant. Idle sandboxes (no run holds them)
//! make room, least recently used first, and are reaped after an idle timeout; a
//! provider destroys what is evicted. Room is made only among the sandboxes of the
//! tenant asking for one: one tenant's load never destroys another's work (at the cap
//! of all, a tenant with nothing idle of its own is refused).
//!
//! The live map's [`Entry`] is the one owner of a sandbox's lifetime: made by the
//! provider's `ensure`, it ends when the provider takes it out of the map (destroy,
//! a `DELETE`'s `destroy_unheld`, eviction to make room, idle reaping, the server
//! stopping), and nothing else keeps a sandbox alive or decides that it goes. What
//! others keep with a sandbox hangs off its entry ([`Extras`]: the API's file events,
//! their watcher and waiters, its network) and is dropped with it, after the provider
//! has ended its processes and discarded its workspace, outside the map's lock.

use crate::sys::Locked;
use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::handle::SandboxHandle;
use crate::middleware::error::{MiddlewareError, MiddlewareResult};

/// What a user of the provider keeps with one live sandbox (the server's API: its
/// events and their watcher): attached to the sandbox's [`Entry`]
/// ([`Live::attach`]) and dropped when the sandbox ends. Any type: the provider knows
/// nothing of its users' (`middleware::serve` is above it).
pub type Extras = Arc<dyn Any + Send + Sync>;

/// A live sandbox: the owner of its lifetime, and of everything kept with it.
pub(crate) struct Entry {
    pub handle: SandboxHandle,
    /// When a run last took it (or it was made).
    pub used: Instant,
    /// What a user keeps with it, gone with it.
    pub extras: Option<Extras>,
}

impl Entry {
    /// A sandbox made now.
    pub fn new(handle: SandboxHandle) -> Entry {
        Entry {
            handle,
            used: Instant::now(),
            extras: None,
        }
    }
}

#[derive(Default)]
pub(crate) struct Live {
    map: Mutex<HashMap<String, Entry>>,
    /// The most live sandboxes (0: no limit).
    max: AtomicUsize,
    /// The most of one tenant (0: no limit); administrators' sandboxes are held only
    /// to `max`.
    max_per_tenant: AtomicUsize,
}

pub(crate) type LiveMap = HashMap<String, Entry>;

impl Live {
    pub fn lock(&self) -> MutexGuard<'_, LiveMap> {
        self.map.locked()
    }

    pub fn set_max(&self, n: usize) {
        self.max.store(n, Ordering::Relaxed);
    }

    pub fn set_max_per_tenant(&self, n: usize) {
        self.max_per_tenant.store(n, Ordering::Relaxed);
    }

    /// Handles that look at every sandbox without holding any.
    pub fn handles(&self) -> Vec<SandboxHandle> {
        self.lock().values().map(|e| e.handle.look()).collect()
    }

    /// Sandbox `key`, held while the handle returned lives.
    pub fn get(&self, key: &str) -> Option<SandboxHandle> {
        self.lock().get(key).map(|e| e.handle.clone())
    }

    /// Sandbox `key`, looked at without holding it.
    pub fn look(&self, key: &str) -> Option<SandboxHandle> {
        self.lock().get(key).map(|e| e.handle.look())
    }

    pub fn keys(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// The extras of live sandbox `h` (that very sandbox, not another of its key),
    /// made by `make` if it has none. None: it is no longer live.
    pub fn attach(&self, h: &SandboxHandle, make: &mut dyn FnMut() -> Extras) -> Option<Extras> {
        let mut map = self.lock();
        let e = map
            .get_mut(&h.key)
            .filter(|e| e.handle.instance() == h.instance())?;
        Some(e.extras.get_or_insert_with(make).clone())
    }

    /// Calls `f` with the extras of live sandbox `key`, if it has any, under the map's
    /// lock (so that they are never held past the sandbox's end: it drops them).
    pub fn with_attached(&self, key: &str, f: &mut dyn FnMut(&Extras)) {
        if let Some(x) = self.lock().get(key).and_then(|e| e.extras.as_ref()) {
            f(x)
        }
    }

    /// The keys of the live sandboxes that have extras.
    pub fn attached_keys(&self) -> HashSet<String> {
        self.lock()
            .iter()
            .filter(|(_, e)| e.extras.is_some())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Makes room in `map` for one more sandbox of `tenant` (None: the
    /// administrators'): removes and returns that tenant's idle sandboxes, least
    /// recently used first, with their key locks taken (one whose key is locked is being
    /// changed: not idle), for the caller to destroy (and then drop), until both the cap of all and the
    /// tenant's own hold. Refused (429) when the tenant has nothing idle to give up.
    pub fn make_room<'k>(
        &self,
        map: &mut LiveMap,
        keys: &'k KeyLocks,
        tenant: Option<&str>,
    ) -> MiddlewareResult<Vec<(KeyGuard<'k>, Entry)>> {
        let max = self.max.load(Ordering::Relaxed);
        let per = match tenant {
            Some(_) => self.max_per_tenant.load(Ordering::Relaxed),
            None => 0,
        };
        let mine = |e: &Entry| e.handle.thread.tenant() == tenant;
        let mut out = Vec::new();
        let mut idle: Vec<(String, Instant)> = map
            .iter()
            .filter(|(_, e)| mine(e) && !e.handle.in_use())
            .map(|(k, e)| (k.clone(), e.used))
            .collect();
        idle.sort_by_key(|(_, used)| *used);
        let mut idle = idle.into_iter();
        loop {
            let over_all = max != 0 && map.len() >= max;
            let over_mine = per != 0 && map.values().filter(|e| mine(e)).count() >= per;
            if !over_all && !over_mine {
                return Ok(out);
            }
            let Some((k, _)) = idle.next() else {
                return Err(match (over_mine, tenant) {
                    (true, Some(t)) => MiddlewareError::TenantAtCapacity {
                        tenant: t.to_string(),
                        limit: per,
                    },
                    _ => MiddlewareError::AtCapacity {
                        what: "sandboxes",
                        limit: max,
                    },
                });
            };
            if let Some(g) = keys.try_lock(&k) {
                let e = map.remove(&k).expect("listed above");
                out.push((g, e));
            }
        }
    }

    /// Notes that sandbox `key` was used now.
    pub fn touch(&self, key: &str) {
        if let Some(e) = self.lock().get_mut(key) {
            e.used = Instant::now();
        }
    }

    /// Takes sandbox `key` out of the map unless someone holds it (see
    /// [`take_unheld_from`]).
    pub fn take_unheld(&self, key: &str) -> MiddlewareResult<Option<Entry>> {
        take_unheld_from(&mut self.lock(), key)
    }

    /// Removes and returns the sandboxes no run has held for `idle`, but those `spare`
    /// keeps. Called often (a server's reaper: every second at most), it also notes
    /// when each sandbox in use was last seen so, which is when its idle time starts.
    pub fn idle<'k>(
        &self,
        map: &mut LiveMap,
        keys: &'k KeyLocks,
        idle: Duration,
        spare: &dyn Fn(&str) -> bool,
    ) -> Vec<(KeyGuard<'k>, Entry)> {
        let now = Instant::now();
        for e in map.values_mut() {
            if e.handle.in_use() {
                e.used = now;
            }
        }
        let stale: Vec<String> = map
            .iter()
            .filter(|(k, e)| now.duration_since(e.used) >= idle && !spare(k))
            .map(|(k, _)| k.clone())
            .collect();
        stale
            .into_iter()
            .filter_map(|k| {
                let g = keys.try_lock(&k)?;
                map.remove(&k).map(|e| (g, e))
            })
            .collect()
    }
}

/// Takes sandbox `key` out of `map` unless someone besides the provider holds it (a
/// run, a capture in progress): that is refused, naming the key, and the sandbox stays.
pub(crate) fn take_unheld_from(map: &mut LiveMap, key: &str) -> MiddlewareResult<Option<Entry>> {
    match map.get(key) {
        None => Ok(None),
        Some(e) if e.handle.in_use() => Err(MiddlewareError::SandboxBusy {
            key: key.to_string(),
            detail: "a run holds it (or a capture of it is going on): end the run first; \
                     the sandbox is kept"
                .into(),
        }),
        Some(_) => Ok(map.remove(key)),
    }
}

/// Per-key locks: every change to the sandbox of one key (make, resume, destroy, reap)
/// holds its key's lock, so that changes of different keys (a mount takes tens of
/// milliseconds) run at once while those of one key never overlap.
#[derive(Default)]
pub(crate) struct KeyLocks {
    held: Mutex<HashSet<String>>,
    freed: Condvar,
}

/// A held key lock, given back when dropped.
pub(crate) struct KeyGuard<'a> {
    locks: &'a KeyLocks,
    key: String,
}

impl KeyLocks {
    fn held(&self) -> MutexGuard<'_, HashSet<String>> {
        self.held.locked()
    }

    /// Waits for `key` and takes it.
    pub fn lock(&self, key: &str) -> KeyGuard<'_> {
        let mut held = self.held();
        while held.contains(key) {
            held = self.freed.wait(held).unwrap_or_else(|p| p.into_inner());
        }
        held.insert(key.to_string());
        KeyGuard {
            locks: self,
            key: key.to_string(),
        }
    }

    /// Takes `key` if nobody holds it.
    pub fn try_lock(&self, key: &str) -> Option<KeyGuard<'_>> {
        let mut held = self.held();
        if held.contains(key) {
            return None;
        }
        held.insert(key.to_string());
        Some(KeyGuard {
            locks: self,
            key: key.to_string(),
        })
    }
}

impl KeyGuard<'_> {
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        self.locks.held().remove(&self.key);
        self.locks.freed.notify_all();
    }
}
