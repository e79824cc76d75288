//! What the kernel says of the process at the other end of a Unix socket beyond its
//! uid, gid and pid (which std's and tokio's `peer_cred` give): its supplementary
//! groups as it connected (`SO_PEERGROUPS`, Linux 4.13 and later).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The supplementary groups of the process at the other end of the Unix socket `s`
/// when it connected, in the kernel's order.
pub fn groups(s: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<u32>()) as libc::socklen_t;
        // SAFETY: a valid socket, a buffer of `len` bytes and its length, alive for the
        // call.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<u32>();
        if r == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        // Too small a buffer: `len` says how large it must be.
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 1 << 16 {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_socket_pair_peer_has_our_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut got = groups(a.as_fd()).unwrap();
        let mut ours: Vec<u32> = rustix::process::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        got.sort_unstable();
        ours.sort_unstable();
        ours.dedup();
        got.dedup();
        assert_eq!(got, ours);
    }
}
