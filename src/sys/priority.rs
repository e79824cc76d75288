//! The calling thread's priorities: its CPU share (nice) and its I/O class and level.

use std::io;

/// Sets the calling thread's nice value (`setpriority(PRIO_PROCESS, 0)`, which on Linux
/// is the thread).
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    rustix::process::setpriority_process(None, nice).map_err(io::Error::from)
}

/// Puts the calling thread in the best-effort I/O class at `level` (0, the highest, to
/// 7, the lowest): `ioprio_set(IOPRIO_WHO_PROCESS, 0)`, which on Linux is the thread.
pub fn set_thread_io_best_effort(level: u8) -> io::Result<()> {
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_BE: libc::c_long = 2;
    const IOPRIO_CLASS_SHIFT: u32 = 13;
    let prio = (IOPRIO_CLASS_BE << IOPRIO_CLASS_SHIFT) | libc::c_long::from(level.min(7));
    // SAFETY: ioprio_set takes plain integers and touches no memory; who 0 is the
    // calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            prio,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
