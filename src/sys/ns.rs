//! Namespaces: what nsfs says of a user namespace (its owner, its parent), a new user
//! and mount namespace for this process, and a probe of whether this user may make
//! one and mount in it.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

// <linux/nsfs.h>
const NS_GET_PARENT: libc::c_ulong = 0xb702;
const NS_GET_OWNER_UID: libc::c_ulong = 0xb704;

/// The uid that owns the user namespace `ns` (an open `/proc/<pid>/ns/user`).
pub fn owner_uid(ns: BorrowedFd<'_>) -> io::Result<u32> {
    let mut owner: libc::uid_t = u32::MAX;
    // SAFETY: an nsfs descriptor and a pointer to a uid_t, as the ioctl wants.
    if unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_OWNER_UID, &mut owner) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(owner)
}

/// The parent of the user namespace `ns` (an open `/proc/<pid>/ns/user`), opened.
pub fn parent(ns: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: an nsfs descriptor; the ioctl returns a new descriptor or -1.
    let fd = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_PARENT) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the ioctl just opened, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Moves this process (single-threaded, as the kernel requires) into a new user
/// namespace and a new mount namespace owned by it.
pub fn unshare_user_and_mount() -> io::Result<()> {
    use rustix::thread::UnshareFlags;
    // SAFETY: only the namespaces are unshared, never the descriptor table (FILES),
    // so no thread can see descriptors of a table it does not share.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWUSER | UnshareFlags::NEWNS) }
        .map_err(io::Error::from)
}

/// Does in a child process what a namespace of this user's needs, then exits: a user
/// and mount namespace, `uid` and `gid` mapped to themselves, and a tmpfs mounted at
/// `/tmp` in it (where a namespace is made but given no rights, as under AppArmor's
/// restriction, that fails). The child's error, if any.
pub fn probe_user_namespace(uid: u32, gid: u32) -> io::Result<()> {
    // Everything the child uses is made before the fork: it may only make system calls.
    let files: [(&CStr, String); 3] = [
        (c"/proc/self/setgroups", "deny".to_string()),
        (c"/proc/self/uid_map", format!("{uid} {uid} 1\n")),
        (c"/proc/self/gid_map", format!("{gid} {gid} 1\n")),
    ];
    let (tmpfs, target) = (c"tmpfs", c"/tmp");
    // SAFETY: the child makes only system calls (unshare, open, write, close, mount,
    // _exit: async-signal-safe) on memory made before the fork, so forking a process
    // with threads is sound.
    unsafe {
        let pid = libc::fork();
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            let fail = || libc::_exit((*libc::__errno_location()).clamp(1, 255));
            if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                fail();
            }
            for (path, text) in &files {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, text.as_ptr().cast(), text.len()) < 0 {
                    fail();
                }
                libc::close(fd);
            }
            if libc::mount(
                tmpfs.as_ptr(),
                target.as_ptr(),
                tmpfs.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                std::ptr::null(),
            ) != 0
            {
                fail();
            }
            libc::_exit(0);
        }
        let mut status = 0;
        while libc::waitpid(pid, &mut status, 0) < 0 {
            if *libc::__errno_location() != libc::EINTR {
                return Err(io::Error::last_os_error());
            }
        }
        if !libc::WIFEXITED(status) {
            return Err(io::Error::other("the probe was killed"));
        }
        match libc::WEXITSTATUS(status) {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
}
