//! Memory files: data handed to a sandbox's bubblewrap or init as a descriptor (its
//! `/etc/passwd` and `/etc/group`, its seccomp filter) rather than as a file on disk.

use std::io;
use std::os::fd::OwnedFd;

/// A memory file holding `bytes`, read from its start.
pub(super) fn data_fd(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{memfd_create, MemfdFlags};
    let fd = memfd_create(name, MemfdFlags::CLOEXEC)?;
    let mut f = std::fs::File::from(fd);
    io::Write::write_all(&mut f, bytes)?;
    io::Seek::seek(&mut f, io::SeekFrom::Start(0))?;
    Ok(OwnedFd::from(f))
}
