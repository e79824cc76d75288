//! Sandboxes booted ahead of the workspace they will get (a root server's).
//!
//! Bubblewrap's namespaces, mounts and filter, and the sandbox's init, take most of a
//! sandbox's start (about 10 ms here, on a loaded machine more): none of it depends on
//! the workspace, only on who the sandbox's processes are and what it may use (its
//! [`Shape`]). So a root server keeps one sandbox booted, its init waiting, with an
//! empty slot at `/workspace` ([`engine::Stage`]); the next sandbox of that shape takes
//! it, and its workspace is mounted into it by propagation, which costs a few system
//! calls. A new one is booted in the background for the sandbox after (one at a time;
//! a start that finds one on its way waits for it rather than boot a second).
//!
//! A booted sandbox holds nothing of anyone's until its workspace arrives: its init
//! runs as the user its processes will be (never root) and starts nothing until the
//! server asks. A server that is not root cannot mount on the host, so its sandboxes
//! boot with their workspace ([`super::spare`] still starts their process ahead).

use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::engine::{self, Network, Stage};
use super::limits::{Group, Limits};
use super::wire::{self, Event};
use super::{lock, spare::Spare, START_WAIT};

/// What a booted sandbox can serve: every argument of its bubblewrap, and its limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shape {
    pub uid: u32,
    pub gid: u32,
    pub network: Network,
    pub tmp_bytes: u64,
    pub limits: Limits,
}

/// A sandbox's isolation, booted: bubblewrap runs and its init said it is ready.
pub(super) struct Booted {
    child: Option<Child>,
    control: Option<OwnedFd>,
    /// Until the workspace is there (a root server's).
    stage: Option<Stage>,
    group: Option<Group>,
    netns: Option<OwnedFd>,
    /// What bubblewrap said on stderr (its last bytes): why a sandbox failed to start.
    engine_err: Arc<Mutex<Vec<u8>>>,
    errs: Option<std::thread::JoinHandle<()>>,
}

/// A booted sandbox, taken apart for its [`super::Jail`].
pub(super) struct Parts {
    pub child: Child,
    pub control: OwnedFd,
    pub group: Option<Group>,
    pub netns: OwnedFd,
    pub engine_err: Arc<Mutex<Vec<u8>>>,
}

impl Booted {
    /// Boots a sandbox of `shape` in `spare`, with `workspace` (none: a root server's,
    /// with a slot for it), and waits for its init.
    pub fn boot(shape: &Shape, workspace: Option<&Path>, spare: Spare) -> io::Result<Booted> {
        let spec = engine::Spec {
            workspace,
            uid: shape.uid,
            gid: shape.gid,
            network: shape.network,
            tmp_bytes: shape.tmp_bytes,
        };
        let mut started = engine::start(&spec, spare)?;
        let engine_err = Arc::new(Mutex::new(Vec::new()));
        let errs = match started.child.stderr.take() {
            Some(mut e) => {
                let keep = engine_err.clone();
                Some(
                    std::thread::Builder::new()
                        .name("casfs-bwrap-err".into())
                        .spawn(move || {
                            let mut buf = [0u8; 4096];
                            while let Ok(n) = e.read(&mut buf) {
                                if n == 0 {
                                    break;
                                }
                                let mut k = lock(&keep);
                                k.extend_from_slice(&buf[..n]);
                                let over = k.len().saturating_sub(4096);
                                k.drain(..over);
                            }
                        })?,
                )
            }
            None => None,
        };
        let mut b = Booted {
            child: Some(started.child),
            control: Some(started.control),
            stage: started.stage,
            group: started.group,
            netns: None,
            engine_err,
            errs,
        };
        // The init's first word: ready, with its network namespace (or the sandbox
        // failed to start: its socket closes).
        let control = b.control.as_ref().expect("a booted sandbox's socket");
        let timeout = rustix::net::sockopt::Timeout::Recv;
        rustix::net::sockopt::set_socket_timeout(control, timeout, Some(START_WAIT))?;
        let mut buf = Vec::new();
        let got = wire::recv::<Event>(control.as_fd(), &mut buf);
        rustix::net::sockopt::set_socket_timeout(control, timeout, None)?;
        match got {
            Ok(Some((Event::Ready, fds))) if fds.len() == 1 => {
                b.netns = fds.into_iter().next();
                Ok(b)
            }
            Ok(Some(_)) => Err(io::Error::other(
                "its init said something other than that it is ready",
            )),
            Ok(None) | Err(_) => {
                b.stop();
                Err(io::Error::other(b.why()))
            }
        }
    }

    /// Brings the workspace at `workspace` into a sandbox booted with a slot for it;
    /// then what was staged for its bubblewrap goes. A sandbox booted with its
    /// workspace has it already.
    pub fn attach(&mut self, workspace: &Path) -> io::Result<()> {
        if let Some(mut stage) = self.stage.take() {
            let ws = crate::checkpoint::dirfd::open_dir_path(workspace)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", workspace.display())))?;
            stage.attach(&ws)?;
            clear_later(stage);
        }
        Ok(())
    }

    /// Its processes have their fair share of the CPU again (a sandbox booted ahead
    /// boots in the background: [`super::limits::Group::set_background`]).
    pub fn foreground(&self) {
        if let Some(g) = &self.group {
            g.set_background(false);
        }
    }

    /// Whether its bubblewrap (and so its init) still runs.
    fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// What bubblewrap said, as why the sandbox failed to start.
    fn why(&self) -> String {
        let err = String::from_utf8_lossy(&lock(&self.engine_err))
            .trim()
            .to_string();
        if err.is_empty() {
            "its init did not start".into()
        } else {
            format!("its init did not start: {err}")
        }
    }

