//! Signals waited for rather than handled: a set blocked in the calling thread (and
//! the threads it starts afterwards), then taken one at a time or polled for through a
//! descriptor; signals ignored by the whole process (or given their default action
//! back); and a signal sent to a process group by number (real-time ones too, which
//! `rustix` leaves to the libc).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

/// Sends signal number `signal` to every process of the group `pgid` leads.
pub fn send_to_group(pgid: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) on integers; no memory is passed.
    if unsafe { libc::kill(-pgid, signal) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A set of signals blocked in the thread that made it.
#[derive(Clone, Copy)]
pub struct Blocked {
    set: libc::sigset_t,
}

impl Blocked {
    /// Blocks `signals` (`libc::SIGINT`, ...) in this thread and in the threads it
    /// starts from now on, so that they can be waited for.
    pub fn block(signals: &[libc::c_int]) -> Blocked {
        // SAFETY: a local signal set, initialized before use; pthread_sigmask changes
        // only this thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for s in signals {
                libc::sigaddset(&mut set, *s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Blocked { set }
        }
    }

    /// The next of the signals to arrive, taken from the pending ones: waited for at
    /// most `timeout` (for ever if `None`); `None` if none came. Only of use in a
    /// thread that blocks them (the one that made the set, or one it started after).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<libc::c_int> {
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
        // SAFETY: a valid signal set and, if any, a timeout that outlive the call; no
        // siginfo is asked for.
        let sig = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), ts_ptr) };
        (sig > 0).then_some(sig)
    }

    /// A descriptor that is readable while one of the signals is pending
    /// (`signalfd`, close-on-exec and non-blocking), to poll for them along with other
    /// descriptors. Only of use in a thread that blocks them.
    pub fn fd(&self) -> io::Result<OwnedFd> {
        // SAFETY: a valid signal set that outlives the call; -1 asks for a new
        // descriptor.
        let fd = unsafe { libc::signalfd(-1, &self.set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor signalfd just opened, owned from here on.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Ignores `signal` (`libc::SIGPIPE`, ...) in the whole process: its disposition is
/// set to `SIG_IGN`, so no handler ever runs. Programs it starts get the default back
/// where the starter resets it (`std::process::Command` does for SIGPIPE).
pub fn ignore(signal: libc::c_int) {
    // SAFETY: setting a disposition to SIG_IGN installs no handler: no code runs when
    // the signal comes.
    unsafe { libc::signal(signal, libc::SIG_IGN) };
}

/// Gives `signal` its default action again in the whole process (`SIG_DFL`): a
/// command that ends quietly on a broken pipe, as other Unix tools do.
pub fn default_action(signal: libc::c_int) {
    // SAFETY: setting a disposition to SIG_DFL installs no handler: no code of this
    // process runs when the signal comes.
    unsafe { libc::signal(signal, libc::SIG_DFL) };
}
