//! Sandboxes booted ahead of the workspace they will get (a root server's).
//!
//! Bubblewrap's namespaces, mounts and filter, and the sandbox's init, take most of a
//! sandbox's start (about 10 ms here, on a loaded machine more): none of it depends on
//! the workspace, only on who the sandbox's processes are and what it may use (its
//! [`Shape`]). So a root server keeps sandboxes booted ([`DEFAULT_AHEAD`], `serve
//! --sandboxes-ahead`), each init waiting, with an empty slot at `/workspace`
//! ([`engine::Stage`]), of the shape it started last (those of an earlier shape stay
//! until taken, too old, or pushed out); the next sandbox of a shape takes the oldest
//! of it, and its workspace is mounted into it by propagation, which costs a few
//! system calls. Those taken are booted again one at a time on a thread of their own,
//! while the server answers no request ([`Busy`]; or after [`BUSY_WAIT`] of requests
//! without a pause), so that a boot's work does not slow a burst of requests (a start,
//! its first commands, a checkpoint and a fork); one kept too long is booted again. A
//! start that finds none kept but one being booted for its shape waits for it rather
//! than boot its own; a boot that fails is tried again less and less often.
//!
//! A booted sandbox holds nothing of anyone's until its workspace arrives: its init
//! runs as the user its processes will be (never root) and starts nothing until the
//! server asks. A server that is not root cannot mount on the host, so its sandboxes
//! boot with their workspace ([`super::spare`] still starts their process ahead).

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::engine::{self, Network, Stage};
use super::limits::{Group, Limits};
use super::spare::Spare;
use super::wire::{self, Event, START_WAIT};
use crate::sys::Locked;

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
    /// Its pid namespace's inode.
    pid_ns: u64,
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
    /// Its pid namespace's inode.
    pub pid_ns: u64,
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
                                let mut k = keep.locked();
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
            pid_ns: 0,
            engine_err,
            errs,
        };
        // The init's first word: ready, with its network and pid namespaces (or the
        // sandbox failed to start: its socket closes).
        let control = b.control.as_ref().expect("a booted sandbox's socket");
        let timeout = rustix::net::sockopt::Timeout::Recv;
        rustix::net::sockopt::set_socket_timeout(control, timeout, Some(START_WAIT))?;
        let mut buf = Vec::new();
        let got = wire::recv::<Event>(control.as_fd(), &mut buf);
        rustix::net::sockopt::set_socket_timeout(control, timeout, None)?;
        match got {
            Ok(Some((Event::Ready, fds))) if fds.len() == 2 => {
                let mut fds = fds.into_iter();
                b.netns = fds.next();
                b.pid_ns = rustix::fs::fstat(fds.next().expect("two descriptors"))?.st_ino;
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
            let ws = crate::sys::dirfd::open_dir_path(workspace)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", workspace.display())))?;
            stage.attach(&ws)?;
            // Its slot is private by now: nothing of the clearing reaches the sandbox.
            drop_aside("casfs-stage", stage);
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
        let err = String::from_utf8_lossy(&self.engine_err.locked())
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
            pid_ns: self.pid_ns,
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

/// What is being dropped aside ([`drop_aside`]), for the server's stop to wait for.
static ASIDE: Mutex<usize> = Mutex::new(0);
static DROPPED: Condvar = Condvar::new();

/// Drops `what` on a thread of its own named `name` (here if none starts), out of the
/// way of whoever let it go: a stage's unmounts wait for the kernel's RCU grace period
/// (0.3 ms to several ms measured), a booted sandbox's end for its bubblewrap. The
/// server's stop waits for what is under way ([`end`]).
fn drop_aside<T: Send + 'static>(name: &str, what: T) {
    struct Dropped;
    impl Drop for Dropped {
        fn drop(&mut self) {
            *ASIDE.locked() -= 1;
            DROPPED.notify_all();
        }
    }
    *ASIDE.locked() += 1;
    let dropped = Dropped;
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            drop(what);
            drop(dropped);
        });
    if let Err(e) = spawned {
        tracing::debug!("{name}: dropped in place: {e}");
    }
}

/// How long a booted sandbox is kept for the next one: what bubblewrap bound of the
/// host's `/etc` (resolver, certificates) is as it was at its boot.
const MAX_AGE: Duration = Duration::from_secs(300);

/// How many are kept booted ([`keep_ahead`]).
static AHEAD: AtomicUsize = AtomicUsize::new(DEFAULT_AHEAD);

