//! Sandboxes: where a run's workspace lives. The casfs provider mounts one writable
//! workspace per sandbox key, in this process; the directory provider uses plain
//! directories (for hosts without FUSE): captured by walking them, events from inotify.
//!
//! A sandbox key names a directory: [`sandbox_key`] makes it from the tenant and thread
//! so that two different (tenant, thread) pairs never share one, whatever characters
//! they hold. Destroying a sandbox discards its uncaptured work (upper files and dirty
//! set, or the plain directory): a sandbox created later for the same key starts at the
//! thread's head, or empty. Only a sandbox resumed alive keeps what the last run left.

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

    #[test]
    fn only_holding_handles_keep_a_sandbox_from_being_destroyed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            &dir.path().join("store"),
            crate::checkpoint::OpenMode::Create,
            Duration::from_secs(5),
        )
        .unwrap();
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
}
