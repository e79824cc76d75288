//! The overlay backend: the kernel's overlayfs serves the workspace, with every write,
//! create, rename and unlink on a local upper directory at native speed, over a lower
//! that is the base checkpoint's tree served read-only and lazily by casfs
//! ([`crate::fs::mount_tree`], everything cacheable forever since it never changes).
//!
//! Files live under `<store>/mounts/<key>/overlay/<generation>/`: `lower/` (the
//! view's mountpoint), `upper/` and `work/`. A restore starts a new generation (a fresh
//! empty upper over the new checkpoint's lower) and mounts it in place of the old one;
//! the old generation is removed in the background. The dirty set is the upper itself
//! (crash-safe by construction: it is a plain directory); what the lower is and which
//! checkpoint the mount is on are kept in the store's `mounts` column family as a
//! FUSE mount's are (so prune, gc and fsck keep the lower's tree alive), with the
//! generation in the tag.
//!
//! A checkpoint reads the upper only ([`upper`]): O(changed since the mount), with
//! files stored at an earlier checkpoint not read again (by stamp).

mod capture;
mod image;
mod kernel;
mod retire;
mod state;
mod upper;
mod watch;
mod writers;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::cas::TreeId;
use crate::checkpoint::{CheckpointError, CheckpointResult, MountTag, Store};
use crate::fs::dirty::DirtyStore;
use crate::fs::{
    is_overlay_mount, mount_identity, mount_key, mount_objects, mount_tree, unmount_retrying,
    ReadMode, SnapshotStats, ViewOptions, WorkspaceStatus,
};
use crate::sys::Locked;

pub(super) use kernel::cstr;
use kernel::{
    detach, detach_lowers, detach_quickly, escape, hold, mount_overlay, overlay_dir,
    remove_generations, upper_is_empty,
};
pub(crate) use retire::Busy;
pub use state::OverlayMount;
use state::{io_err, Layers, Memo, OverlayTag};
pub(crate) use state::{tree_of, Capture};
use upper::{changes_since, UpperCapture};
pub use watch::start as start_upper_watch;

/// What an overlay mount left in the store for `mountpoint`: its lower's root, tag
/// and generation (whose upper exists).
pub(crate) fn found_state(
    store: &Store,
    mountpoint: &Path,
) -> CheckpointResult<Option<(TreeId, MountTag, u64)>> {
    Ok(found(store, mountpoint)?.map(|(lower, t)| (lower, t.tag, t.overlay_generation)))
}

fn found(store: &Store, mountpoint: &Path) -> CheckpointResult<Option<(TreeId, OverlayTag)>> {
    let dirty = DirtyStore::new(store.database().clone(), mount_key(mountpoint));
    let Some(meta) = dirty.meta()? else {
        return Ok(None);
    };
    let Ok(t) = serde_json::from_str::<OverlayTag>(meta.tag.get()) else {
        return Ok(None);
    };
    let dir = overlay_dir(store, mountpoint);
    if !dir
        .join(t.overlay_generation.to_string())
        .join("upper")
        .is_dir()
    {
        return Ok(None);
    }
    Ok(Some((meta.base, t)))
}

