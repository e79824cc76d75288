//! Publishing a sandbox's state as a checkpoint, and showing a checkpoint in a sandbox:
//! the two halves of a run's lifecycle that do not depend on who holds the lease. A
//! [`super::Run`] publishes under the lease its keeper renews; a client of `casfs serve`
//! that keeps its own lease (the TypeScript adapter) publishes under the lease it sends.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;

use super::error::{MiddlewareError, MiddlewareResult};
use super::persistence::{Parts, Persistence};
use super::policy::{CaptureFilter, SnapshotPolicy};
use super::provider::{EnsureOutcome, SandboxHandle, SandboxWorkspace};
use super::secrets::Secrets;
use crate::cas::file::{read_file, store_bytes, StoreStats};
use crate::cas::FileRef;
use crate::checkpoint::diff::diff_trees;
use crate::checkpoint::{
    capture_dir, restore_tree, Artifact, CaptureOptions, Checkpoint, CheckpointError, CheckpointId,
    CheckpointResult, ContentRef, LeaseStatus, NewCheckpoint, RestoreOptions, Store, ThreadId,
    WriterLease,
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

/// What publishing and showing a checkpoint take from the middleware.
pub(crate) struct Publisher<'a> {
    pub store: &'a Store,
    pub secrets: &'a Secrets,
    pub workspace_hash: Option<&'a str>,
    pub snapshots: Option<&'a SnapshotConfig>,
}

/// What to publish, and under which lease.
pub(crate) struct Publish<'a> {
    pub thread: &'a ThreadId,
    pub handle: &'a SandboxHandle,
    pub reason: String,
    pub source_run_id: Option<String>,
    /// A run hosted here: wait until its persistence completed before reading it.
    pub completion_of: Option<&'a str>,
    /// The conversation as given by the caller; `None`: the persistence layer's.
    pub conversation: Option<Vec<Value>>,
    /// The head the caller read and publishes on (`Some(None)`: the thread has none);
    /// `None`: the head the workspace shows.
    pub expected_head: Option<Option<CheckpointId>>,
    /// The lease as it stands now: asked before every step.
    pub lease: &'a dyn Fn() -> LeaseStatus,
}

