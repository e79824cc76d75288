//! A process started ahead of the sandbox that will need it (`casfs-sandbox-init
//! sandbox-spawn`, the small executable, else `casfs sandbox-spawn`),
//! already in a control group of its own, waiting to become that sandbox's bubblewrap.
//!
//! Moving a process into a control group on a cgroup v1 host costs a grace period of
//! RCU per hierarchy (measured here: 6 to 20 ms each, four hierarchies), and it must
//! happen before bubblewrap forks. A spare pays it while no one waits: a sandbox's
//! start takes the spare (when its limits are the server's current ones) and a new
//! one is made in the background. The spare holds nothing but its socket to the
//! server; when the server goes, the socket closes and the spare exits.
//!
//! The spare receives bubblewrap's arguments, its user and the descriptors it is to
//! have at their numbers (`SCM_RIGHTS`), puts them there, closes everything else at
//! exec, becomes the sandbox's user and execs bubblewrap: the same process, so the
//! server's `Child` of it is bubblewrap's. Its socket closes at that exec: the server
//! reads the end of it as the exec done, and a message as why it failed.

use crate::sys::Locked;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::limits::{Group, Limits};
use super::wire;

/// Where the spare keeps what it receives before it moves each to its number.
const HIGH_FD: RawFd = 64;

/// How long a spare may take to exec bubblewrap.
const LAUNCH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a spare is asked to become.
#[derive(Serialize, Deserialize)]
pub(super) struct Launch {
    pub bwrap: String,
    pub args: Vec<String>,
    /// Become this user (a root server's spare), with no supplementary group.
    pub user: Option<(u32, u32)>,
    /// The number each descriptor that comes with the message gets, in order.
    pub targets: Vec<RawFd>,
}

#[derive(Serialize, Deserialize)]
struct Failed {
    error: String,
}

/// A spare process and its control group.
pub(super) struct Spare {
    /// Until it is launched (or ended).
    child: Option<Child>,
    sock: OwnedFd,
    group: Option<Group>,
}

