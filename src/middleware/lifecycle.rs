//! The run lifecycle: setup, on_chunk, on_finish, on_abort, on_error, on_disconnect.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::events::Watcher;
use super::persistence::Parts;
use super::policy::CaptureFilter;
use super::{
    ArtifactMeta, EnsureOutcome, FileEvents, MiddlewareError, MiddlewareResult, Persistence,
    RunContext, SandboxHandle, SandboxProvider, SandboxWorkspace, Secrets, SnapshotPolicy,
};
use crate::cas::file::{read_file, store_bytes, StoreStats};
use crate::cas::FileRef;
use crate::checkpoint::diff::diff_trees;
use crate::checkpoint::{
    capture_dir, holder_name, restore_tree, Artifact, CaptureOptions, Checkpoint, CheckpointError,
    CheckpointId, CheckpointResult, ContentRef, LeaseKeeper, LeaseStatus, NewCheckpoint,
    RestoreOptions, Store, WriterLease,
};

/// Portable checkpoints of runs: where the conversation and artifacts come from, what
/// a capture keeps, the secrets it must never store, the workspace definition.
#[derive(Clone)]
pub struct SnapshotConfig {
    pub persistence: Persistence,
    pub policy: SnapshotPolicy,
    /// The workspace's resolved secret values, by name.
    pub secrets: BTreeMap<String, String>,
    /// The workspace definition whose hash each checkpoint records.
    pub workspace: serde_json::Value,
    pub lease_ttl: Duration,
    /// How long on_finish waits for the run's persistence to complete.
    pub completion_timeout: Duration,
}

impl SnapshotConfig {
    pub fn new(persistence: Persistence) -> SnapshotConfig {
        SnapshotConfig {
            persistence,
            policy: SnapshotPolicy::default(),
            secrets: BTreeMap::new(),
            workspace: serde_json::Value::Null,
            lease_ttl: Duration::from_secs(30),
            completion_timeout: Duration::from_secs(60),
        }
    }
}

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

/// What on_finish did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOutcome {
    /// The checkpoint published, if the run could publish one.
    pub checkpoint: Option<CheckpointId>,
    pub changed_files: u64,
    /// Files the policy left out for their size.
    pub skipped: Vec<String>,
    /// Files stored with secret placeholders.
    pub secret_files: usize,
}

/// The lifecycle middleware over one store and one sandbox provider.
pub struct Middleware {
    store: Arc<Store>,
    provider: Arc<dyn SandboxProvider>,
    config: MiddlewareConfig,
    secrets: Secrets,
    workspace_hash: Option<String>,
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
            workspace_hash = Some(super::workspace_hash(&s.workspace));
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

    pub fn config(&self) -> &MiddlewareConfig {
        &self.config
    }

    pub fn provider(&self) -> &Arc<dyn SandboxProvider> {
        &self.provider
    }

