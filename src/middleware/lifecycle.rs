//! The run lifecycle: setup, on_chunk, on_finish, on_abort, on_error, on_disconnect.

use crate::sys::Locked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::context::RunContext;
use super::error::{MiddlewareError, MiddlewareResult};
use super::events::{FileEvents, Watcher};
use super::persistence::{ArtifactMeta, Parts, Persistence};
use super::policy::CaptureFilter;
use super::provider::{check_tenant, EnsureOutcome, SandboxHandle, SandboxProvider};
use super::publish::{Publish, Publisher, RunOutcome, SnapshotConfig};
use super::secrets::Secrets;
use crate::cas::file::read_file;
use crate::cas::FileRef;
use crate::checkpoint::{
    holder_name, Artifact, CheckpointError, LeaseKeeper, LeaseStatus, Store, WriterLease,
};

/// What happens to a sandbox when a run ends. (There is no provider snapshot after a
/// run: with casfs the published checkpoint is the snapshot.)
#[derive(Debug, Clone, Default)]
pub struct Lifecycle {
    pub destroy_on_complete: bool,
    pub destroy_on_error: bool,
}

#[derive(Clone, Default)]
pub struct MiddlewareConfig {
    pub snapshots: Option<SnapshotConfig>,
    pub lifecycle: Lifecycle,
    /// Where the run's file events go, if anywhere.
    pub file_events: Option<FileEvents>,
}

/// How long a terminal hook waits for the host to take the run's last file events.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// What a run streams that the middleware looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// The run finished streaming; `interrupt` is a pause awaiting the user.
    RunFinished {
        interrupt: bool,
    },
    Other,
}

/// Why a run was aborted: cancelled (the sandbox goes), or detached (it stays for a
/// later attach).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbortInfo {
    pub cancelled: bool,
}

/// The lifecycle middleware over one store and one sandbox provider.
pub struct Middleware {
    pub(super) store: Arc<Store>,
    pub(super) provider: Arc<dyn SandboxProvider>,
    pub(super) config: MiddlewareConfig,
    pub(super) secrets: Secrets,
    pub(super) workspace_hash: Option<String>,
}

impl Middleware {
    /// Checks the configuration: persistence parts present, secrets usable, globs valid.
    pub fn new(
        store: Arc<Store>,
        provider: Arc<dyn SandboxProvider>,
        config: MiddlewareConfig,
    ) -> MiddlewareResult<Middleware> {
        let mut secrets = Secrets::default();
        let mut workspace_hash = None;
        if let Some(s) = &config.snapshots {
            s.persistence.parts()?;
            secrets = Secrets::new(s.secrets.clone())?;
            CaptureFilter::new(&s.policy, &secrets)?;
            if s.lease_ttl < Duration::from_millis(100) {
                return Err(MiddlewareError::Config(format!(
                    "lease_ttl {:?} is too short to renew in time",
                    s.lease_ttl
                )));
            }
            workspace_hash = Some(super::policy::workspace_hash(&s.workspace));
        }
        // Whatever sandboxes of a process that died left behind holds uncaptured work
        // (and maybe secrets): gone before the first run.
        let cleaned = provider.recover(&secrets)?;
        if cleaned > 0 {
            tracing::info!("cleaned {cleaned} sandbox(es) left by an earlier process");
        }
        Ok(Middleware {
            store,
            provider,
            config,
            secrets,
            workspace_hash,
        })
    }

