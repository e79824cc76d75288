//! Processes: a child started in a session of its own (and with no descriptor but its
//! standard ones), and a program run in place of this process; what a process does
//! before that exec (the descriptors it gives the program at their numbers, the rest
//! closed at exec, the user it becomes for good); and the descriptor a parent left a
//! new process at a known number, taken at its start.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// `close_range(2)`'s flag: mark close-on-exec rather than close.
const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;

/// Makes the child `cmd` spawns the leader of a new session (it outlives ours and has
/// no terminal) and, if `close_others`, closes every descriptor above stderr in it
/// before its exec.
pub fn detach(cmd: &mut Command, close_others: bool) {
    // SAFETY: the hook runs in the child between fork and exec, where only
    // async-signal-safe calls are sound: setsid and close_range are plain system calls
    // on no memory of the parent's.
    unsafe {
        cmd.pre_exec(move || {
            let _ = rustix::process::setsid();
            if close_others {
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            }
            Ok(())
        });
    }
}

/// Runs the program `argv` (its first word looked up in `PATH`, as `execvp` does) in
/// place of this process: only returns, with the error, if it could not.
pub fn exec(argv: &[CString]) -> io::Error {
    if argv.is_empty() {
        return io::Error::new(io::ErrorKind::InvalidInput, "no program to run");
    }
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: a NUL-terminated array of NUL-terminated strings that outlive the call.
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    io::Error::last_os_error()
}

/// Marks every descriptor of this process from `first` up close-on-exec (`close_range`
/// with `CLOSE_RANGE_CLOEXEC`): none of them goes on to the program it execs next.
pub fn cloexec_from(first: u32) -> io::Result<()> {
    // SAFETY: a system call on integers; it only sets a flag of descriptors, closing
    // none, so no descriptor owned anywhere changes.
    if unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, CLOSE_RANGE_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether [`take_inherited`] ran.
static INHERITED_TAKEN: AtomicBool = AtomicBool::new(false);

/// The descriptor a parent left this process at number `fd` (a control socket passed
/// on at a number agreed on), this process's own from here on; and every descriptor
/// above it closed: whatever else was inherited. For the very start of a process,
/// before it opens anything of its own; once (an error after).
pub fn take_inherited(fd: RawFd) -> io::Result<OwnedFd> {
    if INHERITED_TAKEN.swap(true, Ordering::SeqCst) {
        return Err(io::Error::other(
            "the inherited descriptor was taken already",
        ));
    }
    // SAFETY: at the start of the process (as documented, and once) nothing in it
    // names the descriptor its parent left at `fd`, nor any above it: the first is
    // owned from here on, the others closed (a failure to close leaves them open, as
    // inherited).
    unsafe {
        let owned = OwnedFd::from_raw_fd(fd);
        libc::syscall(libc::SYS_close_range, fd as u32 + 1, u32::MAX, 0);
        Ok(owned)
    }
}

/// Gives the program this process execs next `fds` at the numbers `targets` (as many,
/// each above stderr and below `park`): each is put at its number, not close-on-exec,
/// and every descriptor above the highest of them is marked close-on-exec. Each is
/// first moved to `park` or above, out of the way of the numbers given. For a process
/// about to exec: whatever it had at one of those numbers is replaced, so it must own
/// nothing there.
pub fn give_for_exec(fds: Vec<OwnedFd>, targets: &[RawFd], park: RawFd) -> io::Result<()> {
    if fds.len() != targets.len() || targets.iter().any(|&t| !(3..park).contains(&t)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "descriptors and their numbers differ",
        ));
    }
    let mut parked = Vec::with_capacity(fds.len());
    for f in &fds {
        parked.push(rustix::io::fcntl_dupfd_cloexec(f, park)?);
    }
    drop(fds);
    for (f, &to) in parked.iter().zip(targets) {
        // SAFETY: dup2 onto a number this process gives away to the program it execs
        // (it owns nothing there, as documented; the parked copies are above `park`);
        // the copy is not close-on-exec, and nothing here owns it.
        if unsafe { libc::dup2(f.as_raw_fd(), to) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    drop(parked);
    let first_free = targets.iter().max().map_or(3, |m| m + 1);
    cloexec_from(first_free as u32)
}

/// Makes this process (every thread of it, as glibc's calls do) user `uid` of group
/// `gid` with no supplementary group, for good: whether it is now, and cannot become
/// root again.
pub fn become_user_for_good(uid: u32, gid: u32) -> bool {
    // SAFETY: plain system calls on integers (and an empty list of groups).
    let switched = unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(gid) == 0
            && libc::setuid(uid) == 0
    };
    // And no way back.
    // SAFETY: as above; it must fail.
    switched && !rustix::process::geteuid().is_root() && unsafe { libc::setuid(0) } != 0
}
