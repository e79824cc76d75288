//! What a provider of sandboxes is ([`SandboxProvider`]), and what every provider keeps
//! of its sandboxes ([`Kept`]), which the trait's methods answer from.
//!
//! The provider owns each sandbox's lifetime, from `ensure` to the end that takes its
//! live entry out (`super::live`); users keep what they need with a sandbox on its
//! entry ([`SandboxProvider::attach`]) rather than in maps of their own by key, so that
//! it goes when the sandbox goes.

use std::sync::Arc;
use std::time::Duration;

use super::handle::{EnsureOutcome, SandboxHandle};
use super::keys::sandbox_key;
use super::live::{Extras, KeyLocks, Live};
use crate::middleware::context::RunContext;
use crate::middleware::error::MiddlewareResult;
use crate::middleware::secrets::Secrets;

/// What every provider keeps of its sandboxes, and the one place their lifetime is
/// decided: the live ones (capped in all and per tenant), each entry the owner of its
/// sandbox and of the extras its users attached; a lock per key (held while a key's
/// sandbox is made, resumed or destroyed); and the isolation of their processes, by
/// key (`isolate::Jails`, which starts one without holding the live map), ended by
/// every end of a sandbox before its workspace goes.
#[derive(Default)]
pub struct Kept {
    pub(crate) live: Live,
    pub(crate) keys: KeyLocks,
    pub(crate) jails: Arc<crate::middleware::isolate::Jails>,
}

pub trait SandboxProvider: Send + Sync {
    /// The sandbox key of a run (default: [`sandbox_key`] of its tenant and thread).
    fn key(&self, ctx: &RunContext) -> String {
        sandbox_key(ctx.tenant.as_deref(), &ctx.thread)
    }

    /// The run's sandbox: the live one of its key, or a new one. A new sandbox holds
    /// nothing that was not checkpointed (a provider cleans what an earlier sandbox of
    /// the key left). `secrets` are the workspace's: see [`SandboxProvider::destroy`].
    fn ensure(
        &self,
        ctx: &RunContext,
        secrets: &Secrets,
    ) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)>;

    /// Tears the sandbox down and discards its uncaptured work, so that nothing of it
    /// reaches a later sandbox of the key. Whatever of it held one of `secrets`
    /// (names, link targets, attributes kept in the store's records) is purged from
    /// the store's files.
    fn destroy(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<()>;

    /// [`SandboxProvider::destroy`] of a sandbox nobody holds (no run, no capture in
    /// progress): one that is held is refused (`SandboxBusy`) and kept. Checked and
    /// done under the key's lock, so a run that takes the sandbox meanwhile either
    /// holds it before (refused) or gets a new one after. Returns whether a live
    /// sandbox was destroyed (of two callers at once, one is told `true`).
    fn destroy_unheld(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<bool>;

    /// What this provider keeps of its sandboxes ([`Kept`]): the methods below answer
    /// from it. None: it keeps nothing itself (they answer that nothing is live).
    fn kept(&self) -> Option<&Kept> {
        None
    }

    /// Notes that sandbox `key` was used now (a client asked about it): the least
    /// recently used idle sandbox is the first made room for at the cap.
    fn touch(&self, key: &str) {
        if let Some(k) = self.kept() {
            k.live.touch(key);
        }
    }

    /// The isolation of its sandboxes' processes (`middleware::isolate`): ended before
    /// a sandbox's workspace goes.
    fn jails(&self) -> Option<&Arc<crate::middleware::isolate::Jails>> {
        self.kept().map(|k| &k.jails)
    }

    /// The live sandboxes this provider holds, as handles that look at them without
    /// holding them ([`SandboxHandle::look`]).
    fn live(&self) -> Vec<SandboxHandle> {
        self.kept().map(|k| k.live.handles()).unwrap_or_default()
    }

    /// What a user keeps with live sandbox `h` (that very sandbox, not an earlier or
    /// later one of its key): the extras attached to it, or, if it has none, those
    /// `make` makes, attached now. They are dropped when the sandbox ends, however it
    /// ends. None: it is no longer live, or this provider keeps nothing itself.
    fn attach(&self, h: &SandboxHandle, make: &mut dyn FnMut() -> Extras) -> Option<Extras> {
        self.kept()?.live.attach(h, make)
    }

    /// Calls `f` with the extras attached to live sandbox `key`, if any, under the
    /// provider's lock: `f` takes what it needs of them, quickly, and holds on to none
    /// of them, so that they go when the sandbox goes, where it goes.
    fn with_attached(&self, key: &str, f: &mut dyn FnMut(&Extras)) {
        if let Some(k) = self.kept() {
            k.live.with_attached(key, f)
        }
    }

    /// The keys of the live sandboxes that have extras attached.
    fn attached_keys(&self) -> std::collections::HashSet<String> {
        self.kept()
            .map(|k| k.live.attached_keys())
            .unwrap_or_default()
    }

    /// Live sandbox `key`, held while the handle returned lives (a capture of it).
    fn get(&self, key: &str) -> Option<SandboxHandle> {
        self.kept()?.live.get(key)
    }

    /// Live sandbox `key`, looked at without holding it (a client's file operation in
    /// it: a DELETE meanwhile is not refused for it).
    fn look(&self, key: &str) -> Option<SandboxHandle> {
        match self.kept() {
            Some(k) => k.live.look(key),
            None => self.live().into_iter().find(|h| h.key == key),
        }
    }

    /// Cleans what sandboxes of an earlier process left behind (a server killed
    /// mid-run): mounts, uncaptured work. Live sandboxes of this one are not touched.
    /// Returns how many it cleaned.
    fn recover(&self, _secrets: &Secrets) -> MiddlewareResult<usize> {
        Ok(0)
    }

    /// Destroys the sandboxes no run has held for `idle` (a server's reaper calls it
    /// every second at most), but those `spare` says to keep. Returns how many.
    fn reap_idle(
        &self,
        _idle: Duration,
        _secrets: &Secrets,
        _spare: &dyn Fn(&str) -> bool,
    ) -> MiddlewareResult<usize> {
        Ok(0)
    }

    /// Destroys every live sandbox (a server stopping): tries each, reports the first
    /// failure.
    fn destroy_all(&self, secrets: &Secrets) -> MiddlewareResult<()> {
        let mut first = Ok(());
        for h in self.live() {
            if let Err(e) = self.destroy(&h.key, secrets) {
                tracing::warn!("destroying sandbox {:?}: {e}", h.key);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// Whether discarding a sandbox must purge the store's files of its records: whenever
/// there are secrets, since its names, link targets and attributes may have held one.
pub(super) fn purge(secrets: &Secrets) -> bool {
    !secrets.is_empty()
}
