//! A mounted thread's checkpoint: the snapshot taken under the thread's writer lease,
//! the append on the head the workspace expects, and a checkpoint that landed before a
//! crash adopted as the mount's base.

use std::time::Instant;

use super::mounted::{empty_root, ws_err, Backend, MountCheckpoint, MountedThread};
use crate::cas::TreeId;
use crate::checkpoint::{
    holder_name, CheckpointError, CheckpointId, CheckpointResult, LeaseKeeper, MountTag,
    NewCheckpoint, Store, WriterLease,
};
use crate::fs::{SnapshotFilter, SnapshotStats, Workspace};
use crate::mount::overlay::{self, OverlayMount};

impl MountedThread {
    /// Checkpoints the dirty set: under the thread's writer lease, appends a checkpoint
    /// whose parent must be the head this workspace expects.
    pub fn checkpoint(&self, reason: &str) -> CheckpointResult<MountCheckpoint> {
        let _busy = overlay::Busy::new();
        let tag = self.tag();
        let cps = self.store.checkpoints();
        let lease = cps.acquire_writer(&tag.thread, &holder_name("casfs-mount"), self.lease_ttl)?;
        let keeper = LeaseKeeper::start(self.store.checkpoints_shared(), lease);
        let template = NewCheckpoint::new(tag.thread.clone(), empty_root(), reason);
        let result = self.publish(template, None, &|_| keeper.held());
        if let Err(e) = keeper.close() {
            tracing::warn!("releasing the writer lease after a checkpoint: {e}");
        }
        result
    }

    /// Checkpoints the dirty set for a run that holds the thread's writer lease (kept
    /// by the caller): `template` gives everything but the root (conversation,
    /// artifacts, run, workspace hash), `filter` what of the changes goes in.
    /// `before_append` runs after the snapshot and right before the append: it may
    /// complete the record (what the filter saw) and gives the current lease, or refuses
    /// (a lost or closed lease), and then nothing is published. The head must still be
    /// the one this workspace was restored at or last checkpointed.
    pub fn checkpoint_with(
        &self,
        template: NewCheckpoint,
        filter: Option<&dyn SnapshotFilter>,
        before_append: &dyn Fn(&mut NewCheckpoint) -> CheckpointResult<WriterLease>,
    ) -> CheckpointResult<MountCheckpoint> {
        self.publish(template, filter, before_append)
    }

    fn publish(
        &self,
        template: NewCheckpoint,
        filter: Option<&dyn SnapshotFilter>,
        before_append: &dyn Fn(&mut NewCheckpoint) -> CheckpointResult<WriterLease>,
    ) -> CheckpointResult<MountCheckpoint> {
        let start = Instant::now();
        // Replaced generations are not torn down meanwhile.
        let _busy = overlay::Busy::new();
        // Objects the snapshot puts are named by nothing until the append.
        let _session = crate::cas::write_session(self.store.objects());
        let mut template = template;
        let reads = match &self.backend {
            Backend::Fuse { workspace, .. } => workspace.take_reads(),
            Backend::Overlay(o) => o.take_reads(),
        };
        // Only another host fetches ahead (from a remote object store): a local store
        // would pay a list of up to 8192 files on every checkpoint for nothing.
        if self.store.remote().is_some() && !reads.is_empty() && template.read_first.is_none() {
            let list: Vec<(String, u64)> =
                reads.iter().map(|f| (f.id.0.to_hex(), f.size)).collect();
            let bytes = serde_json::to_vec(&list).expect("a list serializes");
            let mut stats = crate::cas::StoreStats::default();
            let c = crate::cas::file::store_bytes(self.store.objects(), &bytes, &mut stats)?;
            template.read_first = Some(c.into());
        }
        let tag = self.tag();
        if template.thread_id != tag.thread {
            return Err(CheckpointError::Invalid(format!(
                "checkpoint for thread {} from a mount of thread {}",
                template.thread_id, tag.thread
            )));
        }
        let cps = self.store.checkpoints();
        let mut t_snap = std::time::Duration::ZERO;
        // Snapshot, append under the lease, then make the snapshot the base: a refused
        // append drops the snapshot and leaves the workspace as it was.
        let snap = match &self.backend {
            Backend::Fuse { workspace, .. } => {
                Pending::Fuse(workspace.begin_snapshot(filter).map_err(ws_err)?)
            }
            Backend::Overlay(o) => {
                let (root, stats, capture) = o.snapshot(filter)?;
                t_snap = start.elapsed();
                // Nothing may name an object before it is durable here and, with fleet
                // objects, in the bucket (the FUSE snapshot syncs on its own).
                self.store.objects().sync()?;
                Pending::Overlay(o, root, stats, capture)
            }
        };
        let mut new = template;
        new.root = snap.root();
        let stats = snap.stats();
        new.stats.files_hashed = stats.files_hashed;
        new.stats.bytes_hashed = stats.bytes_hashed;
        new.stats.new_objects = stats.new_objects;
        new.stats.new_bytes = stats.new_bytes;
        new.stats.reused_objects = stats.reused_objects;
        new.stats.unsupported = stats.skipped;
        new.stats.changed = Some(stats.changed_paths.len() as u64);
        new.stats.removed = Some(stats.removed_paths.len() as u64);
        new.stats.duration_ms = start.elapsed().as_millis() as u64;
        let t_synced = start.elapsed();
        let lease = before_append(&mut new)?;
        let cp = cps.append(new, tag.expected_head, &lease)?;
        let t_appended = start.elapsed();
        let next = MountTag {
            thread: tag.thread.clone(),
            base: Some(cp.id),
            expected_head: Some(cp.id),
        };
        let stats = snap.finish(next.clone())?;
        // The new base is the head (this writer holds the thread's lease): pinned now,
        // before another writer can move the head past it. The checkpoint is published
        // whatever this says: a failure is logged, and the next restore or mount pins.
        if let Err(e) = self
            .store
            .pin_mount(&crate::fs::mount_key(&self.mountpoint), &next, true)
        {
            tracing::warn!(
                "pinning checkpoint {} for {}: {e}",
                cp.id,
                self.mountpoint.display()
            );
        }
        tracing::debug!(
            "checkpoint {} of {}: snapshot at {t_snap:?}, durable at {t_synced:?}, \
             appended at {t_appended:?}, done in {:?}",
            cp.id,
            tag.thread,
            start.elapsed()
        );
        Ok(MountCheckpoint {
            checkpoint: cp.id,
            thread: tag.thread,
            parent: cp.body.parent_id,
            changed_files: (stats.changed_paths.len() + stats.removed_paths.len()) as u64,
            stats,
            duration_us: start.elapsed().as_micros() as u64,
        })
    }
}

