//! Tests that mount for real. Every mount is owned by a [`MountGuard`] that unmounts
//! (lazily, so a stuck mount can never hang the run) and stops the daemon when dropped,
//! also when the test fails.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/soak.rs"]
mod soak_driver;

mod bench;
mod fleet;
mod lifecycle;
mod middleware;
mod read_only;
mod reliability;
mod serve;
mod soak;
mod trust;
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