impl OverlayMount {
    /// Mounts generation `generation` (made if new: an empty upper) over tree
    /// `lower_root` at `mountpoint` (canonical), replacing whatever overlay of this
    /// mount was there (left by a killed daemon). With `build_image`, a tree with no
    /// metadata image gets one first; without, its view is the lower until an image
    /// exists.
    pub(crate) fn start(
        store: Arc<Store>,
        mountpoint: &Path,
        lower_root: TreeId,
        tag: MountTag,
        generation: u64,
        view: &ViewOptions,
        build_image: bool,
    ) -> CheckpointResult<OverlayMount> {
        let dir = overlay_dir(&store, mountpoint);
        let rootless = crate::mount::namespace::rootless();
        // An upper keeps overlayfs's attributes in one namespace of xattrs: one made by
        // root (trusted.overlay.*) is not read by a rootless mount, nor the reverse.
        if let Some((_, t)) = found(&store, mountpoint)? {
            if t.userxattr != rootless && !upper_is_empty(&dir, t.overlay_generation) {
                return Err(CheckpointError::Invalid(format!(
                    "{} has uncaptured changes from an overlay mount made {}; mount it that \
                     way and checkpoint them first",
                    mountpoint.display(),
                    if t.userxattr {
                        "by a user other than root"
                    } else {
                        "by root"
                    }
                )));
            }
        }
        // A killed daemon leaves its overlay mounted (its lower dead): detach it.
        if is_overlay_mount(mountpoint) {
            if !Self::ours(&dir, mountpoint) {
                return Err(CheckpointError::Invalid(format!(
                    "{}: already an overlay mount, not casfs's",
                    mountpoint.display()
                )));
            }
            detach(mountpoint);
        }
        let m = OverlayMount {
            store,
            rootless,
            mountpoint: mountpoint.to_path_buf(),
            dir,
            view: ViewOptions {
                // Every file the lower serves is noted: what the run read (the
                // upper's own files are its writes).
                reads: Some(view.reads.clone().unwrap_or_default()),
                // overlayfs reaches the lower with the mounter's credentials, callers'
                // permissions are checked by overlayfs itself.
                allow_other: true,
                ..view.clone()
            },
            state: Mutex::new(Layers {
                generation,
                lower_root,
                tag,
                lower: None,
                lowerdir: String::new(),
                image: false,
                mounted: false,
                id: (0, 0),
            }),
            memo: Mutex::new(Memo {
                generation,
                watch: None,
                captured: HashMap::new(),
                trees: HashMap::new(),
            }),
            cache: Mutex::new(HashMap::new()),
            retiring: Arc::default(),
            writers_pid_ns: Default::default(),
        };
        {
            let mut st = m.layers();
            m.mount_generation(&mut st, build_image)?;
            // Whatever the upper holds already (a daemon's uncaptured work) counts as
            // changed until a checkpoint.
            *m.memo() = Memo::new(generation, &m.upper(&st));
        }
        remove_generations(&m.dir, Some(generation));
        Ok(m)
    }