/// A snapshot taken and not yet recorded as the mount's base.
enum Pending<'a> {
    Fuse(crate::fs::Snapshot<'a>),
    Overlay(&'a OverlayMount, TreeId, SnapshotStats, overlay::Capture),
}

impl Pending<'_> {
    fn root(&self) -> TreeId {
        match self {
            Pending::Fuse(s) => s.root(),
            Pending::Overlay(_, root, _, _) => *root,
        }
    }

    fn stats(&self) -> SnapshotStats {
        match self {
            Pending::Fuse(s) => s.stats().clone(),
            Pending::Overlay(_, _, stats, _) => stats.clone(),
        }
    }

    fn finish(self, tag: MountTag) -> CheckpointResult<SnapshotStats> {
        match self {
            Pending::Fuse(s) => s.finish(tag.to_tag()).map_err(ws_err),
            Pending::Overlay(o, _, stats, capture) => {
                o.finish(tag, capture)?;
                Ok(stats)
            }
        }
    }
}

/// A daemon killed between appending a checkpoint and recording it leaves the mount on
/// a head the thread has moved past. If the head's parent is the expected head and its
/// root is what the mount holds (`content`, computed only then), that checkpoint is
/// this work: the tag to adopt it with.
pub(super) fn landed_checkpoint(
    store: &Store,
    found: &MountTag,
    head: Option<CheckpointId>,
    content: impl FnOnce() -> CheckpointResult<TreeId>,
) -> CheckpointResult<Option<MountTag>> {
    let Some(head) = head else { return Ok(None) };
    if found.expected_head == Some(head) {
        return Ok(None);
    }
    let cp = store.checkpoints().get(&head)?;
    if cp.body.parent_id != found.expected_head || content()? != cp.body.root {
        return Ok(None);
    }
    tracing::info!(
        "checkpoint {} of thread {} holds this mount's uncaptured work (its daemon \
         stopped before recording it): adopting it as the base",
        head.short(),
        found.thread
    );
    Ok(Some(MountTag {
        thread: found.thread.clone(),
        base: Some(head),
        expected_head: Some(head),
    }))
}

/// A daemon killed between appending a checkpoint and recording it in the dirty set
/// leaves the dirty set as it was, on a base the thread has moved past. If the head's
/// parent is the expected head and the uncaptured work snapshots to exactly the head's
/// root, that checkpoint is this work: the workspace adopts it as its base (nothing
/// changes in its content). Otherwise the work stays as it is (a checkpoint of it then
/// meets the moved head and says so).
pub(super) fn adopt_landed_checkpoint(
    store: &Store,
    ws: &Workspace,
    found: Option<&MountTag>,
    head: Option<CheckpointId>,
) -> CheckpointResult<()> {
    let Some(found) = found else { return Ok(()) };
    let mut root = None;
    // What the uncaptured work would store, without making it the base.
    let content = || {
        let r = ws.begin_snapshot(None).map_err(ws_err)?.root();
        root = Some(r);
        Ok(r)
    };
    if let Some(tag) = landed_checkpoint(store, found, head, content)? {
        let root = root.expect("the content was computed");
        ws.swap_root(root, tag.to_tag(), true).map_err(ws_err)?;
    }
    Ok(())
}
