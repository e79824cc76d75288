//! A workspace served for a thread, on either backend ([`MountMode`]): casfs's own FUSE
//! file system (the [`Workspace`] of `fs`) or the kernel's overlayfs over a read-only
//! casfs lower ([`OverlayMount`], `super::overlay`); plus what it is a checkpoint of (a
//! [`MountTag`]: thread, base checkpoint, the head the next append expects), its
//! checkpoint (snapshot, append under the lease, finish) and restore (a root swap on
//! FUSE, a remount on overlay), and the adoption of work a killed daemon left.
//!
//! Files of a mount live under `<store>/mounts/<key>/` ([`mount_dir`]): on FUSE
//! `upper/` (local copies of dirty files), on overlay `overlay/<generation>/` (its
//! lower's mountpoint, upper and work directory); a `casfs mount` daemon's
//! `control.sock` and `pid` on both. Its dirty set or overlay record lives in the
//! store's `mounts` column family, keyed by the same 8-byte key (from the mountpoint's
//! canonical path), so mounting the same mountpoint again after a crash picks the
//! uncaptured work back up.

mod checkpoint;
mod mounted;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cas::TreeId;
use crate::checkpoint::{
    mount_dir, CheckpointError, CheckpointId, CheckpointResult, MountTag, Store, ThreadId,
};
use crate::fs::dirty::DirtyStore;
use crate::fs::{mount_key, mount_workspace, Workspace, WorkspaceOptions};
use crate::sys::Locked;

use super::overlay::{self, OverlayMount};
use checkpoint::{adopt_landed_checkpoint, landed_checkpoint};
use mounted::{unmount_session, ws_err, Backend};
pub use mounted::{MountCheckpoint, MountMode, MountedThread};

