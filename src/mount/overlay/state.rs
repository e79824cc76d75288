//! An overlay mount's state: the [`OverlayMount`] value (its store, mountpoint and
//! directory, the current generation's [`Layers`], the [`Memo`] of the last capture,
//! the hash cache), the tag it records, a [`Capture`] waiting to be recorded, and the
//! accessors its mounting, capture and status share.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::cas::TreeId;
use crate::checkpoint::{CheckpointError, CheckpointId, CheckpointResult, MountTag, Store};
use crate::fs::dirty::{DirtyStore, MountMeta};
use crate::fs::{mount_key, MountedTree, ViewOptions};
use crate::sys::Locked;

use super::retire::Retirements;
use super::upper::{self, DirTrees, HashCache, Listings, Partial, Rel, Stamp, UpperError};
use super::watch::UpperWatch;

/// The tag an overlay mount keeps in its mount record: a [`MountTag`] (what prune, gc
/// and a FUSE mount read) and the generation of its layers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct OverlayTag {
    #[serde(flatten)]
    pub(super) tag: MountTag,
    pub(super) overlay_generation: u64,
    /// Whether the overlay keeps its own attributes as `user.overlay.*` (a rootless
    /// mount, made in the user's namespace) rather than `trusted.overlay.*`.
    #[serde(default)]
    pub(super) userxattr: bool,
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::io(path, e)
}

impl From<UpperError> for CheckpointError {
    fn from(e: UpperError) -> CheckpointError {
        match e {
            UpperError::Io { path, source } => CheckpointError::io(Path::new(&path), source),
            UpperError::Refused(why) => CheckpointError::Refused(why),
            UpperError::Cas(c) => CheckpointError::Cas(c),
            UpperError::Invalid(why) => CheckpointError::Invalid(why),
        }
    }
}

/// The layers of one generation.
pub(super) struct Layers {
    pub(super) generation: u64,
    pub(super) lower_root: TreeId,
    pub(super) tag: MountTag,
    /// The read-only view serving the lower, the tree's or (under an image) the
    /// objects' (none once unmounted).
    pub(super) lower: Option<MountedTree>,
    /// The overlay's `lowerdir` option (one layer, or the image and its data layer).
    pub(super) lowerdir: String,
    /// Whether the lower's metadata is an image.
    pub(super) image: bool,
    /// Whether the overlay at the mountpoint is this one.
    pub(super) mounted: bool,
    /// `identity` of the overlay's root, to tell it from whatever is mounted there later.
    pub(super) id: (u64, u64),
}

impl Layers {
    /// The overlay's device, as identified when it was mounted (none while it is not).
    pub(super) fn dev(&self) -> Option<u64> {
        (self.mounted && self.id.0 != 0).then_some(self.id.0)
    }
}

/// What the last checkpoint captured of the current generation's upper, and the watch
/// that says which directories changed since: a checkpoint or `status` looks at those
/// only.
pub(super) struct Memo {
    pub(super) generation: u64,
    /// None where inotify is not available: the whole upper is walked.
    pub(super) watch: Option<UpperWatch>,
    /// Every upper entry's stamp at the last checkpoint.
    pub(super) captured: Listings,
    /// Every upper directory's tree at the last checkpoint.
    pub(super) trees: DirTrees,
}

impl Memo {
    pub(super) fn new(generation: u64, upper: &Path) -> Memo {
        Memo {
            generation,
            watch: UpperWatch::start(upper),
            captured: HashMap::new(),
            trees: HashMap::new(),
        }
    }
}

/// A capture of the upper, to record as what a checkpoint holds once it is appended.
pub(crate) struct Capture {
    pub(super) generation: u64,
    /// The last watch event the capture covers.
    pub(super) upto: Option<u64>,
    /// Whether every directory was visited.
    pub(super) full: bool,
    pub(super) listings: Listings,
    /// Entries of directories looked at in part (none: not in the upper).
    pub(super) partial: Partial,
    pub(super) trees: DirTrees,
    /// Entries left uncaptured (left out or stored in another form by the filter).
    pub(super) kept_back: Vec<Rel>,
    /// The files it counted as hashed.
    pub(super) hashed: Vec<Stamp>,
}