    /// What publishing and showing checkpoints needs of this middleware.
    pub(crate) fn publisher(&self) -> Publisher<'_> {
        Publisher {
            store: &self.store,
            secrets: &self.secrets,
            workspace_hash: self.workspace_hash.as_deref(),
            snapshots: self.config.snapshots.as_ref(),
        }
    }

    pub fn config(&self) -> &MiddlewareConfig {
        &self.config
    }

    pub fn provider(&self) -> &Arc<dyn SandboxProvider> {
        &self.provider
    }

    /// Destroys the sandboxes no run has held for `idle`, but those `spare` keeps;
    /// returns how many.
    pub fn reap_idle_sandboxes(
        &self,
        idle: Duration,
        spare: &dyn Fn(&str) -> bool,
    ) -> MiddlewareResult<usize> {
        self.provider.reap_idle(idle, &self.secrets, spare)
    }

    /// Destroys every live sandbox of the provider (a host shutting down): their
    /// uncaptured work is discarded.
    pub fn destroy_all_sandboxes(&self) -> MiddlewareResult<()> {
        self.provider.destroy_all(&self.secrets)
    }

    /// Starts a run. `persistence` is what the host's run writes through: it must be the
    /// very stores the snapshot configuration names (a capture would otherwise read a
    /// conversation the run never wrote). A thread another run holds is refused
    /// (`LeaseHeld`). Any failure releases the lease and destroys a sandbox this call
    /// created.
    pub fn setup(
        self: &Arc<Self>,
        ctx: RunContext,
        persistence: Option<&Persistence>,
    ) -> MiddlewareResult<Run> {
        self.setup_with_events(ctx, persistence, None)
    }

    /// [`Middleware::setup`] with this run's file events going to `events` instead of
    /// the configuration's.
    pub fn setup_with_events(
        self: &Arc<Self>,
        ctx: RunContext,
        persistence: Option<&Persistence>,
        events: Option<FileEvents>,
    ) -> MiddlewareResult<Run> {
        self.check_names(&ctx)?;
        let mut keeper = None;
        if let Some(s) = &self.config.snapshots {
            let theirs = persistence.ok_or_else(|| {
                MiddlewareError::Config(
                    "snapshots are configured but the run has no persistence layer".into(),
                )
            })?;
            if !s.persistence.same_as(theirs) {
                return Err(MiddlewareError::Config(
                    "the run's persistence layer is not the one the snapshot configuration \
                     names; pass the same stores to both"
                        .into(),
                ));
            }
            let lease = self.store.checkpoints().acquire_writer(
                &ctx.thread,
                &holder_name(&format!("casfs-run-{}", ctx.run_id)),
                s.lease_ttl,
            )?;
            keeper = Some(LeaseKeeper::start(self.store.checkpoints_shared(), lease));
        }
        let run = Run {
            mw: self.clone(),
            ctx,
            keeper,
            handle: Mutex::new(None),
            events: events.or_else(|| self.config.file_events.clone()),
            watcher: Mutex::new(None),
            created: AtomicBool::new(false),
            ended: AtomicBool::new(false),
        };
        match run.prepare() {
            Ok(()) => Ok(run),
            Err(e) => {
                if let Err(c) = run.close_lease() {
                    tracing::warn!("releasing the lease after a failed setup: {c}");
                }
                if run.created.load(Ordering::SeqCst) {
                    if let Err(c) = run.destroy() {
                        tracing::warn!("destroying the sandbox after a failed setup: {c}");
                    }
                }
                Err(e)
            }
        }
    }
}

impl Middleware {
    /// A run's names go into records (thread, run id) and directory names (tenant):
    /// none may hold a secret value, and the tenant must make a sandbox key.
    fn check_names(&self, ctx: &RunContext) -> MiddlewareResult<()> {
        if let Some(t) = &ctx.tenant {
            check_tenant(t).map_err(MiddlewareError::Config)?;
        }
        if ctx.run_id.is_empty() || ctx.run_id.len() > 200 {
            return Err(MiddlewareError::Config(format!(
                "run id {:?}: use 1 to 200 bytes",
                ctx.run_id
            )));
        }
        let named = [
            ("thread", Some(ctx.thread.as_str())),
            ("run id", Some(ctx.run_id.as_str())),
            ("tenant", ctx.tenant.as_deref()),
        ];
        for (what, v) in named {
            if let Some(secret) = v.and_then(|v| self.secrets.found_in(v.as_bytes())) {
                return Err(MiddlewareError::Config(format!(
                    "the run's {what} holds the value of secret {secret}; names are stored as \
                     they are, so this is refused"
                )));
            }
        }
        Ok(())
    }
}

/// One run between setup and its terminal hook. The hooks take `&self`: a disconnect
/// may come from another thread while the run is finishing.
pub struct Run {
    mw: Arc<Middleware>,
    ctx: RunContext,
    keeper: Option<LeaseKeeper>,
    handle: Mutex<Option<SandboxHandle>>,
    events: Option<FileEvents>,
    watcher: Mutex<Option<Watcher>>,
    /// This run created its sandbox (it is its to destroy on a failed setup).
    created: AtomicBool,
    ended: AtomicBool,
}

impl Run {
    pub fn context(&self) -> &RunContext {
        &self.ctx
    }

    /// The run's sandbox (none after it was destroyed).
    pub fn sandbox(&self) -> Option<SandboxHandle> {
        self.handle.locked().clone()
    }

    /// Stops renewing the writer lease without giving it up, as a stalled process (a
    /// paused VM, a long GC) would: once its TTL has passed, another writer may take the
    /// thread and this run's append is refused. For failure drills and tests.
    pub fn stall_lease_renewal(&self) {
        if let Some(k) = &self.keeper {
            k.stall();
        }
    }