impl<'a> Publisher<'a> {
    /// The snapshot configuration, or the error saying publishing needs one.
    pub(crate) fn snapshots(&self) -> MiddlewareResult<&'a SnapshotConfig> {
        self.snapshots.ok_or_else(|| {
            MiddlewareError::Config("no snapshot configuration: nothing can be published".into())
        })
    }

    /// Whether a publish may go on: an error if the lease was lost.
    fn may_publish(p: &Publish<'_>) -> MiddlewareResult<bool> {
        match (p.lease)() {
            LeaseStatus::Held(_) => Ok(true),
            LeaseStatus::Closed => Ok(false),
            LeaseStatus::Lost(e) => Err(e.into()),
        }
    }

    /// Captures the sandbox's changes (under the policy, secrets replaced by
    /// placeholders), the conversation and the thread's artifacts, and appends them as
    /// a checkpoint on the head the workspace shows, checking between every step that
    /// the lease still stands. A closed lease publishes nothing (no error).
    pub(crate) fn publish(&self, p: Publish<'_>) -> MiddlewareResult<RunOutcome> {
        let cfg = self.snapshots()?;
        let none = || Ok(RunOutcome::default());
        let handle = p.handle;
        if !Self::may_publish(&p)? {
            return none();
        }
        let parts = cfg.persistence.parts()?;
        if let Some(run) = p.completion_of {
            parts
                .completion
                .wait_for_run_completion(run, cfg.completion_timeout)?;
            if !Self::may_publish(&p)? {
                return none();
            }
        }
        let messages = match &p.conversation {
            Some(m) => m.clone(),
            None => parts.messages.load_thread(p.thread)?,
        };
        if !Self::may_publish(&p)? {
            return none();
        }
        let objects = self.store.objects();
        // The conversation and artifacts are put before the snapshot: garbage
        // collection waits until the checkpoint naming them is appended.
        let _session = crate::cas::write_session(objects);
        let secrets = &self.secrets;
        let mut stats = StoreStats::default();
        // Stored as given (already scrubbed), or scrubbed first: scrubbing twice would
        // escape the placeholders the first put in.
        let mut store = |data: &[u8], scrub: bool| -> MiddlewareResult<ContentRef> {
            let scrubbed = scrub.then(|| secrets.scrub(data)).flatten();
            let data = scrubbed.as_ref().map_or(data, |(d, _)| d);
            Ok(store_bytes(objects, data, &mut stats)
                .map_err(CheckpointError::from)?
                .into())
        };
        // Values are scrubbed before they are encoded: encoding escapes a value next
        // to `"` or `\`, and the escaped form would not be found.
        let conversation = if messages.is_empty() {
            None
        } else {
            let scrubbed: Vec<Value> = messages.iter().map(|m| secrets.scrub_json(m)).collect();
            Some(store(
                &serde_json::to_vec(&scrubbed).expect("JSON values serialize"),
                false,
            )?)
        };
        let scrub = |s: &str| secrets.scrub_str(s);
        let mut artifacts = Vec::new();
        for a in parts.artifacts.list_for_thread(p.thread)? {
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
                content: store(&bytes, true)?,
                media_type: Some(scrub(&a.mime_type)),
                artifact_id: Some(scrub(&a.artifact_id)),
                blob_key: Some(scrub(key)),
                run_id: Some(scrub(&a.run_id)),
                created_at_ms: Some(a.created_at_ms),
            });
        }
        if !Self::may_publish(&p)? {
            return none();
        }
        // The head this workspace shows must still be the thread's (and the one the
        // caller read): a writer publishes on top of what it started from, never over
        // someone else's checkpoint.
        let head = self.store.checkpoints().head(p.thread)?;
        let expected = handle.expected_head();
        let wanted = p.expected_head.unwrap_or(expected);
        if head != wanted {
            return Err(CheckpointError::HeadMismatch {
                thread: p.thread.clone(),
                expected: wanted,
                actual: head,
            }
            .into());
        }
        if expected != wanted {
            return Err(MiddlewareError::SandboxBehind {
                key: handle.key.clone(),
                shows: expected,
                expected: wanted,
            });
        }
        if !Self::may_publish(&p)? {
            return none();
        }
        let filter = CaptureFilter::new(&cfg.policy, secrets)?;
        let mut template = NewCheckpoint::new(
            p.thread.clone(),
            crate::cas::TreeId(crate::cas::Hash::of(b"")),
            p.reason.clone(),
        );
        template.source_run_id = p.source_run_id.clone();
        template.conversation = conversation;
        template.artifacts = artifacts;
        template.workspace_hash = self.workspace_hash.map(str::to_string);
        let closed = AtomicBool::new(false);
        let before_append = |new: &mut NewCheckpoint| -> CheckpointResult<WriterLease> {
            if let Some(why) = filter.peek(|st| st.oversize.clone()) {
                return Err(CheckpointError::Invalid(format!("oversize: {why}")));
            }
            new.secret_files = filter.peek(|st| st.secret_files.clone());
            match (p.lease)() {
                LeaseStatus::Held(l) => Ok(l),
                LeaseStatus::Lost(e) => Err(e),
                LeaseStatus::Closed => {
                    closed.store(true, Ordering::SeqCst);
                    Err(CheckpointError::Invalid("the lease was closed".into()))
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
                if let LeaseStatus::Lost(lost) = (p.lease)() {
                    return Err(lost.into());
                }
                return Err(e.into());
            }
        };
        if let LeaseStatus::Lost(lost) = (p.lease)() {
            return Err(lost.into());
        }
        Ok(RunOutcome {
            checkpoint: Some(cp.0),
            changed_files: cp.1,
            skipped: st.skipped,
            secret_files: st.secret_files.len(),
        })
    }

    /// The thread's head checkpoint, if it has one, checked to be restorable here
    /// (present, and of this workspace definition unless the policy allows another).
    pub(crate) fn head_checkpoint(
        &self,
        thread: &ThreadId,
    ) -> MiddlewareResult<Option<Checkpoint>> {
        let cfg = self.snapshots()?;
        let cps = self.store.checkpoints();
        let Some(head) = cps.head(thread)? else {
            return Ok(None);
        };
        let cp = match cps.get(&head) {
            Ok(cp) => cp,
            Err(CheckpointError::NotFound(_)) => {
                return Err(MiddlewareError::HeadMissing {
                    thread: thread.clone(),
                    id: head,
                })
            }
            Err(e) => return Err(e.into()),
        };
        if let (Some(recorded), Some(current)) = (&cp.body.workspace_hash, self.workspace_hash) {
            if recorded != current && !cfg.policy.allow_workspace_mismatch {
                return Err(MiddlewareError::WorkspaceMismatch {
                    checkpoint: cp.id,
                    recorded: recorded.clone(),
                    current: current.to_string(),
                });
            }
        }
        Ok(Some(cp))
    }

    /// Makes a sandbox just ensured show checkpoint `cp`'s files (with the current
    /// secret values put back), unless it was resumed alive at `cp` already. Returns
    /// whether it restored.
    pub(crate) fn show_files(
        &self,
        handle: &SandboxHandle,
        outcome: EnsureOutcome,
        cp: &Checkpoint,
    ) -> MiddlewareResult<bool> {
        if outcome == EnsureOutcome::Resumed {
            if handle.expected_head() == Some(cp.id) {
                return Ok(false);
            }
            // Another sandbox published on the thread since this one was last used: the
            // head is the thread's state (what this sandbox holds was never published).
            tracing::info!(sandbox = %handle.key, "live sandbox is behind the head; restoring it");
        }
        // A sandbox made (or found stale): whatever a writer that never published left
        // in it is not the thread's state.
        match &handle.workspace {
            SandboxWorkspace::Mount(m) => {
                // A new mount starts at the head already (its provider discarded what
                // an earlier sandbox of the key left). Asked as announced: a file
                // opened for writing in the instant since it was mounted is not looked
                // for in every process (what it writes is the sandbox's, unpublished).
                let fresh = outcome == EnsureOutcome::Created
                    && m.tag().base == Some(cp.id)
                    && m.is_clean();
                if !fresh {
                    m.restore(cp.id, None, true)?;
                }
            }
            SandboxWorkspace::Dir(d) => {
                // Every entry written is the owner's before its mode is set: no file of
                // the server's with a set-id bit ever stands in their directory.
                let opts = RestoreOptions {
                    owner: d.owner.is_other().then_some((d.owner.uid, d.owner.gid)),
                    ..RestoreOptions::default()
                };
                restore_tree(&d.store, cp.body.root, &handle.root, &opts)?;
                handle.set_base(cp.id, cp.body.root);
            }
        }
        for f in &cp.body.secret_files {
            put_secrets_back(handle, &f.path, self.secrets)?;
        }
        Ok(true)
    }

    /// The checkpoint's conversation, into a message store that has none for the thread
    /// (one that has some is newer: the host keeps it).
    pub(crate) fn restore_conversation(
        &self,
        parts: &Parts<'_>,
        thread: &ThreadId,
        conversation: Option<ContentRef>,
    ) -> MiddlewareResult<()> {
        let Some(c) = conversation else {
            return Ok(());
        };
        if !parts.messages.load_thread(thread)?.is_empty() {
            return Ok(());
        }
        let bytes =
            read_file(self.store.objects(), &FileRef::from(c)).map_err(CheckpointError::from)?;
        let messages: Vec<Value> = serde_json::from_slice(&bytes).map_err(|e| {
            MiddlewareError::Persistence(format!("stored conversation {}: {e}", c.id))
        })?;
        // Placeholders are put back into the decoded strings: a value holding `"` or
        // `\` put into the encoded form would break it.
        let messages: Vec<Value> = messages.iter().map(|m| self.secrets.fill_json(m)).collect();
        parts.messages.save_thread(thread, &messages)
    }
}