    /// Ends it: its socket closed (the init returns, and with it the pid namespace),
    /// its control group killed, bubblewrap reaped.
    fn stop(&mut self) {
        if let Some(c) = &self.control {
            let _ = rustix::net::shutdown(c, rustix::net::Shutdown::Both);
        }
        if let Some(mut child) = self.child.take() {
            stop_engine(&mut child, self.group.as_ref());
        }
        // What bubblewrap said before it went (its stderr closes with it).
        if let Some(t) = self.errs.take() {
            let until = Instant::now() + Duration::from_millis(200);
            while !t.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// Its parts, for a sandbox's [`super::Jail`] (its workspace attached).
    pub fn into_parts(mut self) -> Parts {
        self.stage.take();
        // Its stderr's reader goes on for the sandbox.
        self.errs.take();
        Parts {
            child: self.child.take().expect("a booted sandbox's bubblewrap"),
            control: self.control.take().expect("a booted sandbox's socket"),
            group: self.group.take(),
            netns: self.netns.take().expect("a booted sandbox's namespace"),
            engine_err: self.engine_err.clone(),
        }
    }
}

impl Drop for Booted {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Ends a sandbox's bubblewrap `child`: `group` killed (its socket already closed),
/// then a second for it to go before it is killed; reaped.
pub(super) fn stop_engine(child: &mut Child, group: Option<&Group>) {
    if let Some(g) = group {
        g.kill_all();
    }
    for _ in 0..200 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Clears a stage whose workspace is attached, off the start's path: its unmounts wait
/// for the kernel's RCU grace period (0.3 ms to several ms measured), which the
/// sandbox's start need not. Its slot is private by then, so nothing of the clearing
/// reaches the sandbox; a stage a server's exit leaves is swept by the next server.
fn clear_later(stage: Stage) {
    // A thread that does not start drops (clears) the stage here.
    let spawned = std::thread::Builder::new()
        .name("casfs-stage".into())
        .spawn(move || drop(stage));
    if let Err(e) = spawned {
        tracing::debug!("a stage cleared where it was attached: {e}");
    }
}

/// How long a booted sandbox is kept for the next one: what bubblewrap bound of the
/// host's `/etc` (resolver, certificates) is as it was at its boot.
const MAX_AGE: Duration = Duration::from_secs(300);

struct Kept {
    /// The one booted, waiting, and when.
    ready: Option<(Shape, Booted, Instant)>,
    /// The shape of one being booted.
    making: Option<Shape>,
    stopped: bool,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    ready: None,
    making: None,
    stopped: false,
});
/// Told when one is booted (or failed to).
static BOOTED: Condvar = Condvar::new();

/// [`KEPT`], once `pending` is false of it (a boot ended), or after [`START_WAIT`].
fn wait(pending: impl FnMut(&mut Kept) -> bool) -> std::sync::MutexGuard<'static, Kept> {
    BOOTED
        .wait_timeout_while(lock(&KEPT), START_WAIT, pending)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

/// The booted sandbox of `shape` if one is kept (waiting for one of that shape being
/// booted, up to [`START_WAIT`]); none else. One of another shape is ended.
pub(super) fn take(shape: &Shape) -> Option<Booted> {
    let mut k = wait(|k| k.ready.is_none() && k.making == Some(*shape));
    let kept = k.ready.take();
    drop(k);
    let (s, mut b, at) = kept?;
    if s == *shape && at.elapsed() < MAX_AGE && b.alive() {
        return Some(b);
    }
    // Another shape's, an old one, or one that died: ended aside, not in the way of the
    // start that asked (without a thread, here).
    let _ = std::thread::Builder::new()
        .name("casfs-warm-end".into())
        .spawn(move || drop(b));
    None
}

/// Boots one of `shape` with `boot` in the background for the next sandbox, unless one
/// is kept or being booted already.
pub(super) fn replenish(shape: Shape, boot: impl FnOnce() -> io::Result<Booted> + Send + 'static) {
    {
        let mut k = lock(&KEPT);
        if k.stopped || k.making.is_some() || k.ready.as_ref().is_some_and(|(s, ..)| *s == shape) {
            return;
        }
        k.making = Some(shape);
    }
    let made = std::thread::Builder::new()
        .name("casfs-warm".into())
        .spawn(move || {
            // `making` is cleared however this ends (a panic in the boot too), so that
            // no start waits for a boot that will never come.
            struct Made;
            impl Drop for Made {
                fn drop(&mut self) {
                    lock(&KEPT).making = None;
                    BOOTED.notify_all();
                }
            }
            let made = Made;
            let booted = boot();
            let old = {
                let mut k = lock(&KEPT);
                match booted {
                    Ok(b) if !k.stopped => k.ready.replace((shape, b, Instant::now())),
                    Ok(b) => Some((shape, b, Instant::now())),
                    Err(e) => {
                        tracing::warn!("no sandbox booted ahead: {e}");
                        None
                    }
                }
            };
            drop(made);
            drop(old);
        });
    if made.is_err() {
        lock(&KEPT).making = None;
        BOOTED.notify_all();
    }
}

/// The server stops: the kept one is ended, and none is booted again.
pub(super) fn end() {
    lock(&KEPT).stopped = true;
    let mut k = wait(|k| k.making.is_some());
    let kept = k.ready.take();
    drop(k);
    drop(kept);
}