    /// The writer lease as held now (none without snapshots, or once closed or lost).
    pub fn lease(&self) -> Option<WriterLease> {
        match self.keeper.as_ref()?.status() {
            LeaseStatus::Held(l) => Some(l),
            _ => None,
        }
    }

    fn cancelled(&self) -> MiddlewareResult<()> {
        if self.ctx.cancel.is_cancelled() {
            return Err(MiddlewareError::Cancelled(self.ctx.run_id.clone()));
        }
        Ok(())
    }

    /// Ensures the sandbox and, unless it was resumed alive and current, shows the head
    /// checkpoint; then starts delivering file events. The head is looked up first: a
    /// head that cannot be restored fails the run before a sandbox is made.
    fn prepare(&self) -> MiddlewareResult<()> {
        self.show_head()?;
        if let (Some(ev), Some(h)) = (&self.events, self.sandbox()) {
            let w = Watcher::start(&h, ev).map_err(|detail| MiddlewareError::Sandbox {
                key: h.key.clone(),
                detail,
            })?;
            *self.watcher.locked() = Some(w);
        }
        Ok(())
    }

    fn show_head(&self) -> MiddlewareResult<()> {
        self.cancelled()?;
        let head = match &self.mw.config.snapshots {
            Some(_) => self.mw.publisher().head_checkpoint(&self.ctx.thread)?,
            None => None,
        };
        let (handle, outcome) = self.mw.provider.ensure(&self.ctx, &self.mw.secrets)?;
        self.created
            .store(outcome != EnsureOutcome::Resumed, Ordering::SeqCst);
        *self.handle.locked() = Some(handle.clone());
        self.cancelled()?;
        let (Some(cfg), Some(cp)) = (&self.mw.config.snapshots, head) else {
            return Ok(());
        };
        if !self.mw.publisher().show_files(&handle, outcome, &cp)? {
            return Ok(());
        }
        let parts = cfg.persistence.parts()?;
        self.mw
            .publisher()
            .restore_conversation(&parts, &self.ctx.thread, cp.body.conversation)?;
        self.restore_artifacts(&parts, &cp.body.artifacts)?;
        Ok(())
    }

    /// Artifacts the checkpoint names that the host's stores lack.
    fn restore_artifacts(&self, parts: &Parts<'_>, artifacts: &[Artifact]) -> MiddlewareResult<()> {
        let have: Vec<String> = parts
            .artifacts
            .list_for_thread(&self.ctx.thread)?
            .into_iter()
            .map(|a| a.artifact_id)
            .collect();
        // The record's text was stored scrubbed: the host gets it as it was written.
        let fill = |s: &str| self.mw.secrets.fill_str(s);
        for a in artifacts {
            let key =
                a.blob_key.as_deref().map(fill).unwrap_or_else(|| {
                    format!("casfs/{}/{}", self.ctx.thread, a.content.id.to_hex())
                });
            // The size recorded is that of the blob the host has: with secrets put
            // back, not the stored (scrubbed) size.
            let size = match parts.blobs.head(&key)? {
                Some(n) => n,
                None => {
                    let bytes = read_file(self.mw.store.objects(), &FileRef::from(a.content))
                        .map_err(CheckpointError::from)?;
                    let bytes = self.mw.secrets.fill(&bytes).unwrap_or(bytes);
                    parts.blobs.put(&key, &bytes)?;
                    bytes.len() as u64
                }
            };
            let id = a
                .artifact_id
                .as_deref()
                .map(fill)
                .unwrap_or_else(|| a.content.id.to_hex());
            if !have.contains(&id) {
                parts.artifacts.put(&ArtifactMeta {
                    artifact_id: id,
                    run_id: a.run_id.as_deref().map(fill).unwrap_or_default(),
                    thread: self.ctx.thread.clone(),
                    blob_key: Some(key),
                    name: fill(&a.name),
                    mime_type: a
                        .media_type
                        .as_deref()
                        .map(fill)
                        .unwrap_or_else(|| "application/octet-stream".into()),
                    size,
                    created_at_ms: a.created_at_ms.unwrap_or(0),
                })?;
            }
        }
        Ok(())
    }

    /// A chunk of the run's stream: a run that finishes with an interrupt (a pause)
    /// closes its lease and will not publish later.
    pub fn on_chunk(&self, chunk: &Chunk) -> MiddlewareResult<()> {
        if let Chunk::RunFinished { interrupt: true } = chunk {
            self.drain_events("pause");
            self.close_lease()?;
        }
        Ok(())
    }

