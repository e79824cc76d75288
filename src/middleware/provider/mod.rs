//! Sandboxes: where a run's workspace lives. The casfs provider mounts one writable
//! workspace per sandbox key, in this process; the directory provider uses plain
//! directories (for hosts without FUSE): captured by walking them, events from inotify.
//!
//! A sandbox key names a directory: [`sandbox_key`] makes it from the tenant and thread
//! so that two different (tenant, thread) pairs never share one, whatever characters
//! they hold. Destroying a sandbox discards its uncaptured work (upper files and dirty
//! set, or the plain directory): a sandbox created later for the same key starts at the
//! thread's head, or empty. Only a sandbox resumed alive keeps what the last run left.
//!
//! A provider owns each of its sandboxes' lifetime: its live entry (`live`) is the
//! sandbox, and what users keep with one ([`Extras`]) hangs off that entry and goes
//! when the provider ends it.

mod casfs;
mod dir;
mod gate;
mod handle;
mod keys;
pub(crate) mod live;
mod sandbox_provider;

pub use casfs::CasfsProvider;
pub use dir::DirProvider;
pub use handle::{DirWorkspace, EnsureOutcome, SandboxHandle, SandboxWorkspace, WeakSandboxHandle};
pub use keys::{check_tenant, sandbox_key};
pub use live::Extras;
pub use sandbox_provider::SandboxProvider;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Store, ThreadId};
    use crate::middleware::context::RunContext;
    use crate::middleware::error::MiddlewareError;
    use crate::middleware::secrets::Secrets;
    use std::sync::Arc;
    use std::time::Duration;

    fn t(s: &str) -> ThreadId {
        ThreadId::new(s).unwrap()
    }

    /// A store in a temporary directory of its own (which also holds the sandboxes).
    fn temp_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            &dir.path().join("store"),
            crate::checkpoint::OpenMode::Create,
            Duration::from_secs(5),
        )
        .unwrap();
        (dir, store)
    }

    #[test]
    fn only_holding_handles_keep_a_sandbox_from_being_destroyed() {
        let (dir, store) = temp_store();
        let p = DirProvider::new(Arc::new(store), &dir.path().join("sb"));
        let none = Secrets::default();
        let ctx = RunContext::new(t("t"), "r1");
        let (run, _) = p.ensure(&ctx, &none).unwrap();
        // A run holds it: refused, and kept.
        let busy = p.destroy_unheld(&run.key, &none).unwrap_err();
        assert!(
            matches!(busy, MiddlewareError::SandboxBusy { .. }),
            "{busy}"
        );
        drop(run);
        // A capture holds it too.
        let capture = p.get("t").unwrap();
        assert!(p.destroy_unheld("t", &none).is_err());
        drop(capture);
        // What looks does not: listings, an observer's upgraded weak handle, a look.
        let listed = p.live();
        let weak = listed[0].downgrade();
        let upgraded = weak.upgrade().unwrap();
        let looked = listed[0].look();
        assert!(p.destroy_unheld("t", &none).unwrap());
        assert!(!listed[0].root.exists());
        drop((listed, upgraded, looked));
        assert!(p.get("t").is_none());
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn what_is_attached_to_a_sandbox_goes_with_it() {
        let (dir, store) = temp_store();
        let p = DirProvider::new(Arc::new(store), &dir.path().join("sb")).with_max_sandboxes(1);
        let none = Secrets::default();
        let ctx = |thread: &str| RunContext::new(t(thread), "r");
        let (h, _) = p.ensure(&ctx("a"), &none).unwrap();
        let extras: Extras = Arc::new(1u32);
        let first = Arc::downgrade(&extras);
        let mut given = Some(extras);
        let got = p
            .attach(&h, &mut || -> Extras { given.take().unwrap() })
            .unwrap();
        assert_eq!(got.downcast_ref::<u32>(), Some(&1));
        drop(got);
        // Resumed, it keeps them: nothing new is made.
        let (again, outcome) = p.ensure(&ctx("a"), &none).unwrap();
        assert_eq!(outcome, EnsureOutcome::Resumed);
        assert!(p
            .attach(&again, &mut || -> Extras { unreachable!() })
            .is_some());
        assert_eq!(p.attached_keys().into_iter().collect::<Vec<_>>(), ["a"]);
        let old = h.look();
        drop((h, again));
        // Evicted to make room: they go with it.
        let (b, _) = p.ensure(&ctx("b"), &none).unwrap();
        assert!(first.upgrade().is_none());
        assert!(p.attached_keys().is_empty());
        // Nothing attaches through a handle of a sandbox that ended, not even to a later
        // sandbox of its key.
        assert!(p
            .attach(&old, &mut || -> Extras { Arc::new(2u32) })
            .is_none());
        drop(b);
        let (a2, _) = p.ensure(&ctx("a"), &none).unwrap();
        assert!(p
            .attach(&old, &mut || -> Extras { Arc::new(2u32) })
            .is_none());
        // Destroyed (held or not): they go with it.
        let second = Arc::downgrade(&p.attach(&a2, &mut || -> Extras { Arc::new(3u32) }).unwrap());
        let mut seen = None;
        p.with_attached("a", &mut |x| seen = x.downcast_ref::<u32>().copied());
        assert_eq!(seen, Some(3));
        p.destroy("a", &none).unwrap();
        assert!(second.upgrade().is_none());
        assert!(p.attached_keys().is_empty());
        drop((a2, old));
    }
}