/// A workspace served by overlayfs over a casfs lower.
pub struct OverlayMount {
    pub(super) store: Arc<Store>,
    /// Mounted by a user who is not root, in the user's namespace
    /// ([`crate::mount::namespace`]): `userxattr`, no redirects, no image.
    pub(super) rootless: bool,
    pub(super) mountpoint: PathBuf,
    /// `<store>/mounts/<key>/overlay`.
    pub(super) dir: PathBuf,
    pub(super) view: ViewOptions,
    pub(super) state: Mutex<Layers>,
    /// Lock order: `state`, then `memo`; never `state` while `memo` is held.
    pub(super) memo: Mutex<Memo>,
    pub(super) cache: HashCache,
    /// Generations replaced by restores, waiting for a quiet store to be torn down.
    pub(super) retiring: Arc<Retirements>,
    /// Where files still open for writing are looked for ([`Self::writers_in`]): the
    /// pid namespace's inode, 0 for every process of the host.
    pub(super) writers_pid_ns: std::sync::atomic::AtomicU64,
}

impl OverlayMount {
    /// The FUSE transport of the lower's view: `io_uring` or `classic`.
    pub(crate) fn fuse_transport(&self) -> &'static str {
        self.layers()
            .lower
            .as_ref()
            .map_or("classic", |m| m.transport())
    }

    pub(super) fn layers(&self) -> MutexGuard<'_, Layers> {
        self.state.locked()
    }

    pub(super) fn memo(&self) -> MutexGuard<'_, Memo> {
        self.memo.locked()
    }

    pub(super) fn gen_dir(&self, g: u64) -> PathBuf {
        self.dir.join(g.to_string())
    }

    /// Persists the layers' record (lower root, tag, generation) durably.
    pub(super) fn record(&self, st: &Layers) -> CheckpointResult<()> {
        let dirty = DirtyStore::new(self.store.database().clone(), mount_key(&self.mountpoint));
        let tag = OverlayTag {
            tag: st.tag.clone(),
            overlay_generation: st.generation,
            userxattr: self.rootless,
        };
        let meta = MountMeta {
            base: st.lower_root,
            tag: serde_json::value::to_raw_value(&tag).expect("a tag serializes"),
        };
        let mut b = dirty.batch();
        dirty.put_meta(&mut b, &meta);
        dirty.commit(b)?;
        dirty.sync()?;
        Ok(())
    }

    /// The xattr prefix of overlayfs's own attributes on this mount's upper.
    pub(super) fn prefix(&self) -> &'static [u8] {
        if self.rootless {
            upper::USER_PREFIX
        } else {
            upper::TRUSTED_PREFIX
        }
    }

    pub(super) fn upper(&self, st: &Layers) -> PathBuf {
        self.gen_dir(st.generation).join("upper")
    }

    pub fn tag(&self) -> MountTag {
        self.layers().tag.clone()
    }

    /// Files still open for writing (whose writes may have returned with no close
    /// yet) are looked for only among the processes of pid namespace `pid_ns` (its
    /// inode; `None`: among every process of the host). An isolated sandbox's processes
    /// cannot leave theirs, and a look at every process of the host costs with their
    /// number; a process outside the namespace writing through a handle it keeps open
    /// is then captured once it closes it.
    pub fn writers_in(&self, pid_ns: Option<u64>) {
        self.writers_pid_ns
            .store(pid_ns.unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
    }

    pub(super) fn writers_scope(&self) -> Option<u64> {
        Some(
            self.writers_pid_ns
                .load(std::sync::atomic::Ordering::SeqCst),
        )
        .filter(|n| *n != 0)
    }
}

/// The tree of checkpoint `base`, or the empty tree without one.
pub(crate) fn tree_of(store: &Store, base: Option<CheckpointId>) -> CheckpointResult<TreeId> {
    match base {
        Some(b) => Ok(store.checkpoints().get(&b)?.body.root),
        None => {
            let empty = crate::cas::Tree::from_sorted_entries(Vec::new()).expect("empty tree");
            Ok(crate::cas::store_tree(store.objects(), &empty)?.0)
        }
    }
}