    /// The client went away; the run keeps executing but can no longer publish.
    pub fn on_disconnect(&self) -> MiddlewareResult<()> {
        self.close_lease()
    }

    /// The run completed: capture and publish (if it still may), then the lifecycle's
    /// provider snapshot and destroy, then release the lease. A capture error wins over
    /// a cleanup error, which is logged.
    pub fn on_finish(&self) -> MiddlewareResult<RunOutcome> {
        self.end()?;
        self.drain_events("finish");
        let lifecycle = &self.mw.config.lifecycle;
        let mut primary = None;
        let mut outcome = RunOutcome::default();
        match self.capture() {
            Ok(o) => outcome = o,
            Err(e) => primary = Some(e),
        }
        if lifecycle.destroy_on_complete {
            if let Err(c) = self.destroy() {
                match primary {
                    // A capture error wins over a cleanup error, which is logged.
                    Some(_) => {
                        tracing::warn!(run = %self.ctx.run_id, "destroy after a failed finish: {c}")
                    }
                    None => primary = Some(c),
                }
            }
        }
        let cleanup = self.close_lease();
        match (primary, cleanup) {
            (Some(p), Err(c)) => {
                tracing::warn!(run = %self.ctx.run_id, "releasing the writer lease: {c}");
                Err(p)
            }
            (Some(p), Ok(())) => Err(p),
            (None, Err(c)) => Err(c),
            (None, Ok(())) => Ok(outcome),
        }
    }

    /// The run was stopped: release the lease, then destroy the sandbox if it was
    /// cancelled or leave it for a later attach if it was detached. A lost lease is
    /// reported, after the sandbox was dealt with.
    pub fn on_abort(&self, info: AbortInfo) -> MiddlewareResult<()> {
        self.end()?;
        self.drain_events("abort");
        let release = self.close_lease();
        if info.cancelled {
            self.destroy()?;
        }
        release
    }

    /// The run failed: release the lease; destroy the sandbox if the lifecycle says so.
    pub fn on_error(&self, error: &str) -> MiddlewareResult<()> {
        self.end()?;
        self.drain_events("error");
        tracing::info!(
            run = %self.ctx.run_id,
            "run failed: {}",
            self.mw.secrets.scrub_str(error)
        );
        let release = self.close_lease();
        if self.mw.config.lifecycle.destroy_on_error {
            self.destroy()?;
        }
        release
    }

    fn end(&self) -> MiddlewareResult<()> {
        if self.ended.swap(true, Ordering::SeqCst) {
            return Err(MiddlewareError::Config(format!(
                "run {:?} already ended (one terminal hook per run)",
                self.ctx.run_id
            )));
        }
        Ok(())
    }

    /// Delivers the file events of every change made so far and stops watching. A host
    /// that does not take them in time is logged, not an error of the run.
    fn drain_events(&self, phase: &str) {
        let w = self.watcher.locked().take();
        if let Some(w) = w {
            if let Err(e) = w.drain(DRAIN_LIMIT) {
                tracing::warn!(run = %self.ctx.run_id, phase, "file events: {e}");
            }
        }
    }

    fn close_lease(&self) -> MiddlewareResult<()> {
        match &self.keeper {
            Some(k) => k.close().map_err(Into::into),
            None => Ok(()),
        }
    }

    fn destroy(&self) -> MiddlewareResult<()> {
        let Some(h) = self.handle.locked().take() else {
            return Ok(());
        };
        let key = h.key.clone();
        drop(h);
        self.mw.provider.destroy(&key, &self.mw.secrets)
    }

    fn capture(&self) -> MiddlewareResult<RunOutcome> {
        let (Some(_), Some(keeper)) = (&self.mw.config.snapshots, &self.keeper) else {
            return Ok(RunOutcome::default());
        };
        let Some(handle) = self.sandbox() else {
            return Ok(RunOutcome::default());
        };
        self.mw.publisher().publish(Publish {
            thread: &self.ctx.thread,
            handle: &handle,
            reason: format!("run {}", self.ctx.run_id),
            source_run_id: Some(self.ctx.run_id.clone()),
            completion_of: Some(&self.ctx.run_id),
            conversation: None,
            expected_head: None,
            lease: &|| keeper.status(),
        })
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // A run dropped without a terminal hook publishes nothing and lets the thread go.
        if let Err(e) = self.close_lease() {
            tracing::warn!(run = %self.ctx.run_id, "releasing the writer lease: {e}");
        }
    }
}