/// Writes the current secret values back into a restored file, keeping its mode and
/// modification time: the file is found beneath the sandbox's root through handles (no
/// link followed: a link put in its place is not written through), and read and written
/// through the one descriptor checked to be a regular file.
fn put_secrets_back(h: &SandboxHandle, rel: &str, secrets: &Secrets) -> MiddlewareResult<()> {
    use crate::sys::dirfd::{self, Entry};
    use std::io::{Read, Seek};
    use std::os::fd::AsFd;
    let path = h.root.join(rel);
    let io = |e: std::io::Error| MiddlewareError::Sandbox {
        key: h.key.clone(),
        detail: format!("putting secrets back into {}: {e}", path.display()),
    };
    let root = dirfd::open_dir_path(&h.root).map_err(io)?;
    let entry = match Entry::open_beneath(root.as_fd(), rel.as_bytes()) {
        Ok(e) => e,
        // Not (or no longer) a file reached without a link: nothing of it to fill.
        Err(e) if dirfd::vanished(&e) || e.raw_os_error() == Some(libc::ELOOP) => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    if !entry.meta.is_file() {
        return Ok(());
    }
    let mut f = entry.open_rw().map_err(io)?;
    let mut data = Vec::new();
    f.read_to_end(&mut data).map_err(io)?;
    let Some(filled) = secrets.fill(&data) else {
        return Ok(());
    };
    f.rewind().map_err(io)?;
    f.set_len(0).map_err(io)?;
    f.write_all(&filled).map_err(io)?;
    dirfd::set_fd_mtime(f.as_fd(), entry.meta.mtime_ns).map_err(io)?;
    Ok(())
}