/// Kept booted unless a server says otherwise: enough for a start, a restore and a
/// fork one after the other (the provider's `fork()` is a checkpoint and a start).
pub const DEFAULT_AHEAD: usize = 3;

/// The server quiet this long (no request being answered) boots the next one ...
const QUIET: Duration = Duration::from_millis(10);
/// ... or, on a server never quiet so long, after this long of requests without a
/// pause (until then its starts boot their own, as a server keeping none would).
const BUSY_WAIT: Duration = Duration::from_secs(2);

/// Requests being answered, and when the last one was (since [`epoch`]).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static LAST: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// A request being answered: while one is, no sandbox is booted ahead (unless the
/// server has been busy for [`BUSY_WAIT`]), so that a boot's work does not slow the
/// answers of a burst of requests.
pub struct Busy(());

impl Busy {
    pub fn new() -> Busy {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Busy(())
    }
}

impl Default for Busy {
    fn default() -> Busy {
        Busy::new()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        LAST.store(epoch().elapsed().as_micros() as u64, Ordering::SeqCst);
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long no request has been answered (zero while one is).
fn quiet_for() -> Duration {
    if ACTIVE.load(Ordering::SeqCst) > 0 {
        return Duration::ZERO;
    }
    let last = Duration::from_micros(LAST.load(Ordering::SeqCst));
    epoch().elapsed().saturating_sub(last)
}

/// Keep `n` sandboxes booted ahead (0: none; the next start boots its own).
pub fn keep_ahead(n: usize) {
    AHEAD.store(n, Ordering::SeqCst);
    FILL.notify_all();
}

type Boot = Arc<dyn Fn() -> io::Result<Booted> + Send + Sync>;

struct Kept {
    /// Booted and waiting, oldest first, with when each was.
    ready: VecDeque<(Shape, Booted, Instant)>,
    /// The shape of one being booted.
    making: Option<Shape>,
    /// What to keep booted.
    want: Option<(Shape, Boot)>,
    /// The thread that boots them runs.
    filling: bool,
    stopped: bool,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    ready: VecDeque::new(),
    making: None,
    want: None,
    filling: false,
    stopped: false,
});
/// Told when one is booted (or failed to).
static BOOTED: Condvar = Condvar::new();
/// Told when there may be one to boot.
static FILL: Condvar = Condvar::new();

/// [`KEPT`], once `pending` is false of it (a boot ended), or after [`START_WAIT`].
fn wait(pending: impl FnMut(&mut Kept) -> bool) -> std::sync::MutexGuard<'static, Kept> {
    BOOTED
        .wait_timeout_while(KEPT.locked(), START_WAIT, pending)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

/// Ends `booted` aside ([`drop_aside`]).
fn end_aside(booted: Vec<Booted>) {
    if !booted.is_empty() {
        drop_aside("casfs-warm-end", booted);
    }
}

/// Takes out of `k` those kept too long or dead.
fn expired(k: &mut Kept) -> Vec<Booted> {
    let mut gone = Vec::new();
    for (s, mut b, at) in std::mem::take(&mut k.ready) {
        if at.elapsed() < MAX_AGE && b.alive() {
            k.ready.push_back((s, b, at));
        } else {
            gone.push(b);
        }
    }
    gone
}

/// A booted sandbox of `shape` if one is kept, the oldest (waiting for one of that
/// shape being booted, up to [`START_WAIT`], when none is); none else. Those kept too
/// long or dead are ended; those of another shape stay for their own starts.
pub(super) fn take(shape: &Shape) -> Option<Booted> {
    let mut k = wait(|k| k.making == Some(*shape) && !k.ready.iter().any(|r| r.0 == *shape));
    let gone = expired(&mut k);
    let found = k
        .ready
        .iter()
        .position(|r| r.0 == *shape)
        .and_then(|i| k.ready.remove(i))
        .map(|r| r.1);
    drop(k);
    end_aside(gone);
    if found.is_some() {
        FILL.notify_all();
    }
    found
}

/// Keeps sandboxes of `shape` booted with `boot` for the next starts (as many as
/// [`keep_ahead`] says), booted one at a time in the background while the server is
/// quiet. A wish for another shape replaces this one (those kept of the other shape
/// stay until they are taken, too old, or pushed out by the new shape's).
pub(super) fn replenish(
    shape: Shape,
    boot: impl Fn() -> io::Result<Booted> + Send + Sync + 'static,
) {
    let mut k = KEPT.locked();
    if k.stopped {
        return;
    }
    if !k.want.as_ref().is_some_and(|w| w.0 == shape) {
        k.want = Some((shape, Arc::new(boot)));
    }
    if !k.filling {
        let started = std::thread::Builder::new()
            .name("casfs-warm".into())
            .spawn(fill);
        k.filling = started.is_ok();
    }
    drop(k);
    FILL.notify_all();
}

/// The thread that boots sandboxes ahead, until the server stops.
fn fill() {
    let mut failures = 0u32;
    loop {
        // Something to boot: fewer of the wanted shape kept (fresh and alive) than
        // wanted; else a wait, until told or until the oldest kept is too old.
        let (shape, boot) = {
            let mut k = KEPT.locked();
            if k.stopped {
                k.filling = false;
                return;
            }
            let gone = expired(&mut k);
            let wanted = k.want.as_ref().and_then(|(shape, boot)| {
                let have = k.ready.iter().filter(|r| r.0 == *shape).count();
                (have < AHEAD.load(Ordering::SeqCst)).then(|| (*shape, boot.clone()))
            });
            match wanted {
                Some(w) => {
                    drop(k);
                    end_aside(gone);
                    w
                }
                None if !gone.is_empty() => {
                    // Ended first, not kept while this waits.
                    drop(k);
                    end_aside(gone);
                    continue;
                }
                None => {
                    let until = k
                        .ready
                        .iter()
                        .map(|r| MAX_AGE.saturating_sub(r.2.elapsed()))
                        .min()
                        .unwrap_or(MAX_AGE);
                    let k = FILL
                        .wait_timeout(k, until + Duration::from_millis(10))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    drop(k);
                    continue;
                }
            }
        };
        // The server quiet, or busy for BUSY_WAIT since this boot was wanted.
        let waiting = Instant::now();
        loop {
            let q = quiet_for();
            if q >= QUIET || waiting.elapsed() >= BUSY_WAIT {
                break;
            }
            std::thread::sleep(QUIET.saturating_sub(q).max(Duration::from_millis(1)));
        }
        {
            let mut k = KEPT.locked();
            if k.stopped || !k.want.as_ref().is_some_and(|w| w.0 == shape) {
                continue;
            }
            k.making = Some(shape);
        }
        // A boot that panics is one that failed: the thread goes on.
        let booted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| boot()))
            .unwrap_or_else(|_| Err(io::Error::other("the boot panicked")));
        let mut gone = Vec::new();
        let failed = {
            let mut k = KEPT.locked();
            k.making = None;
            match booted {
                Ok(b) if !k.stopped => {
                    k.ready.push_back((shape, b, Instant::now()));
                    // Past the number kept: the oldest of another shape goes, else
                    // the oldest.
                    while k.ready.len() > AHEAD.load(Ordering::SeqCst).max(1) {
                        let i = k.ready.iter().position(|r| r.0 != shape).unwrap_or(0);
                        gone.extend(k.ready.remove(i).map(|r| r.1));
                    }
                    false
                }
                Ok(b) => {
                    gone.push(b);
                    false
                }
                Err(e) => {
                    tracing::warn!("no sandbox booted ahead: {e}");
                    true
                }
            }
        };
        BOOTED.notify_all();
        end_aside(gone);
        // Failing again and again (bubblewrap missing, say): less and less often.
        if failed {
            failures = (failures + 1).min(9);
            std::thread::sleep(Duration::from_millis(100) * (1 << failures));
        } else {
            failures = 0;
        }
    }
}

/// The server stops: those kept are ended, none is booted again, and what is being
/// dropped aside is waited for.
pub(super) fn end() {
    KEPT.locked().stopped = true;
    FILL.notify_all();
    let mut k = wait(|k| k.making.is_some());
    let kept: Vec<Booted> = std::mem::take(&mut k.ready)
        .into_iter()
        .map(|r| r.1)
        .collect();
    k.want = None;
    drop(k);
    drop(kept);
    let _ = DROPPED.wait_timeout_while(ASIDE.locked(), START_WAIT, |n| *n > 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server is quiet only with no request being answered, for as long as the last
    /// one ended; requests overlapping keep it busy until the last of them ends.
    #[test]
    fn quiet_counts_from_the_last_request_answered() {
        let a = Busy::new();
        let b = Busy::new();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(quiet_for(), Duration::ZERO);
        drop(a);
        assert_eq!(quiet_for(), Duration::ZERO, "one is still answered");
        drop(b);
        std::thread::sleep(Duration::from_millis(20));
        let q = quiet_for();
        assert!(q >= Duration::from_millis(20), "{q:?}");
        let c = Busy::new();
        assert_eq!(quiet_for(), Duration::ZERO);
        drop(c);
        assert!(quiet_for() < q);
    }
}
