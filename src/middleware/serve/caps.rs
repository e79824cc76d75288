//! The caps on `casfs serve`'s open connections: at most `--max-connections` in all,
//! and at most `--max-connections-per-peer` of one peer ([`PeerKey`]: a Unix user by
//! the uid the kernel gives, `SO_PEERCRED`; a TCP client by its address), so that one
//! member's idle connections never turn another member away. The server's own user is
//! held to the total only. A connection beyond a cap is answered 503
//! `too_many_connections` after its request head and closed (`turn_away`); hyper never
//! sees it.

use crate::sys::Locked;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::stream::{Refusal, Stream, MAX_HEAD};

/// Whose a connection is, for the cap of one peer's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A Unix peer's uid.
    Uid(u32),
    /// A Unix peer the kernel did not name.
    Unknown,
    /// A TCP client's address.
    Addr(IpAddr),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Uid(u) => write!(f, "uid {u}"),
            PeerKey::Unknown => write!(f, "a peer of no known uid"),
            PeerKey::Addr(a) => write!(f, "{a}"),
        }
    }
}

impl Stream {
    /// Whose the connection is; None for the server's own user (held to the total).
    pub fn peer_key(&self) -> Option<PeerKey> {
        match self {
            Stream::Unix(s) => match s.peer_cred() {
                Ok(c) if c.uid() == rustix::process::geteuid().as_raw() => None,
                Ok(c) => Some(PeerKey::Uid(c.uid())),
                Err(_) => Some(PeerKey::Unknown),
            },
            Stream::Tcp(s) => Some(
                s.peer_addr()
                    .map_or(PeerKey::Unknown, |a| PeerKey::Addr(a.ip())),
            ),
        }
    }
}

/// Counts the open connections, in all and by peer; one is given back when its
/// connection (`conn::GuardedIo`) drops.
#[derive(Clone, Default)]
pub struct OpenCount(Arc<Mutex<Open>>);

#[derive(Default)]
struct Open {
    all: usize,
    /// Peers with connections open, and how many.
    by_peer: HashMap<PeerKey, usize>,
    /// Connections being turned away ([`OpenCount::turn_away`]).
    turning: usize,
}

/// Why a connection was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// This many are open in all.
    All(usize),
    /// This many of this peer's are open.
    Peer(PeerKey, usize),
}

impl OpenCount {
    /// Takes one if fewer than `max` are open and, for a peer (None: the server's own
    /// user), fewer than `per_peer` of its own.
    pub fn take(
        &self,
        peer: Option<PeerKey>,
        max: usize,
        per_peer: usize,
    ) -> Result<OpenSlot, Full> {
        let mut o = self.0.locked();
        if o.all >= max {
            return Err(Full::All(max));
        }
        if let Some(k) = peer {
            let mine = o.by_peer.entry(k).or_default();
            if *mine >= per_peer {
                return Err(Full::Peer(k, per_peer));
            }
            *mine += 1;
        }
        o.all += 1;
        Ok(OpenSlot {
            open: self.0.clone(),
            peer,
        })
    }
}

impl OpenCount {
    /// Turns a connection away (a 503, `turn_away`) unless `max` are being turned away
    /// already: then it is closed at once, so that a flood of connections beyond the
    /// caps holds no more descriptors than the caps allow.
    pub fn turn_away(&self, io: Stream, full: Full, max: usize) {
        {
            let mut o = self.0.locked();
            if o.turning >= max {
                return;
            }
            o.turning += 1;
        }
        struct Turning(Arc<Mutex<Open>>);
        impl Drop for Turning {
            fn drop(&mut self) {
                self.0.locked().turning -= 1;
            }
        }
        let turning = Turning(self.0.clone());
        tokio::spawn(async move {
            turn_away(io, full).await;
            drop(turning);
        });
    }
}

/// One open connection, counted until dropped.
pub struct OpenSlot {
    open: Arc<Mutex<Open>>,
    peer: Option<PeerKey>,
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        let mut o = self.open.locked();
        o.all -= 1;
        if let Some(k) = self.peer {
            if let Some(n) = o.by_peer.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    o.by_peer.remove(&k);
                }
            }
        }
    }
}

/// Answers a connection beyond a cap with a 503 and closes it. The answer follows the
/// client's request head (a client such as curl takes an answer that comes before it
/// has sent its request as a failure to connect), waiting at most a second for it, and
/// at most a second more for the client to take the answer.
async fn turn_away(io: Stream, full: Full) {
    let message = match full {
        Full::All(max) => {
            format!("the server has {max} connections open (casfs serve --max-connections)")
        }
        Full::Peer(k, max) => format!(
            "{k} has {max} connections open to the server (casfs serve \
             --max-connections-per-peer); close one"
        ),
    };
    let r = Refusal::new(503, "too_many_connections", message);
    let mut io = io;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
        while let Ok(n @ 1..) = io.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
            if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() > MAX_HEAD {
                break;
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = io.write_all(&r.to_http()).await;
        let _ = io.shutdown().await;
        // What else the client sends (a body) is read and dropped until it closes, so
        // that closing never cuts the answer short.
        let mut buf = [0u8; 4096];
        while let Ok(1..) = io.read(&mut buf).await {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_holds_at_most_its_share_of_connections() {
        let open = OpenCount::default();
        let (a, b) = (Some(PeerKey::Uid(1000)), Some(PeerKey::Uid(1001)));
        let a1 = open.take(a, 5, 2).unwrap();
        let _a2 = open.take(a, 5, 2).unwrap();
        assert_eq!(
            open.take(a, 5, 2).err(),
            Some(Full::Peer(PeerKey::Uid(1000), 2))
        );
        let _b1 = open.take(b, 5, 2).unwrap();
        // The server's own user: the total only.
        let _own = open.take(None, 5, 2).unwrap();
        let _own2 = open.take(None, 5, 2).unwrap();
        assert_eq!(open.take(b, 5, 2).err(), Some(Full::All(5)));
        drop(a1);
        let _a3 = open.take(a, 5, 2).unwrap();
        assert_eq!(open.take(None, 5, 2).err(), Some(Full::All(5)));
    }
}
