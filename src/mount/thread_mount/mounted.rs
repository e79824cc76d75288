//! A mounted thread's core: the [`MountedThread`] value (its store, backend and
//! mountpoint), the [`MountMode`] that picks its backend, the [`MountCheckpoint`] a
//! checkpoint of it yields, and what reads or tears down the mount as it stands (its
//! tag, status, unmount, detach). Mounting, restore and checkpoint sit above it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cas::TreeId;
use crate::checkpoint::{
    CheckpointError, CheckpointId, CheckpointResult, MountTag, Store, ThreadId,
};
use crate::fs::{
    mount_key, MountedWorkspace, SnapshotStats, Workspace, WorkspaceError, WorkspaceStatus,
};
use crate::mount::overlay::OverlayMount;
use crate::sys::Locked;

pub(super) fn ws_err(e: WorkspaceError) -> CheckpointError {
    match e {
        WorkspaceError::Cas(c) => CheckpointError::Cas(c),
        WorkspaceError::Refused(why) => CheckpointError::Refused(why),
        other => CheckpointError::Invalid(other.to_string()),
    }
}

/// The outcome of a checkpoint of a mount.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MountCheckpoint {
    pub checkpoint: CheckpointId,
    pub thread: ThreadId,
    pub parent: Option<CheckpointId>,
    pub changed_files: u64,
    pub stats: SnapshotStats,
    pub duration_us: u64,
}

/// How a workspace is mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountMode {
    /// casfs's own FUSE filesystem: every request answered by the daemon (per-write
    /// events, chunk-exact checkpoints of large files).
    Fuse,
    /// The kernel's overlayfs over a read-only casfs lower: native-speed metadata and
    /// writes on a local upper directory. As root, in the host's mount namespace; as
    /// any other user, in that user's namespace ([`crate::mount::namespace`]).
    Overlay,
}

/// Why `auto` chose FUSE in this process, if it did for a reason the user can change.
static AUTO_FALLBACK: std::sync::OnceLock<String> = std::sync::OnceLock::new();

impl MountMode {
    /// The faster mode this host allows: overlay where the kernel has overlayfs and
    /// the caller is root, or may make a user namespace and open `/dev/fuse`; else FUSE
    /// (and [`MountMode::auto_fallback`] says why).
    pub fn default_for_host() -> MountMode {
        let why = if crate::mount::namespace::rootless() {
            crate::mount::namespace::rootless_overlay_blocked()
        } else {
            let overlay = std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| {
                f.lines()
                    .any(|l| l.split_whitespace().last() == Some("overlay"))
            });
            (!overlay).then(|| "the kernel has no overlayfs (modprobe overlay)".to_string())
        };
        match why {
            None => MountMode::Overlay,
            Some(w) => {
                let _ = AUTO_FALLBACK.set(w);
                MountMode::Fuse
            }
        }
    }

    /// Why `auto` chose FUSE over overlay in this process (None: it did not, or it was
    /// not asked).
    pub fn auto_fallback() -> Option<&'static str> {
        AUTO_FALLBACK.get().map(String::as_str)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MountMode::Fuse => "fuse",
            MountMode::Overlay => "overlay",
        }
    }
}

impl std::str::FromStr for MountMode {
    type Err = String;
    fn from_str(s: &str) -> Result<MountMode, String> {
        match s {
            "fuse" => Ok(MountMode::Fuse),
            "overlay" => Ok(MountMode::Overlay),
            "auto" => Ok(MountMode::default_for_host()),
            other => Err(format!("mount mode {other:?}: use fuse, overlay or auto")),
        }
    }
}

/// What serves the workspace.
pub(super) enum Backend {
    Fuse {
        workspace: Arc<Workspace>,
        /// The FUSE session (none once unmounted).
        mounted: std::sync::Mutex<Option<MountedWorkspace>>,
    },
    Overlay(Box<OverlayMount>),
}

/// A workspace being served for a thread.
pub struct MountedThread {
    pub(super) store: Arc<Store>,
    pub(super) backend: Backend,
    pub(super) mountpoint: PathBuf,
    pub lease_ttl: Duration,
}

