//! A mounted FUSE session ([`Mounted`]) and what casfs asks of the host's mounts: a
//! mount's identity, unmounting, detaching, whether a path is a FUSE, overlay or dead
//! mount, and the process settings a FUSE server runs with.

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, StatxFlags};
use rustix::io::Errno;
use rustix::mount::UnmountFlags;

/// A FUSE session served by background threads; unmounted when dropped or by
/// [`Mounted::unmount`].
///
/// casfs unmounts by itself and drops the session once the kernel has ended it. fuser
/// 0.18.0 decided whether its session was still mounted from an inverted POLLERR test
/// (cberner/fuser#703, fixed after 0.18.0), so dropping it unmounted the path again,
/// which by then could be the next mount there; casfs carries the fix
/// (third_party/fuser/PATCHES.md), so a finished session and its /dev/fuse descriptor
/// are given back.
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
    /// `mount_identity` of the mount's root, to tell it from whatever else is mounted
    /// there later.
    id: (u64, u64),
}

/// How long unmount tries again while the mount is busy.
const BUSY_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long unmount waits for the serving threads after the kernel let go.
const UNMOUNT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long it waits once the process is ending ([`process_ending`]).
const ENDING_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

static ENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says that this process is about to exit (a server destroying its sandboxes as it
/// stops): a mount unmounted from here whose connection lives on elsewhere (a bind
/// mount someone made of it, an overlay over it that is held) is not waited for. Its
/// connection ends with the process, and every such mount waiting [`UNMOUNT_WAIT`]
/// would make the stop take ten seconds a sandbox, past a service manager's patience.
pub fn process_ending() {
    ENDING.store(true, std::sync::atomic::Ordering::SeqCst);
}

impl Mounted {
    pub(super) fn new(session: fuser::BackgroundSession, mountpoint: &Path) -> Mounted {
        let id = mount_identity(mountpoint);
        // When io_uring was agreed at INIT, the ring threads register their queues
        // right after: wait a moment, so that what the mount reports is what serves it.
        let start = std::time::Instant::now();
        while session.io_uring_negotiated()
            && !session.io_uring_active()
            && !session.guard.is_finished()
            && start.elapsed() < std::time::Duration::from_secs(2)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Mounted {
            session: Some(session),
            mountpoint: mountpoint.to_path_buf(),
            id,
        }
    }

    /// Unmounts (if the mount at the path is still this one) and waits for the serving
    /// threads to end. A busy mount is an error and stays mounted.
    pub fn unmount(mut self) -> std::io::Result<()> {
        self.finish()
    }

    /// [`Mounted::unmount`] that keeps the session on failure (a busy mount), so it can
    /// be tried again.
    pub fn try_unmount(&mut self) -> std::io::Result<()> {
        self.finish()
    }

    /// The FUSE transport serving the mount: `io_uring` or `classic`.
    pub fn transport(&self) -> &'static str {
        self.session
            .as_ref()
            .map_or("classic", super::transport::describe)
    }

    /// Whether the kernel side is gone (someone unmounted it).
    pub fn is_finished(&self) -> bool {
        self.session.as_ref().is_none_or(|s| s.guard.is_finished())
    }

    fn finish(&mut self) -> std::io::Result<()> {
        let Some(s) = self.session.take() else {
            return Ok(());
        };
        if !s.guard.is_finished() && self.ours_on_top() {
            // A file closed just now keeps the mount busy until the daemon has answered
            // the kernel's asynchronous release of it: busy is tried again for a while.
            if let Err(e) = unmount_retrying(&self.mountpoint) {
                self.session = Some(s);
                return Err(e);
            }
            // Unmounted: the kernel ends the connection and the threads return.
            let start = std::time::Instant::now();
            let wait = if ENDING.load(std::sync::atomic::Ordering::SeqCst) {
                ENDING_WAIT
            } else {
                UNMOUNT_WAIT
            };
            while !s.guard.is_finished() && start.elapsed() < wait {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        if s.guard.is_finished() {
            // The connection is gone: dropping the session unmounts nothing (fuser's
            // check, patched: third_party/fuser/PATCHES.md) and closes its /dev/fuse
            // descriptor.
            drop(s);
        } else {
            // Detached elsewhere with files still open: the connection lives on, and
            // dropping the session would unmount the path, which may hold another
            // mount by now. Its threads end when the last file is closed.
            std::mem::forget(s);
        }
        Ok(())
    }

    /// Whether the topmost mount at the mountpoint is this session's.
    fn ours_on_top(&self) -> bool {
        self.id != (0, 0) && mount_identity(&self.mountpoint) == self.id
    }
}

/// Which mount `path` shows: its device and its mount's id, unique for the boot where
/// the kernel offers `STATX_MNT_ID_UNIQUE` (6.8 on), else the classic id. The device
/// alone does not tell an overlay from the next one mounted there: both take anonymous
/// device numbers, and a number freed by an unmount is handed out again at once.
/// `(0, 0)` when the path cannot be looked up.
pub fn mount_identity(path: &Path) -> (u64, u64) {
    identity_at(rustix::fs::CWD, path, AtFlags::empty())
}

/// [`mount_identity`] of what the open descriptor `f` (an `O_PATH` one too) refers to.
pub fn fd_identity(f: &impl AsFd) -> (u64, u64) {
    identity_at(f.as_fd(), c"", AtFlags::EMPTY_PATH)
}

fn identity_at(dir: BorrowedFd<'_>, path: impl rustix::path::Arg, flags: AtFlags) -> (u64, u64) {
    const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
    let mask = StatxFlags::BASIC_STATS
        | StatxFlags::MNT_ID
        | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE);
    match rustix::fs::statx(dir, path, flags, mask) {
        Ok(x) => (
            rustix::fs::makedev(x.stx_dev_major, x.stx_dev_minor),
            x.stx_mnt_id,
        ),
        Err(_) => (0, 0),
    }
}

/// Unmounts whatever is mounted at `path` (not lazily), trying again for a while
/// (`BUSY_WAIT`) while it is busy; nothing mounted there (EINVAL) is success. A mount
/// still busy after that is the error, and stays mounted.
pub fn unmount_retrying(path: &Path) -> std::io::Result<()> {
    let c = cpath(path)?;
    let start = std::time::Instant::now();
    loop {
        match rustix::mount::unmount(c.as_c_str(), UnmountFlags::empty()) {
            Ok(()) | Err(Errno::INVAL) => return Ok(()),
            Err(Errno::BUSY) if start.elapsed() < BUSY_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!("unmounting {}: {e}", self.mountpoint.display());
            if let Some(s) = self.session.take() {
                std::mem::forget(s);
            }
        }
    }
}

/// `statfs` magic number of FUSE filesystems.
pub const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Lowers the calling thread's CPU and I/O priority (nice 19, best-effort I/O level 7;
/// never the idle classes, which a busy machine would starve): background work (a
/// replaced overlay generation removed, a replaced inode table dropped) yields to the
/// workspace.
pub fn low_priority() {
    let _ = crate::sys::priority::set_thread_nice(19);
    let _ = crate::sys::priority::set_thread_io_best_effort(7);
}

/// Whether the kernel lets this process register passthrough backing files: it wants
/// `CAP_SYS_ADMIN` in the initial user namespace (fs/fuse/backing.c), which a user
/// other than root, or root inside a user namespace, lacks. FUSE would accept the
/// passthrough flag at init and then refuse every backing file.
pub fn passthrough_permitted() -> bool {
    use std::os::unix::fs::MetadataExt;
    const CAP_SYS_ADMIN: u32 = 21;
    // The initial user namespace's nsfs inode (PROC_USER_INIT_INO).
    const INITIAL_USER_NS: u64 = 0xEFFF_FFFD;
    let initial_ns =
        std::fs::metadata("/proc/self/ns/user").is_ok_and(|m| m.ino() == INITIAL_USER_NS);
    let sys_admin = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
            .is_some_and(|c| c & (1 << CAP_SYS_ADMIN) != 0)
    });
    initial_ns && sys_admin
}