    /// Whether the overlay at `mountpoint` has its upper under `dir`.
    fn ours(dir: &Path, mountpoint: &Path) -> bool {
        let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return false;
        };
        let mp = mountpoint.to_string_lossy();
        let up = format!("upperdir={}", escape(dir));
        info.lines().any(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f.get(4).is_some_and(|m| *m == mp) && l.contains(&up)
        })
    }

    /// Mounts the lower layers and the overlay of `st`'s generation at the mountpoint:
    /// the tree's image over the object view when there is an image (built now if
    /// missing and `build`: a new mount, not a restore), else the tree's view.
    fn mount_generation(&self, st: &mut Layers, build: bool) -> CheckpointResult<()> {
        let g = self.gen_dir(st.generation);
        let (lower, meta, upper, work) = (
            g.join("lower"),
            g.join("meta"),
            g.join("upper"),
            g.join("work"),
        );
        // First: a lower left by a killed daemon answers ENOTCONN, and creating the
        // directory it is mounted on would fail.
        detach_lowers(&g);
        for d in [&lower, &meta, &upper, &work] {
            std::fs::create_dir_all(d).map_err(io_err(d))?;
        }
        // The merged root is the upper's: the workspace's owner's, like every file of
        // the lower (whose image or view says so), so that copy-up keeps them theirs.
        if self.view.owner.is_other() {
            self.view.owner.chown(&upper).map_err(io_err(&upper))?;
        }
        // An image needs root (EROFS mounts, metacopy); a rootless lower is the view.
        let image = if image::images_enabled() && !self.rootless {
            image::image_for(&self.store, st.lower_root, self.view.owner, build)
        } else {
            None
        };
        let image = image.filter(|img| match image::mount_image(img, &meta) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("mounting {}: {e}; serving the tree's view", img.display());
                false
            }
        });
        let objects = self.store.objects_shared();
        let (view, lowerdir) = if image.is_some() {
            let v = mount_objects(objects, &lower, &self.view).map_err(|e| {
                detach(&meta);
                io_err(&lower)(e)
            })?;
            (v, format!("{}::{}", escape(&meta), escape(&lower)))
        } else {
            let v =
                mount_tree(objects, st.lower_root, &lower, &self.view).map_err(io_err(&lower))?;
            (v, escape(&lower))
        };
        st.lowerdir = lowerdir;
        st.image = image.is_some();
        let mounted = self.record(st).and_then(|()| {
            mount_overlay(&st.lowerdir, &upper, &work, &self.mountpoint, self.rootless).map_err(
                |e| {
                    CheckpointError::io(
                        &self.mountpoint,
                        std::io::Error::new(e.kind(), format!("mounting overlayfs: {e}")),
                    )
                },
            )
        });
        if let Err(e) = mounted {
            // The view unmounts as it drops; the image's mount goes with it.
            detach(&meta);
            return Err(e);
        }
        st.lower = Some(view);
        st.mounted = true;
        st.id = mount_identity(&self.mountpoint);
        Ok(())
    }

    /// What changed since the last checkpoint.
    pub fn status(&self) -> WorkspaceStatus {
        self.status_with(true)
    }

    /// Whether nothing changed since the last checkpoint as far as was announced: the
    /// status without the look in `/proc` for files still open for writing (whose
    /// writes may have returned with no close yet). For a mount just made, which no
    /// process could have held a file of for long.
    pub fn is_clean(&self) -> bool {
        self.status_with(false).dirty_nodes == 0
    }

    fn status_with(&self, writers: bool) -> WorkspaceStatus {
        let (upper, base, image, dev) = {
            let st = self.layers();
            (self.upper(&st), st.lower_root, st.image, st.dev())
        };
        let memo = self.memo();
        let dirs = memo.watch.as_ref().and_then(|w| {
            if writers {
                w.changed(&self.mountpoint, dev, self.writers_scope()).dirs
            } else {
                w.announced(&self.mountpoint).dirs
            }
        });
        let c = changes_since(&upper, &memo.captured, dirs.as_ref(), 20).unwrap_or_default();
        WorkspaceStatus {
            base,
            dirty_nodes: c.nodes,
            dirty_files: c.files,
            dirty_bytes: c.bytes,
            dirty_paths: c.paths,
            nodes_loaded: 0,
            read_mode: if image {
                ReadMode::OverlayImage
            } else {
                ReadMode::Overlay
            },
        }
    }

    /// Shows tree `root` with `tag`: a new generation (an empty upper over it) mounted
    /// in place of the current one. Processes inside the old one keep what they had
    /// open (and their working directories) on the old layers, detached, which are
    /// removed once the last is let go. Refuses uncaptured changes unless `force`.
    pub(crate) fn swap(&self, root: TreeId, tag: MountTag, force: bool) -> CheckpointResult<()> {
        if !force {
            let s = self.status();
            if s.dirty_nodes > 0 {
                return Err(CheckpointError::Invalid(format!(
                    "{} uncaptured change(s) (for example {}); checkpoint them first or force",
                    s.dirty_nodes,
                    s.dirty_paths.first().cloned().unwrap_or_default()
                )));
            }
        }
        let mut st = self.layers();
        let old_lower = st.lower.take();
        let mut next = Layers {
            generation: st.generation + 1,
            lower_root: root,
            tag,
            lower: None,
            lowerdir: String::new(),
            image: false,
            mounted: false,
            id: (0, 0),
        };
        // Held, the detached overlay stays alive (its teardown waits for a quiet store).
        let mut held = None;
        if st.mounted && mount_identity(&self.mountpoint) == st.id {
            held = hold(&self.mountpoint, st.id);
            detach_quickly(&self.mountpoint, st.id);
        }
        st.mounted = false;
        if let Err(e) = self.mount_generation(&mut next, false) {
            // Put the old layers back rather than leave the mountpoint empty.
            let g = self.gen_dir(st.generation);
            if mount_overlay(
                &st.lowerdir,
                &g.join("upper"),
                &g.join("work"),
                &self.mountpoint,
                self.rootless,
            )
            .is_ok()
            {
                st.mounted = true;
                st.id = mount_identity(&self.mountpoint);
                st.lower = old_lower;
            }
            return Err(e);
        }
        let old_dir = self.gen_dir(st.generation);
        *st = next;
        *self.memo() = Memo::new(st.generation, &self.upper(&st));
        drop(st);
        // Stamps name inodes of the old upper, whose numbers the new one may reuse.
        self.cache.locked().clear();
        if let Some(v) = old_lower {
            self.retiring.retire(old_dir, v, held);
        }
        Ok(())
    }

    /// Whether the overlay is gone from the mountpoint (unmounted by anyone).
    pub fn is_finished(&self) -> bool {
        let st = self.layers();
        !st.mounted
            || !is_overlay_mount(&self.mountpoint)
            || mount_identity(&self.mountpoint) != st.id
    }

    /// Unmounts the overlay, then its lower, and tears down the generations restores
    /// replaced. A busy overlay is an error and stays.
    pub fn unmount(&self) -> std::io::Result<()> {
        self.retiring.flush();
        let mut st = self.layers();
        if st.mounted
            && is_overlay_mount(&self.mountpoint)
            && mount_identity(&self.mountpoint) == st.id
        {
            unmount_retrying(&self.mountpoint)?;
        }
        st.mounted = false;
        if let Some(v) = st.lower.take() {
            // The overlay is gone: nothing holds the lower but whoever detached files.
            detach(&self.gen_dir(st.generation).join("meta"));
            if let Err(e) = v.unmount() {
                tracing::warn!("unmounting the lower of {}: {e}", self.mountpoint.display());
            }
        }
        drop(st);
        // The generations torn down above are removed by threads of their own: a daemon
        // that exits now would cut them short and leave their files behind.
        if !retire::wait_removed(std::time::Duration::from_secs(5)) {
            tracing::warn!(
                "replaced generations of {} still in use: their files stay until the next mount",
                self.mountpoint.display()
            );
        }
        Ok(())
    }

    /// Detaches the overlay (users keep what they hold) and ends the lower.
    pub fn detach(&self) {
        self.retiring.flush();
        let mut st = self.layers();
        if st.mounted && mount_identity(&self.mountpoint) == st.id {
            detach(&self.mountpoint);
        }
        st.mounted = false;
        if let Some(v) = st.lower.take() {
            detach_lowers(&self.gen_dir(st.generation));
            drop(v);
        }
    }
}