    /// Destroys the sandboxes no run has held for `idle`; returns how many.
    pub fn reap_idle_sandboxes(&self, idle: Duration) -> MiddlewareResult<usize> {
        self.provider.reap_idle(idle, &self.secrets)
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
            super::check_tenant(t).map_err(MiddlewareError::Config)?;
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
        self.handle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
            *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
        }
        Ok(())
    }

    fn show_head(&self) -> MiddlewareResult<()> {
        self.cancelled()?;
        let head = match &self.mw.config.snapshots {
            Some(cfg) => self.head_checkpoint(cfg)?,
            None => None,
        };
        let (handle, outcome) = self.mw.provider.ensure(&self.ctx, &self.mw.secrets)?;
        self.created
            .store(outcome != EnsureOutcome::Resumed, Ordering::SeqCst);
        *self.handle.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle.clone());
        self.cancelled()?;
        let (Some(cfg), Some(cp)) = (&self.mw.config.snapshots, head) else {
            return Ok(());
        };
        if outcome == EnsureOutcome::Resumed {
            if handle.expected_head() == Some(cp.id) {
                return Ok(());
            }
            // Another sandbox published on the thread since this one was last used: the
            // head is the thread's state (what this sandbox holds was never published).
            tracing::info!(run = %self.ctx.run_id, "live sandbox is behind the head; restoring it");
        }
        // A sandbox made (or found stale) for this run: whatever a run that never
        // published left in it is not the thread's state.
        match &handle.workspace {
            SandboxWorkspace::Mount(m) => {
                // A new mount starts at the head already (its provider discarded what
                // an earlier sandbox of the key left).
                let fresh = outcome == EnsureOutcome::Created
                    && m.tag().base == Some(cp.id)
                    && m.status().1.dirty_nodes == 0;
                if !fresh {
                    m.restore(cp.id, None, true)?;
                }
            }
            SandboxWorkspace::Dir(d) => {
                restore_tree(
                    &d.store,
                    cp.body.root,
                    &handle.root,
                    &RestoreOptions::default(),
                )?;
                handle.set_base(cp.id, cp.body.root);
            }
        }
        let secrets = &self.mw.secrets;
        for f in &cp.body.secret_files {
            put_secrets_back(&handle, &f.path, secrets)?;
        }
        let parts = cfg.persistence.parts()?;
        self.restore_conversation(&parts, cp.body.conversation)?;
        self.restore_artifacts(&parts, &cp.body.artifacts)?;
        Ok(())
    }

    /// The thread's head checkpoint, if it has one, checked to be restorable here.
    fn head_checkpoint(&self, cfg: &SnapshotConfig) -> MiddlewareResult<Option<Checkpoint>> {
        let cps = self.mw.store.checkpoints();
        let Some(head) = cps.head(&self.ctx.thread)? else {
            return Ok(None);
        };
        let cp = match cps.get(&head) {
            Ok(cp) => cp,
            Err(CheckpointError::NotFound(_)) => {
                return Err(MiddlewareError::HeadMissing {
                    thread: self.ctx.thread.clone(),
                    id: head,
                })
            }
            Err(e) => return Err(e.into()),
        };
        if let (Some(recorded), Some(current)) = (&cp.body.workspace_hash, &self.mw.workspace_hash)
        {
            if recorded != current && !cfg.policy.allow_workspace_mismatch {
                return Err(MiddlewareError::WorkspaceMismatch {
                    checkpoint: cp.id,
                    recorded: recorded.clone(),
                    current: current.clone(),
                });
            }
        }
        Ok(Some(cp))
    }

    /// The checkpoint's conversation, into a message store that has none for the thread
    /// (one that has some is newer: the host keeps it).
    fn restore_conversation(
        &self,
        parts: &Parts<'_>,
        conversation: Option<ContentRef>,
    ) -> MiddlewareResult<()> {
        let Some(c) = conversation else {
            return Ok(());
        };
        if !parts.messages.load_thread(&self.ctx.thread)?.is_empty() {
            return Ok(());
        }
        let bytes =
            read_file(self.mw.store.objects(), &FileRef::from(c)).map_err(CheckpointError::from)?;
        let messages: Vec<serde_json::Value> = serde_json::from_slice(&bytes).map_err(|e| {
            MiddlewareError::Persistence(format!("stored conversation {}: {e}", c.id))
        })?;
        // Placeholders are put back into the decoded strings: a value holding `"` or
        // `\` put into the encoded form would break it.
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| self.mw.secrets.fill_json(m))
            .collect();
        parts.messages.save_thread(&self.ctx.thread, &messages)
    }

    /// Artifacts the checkpoint names that the host's stores lack.
    fn restore_artifacts(&self, parts: &Parts<'_>, artifacts: &[Artifact]) -> MiddlewareResult<()> {
        let have: Vec<String> = parts
            .artifacts
            .list_for_thread(&self.ctx.thread)?
            .into_iter()
            .map(|a| a.artifact_id)
            .collect();
        for a in artifacts {
            let key = a
                .blob_key
                .clone()
                .unwrap_or_else(|| format!("casfs/{}/{}", self.ctx.thread, a.content.id.to_hex()));
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
                .clone()
                .unwrap_or_else(|| a.content.id.to_hex());
            if !have.contains(&id) {
                parts.artifacts.put(&ArtifactMeta {
                    artifact_id: id,
                    run_id: a.run_id.clone().unwrap_or_default(),
                    thread: self.ctx.thread.clone(),
                    blob_key: Some(key),
                    name: a.name.clone(),
                    mime_type: a
                        .media_type
                        .clone()
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
        let w = self
            .watcher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
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
        let Some(h) = self.handle.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(());
        };
        let key = h.key.clone();
        drop(h);
        self.mw.provider.destroy(&key, &self.mw.secrets)
    }

    /// Whether the run may still publish: an error if the lease was lost.
    fn may_publish(&self, keeper: &LeaseKeeper) -> MiddlewareResult<bool> {
        match keeper.status() {
            LeaseStatus::Held(_) => Ok(true),
            LeaseStatus::Closed => Ok(false),
            LeaseStatus::Lost(e) => Err(e.into()),
        }
    }

    fn capture(&self) -> MiddlewareResult<RunOutcome> {
        let (Some(cfg), Some(keeper)) = (&self.mw.config.snapshots, &self.keeper) else {
            return Ok(RunOutcome::default());
        };
        let Some(handle) = self.sandbox() else {
            return Ok(RunOutcome::default());
        };
        let none = || Ok(RunOutcome::default());
        if !self.may_publish(keeper)? {
            return none();
        }
        let parts = cfg.persistence.parts()?;
        parts
            .completion
            .wait_for_run_completion(&self.ctx.run_id, cfg.completion_timeout)?;
        if !self.may_publish(keeper)? {
            return none();
        }
        let messages = parts.messages.load_thread(&self.ctx.thread)?;
        if !self.may_publish(keeper)? {
            return none();
        }
        let objects = self.mw.store.objects();
        // The conversation and artifacts are put before the snapshot: garbage
        // collection waits until the checkpoint naming them is appended.
        let _session = crate::cas::write_session(objects);
        let secrets = &self.mw.secrets;
        let mut stats = StoreStats::default();
        let mut store_scrubbed = |data: Vec<u8>| -> MiddlewareResult<ContentRef> {
            let data = secrets.scrub(&data).map(|(d, _)| d).unwrap_or(data);
            Ok(store_bytes(objects, &data, &mut stats)
                .map_err(CheckpointError::from)?
                .into())
        };
        // Values are scrubbed before they are encoded: encoding escapes a value next
        // to `"` or `\`, and the escaped form would not be found.
        let conversation = if messages.is_empty() {
            None
        } else {
            let scrubbed: Vec<serde_json::Value> =
                messages.iter().map(|m| secrets.scrub_json(m)).collect();
            Some(store_scrubbed(
                serde_json::to_vec(&scrubbed).expect("JSON values serialize"),
            )?)
        };
        let scrub = |s: &str| secrets.scrub_str(s);
        let mut artifacts = Vec::new();
        for a in parts.artifacts.list_for_thread(&self.ctx.thread)? {
            let Some(key) = &a.blob_key else {
                continue;
            };
            let bytes = parts.blobs.get(key)?.ok_or_else(|| {
                MiddlewareError::Persistence(format!(
                    "artifact {} ({}) names blob {key:?}, which the blob store lacks",
                    a.artifact_id, a.name
                ))
            })?;
            // The record goes into the checkpoint: its names are scrubbed too.
            artifacts.push(Artifact {
                name: scrub(&a.name),
                content: store_scrubbed(bytes)?,
                media_type: Some(scrub(&a.mime_type)),
                artifact_id: Some(scrub(&a.artifact_id)),
                blob_key: Some(scrub(key)),
                run_id: Some(scrub(&a.run_id)),
                created_at_ms: Some(a.created_at_ms),
            });
        }
        if !self.may_publish(keeper)? {
            return none();
        }
        // The head this workspace shows must still be the thread's: a run publishes on
        // top of what it started from, never over someone else's checkpoint.
        let head = self.mw.store.checkpoints().head(&self.ctx.thread)?;
        let expected = handle.expected_head();
        if head != expected {
            return Err(CheckpointError::HeadMismatch {
                thread: self.ctx.thread.clone(),
                expected,
                actual: head,
            }
            .into());
        }
        if !self.may_publish(keeper)? {
            return none();
        }
        let filter = CaptureFilter::new(&cfg.policy, secrets)?;
        let mut template = NewCheckpoint::new(
            self.ctx.thread.clone(),
            crate::cas::TreeId(crate::cas::Hash::of(b"")),
            format!("run {}", self.ctx.run_id),
        );
        template.source_run_id = Some(self.ctx.run_id.clone());
        template.conversation = conversation;
        template.artifacts = artifacts;
        template.workspace_hash = self.mw.workspace_hash.clone();
        let closed = AtomicBool::new(false);
        let before_append = |new: &mut NewCheckpoint| -> CheckpointResult<WriterLease> {
            if let Some(why) = filter.peek(|st| st.oversize.clone()) {
                return Err(CheckpointError::Invalid(format!("oversize: {why}")));
            }
            new.secret_files = filter.peek(|st| st.secret_files.clone());
            match keeper.status() {
                LeaseStatus::Held(l) => Ok(l),
                LeaseStatus::Lost(e) => Err(e),
                LeaseStatus::Closed => {
                    closed.store(true, Ordering::SeqCst);
                    Err(CheckpointError::Invalid(
                        "the run's lease was closed".into(),
                    ))
                }
            }
        };
        let r: CheckpointResult<(CheckpointId, u64)> = match &handle.workspace {
            SandboxWorkspace::Mount(m) => m
                .checkpoint_with(template, Some(&filter), &before_append)
                .map(|c| (c.checkpoint, c.changed_files)),
            SandboxWorkspace::Dir(d) => (|| {
                let opts = CaptureOptions {
                    no_stat_cache: true,
                    progress: None,
                    filter: Some(&filter),
                };
                let captured = capture_dir(&d.store, &handle.root, &opts)?;
                let mut new = template;
                new.root = captured.root;
                new.stats = captured.stats;
                let lease = before_append(&mut new)?;
                let cps = d.store.checkpoints();
                let before = expected.map(|id| cps.get(&id)).transpose()?;
                let cp = cps.append(new, expected, &lease)?;
                handle.set_base(cp.id, cp.body.root);
                let changed = match before {
                    Some(b) => {
                        diff_trees(d.store.objects(), b.body.root, cp.body.root)?.len() as u64
                    }
                    None => cp.body.stats.files,
                };
                Ok((cp.id, changed))
            })(),
        };
        let st = filter.into_state();
        if let Some(why) = st.oversize.or(st.refused) {
            return Err(MiddlewareError::Policy(why));
        }
        let cp = match r {
            Ok(cp) => cp,
            Err(_) if closed.load(Ordering::SeqCst) => return none(),
            Err(e) => {
                // A lease lost while appending is the error to report.
                if let LeaseStatus::Lost(lost) = keeper.status() {
                    return Err(lost.into());
                }
                return Err(e.into());
            }
        };
        if let LeaseStatus::Lost(lost) = keeper.status() {
            return Err(lost.into());
        }
        Ok(RunOutcome {
            checkpoint: Some(cp.0),
            changed_files: cp.1,
            skipped: st.skipped,
            secret_files: st.secret_files.len(),
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

/// Writes the current secret values back into a restored file, keeping its mode and
/// modification time.
fn put_secrets_back(h: &SandboxHandle, rel: &str, secrets: &Secrets) -> MiddlewareResult<()> {
    let path = h.root.join(rel);
    let io = |e: std::io::Error| MiddlewareError::Sandbox {
        key: h.key.clone(),
        detail: format!("putting secrets back into {}: {e}", path.display()),
    };
    let meta = std::fs::symlink_metadata(&path).map_err(io)?;
    if !meta.is_file() {
        return Ok(());
    }
    let data = std::fs::read(&path).map_err(io)?;
    let Some(filled) = secrets.fill(&data) else {
        return Ok(());
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(io)?;
    f.write_all(&filled).map_err(io)?;
    let mtime = meta.modified().map_err(io)?;
    f.set_times(std::fs::FileTimes::new().set_modified(mtime))
        .map_err(io)?;
    Ok(())
}