/// Whether `path` is the root of a FUSE mount (used to wait for a mount to answer).
pub fn is_fuse_mount(path: &std::path::Path) -> bool {
    statfs(path).is_ok_and(|st| fs_type(&st) == FUSE_SUPER_MAGIC)
}

/// Whether `path` is the root of an overlayfs mount: an overlay filesystem whose device
/// differs from its parent directory's (a plain directory inside an overlay, as in a
/// container whose root is one, is not).
pub fn is_overlay_mount(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    const OVERLAYFS_SUPER_MAGIC: i64 = 0x794c_7630;
    if !statfs(path).is_ok_and(|st| fs_type(&st) == OVERLAYFS_SUPER_MAGIC) {
        return false;
    }
    let dev = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    match dev(&path.join("..")) {
        Some(parent) => dev(path) != Some(parent),
        None => true,
    }
}

/// Detaches the mount at `path` lazily (`MNT_DETACH`: processes inside keep what they
/// hold; a dead FUSE daemon never blocks it), not following a symbolic link there.
pub fn detach(path: &std::path::Path) -> std::io::Result<()> {
    let flags = UnmountFlags::DETACH | UnmountFlags::NOFOLLOW;
    rustix::mount::unmount(cpath(path)?.as_c_str(), flags).map_err(std::io::Error::from)
}

/// Whether `path` is a FUSE mount whose daemon is gone ("transport endpoint is not
/// connected"). Asked with statfs, which the kernel never answers from its caches (a
/// stat of the mountpoint may still succeed from cached attributes).
pub fn is_dead_mount(path: &std::path::Path) -> bool {
    matches!(statfs(path), Err(e) if e.raw_os_error() == Some(libc::ENOTCONN))
}

fn statfs(path: &std::path::Path) -> std::io::Result<rustix::fs::StatFs> {
    rustix::fs::statfs(cpath(path)?.as_c_str()).map_err(std::io::Error::from)
}

/// The filesystem type (`f_type`, a magic number) of a `statfs`, whose width differs
/// between architectures.
#[allow(clippy::useless_conversion)]
fn fs_type(st: &rustix::fs::StatFs) -> i64 {
    i64::from(st.f_type)
}

/// `path` for a system call; a NUL in it is `InvalidInput`.
fn cpath(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}