impl Drop for OverlayMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::warn!(
                "unmounting {}: {e}; detaching it",
                self.mountpoint.display()
            );
            self.detach();
        }
    }
}

/// Hands `mountpoint` over to a FUSE mount: refuses (returns false) while an overlay of
/// it holds uncaptured work (its content is not its base checkpoint's); otherwise
/// removes the overlay's layers and record, so the FUSE mount starts from a checkpoint.
pub(crate) fn release_to_fuse(store: &Store, mountpoint: &Path) -> CheckpointResult<bool> {
    let Some((lower, t)) = found(store, mountpoint)? else {
        return Ok(true);
    };
    let (tag, g) = (t.tag, t.overlay_generation);
    let dir = overlay_dir(store, mountpoint);
    if !upper_is_empty(&dir, g) {
        // The content, computed from the upper and the lower's trees (no mount needed).
        let cache = Mutex::new(HashMap::new());
        let mut cap = UpperCapture {
            objects: store.objects(),
            lower_root: lower,
            filter: None,
            cache: &cache,
            stats: SnapshotStats::default(),
            kept_back: Vec::new(),
            reuse: None,
            listings: HashMap::new(),
            partial: HashMap::new(),
            trees: HashMap::new(),
            hashed: Vec::new(),
            prefix: if t.userxattr {
                upper::USER_PREFIX
            } else {
                upper::TRUSTED_PREFIX
            },
        };
        let upper = dir.join(g.to_string()).join("upper");
        let _session = crate::cas::write_session(store.objects());
        let merged = cap.dir(&upper, "", Some(lower))?;
        if merged != Some(tree_of(store, tag.base)?) {
            return Ok(false);
        }
    }
    detach_leftovers(store, mountpoint);
    let dirty = DirtyStore::new(store.database().clone(), mount_key(mountpoint));
    let mut b = dirty.batch();
    dirty.clear_all(&mut b);
    dirty.commit(b)?;
    dirty.sync()?;
    match crate::sys::dirfd::remove_path(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(CheckpointError::io(&dir, e)),
    }
}

/// Detaches any overlay and lower a killed daemon left for `mountpoint` (so that its
/// files can be removed).
pub(crate) fn detach_leftovers(store: &Store, mountpoint: &Path) {
    let dir = overlay_dir(store, mountpoint);
    if is_overlay_mount(mountpoint) && OverlayMount::ours(&dir, mountpoint) {
        detach(mountpoint);
    }
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            detach_lowers(&e.path());
        }
    }
}
