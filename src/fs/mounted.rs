//! A mounted FUSE session ([`Mounted`]) and what casfs asks of the host's mounts: a
//! mount's identity, unmounting, detaching, whether a path is a FUSE, overlay or dead
//! mount, and the process settings a FUSE server runs with.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

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
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return (0, 0);
    };
    identity_at(libc::AT_FDCWD, &c, 0)
}

/// [`mount_identity`] of what the open descriptor `f` (an `O_PATH` one too) refers to.
pub fn fd_identity(f: &impl std::os::fd::AsRawFd) -> (u64, u64) {
    identity_at(f.as_raw_fd(), c"", libc::AT_EMPTY_PATH)
}

fn identity_at(dirfd: libc::c_int, path: &std::ffi::CStr, flags: libc::c_int) -> (u64, u64) {
    const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut buf: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statx buffer that outlive the call.
    let r = unsafe {
        libc::statx(
            dirfd,
            path.as_ptr(),
            flags,
            libc::STATX_BASIC_STATS | libc::STATX_MNT_ID | STATX_MNT_ID_UNIQUE,
            &mut buf,
        )
    };
    if r != 0 {
        return (0, 0);
    }
    let dev = libc::makedev(buf.stx_dev_major, buf.stx_dev_minor);
    (dev, buf.stx_mnt_id)
}

/// Unmounts whatever is mounted at `path` (not lazily), trying again for a while
/// (`BUSY_WAIT`) while it is busy; nothing mounted there (EINVAL) is success. A mount
/// still busy after that is the error, and stays mounted.
pub fn unmount_retrying(path: &Path) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let start = std::time::Instant::now();
    loop {
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINVAL) => return Ok(()),
            Some(libc::EBUSY) if start.elapsed() < BUSY_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            _ => return Err(e),
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
    // SAFETY: on Linux, PRIO_PROCESS with who 0 is the calling thread.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_BE: libc::c_long = 2;
    // SAFETY: ioprio_set takes plain integers; who 0 is the calling thread.
    unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            (IOPRIO_CLASS_BE << 13) | 7,
        )
    };
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
    statfs(path).is_ok_and(|st| st.f_type == FUSE_SUPER_MAGIC)
}

/// Whether `path` is the root of an overlayfs mount: an overlay filesystem whose device
/// differs from its parent directory's (a plain directory inside an overlay, as in a
/// container whose root is one, is not).
pub fn is_overlay_mount(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    const OVERLAYFS_SUPER_MAGIC: libc::c_long = 0x794c_7630;
    if !statfs(path).is_ok_and(|st| st.f_type as libc::c_long == OVERLAYFS_SUPER_MAGIC) {
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
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `path` is a FUSE mount whose daemon is gone ("transport endpoint is not
/// connected"). Asked with statfs, which the kernel never answers from its caches (a
/// stat of the mountpoint may still succeed from cached attributes).
pub fn is_dead_mount(path: &std::path::Path) -> bool {
    matches!(statfs(path), Err(e) if e.raw_os_error() == Some(libc::ENOTCONN))
}

fn statfs(path: &std::path::Path) -> std::io::Result<libc::statfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: zeroed statfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}