/// Discards the uncaptured work of the workspace at `mountpoint` (canonical), which must
/// not be mounted: its dirty set and every file of it under the store (upper files,
/// local copies). Checkpoints are not touched. Returns whether there was anything.
///
/// With `purge`, the database is then purged of the deleted records
/// ([`crate::cas::Database::purge_deleted`]): the dirty set keeps names, symlink
/// targets and extended attributes as they are, and a workspace that held a secret in
/// one (even one deleted since) must leave no byte of it in a log or table file.
pub fn discard_mount_state(
    store: &Store,
    mountpoint: &Path,
    purge: bool,
) -> CheckpointResult<bool> {
    overlay::detach_leftovers(store, mountpoint);
    let dirty = DirtyStore::new(store.database().clone(), mount_key(mountpoint));
    let dir = mount_dir(store.root(), mountpoint);
    let had = dirty.meta()?.is_some() || dir.exists();
    if !had {
        return Ok(false);
    }
    let mut b = dirty.batch();
    dirty.clear_all(&mut b);
    dirty.commit(b)?;
    dirty.sync()?;
    // A bounded directory's file system goes with its image.
    super::disk::remove(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
    match crate::sys::dirfd::remove_path(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(CheckpointError::io(&dir, e)),
    }
    if purge {
        store.database().purge_deleted(crate::fs::MOUNTS_CF)?;
    }
    // The pins go last: the discard is done whatever the fleet says.
    settle_pins(store, mountpoint, None);
    Ok(true)
}

/// Makes `tag` all the mount at `mountpoint` pins (`None`: nothing), once what it
/// reads is settled. A failure is logged, not returned: the work it follows is done,
/// and a pin left over only keeps a checkpoint from retention (the next mount, restore
/// or checkpoint pins again).
fn settle_pins(store: &Store, mountpoint: &Path, tag: Option<&MountTag>) {
    let key = mount_key(mountpoint);
    let r = match tag {
        Some(t) => store.pin_mount(&key, t, true),
        None => store.unpin_mount(&key),
    };
    if let Err(e) = r {
        tracing::warn!("the pins of {} in the fleet: {e}", mountpoint.display());
    }
}

impl MountedThread {
    /// Mounts the workspace of `mountpoint` (canonical). With a persisted dirty set for
    /// it, the uncaptured work is picked up if it belongs to the same thread (and `at`
    /// names its base or nothing); otherwise it starts at `at` or the thread's head.
    pub fn mount(
        store: Arc<Store>,
        mountpoint: &Path,
        thread: ThreadId,
        at: Option<CheckpointId>,
        opts: &WorkspaceOptions,
    ) -> CheckpointResult<MountedThread> {
        Self::mount_mode(store, mountpoint, thread, at, opts, MountMode::Fuse)
    }

    /// [`MountedThread::mount`] with the backend `mode`. Uncaptured work left by a mount
    /// of the other mode is refused (mount it with that mode and checkpoint it first).
    pub fn mount_mode(
        store: Arc<Store>,
        mountpoint: &Path,
        thread: ThreadId,
        at: Option<CheckpointId>,
        opts: &WorkspaceOptions,
        mode: MountMode,
    ) -> CheckpointResult<MountedThread> {
        let dir = mount_dir(store.root(), mountpoint);
        let made = match opts.disk_bytes {
            Some(bytes) => {
                super::disk::bound(&dir, bytes).map_err(|e| CheckpointError::io(&dir, e))?
            }
            None => false,
        };
        let mounted = Self::mount_backend(store.clone(), mountpoint, thread, at, opts, mode)
            .inspect(|m| {
                // What the mount settled on (picked-up work keeps its base) is all it
                // pins from now on.
                settle_pins(&store, mountpoint, Some(&m.tag()));
            });
        if mounted.is_err() && made {
            // A disk made for a mount that failed goes with it (it holds nothing).
            if let Err(e) = super::disk::remove(&dir).and_then(|()| std::fs::remove_dir_all(&dir)) {
                tracing::warn!("removing the disk of {}: {e}", dir.display());
            }
        }
        mounted
    }

    fn mount_backend(
        store: Arc<Store>,
        mountpoint: &Path,
        thread: ThreadId,
        at: Option<CheckpointId>,
        opts: &WorkspaceOptions,
        mode: MountMode,
    ) -> CheckpointResult<MountedThread> {
        match mode {
            MountMode::Fuse => {
                if !overlay::release_to_fuse(&store, mountpoint)? {
                    return Err(CheckpointError::Invalid(format!(
                        "{} has uncaptured changes from an overlay mount; mount it with \
                         --mode overlay and checkpoint them first",
                        mountpoint.display()
                    )));
                }
                Self::mount_fuse(store, mountpoint, thread, at, opts)
            }
            MountMode::Overlay => Self::mount_overlay(store, mountpoint, thread, at, opts),
        }
    }

    fn mount_fuse(
        store: Arc<Store>,
        mountpoint: &Path,
        thread: ThreadId,
        at: Option<CheckpointId>,
        opts: &WorkspaceOptions,
    ) -> CheckpointResult<MountedThread> {
        let session = crate::cas::write_session(store.objects());
        let (head, root, tag) = start_point(&store, mountpoint, &thread, at)?;
        let base = tag.base;
        let dir = mount_dir(store.root(), mountpoint);
        let ws = Workspace::open(
            store.objects_shared(),
            store.database().clone(),
            mount_key(mountpoint),
            &dir.join("upper"),
            root,
            tag.to_tag(),
            opts,
        )
        .map_err(ws_err)?;
        let (_, found) = ws.base();
        let found = MountTag::from_tag(&found);
        let st = ws.status();
        // Uncaptured work of the same thread is picked up (on the base it was made on);
        // without any, the mount starts at the requested checkpoint or current head.
        let keep = match &found {
            Some(f) => {
                f.thread == thread
                    && (at.is_none() || at == f.base)
                    && (st.dirty_nodes > 0 || f.base == base)
            }
            None => false,
        };
        if keep && st.dirty_nodes > 0 {
            adopt_landed_checkpoint(&store, &ws, found.as_ref(), head)?;
        }
        if !keep {
            // A different thread or checkpoint: start there, unless that would drop
            // uncaptured work.
            if st.dirty_nodes > 0 {
                let f = found.as_ref();
                return Err(CheckpointError::Invalid(format!(
                    "{} has uncaptured changes ({} file(s)) from an earlier mount on thread {} \
                     (for example {}); mount it on that thread and checkpoint them first",
                    mountpoint.display(),
                    st.dirty_files,
                    f.map(|f| f.thread.as_str().to_string())
                        .unwrap_or_else(|| "?".into()),
                    st.dirty_paths
                        .first()
                        .cloned()
                        .unwrap_or_else(|| "a deletion".into())
                )));
            }
            ws.swap_root(root, tag.to_tag(), true).map_err(ws_err)?;
        }
        drop(session);
        let ws = Arc::new(ws);
        let mounted = mount_workspace(ws.clone(), mountpoint, opts)
            .map_err(|e| CheckpointError::io(mountpoint, e))?;
        if let Some(id) = base {
            start_prefetch(&store, id);
        }
        Ok(MountedThread {
            store,
            backend: Backend::Fuse {
                workspace: ws,
                mounted: std::sync::Mutex::new(Some(mounted)),
            },
            mountpoint: mountpoint.to_path_buf(),
            lease_ttl: Duration::from_secs(30),
        })
    }

    fn mount_overlay(
        store: Arc<Store>,
        mountpoint: &Path,
        thread: ThreadId,
        at: Option<CheckpointId>,
        opts: &WorkspaceOptions,
    ) -> CheckpointResult<MountedThread> {
        if super::namespace::rootless()
            && !(super::namespace::inside().is_some() && super::namespace::can_mount())
        {
            return Err(CheckpointError::Refused(format!(
                "{}: an overlay mount by uid {} is made in the user's own namespace, which \
                 this process has not joined with the right to mount (casfs mount and casfs \
                 serve join it before they start)",
                mountpoint.display(),
                super::namespace::euid()
            )));
        }
        let objects = store.objects_shared();
        let _session = crate::cas::write_session(objects.as_ref());
        // FUSE work left at this mountpoint is not the overlay's to drop.
        let dirty = DirtyStore::new(store.database().clone(), mount_key(mountpoint));
        let fuse_dirty = dirty.nodes()?.len();
        if fuse_dirty > 0 {
            return Err(CheckpointError::Invalid(format!(
                "{} has uncaptured changes ({fuse_dirty} node(s)) from a FUSE mount; mount it \
                 with --mode fuse and checkpoint them first",
                mountpoint.display()
            )));
        }
        let (head, root, tag) = start_point(&store, mountpoint, &thread, at)?;
        let base = tag.base;
        let view = crate::fs::ViewOptions {
            chunk_cache_bytes: opts.chunk_cache_bytes,
            threads: opts.threads,
            allow_other: true,
            // The lower's listings start warm: up to 256k entries (about 100 B each)
            // read ahead.
            read_ahead_dirs: 1 << 18,
            fuse_uring: opts.fuse_uring,
            // The overlay mount makes its own.
            reads: None,
            // The lower's files are the workspace's owner's, as the upper's root.
            owner: opts.owner,
        };
        let found = overlay::found_state(&store, mountpoint)?;
        let mount = |lower, tag, generation| {
            OverlayMount::start(
                store.clone(),
                mountpoint,
                lower,
                tag,
                generation,
                &view,
                opts.build_lower_image,
            )
        };
        let ov = match found {
            // Work of the same thread (on the base it was made on) is picked up.
            Some((lower, f, g)) if f.thread == thread && (at.is_none() || at == f.base) => {
                let ov = mount(lower, f.clone(), g)?;
                let (merged, captured, capture) = ov.content()?;
                if captured {
                    ov.captured(capture);
                    if f.base != base && ov.status().dirty_nodes == 0 {
                        // Nothing uncaptured and the thread moved on: follow it.
                        ov.swap(root, tag, true)?;
                    }
                } else if let Some(landed) = landed_checkpoint(&store, &f, head, || Ok(merged))? {
                    ov.finish(landed, capture)?;
                } else {
                    // Uncaptured work: what of it the base holds already is not counted
                    // again.
                    ov.adopt(merged, &capture)?;
                }
                ov
            }
            Some((lower, f, g)) => {
                let ov = mount(lower, f.clone(), g)?;
                let st = ov.status();
                if st.dirty_nodes > 0 && !ov.content()?.1 {
                    return Err(CheckpointError::Invalid(format!(
                        "{} has uncaptured changes ({} file(s)) from an earlier mount on \
                         thread {} (for example {}); mount it on that thread and checkpoint \
                         them first",
                        mountpoint.display(),
                        st.dirty_files,
                        f.thread,
                        st.dirty_paths.first().cloned().unwrap_or_default()
                    )));
                }
                ov.swap(root, tag, true)?;
                ov
            }
            None => mount(root, tag, 1)?,
        };
        if let Some(id) = base {
            start_prefetch(&store, id);
        }
        Ok(MountedThread {
            store,
            backend: Backend::Overlay(Box::new(ov)),
            mountpoint: mountpoint.to_path_buf(),
            lease_ttl: Duration::from_secs(30),
        })
    }

    /// Unmounts and discards the uncaptured work ([`discard_mount_state`]): what was
    /// not checkpointed is gone, and the next mount of this mountpoint starts clean.
    /// Two discards of one mount do not overlap: the second returns after the first.
    pub fn discard(&self, purge: bool) -> CheckpointResult<bool> {
        match &self.backend {
            Backend::Fuse { mounted, .. } => {
                let mut s = mounted.locked();
                unmount_session(&mut s).map_err(|e| CheckpointError::io(&self.mountpoint, e))?;
                discard_mount_state(&self.store, &self.mountpoint, purge)
            }
            Backend::Overlay(o) => {
                o.unmount()
                    .map_err(|e| CheckpointError::io(&self.mountpoint, e))?;
                discard_mount_state(&self.store, &self.mountpoint, purge)
            }
        }
    }

    /// Makes the workspace show checkpoint `id` (of any thread): the next checkpoint
    /// goes on `thread` (default: the mount's) after its current head; a thread that
    /// does not exist yet is forked from `id`.
    pub fn restore(
        &self,
        id: CheckpointId,
        thread: Option<ThreadId>,
        force: bool,
    ) -> CheckpointResult<(MountTag, u64)> {
        let start = Instant::now();
        let _busy = overlay::Busy::new();
        // Retention and collection wait until the mount's base is the checkpoint.
        let _session = crate::cas::write_session(self.store.objects());
        let cps = self.store.checkpoints();
        // Pinned before it is read, so retention elsewhere in a fleet keeps it (or
        // removed it first, and the read says so).
        let key = mount_key(&self.mountpoint);
        let pin = MountTag {
            base: Some(id),
            ..self.tag()
        };
        self.store.pin_mount(&key, &pin, false)?;
        let cp = match cps.get(&id) {
            Err(CheckpointError::NotFound(_)) if cps.is_pruned(&id)? => {
                return Err(CheckpointError::Invalid(format!(
                    "checkpoint {id} was removed by retention (prune); restore a kept one"
                )))
            }
            r => r?,
        };
        let thread = thread.unwrap_or_else(|| self.tag().thread);
        let tag = match cps.head(&thread)? {
            Some(head) => MountTag {
                expected_head: Some(head),
                thread,
                base: Some(id),
            },
            // A new thread: fork it from the checkpoint, so its history starts there
            // (not before the restore is known to be allowed).
            None => {
                let st = self.status().1;
                if !force && st.dirty_nodes > 0 {
                    return Err(CheckpointError::Invalid(format!(
                        "{} uncaptured change(s) (for example {}); checkpoint them first or force",
                        st.dirty_files.max(1),
                        st.dirty_paths
                            .first()
                            .cloned()
                            .unwrap_or_else(|| "a deletion".into())
                    )));
                }
                let forked = cps.fork(&thread, &id)?;
                MountTag {
                    expected_head: Some(forked.id),
                    thread,
                    base: Some(forked.id),
                }
            }
        };
        match &self.backend {
            Backend::Fuse { workspace, .. } => workspace
                .swap_root(cp.body.root, tag.to_tag(), force)
                .map_err(ws_err)?,
            Backend::Overlay(o) => o.swap(cp.body.root, tag.clone(), force)?,
        }
        settle_pins(&self.store, &self.mountpoint, Some(&tag));
        start_prefetch(&self.store, id);
        Ok((tag, start.elapsed().as_micros() as u64))
    }
}

/// With a remote object store, fetches in the background the files the run that made
/// checkpoint `id` read, in the order it first read them, so a restore on another host
/// reads what the agent will likely read first from its own cache.
fn start_prefetch(store: &Arc<Store>, id: CheckpointId) {
    if store.remote().is_none() {
        return;
    }
    let Ok(cp) = store.checkpoints().get(&id) else {
        return;
    };
    let Some(list) = cp.body.read_first else {
        return;
    };
    let store = store.clone();
    let _ = std::thread::Builder::new()
        .name("casfs-prefetch".into())
        .spawn(move || {
            let objects = store.objects();
            let Ok(bytes) = crate::cas::file::read_file(objects, &list.into()) else {
                return;
            };
            let Ok(files) = serde_json::from_slice::<Vec<(String, u64)>>(&bytes) else {
                return;
            };
            let files: Vec<crate::cas::FileRef> = files
                .into_iter()
                .filter_map(|(hex, size)| {
                    Some(crate::cas::FileRef {
                        id: crate::cas::FileId(crate::cas::Hash::from_hex(&hex)?),
                        size,
                    })
                })
                .collect();
            for batch in files.chunks(256) {
                let ids: Vec<crate::cas::ObjectId> =
                    batch.iter().map(|f| crate::cas::ObjectId(f.id.0)).collect();
                objects.prefetch(&ids);
                // A large file's chunks, now that its chunk list is here.
                let mut chunks = Vec::new();
                for f in batch.iter().filter(|f| f.is_chunked()) {
                    if let Ok(l) = crate::cas::file::load_chunk_list(objects, f) {
                        chunks.extend(l.chunks.iter().map(|(c, _)| crate::cas::ObjectId(c.0)));
                    }
                }
                objects.prefetch(&chunks);
            }
            tracing::debug!(
                "prefetched {} file(s) of checkpoint {}",
                files.len(),
                id.short()
            );
        });
}

/// Where a mount of `thread` at `mountpoint` starts: the thread's head, the tree of
/// `at` (or the head; empty without either), and the tag of that start, pinned (added
/// to the mount's pins) before its record is read.
fn start_point(
    store: &Store,
    mountpoint: &Path,
    thread: &ThreadId,
    at: Option<CheckpointId>,
) -> CheckpointResult<(Option<CheckpointId>, TreeId, MountTag)> {
    let cps = store.checkpoints();
    let head = cps.head(thread)?;
    let base = at.or(head);
    let tag = MountTag {
        thread: thread.clone(),
        base,
        expected_head: head,
    };
    store.pin_mount(&mount_key(mountpoint), &tag, false)?;
    let root = overlay::tree_of(store, base)?;
    Ok((head, root, tag))
}