/// Unmounts the session in `s`, if any; a busy mount stays there.
pub(super) fn unmount_session(s: &mut Option<MountedWorkspace>) -> std::io::Result<()> {
    if let Some(m) = s.as_mut() {
        m.try_unmount()?;
    }
    *s = None;
    Ok(())
}

impl MountedThread {
    /// The FUSE workspace (none for an overlay mount).
    pub fn workspace(&self) -> Option<&Arc<Workspace>> {
        match &self.backend {
            Backend::Fuse { workspace, .. } => Some(workspace),
            Backend::Overlay(_) => None,
        }
    }

    /// The FUSE transport of the mount (overlay: of its lower's view).
    pub fn fuse_transport(&self) -> &'static str {
        match &self.backend {
            Backend::Fuse { mounted, .. } => mounted
                .locked()
                .as_ref()
                .map_or("classic", |m| m.transport()),
            Backend::Overlay(o) => o.fuse_transport(),
        }
    }

    /// The backend serving the mount.
    pub fn mode(&self) -> MountMode {
        match &self.backend {
            Backend::Fuse { .. } => MountMode::Fuse,
            Backend::Overlay(_) => MountMode::Overlay,
        }
    }

    /// A file's content in the tree the workspace was restored at.
    pub fn base_file(&self, path: &str) -> CheckpointResult<Option<Vec<u8>>> {
        let base = self.status().1.base;
        Ok(crate::cas::file_at(self.store.objects(), &base, path)?)
    }

    /// The store the workspace checkpoints into.
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    pub fn tag(&self) -> MountTag {
        match &self.backend {
            Backend::Fuse { workspace, .. } => {
                MountTag::from_tag(&workspace.base().1).expect("the daemon wrote it")
            }
            Backend::Overlay(o) => o.tag(),
        }
    }

    /// Whether the mount is gone (unmounted here or by someone else).
    pub fn is_finished(&self) -> bool {
        match &self.backend {
            Backend::Fuse { mounted, .. } => {
                mounted.locked().as_ref().is_none_or(|m| m.is_finished())
            }
            Backend::Overlay(o) => o.is_finished(),
        }
    }

    /// Where a checkpoint looks for files still open for writing: among the processes
    /// of pid namespace `pid_ns` (its inode: an isolated sandbox's), or of the whole
    /// host (`None`, the default). A FUSE mount sees every write and looks nowhere.
    pub fn writers_in(&self, pid_ns: Option<u64>) {
        if let Backend::Overlay(o) = &self.backend {
            o.writers_in(pid_ns);
        }
    }

    /// The key of this mount's dirty set and directory in the store.
    pub fn key(&self) -> [u8; 8] {
        mount_key(&self.mountpoint)
    }

    /// Unmounts (whoever else holds this mount sees it finished). A busy mount is an
    /// error and stays mounted; unmounting again later may succeed.
    pub fn unmount(&self) -> std::io::Result<()> {
        match &self.backend {
            Backend::Fuse { mounted, .. } => unmount_session(&mut mounted.locked()),
            Backend::Overlay(o) => o.unmount(),
        }
    }

    /// Detaches the mount lazily (processes inside keep what they hold).
    pub fn detach(&self) {
        match &self.backend {
            Backend::Fuse { .. } => {
                let _ = crate::fs::detach(&self.mountpoint);
            }
            Backend::Overlay(o) => o.detach(),
        }
    }

    /// Whether the workspace holds nothing uncaptured, as far as its changes were
    /// announced (on the overlay backend, a file still open for writing is not looked
    /// for: see [`OverlayMount::is_clean`]); cheaper than [`status`](Self::status).
    pub fn is_clean(&self) -> bool {
        match &self.backend {
            Backend::Fuse { workspace, .. } => workspace.status().dirty_nodes == 0,
            Backend::Overlay(o) => o.is_clean(),
        }
    }

    pub fn status(&self) -> (MountTag, WorkspaceStatus) {
        let st = match &self.backend {
            Backend::Fuse { workspace, .. } => workspace.status(),
            Backend::Overlay(o) => o.status(),
        };
        (self.tag(), st)
    }
}

/// A root for a template checkpoint, replaced by the snapshot's.
pub(super) fn empty_root() -> TreeId {
    TreeId(crate::cas::Hash::of(b""))
}
