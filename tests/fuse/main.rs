//! Tests that mount for real. Every mount is owned by a [`MountGuard`] that unmounts
//! (lazily, so a stuck mount can never hang the run) and stops the daemon when dropped,
//! also when the test fails.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/soak.rs"]
mod soak_driver;

mod bench;
mod changes;
mod conformance;
mod counters;
mod events;
mod files;
mod fleet;
mod forget;
mod hostile;
mod isolation;
mod isolation_ahead;
mod isolation_net;
mod lifecycle;
mod limits;
mod middleware;
mod overlay;
mod paths;
mod peer;
mod portable;
mod races;
mod read_only;
mod reliability;
mod sandbox_events;
mod serve;
mod serve_writers;
mod setid;
mod soak;
mod tenants;
mod transport;
mod trust;
mod users;
mod workspace;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Unmounts `mountpoint` when dropped, whatever happened.
pub struct MountGuard {
    pub mountpoint: PathBuf,
}

impl MountGuard {
    pub fn new(mountpoint: &Path) -> MountGuard {
        MountGuard {
            mountpoint: mountpoint.to_path_buf(),
        }
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        // Also a dead mount (whose statfs fails), so no is_fuse_mount check: on a plain
        // directory this is a harmless EINVAL.
        let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes())
            .expect("no NUL in test paths");
        // SAFETY: a NUL-terminated path. MNT_DETACH never blocks on a dead daemon.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        // An overlay mount's lower views (left mounted by a killed daemon) live under
        // the store, beside the mountpoint in the test's temporary directory.
        if let Some(parent) = self.mountpoint.parent() {
            for lower in mounts_under(parent) {
                if lower.ends_with("lower") {
                    detach(&lower);
                }
            }
        }
    }
}

/// Unmounts every mount under a directory when dropped (a server's sandboxes,
/// whatever their keys), whatever happened.
pub struct MountsUnder(pub PathBuf);

impl Drop for MountsUnder {
    fn drop(&mut self) {
        for m in mounts_under(&self.0) {
            drop(MountGuard::new(&m));
        }
    }
}

fn detach(p: &Path) {
    if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Mount points strictly under `dir`, from /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let prefix = format!("{}/", dir.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(PathBuf::from)
        .collect()
}

/// The backend `casfs mount` uses in this run: `CASFS_MOUNT_MODE` (fuse, overlay or
/// auto, as the command reads it), the suite is run once per backend.
pub fn mount_mode() -> casfs::mount::MountMode {
    std::env::var("CASFS_MOUNT_MODE")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .expect("CASFS_MOUNT_MODE is fuse, overlay or auto")
}

/// Whether this run's mounts are overlay mounts.
pub fn overlay() -> bool {
    mount_mode() == casfs::mount::MountMode::Overlay
}

/// Whether this run is root's. The rootless pass (scripts/test-rootless.sh) runs the
/// suite as an ordinary user inside casfs's namespace of that user: its overlay mounts
/// have no image, no mount has passthrough, and no test may act as another user.
pub fn root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether this run's overlay mounts are rootless ones (in a user namespace).
pub fn rootless() -> bool {
    overlay() && !root()
}

/// Skips the calling test (returns true, having said why) in a run that is not root's.
pub fn needs_root(why: &str) -> bool {
    if root() {
        return false;
    }
    eprintln!("skipped: not root ({why})");
    true
}

/// Whether `p` is a writable casfs mount of this run's backend.
pub fn is_mounted(p: &Path) -> bool {
    if overlay() {
        casfs::fs::is_overlay_mount(p)
    } else {
        casfs::fs::is_fuse_mount(p)
    }
}

/// Waits until `cond` holds, up to `limit`.
pub fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}
