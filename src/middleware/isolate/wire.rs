//! What the server and a sandbox's init say to each other: one JSON message a datagram
//! on a `SOCK_SEQPACKET` socket pair, a spawn's standard streams passed along with it
//! (`SCM_RIGHTS`). Nothing but these messages crosses: the init holds no secret and can
//! do nothing its sandbox's own processes could not.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// How long the init may take to say it is ready, or that it started a process.
pub(super) const START_WAIT: Duration = Duration::from_secs(10);

/// The largest message either side sends (a spawn's command, directory and environment).
pub const MAX_MESSAGE: usize = 256 << 10;

/// The most descriptors one message carries (a spare's: bubblewrap's every one).
pub const MAX_FDS: usize = 16;

/// From the server to the init.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Start `argv` in `cwd` with exactly `env`, its stdin, stdout and stderr the three
    /// descriptors that come with this message; it leads a process group of its own.
    Spawn {
        id: u64,
        argv: Vec<String>,
        cwd: String,
        env: Vec<(String, String)>,
    },
    /// `signal` to the process group of `id` (everything it started that stayed in it).
    Kill { id: u64, signal: i32 },
}

/// From the init to the server.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// The init runs (bubblewrap has made the sandbox); its network namespace comes
    /// with this message.
    Ready,
    Started {
        id: u64,
        pid: i32,
    },
    /// Could not be started (`error` says why: no such program, ...).
    Failed {
        id: u64,
        error: String,
    },
    /// Ended: `code` as a shell gives it (128 + the signal for a killed one).
    Exited {
        id: u64,
        code: i32,
    },
}

/// A connected pair of `SOCK_SEQPACKET` sockets, close-on-exec: the server's end and
/// the one it gives a child.
pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Sends `msg` with `fds` (at most [`MAX_FDS`]), waiting for room.
pub fn send<T: Serialize>(sock: BorrowedFd<'_>, msg: &T, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    send_with(sock, msg, fds, SendFlags::NOSIGNAL)
}

/// As [`send`], but `WouldBlock` at once when the other side has not taken what was
/// sent before.
pub fn send_now<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    send_with(sock, msg, fds, SendFlags::NOSIGNAL | SendFlags::DONTWAIT)
}

fn send_with<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a message of {} bytes (at most {MAX_MESSAGE})", bytes.len()),
        ));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors",
        ));
    }
    loop {
        match sendmsg(sock, &[IoSlice::new(&bytes)], &mut cmsg, flags) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message and the descriptors that came with it; `None` at the end (the
/// other side closed its end).
pub fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
    buf.resize(MAX_MESSAGE, 0);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let n = loop {
        match recvmsg(
            sock,
            &mut [IoSliceMut::new(buf)],
            &mut cmsg,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(got) = m {
            fds.extend(got);
        }
    }
    if n == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..n]).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a malformed message: {e}"),
        )
    })?;
    Ok(Some((msg, fds)))
}
