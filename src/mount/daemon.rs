//! The life of a mount daemon: started detached (its own session, the command run
//! again with `--foreground`), a pid file beside its control socket, signals waited for
//! (SIGINT, SIGTERM, SIGHUP), the serve loop, and the order of its end: unmount, drop
//! the store, remove the pid file, so whoever waits for the pid file finds the store
//! closed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rustix::process::{test_kill_process, Pid};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::control::{self, control_socket};
use super::{MountMode, MountedThread};
use crate::cas::TreeId;
use crate::checkpoint::{mount_dir, CheckpointError, CheckpointId, MountTag, Store, ThreadId};
use crate::fs::{mount_tree, ViewOptions, WorkspaceOptions};
use crate::sys::signal::Blocked;

/// How long a daemon may take to answer, or to close its store at the end.
pub const DAEMON_WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The detached process did not come up.
    #[error("{0}")]
    Start(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and the threads it starts), so
/// they can be waited for.
pub fn block_signals() -> Blocked {
    Blocked::block(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP])
}

/// Whether one of the blocked `signals` arrived within `ms` milliseconds.
pub fn wait_signal(signals: &Blocked, ms: u64) -> bool {
    signals.wait(Some(Duration::from_millis(ms))).is_some()
}

/// Runs this process's command again with `--foreground` as a detached process (its
/// own session, no terminal, stderr to `log`) and waits until `ready` says it answers;
/// returns its pid. A child that exits first has its log reported as the error; one
/// that does not answer within `wait` is killed.
pub fn start_detached(
    log: &Path,
    what: &str,
    wait: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<u32, DaemonError> {
    let exe = std::env::current_exe().map_err(io("finding the casfs executable"))?;
    let err = open_log(log).map_err(io(format!("creating {}", log.display())))?;
    // Read back (should the child fail) through this descriptor, not the name.
    let mut back = err
        .try_clone()
        .map_err(io(format!("opening {}", log.display())))?;
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    args.push("--foreground".into());
    let mut cmd = Command::new(exe);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err);
    // Its own session: detached from ours.
    crate::sys::process::detach(&mut cmd, false);
    let mut child = cmd.spawn().map_err(io(format!("starting {what}")))?;
    let start = Instant::now();
    loop {
        if ready() {
            return Ok(child.id());
        }
        if let Some(status) = child
            .try_wait()
            .map_err(io(format!("waiting for {what}")))?
        {
            let mut msg = String::new();
            {
                use std::io::{Read, Seek};
                let _ = back.rewind();
                let _ = back.read_to_string(&mut msg);
            }
            let _ = std::fs::remove_file(log);
            let msg = msg.trim().trim_start_matches("casfs: error: ");
            return Err(DaemonError::Start(format!(
                "{what} exited ({status}): {msg}"
            )));
        }
        if start.elapsed() > wait {
            let _ = child.kill();
            return Err(DaemonError::Start(format!(
                "{what} did not answer within {wait:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Opens `log` for a daemon's stderr, emptied: made (mode 0600) if missing, never
/// through a symlink, never a FIFO or device, and only a file of this user's with no
/// other name. A log may be in a directory others write to (a temporary directory), where
/// someone may have put anything under its name first.
fn open_log(log: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(log)?;
    let m = f.metadata()?;
    let euid = rustix::process::geteuid().as_raw();
    if !m.file_type().is_file() || m.uid() != euid || m.nlink() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "there is a file of uid {} there (not this user's log)",
                m.uid()
            ),
        ));
    }
    f.set_len(0)?;
    Ok(f)
}

/// Waits (at most [`DAEMON_WAIT`]) for the daemon named by `pid_file` to remove it or
/// end. Returns false if it is still there.
pub fn wait_daemon_exit(pid_file: &Path) -> bool {
    let Some(pid) = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.trim().parse::<libc::pid_t>().ok())
    else {
        return true;
    };
    let start = Instant::now();
    // Signal 0 only checks that the process exists (a pid of 0 or less names a group,
    // as kill(2) has it: taken to be there).
    let exists = || Pid::from_raw(pid).is_none_or(|p| test_kill_process(p).is_ok());
    while pid_file.exists() && exists() {
        if start.elapsed() > DAEMON_WAIT {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The pid file of the writable mount at `mountpoint` (canonical) of a store.
pub fn pid_file(store_root: &Path, mountpoint: &Path) -> PathBuf {
    mount_dir(store_root, mountpoint).join("pid")
}

/// Serves the writable workspace of `mountpoint` (canonical) for `thread` (at `at`, or
/// its uncaptured work, or the thread's head) until a signal arrives or someone
/// unmounts it. `ready` is told the mount's tag once it answers. On a signal it
/// detaches even with files open (their next access fails with ENOTCONN): every write
/// that returned is in the dirty set already.
pub fn serve_writable(
    store: Arc<Store>,
    mountpoint: &Path,
    thread: ThreadId,
    at: Option<CheckpointId>,
    opts: &WorkspaceOptions,
    mode: MountMode,
    ready: impl FnOnce(&MountTag),
) -> Result<(), DaemonError> {
    let signals = block_signals();
    let dir = mount_dir(store.root(), mountpoint);
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let socket = control_socket(store.root(), mountpoint);
    if socket.as_os_str().len() >= 100 {
        return Err(DaemonError::Start(format!(
            "{}: control socket path too long for a Unix socket; use a shorter --store path",
            socket.display()
        )));
    }
    let pid = pid_file(store.root(), mountpoint);
    let mounted = MountedThread::mount_mode(store, mountpoint, thread, at, opts, mode)?;
    std::fs::write(&pid, std::process::id().to_string())
        .map_err(io(format!("writing {}", pid.display())))?;
    ready(&mounted.tag());
    let stop = || wait_signal(&signals, 0);
    let served = control::serve(&mounted, &socket, &stop);
    let detached = !mounted.is_finished();
    if detached {
        mounted.detach();
    }
    // Unmounting drops the workspace and the store: the pid file goes last, so whoever
    // waits for it finds the store closed.
    let unmounted = mounted.unmount();
    drop(mounted);
    let _ = std::fs::remove_file(&pid);
    if !detached {
        unmounted.map_err(io(format!("unmounting {}", mountpoint.display())))?;
    }
    served.map_err(io(format!("control socket {}", socket.display())))
}

/// Serves tree `root` of `store` read-only at `mountpoint` until a signal arrives or
/// someone unmounts it.
pub fn serve_read_only(
    store: &Store,
    root: TreeId,
    mountpoint: &Path,
    opts: &ViewOptions,
    ready: impl FnOnce(),
) -> Result<(), DaemonError> {
    let signals = block_signals();
    let mounted = mount_tree(store.objects_shared(), root, mountpoint, opts)
        .map_err(io(format!("mounting {}", mountpoint.display())))?;
    ready();
    while !mounted.is_finished() {
        if wait_signal(&signals, 200) {
            break;
        }
    }
    mounted
        .unmount()
        .map_err(io(format!("unmounting {}", mountpoint.display())))
}
