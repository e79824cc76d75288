//! The writable workspace: an overlay of clean nodes (content in the object store) and
//! dirty nodes (content in a local upper file), with a persistent dirty set, an
//! O(dirty) snapshot and an O(1) root swap.
//!
//! One mutex guards the inode table; file data moves outside it (reads of clean files
//! through the chunk cache, reads and writes of upper files with pread/pwrite, or by the
//! kernel itself through FUSE passthrough). Every metadata change writes the nodes it
//! touched to the dirty set in the same step, so a killed daemon loses nothing the
//! kernel had been told was done.
//!
//! The parts, from the ground up: `node` and `nodes` (the inode table's entries),
//! `events` and `state` (what the lock guards), `shared` (the [`Workspace`] itself),
//! `table` (a change under the lock), then the snapshot, upper files and the FUSE side
//! built on them; this file mounts a workspace.

mod events;
mod fuse;
mod node;
mod nodes;
mod ops;
mod setattr;
mod shared;
mod snapshot;
mod state;
mod table;
mod upper;

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::fs::mounted::Mounted;

pub use events::{FsEvent, FsEventKind};
pub use ops::WorkspaceFs;
pub use shared::{ReadMode, Workspace, WorkspaceError, WorkspaceOptions, WorkspaceStatus};
pub use snapshot::{EntryKind, FilterError, Snapshot, SnapshotFilter, SnapshotStats};
pub use upper::upper_rel;

/// A mounted workspace; unmounted when dropped or by [`MountedWorkspace::try_unmount`].
pub struct MountedWorkspace {
    pub(super) mounted: Mounted,
    pub workspace: Arc<Workspace>,
}

impl MountedWorkspace {
    /// The FUSE transport serving it: `io_uring` or `classic`.
    pub fn transport(&self) -> &'static str {
        self.mounted.transport()
    }

    /// Unmounts; a busy mount stays mounted and served, and this may be tried again.
    pub fn try_unmount(&mut self) -> std::io::Result<()> {
        self.mounted.try_unmount()
    }

    pub fn is_finished(&self) -> bool {
        self.mounted.is_finished()
    }
}

/// Mounts `ws` at `mountpoint`, served by background threads.
pub fn mount_workspace(
    ws: Arc<Workspace>,
    mountpoint: &Path,
    opts: &WorkspaceOptions,
) -> std::io::Result<MountedWorkspace> {
    use fuser::{Config, MountOption};
    let mut config = Config::default();
    // nosuid,nodev: the workspace's contents are whatever an agent (or whoever can
    // append to its thread) wrote; their set-id bits and device numbers stay data, kept
    // and shown exactly, and never take effect.
    config.mount_options = vec![
        MountOption::FSName("casfs".into()),
        MountOption::Subtype("casfs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    if opts.allow_other || opts.owner.is_other() {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(opts.threads.max(1));
    raise_fd_limit();
    let started = Instant::now();
    let session = fuser::spawn_mount(WorkspaceFs(ws.clone()), mountpoint, &config)?;
    ws.set_notifier(session.notifier());
    tracing::debug!("mounted in {:?}", started.elapsed());
    Ok(MountedWorkspace {
        mounted: Mounted::new(session, mountpoint),
        workspace: ws,
    })
}

/// Open files (passthrough backings, upper files of open handles) count against the
/// descriptor limit: take the hard limit.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    // `None` is no limit (RLIM_INFINITY).
    let (cur, max) = (l.current.unwrap_or(u64::MAX), l.maximum.unwrap_or(u64::MAX));
    if cur < max {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: l.maximum,
                maximum: l.maximum,
            },
        );
    }
}

/// Mount key of a mountpoint: the first 8 bytes of the blake3 of its canonical path.
pub fn mount_key(mountpoint: &Path) -> [u8; 8] {
    let h = blake3::hash(mountpoint.as_os_str().as_bytes());
    h.as_bytes()[..8].try_into().expect("8 bytes")
}