impl Spare {
    /// Starts one, and moves it into `group` before it is given anything to run.
    ///
    /// Spawned without a fork of the server (no code runs between fork and exec, so
    /// the standard library spawns with `posix_spawn`, which shares the server's memory
    /// until the exec instead of copying its page tables: a fork of a server of many
    /// threads and a large cache stalls every one of them while a sandbox starts).
    /// Its socket is its standard input; it marks every other descriptor it inherited
    /// close-on-exec itself ([`run`]).
    pub fn start(group: Option<Group>) -> io::Result<Spare> {
        let (ours, theirs) = wire::pair()?;
        // The small executable the sandboxes' init is (or this one): a spare made
        // again while a sandbox starts then does not load what the server links,
        // which on a machine of few cores takes from that start. Run through its
        // descriptor, the file checked when it was opened.
        let exe = super::init::init_exe()?;
        let mut child = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()))
            .arg("sandbox-spawn")
            .env_clear()
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting a spare sandbox: {e}")))?;
        drop(exe);
        // Into its control group: it waits for its launch meanwhile, and runs nothing.
        if let Some(g) = &group {
            let pid = child.id().to_string();
            for fd in g.procs() {
                if let Err(e) = rustix::io::write(fd, pid.as_bytes()) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::new(
                        io::Error::from(e).kind(),
                        format!("a spare sandbox into its control group: {e}"),
                    ));
                }
            }
        }
        Ok(Spare {
            child: Some(child),
            sock: ours,
            group,
        })
    }

    /// Makes it bubblewrap as `launch` says, with `fds`: its `Child` and group.
    pub fn launch(
        mut self,
        launch: &Launch,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> io::Result<(Child, Option<Group>)> {
        let Some(mut child) = self.child.take() else {
            return Err(io::Error::other("a spare launched twice"));
        };
        let failed = |e: io::Error, mut child: Child| {
            let _ = child.kill();
            let _ = child.wait();
            e
        };
        if launch.user.is_some_and(|(uid, gid)| uid == 0 || gid == 0) {
            return Err(failed(
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "a sandbox's processes are never root's, nor of group 0",
                ),
                child,
            ));
        }
        // A spare stopped on its way (its user's processes may signal it once it is
        // theirs) does not stall the start for longer than this.
        let _ = rustix::net::sockopt::set_socket_timeout(
            &self.sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(LAUNCH_WAIT),
        );
        if let Err(e) = wire::send(self.sock.as_fd(), launch, fds) {
            return Err(failed(e, child));
        }
        let mut buf = Vec::new();
        match wire::recv::<Failed>(self.sock.as_fd(), &mut buf) {
            // Its socket closed at the exec (or it died: then it has exited).
            Ok(None) => match child.try_wait() {
                Ok(Some(st)) => Err(io::Error::other(format!("bubblewrap ended at once ({st})"))),
                _ => Ok((child, self.group.take())),
            },
            Ok(Some((f, _))) => Err(failed(
                io::Error::other(format!("starting bubblewrap: {}", f.error)),
                child,
            )),
            Err(e) => Err(failed(e, child)),
        }
    }

    /// Its control group (none where the server makes none).
    pub fn group(&self) -> Option<&Group> {
        self.group.as_ref()
    }

    /// Whether it still waits to be launched.
    fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Spare {
    /// An unlaunched spare is ended and reaped before its group goes.
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The spare kept for the next sandbox, with the limits its group has.
static KEPT: Mutex<Option<(Limits, Spare)>> = Mutex::new(None);
/// Whether one is being made.
static MAKING: AtomicBool = AtomicBool::new(false);
/// The server stops: no more spares are kept.
static STOPPED: AtomicBool = AtomicBool::new(false);

/// A spare for a sandbox with `limits`: the one kept if its limits are these, else one
/// started now (`group` makes its control group). Either way a new one is made for the
/// next sandbox in the background.
pub(super) fn take(
    limits: Limits,
    group: impl Fn() -> Option<Group> + Send + Sync + Clone + 'static,
) -> io::Result<Spare> {
    let kept = KEPT.locked().take();
    // One of other limits, or one that died, is ended (outside the lock).
    let kept = kept
        .filter(|(l, _)| *l == limits)
        .map(|(_, s)| s)
        .and_then(|mut s| s.alive().then_some(s));
    let spare = match kept {
        Some(s) => s,
        None => Spare::start(group())?,
    };
    if !MAKING.swap(true, Ordering::SeqCst) {
        let made = std::thread::Builder::new()
            .name("casfs-spare".into())
            .spawn(move || {
                match Spare::start(group()) {
                    Ok(s) if !STOPPED.load(Ordering::SeqCst) => {
                        let old = KEPT.locked().replace((limits, s));
                        drop(old);
                    }
                    Ok(s) => drop(s),
                    Err(e) => tracing::warn!("no spare sandbox: {e}"),
                }
                MAKING.store(false, Ordering::SeqCst);
            });
        if made.is_err() {
            MAKING.store(false, Ordering::SeqCst);
        }
    }
    Ok(spare)
}

/// Ends the kept spare (the server stops).
pub fn end() {
    STOPPED.store(true, Ordering::SeqCst);
    // One being made is ended by its maker (waited for a while, never forever).
    for _ in 0..1000 {
        if !MAKING.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let kept = KEPT.locked().take();
    drop(kept);
}

/// `casfs sandbox-spawn`: waits for the server's [`Launch`], then becomes bubblewrap.
/// Returns when the server went away first.
pub fn run() -> io::Result<()> {
    // Nothing the server's process had open, beyond the standard streams, goes on.
    crate::sys::process::cloexec_from(3)?;
    // The socket the server put at its standard input, out of the way of the numbers it
    // is to give.
    let sock = rustix::io::fcntl_dupfd_cloexec(std::io::stdin(), HIGH_FD * 2)?;
    // Its standard input is nothing (bubblewrap's, after it): the copy there is not
    // close-on-exec.
    let null = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    rustix::stdio::dup2_stdin(&null)?;
    drop(null);
    let mut buf = Vec::new();
    let Some((launch, fds)) = wire::recv::<Launch>(sock.as_fd(), &mut buf)? else {
        return Ok(());
    };
    let e = become_bwrap(&launch, fds);
    wire::send(
        sock.as_fd(),
        &Failed {
            error: e.to_string(),
        },
        &[],
    )?;
    Err(e)
}

/// Puts `fds` at their numbers and execs bubblewrap; returns only what failed.
fn become_bwrap(launch: &Launch, fds: Vec<OwnedFd>) -> io::Error {
    if let Err(e) = crate::sys::process::give_for_exec(fds, &launch.targets, HIGH_FD) {
        return e;
    }
    if let Some((uid, gid)) = launch.user {
        if uid == 0 || gid == 0 {
            return io::Error::new(io::ErrorKind::PermissionDenied, "never root, nor group 0");
        }
        if !crate::sys::process::become_user_for_good(uid, gid) {
            return io::Error::new(
                io::ErrorKind::PermissionDenied,
                "could not become the sandbox's user",
            );
        }
    }
    Command::new(&launch.bwrap)
        .args(&launch.args)
        .env_clear()
        .exec()
}
