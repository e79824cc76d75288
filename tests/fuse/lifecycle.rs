//! Lifecycle paths of the middleware that no other test drives, as a host using the
//! library would: destroy on complete, snapshots switched off, a run whose persistence
//! never completes, a run that outlives several lease TTLs, and a capture error that
//! wins over a cleanup error.

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use casfs::middleware::{
    CasfsProvider, EnsureOutcome, MiddlewareConfig, MiddlewareError, MiddlewareResult,
    RunCompletion, RunContext, SandboxHandle, SandboxProvider, Secrets, SnapshotPolicy,
};

use crate::middleware::{host, host_with, lease_is_free, mem_persistence, open_store};

#[test]
fn destroy_on_complete_discards_the_sandbox_and_the_next_run_starts_at_the_head() {
    let (_t, h) = host(|c| c.lifecycle.destroy_on_complete = true);
    let run = h.setup("t", "r1").unwrap();
    let root = run.sandbox().unwrap().root;
    fs::write(root.join("kept.txt"), "published").unwrap();
    let out = run.on_finish().unwrap();
    assert!(out.checkpoint.is_some());
    assert!(
        !casfs::fs::is_fuse_mount(&root),
        "destroyed after the finish"
    );
    assert!(h.provider.live().is_empty());
    let mounts = h.store.root().join("mounts");
    let left: Vec<_> = fs::read_dir(&mounts)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "the sandbox's files in the store: {left:?}"
    );
    let run = h.setup("t", "r2").unwrap();
    assert_eq!(
        fs::read_to_string(run.sandbox().unwrap().root.join("kept.txt")).unwrap(),
        "published"
    );
    run.on_finish().unwrap();
}

#[test]
fn without_snapshots_runs_take_no_lease_and_publish_nothing() {
    let (_t, h) = host(|c| c.snapshots = None);
    // No persistence needed, and nothing holds the thread.
    let run = h.mw.setup(h.ctx("t", "r1"), None).unwrap();
    assert!(run.lease().is_none());
    assert!(lease_is_free(&h.store, "t"));
    let root = run.sandbox().unwrap().root;
    fs::write(root.join("f"), "x").unwrap();
    let out = run.on_finish().unwrap();
    assert_eq!(out.checkpoint, None);
    assert_eq!(h.head("t"), None);
    // The sandbox stays live for the next run, with its files.
    let run = h.mw.setup(h.ctx("t", "r2"), None).unwrap();
    assert_eq!(
        fs::read_to_string(run.sandbox().unwrap().root.join("f")).unwrap(),
        "x"
    );
}

/// A host whose runs never signal that their persistence completed.
struct NeverCompletes;

impl RunCompletion for NeverCompletes {
    fn wait_for_run_completion(&self, run: &str, timeout: Duration) -> MiddlewareResult<()> {
        std::thread::sleep(timeout);
        Err(MiddlewareError::Persistence(format!(
            "run {run} did not complete within {timeout:?}"
        )))
    }
}

#[test]
fn a_run_that_never_completes_publishes_nothing_and_lets_the_thread_go() {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let (_mem, mut p) = mem_persistence();
    p.completion = Some(Arc::new(NeverCompletes));
    let h = host_with(store, p, |c| {
        c.snapshots.as_mut().unwrap().completion_timeout = Duration::from_millis(300)
    });
    let run = h.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "x").unwrap();
    let e = run.on_finish().unwrap_err();
    assert!(matches!(e, MiddlewareError::Persistence(_)), "{e}");
    assert_eq!(h.head("t"), None);
    assert!(lease_is_free(&h.store, "t"));
}

#[test]
fn a_run_outliving_several_lease_ttls_still_publishes() {
    let (_t, h) = host(|c| c.snapshots.as_mut().unwrap().lease_ttl = Duration::from_millis(300));
    let run = h.setup("t", "r1").unwrap();
    let first = run.lease().unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "x").unwrap();
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !lease_is_free(&h.store, "t"),
            "renewed: nobody else can take it"
        );
    }
    let renewed = run.lease().unwrap();
    assert_eq!(
        renewed.token, first.token,
        "renewal keeps the fencing token"
    );
    assert!(renewed.expires_at_ms > first.expires_at_ms + 600);
    let out = run.on_finish().unwrap();
    assert_eq!(h.head("t"), out.checkpoint);
    assert!(out.checkpoint.is_some());
}

/// A casfs provider whose destroy fails after doing its work (a cleanup error).
struct FailingDestroy(Arc<CasfsProvider>);

impl SandboxProvider for FailingDestroy {
    fn ensure(
        &self,
        ctx: &RunContext,
        secrets: &Secrets,
    ) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)> {
        self.0.ensure(ctx, secrets)
    }

    fn destroy(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<()> {
        self.0.destroy(key, secrets)?;
        Err(MiddlewareError::Sandbox {
            key: key.into(),
            detail: "cleanup failed".into(),
        })
    }

    fn destroy_unheld(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<bool> {
        self.0.destroy_unheld(key, secrets)
    }
}

#[test]
fn a_capture_error_wins_over_a_cleanup_error() {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let provider = Arc::new(FailingDestroy(Arc::new(CasfsProvider::new(
        store.clone(),
        &t.path().join("sb"),
        Default::default(),
    ))));
    let (_mem, p) = mem_persistence();
    let mut snap = casfs::middleware::SnapshotConfig::new(p.clone());
    snap.policy = SnapshotPolicy {
        max_file_size: Some(10),
        oversize: casfs::middleware::Oversize::Fail,
        ..Default::default()
    };
    let config = MiddlewareConfig {
        snapshots: Some(snap),
        lifecycle: casfs::middleware::Lifecycle {
            destroy_on_complete: true,
            destroy_on_error: false,
        },
        file_events: None,
    };
    let mw = Arc::new(casfs::middleware::Middleware::new(store.clone(), provider, config).unwrap());
    let ctx = |run: &str| RunContext::new(casfs::checkpoint::ThreadId::new("t").unwrap(), run);
    let _g = crate::MountGuard::new(&t.path().join("sb/t/workspace"));
    // The capture fails (an oversize file with oversize=fail) and so does the destroy:
    // the capture's error is the one reported.
    let run = mw.setup(ctx("r1"), Some(&p)).unwrap();
    fs::write(run.sandbox().unwrap().root.join("big"), [0u8; 100]).unwrap();
    let e = run.on_finish().unwrap_err();
    assert!(matches!(e, MiddlewareError::Policy(_)), "{e}");
    assert!(lease_is_free(&store, "t"));
    // Without a capture error, the cleanup error is the run's.
    let run = mw.setup(ctx("r2"), Some(&p)).unwrap();
    fs::write(run.sandbox().unwrap().root.join("small"), "ok").unwrap();
    let e = run.on_finish().unwrap_err();
    assert!(matches!(e, MiddlewareError::Sandbox { .. }), "{e}");
    assert!(
        store
            .checkpoints()
            .head(&ctx("x").thread)
            .unwrap()
            .is_some(),
        "published first"
    );
    assert!(lease_is_free(&store, "t"));
}
