//! Processes: a child started in a session of its own (and with no descriptor but its
//! standard ones), and a program run in place of this process.

use std::ffi::CString;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

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
