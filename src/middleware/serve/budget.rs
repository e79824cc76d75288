//! The memory `casfs serve` gives to requests, across all connections: every request
//! body buffered, and the JSON values made of it, is a [`Charge`] against one
//! [`Budget`] (`--max-request-memory`), taken before the bytes are read and given back
//! when the request is answered. One peer (a Unix user other than the server's own)
//! holds at most its share (`--max-request-memory-per-peer`) while it has other
//! requests charged, so that one member's stalled or large bodies never take every
//! other member's room.
//!
//! A request that does not fit waits for room, at most `--request-memory-wait`, then
//! is answered 503 `busy`: a burst of large uploads from one agent host (a checkpoint,
//! its transcript and artifacts at once) goes through a moment later rather than
//! failing, and a waiting request holds nothing (its body is not read yet). One that
//! could never fit (more than the whole budget) is refused at once.

use crate::sys::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The memory for requests in use, and who holds it.
#[derive(Default)]
pub struct Budget {
    state: Mutex<State>,
    /// Woken whenever memory is given back.
    freed: Notify,
}

#[derive(Default)]
struct State {
    used: usize,
    /// What each peer (by uid) holds, while it holds some.
    by_peer: HashMap<u32, usize>,
}

/// The budget's limits (from `ServeLimits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Bytes held at once by all requests.
    pub total: usize,
    /// Bytes held at once by one peer's requests, beyond its first.
    pub per_peer: usize,
    /// How long a request waits for room.
    pub wait: Duration,
}

/// Why a charge was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No room within the wait; there may be later. `peer`: the charge was a peer's,
    /// held to its share too.
    Busy {
        wanted: usize,
        share: Share,
        peer: bool,
    },
    /// More than the whole budget: there never is.
    NeverFits { wanted: usize, total: usize },
}

/// Memory held by one request, given back when dropped.
pub struct Charge {
    budget: Arc<Budget>,
    peer: Option<u32>,
    bytes: usize,
}

impl Budget {
    /// A charge of nothing yet for a request of `peer` (None: the server's own user, or
    /// one not told apart, held to the total only).
    pub fn open(self: &Arc<Budget>, peer: Option<u32>) -> Charge {
        Charge {
            budget: self.clone(),
            peer,
            bytes: 0,
        }
    }

    /// Bytes in use.
    #[cfg(test)]
    pub fn used(&self) -> usize {
        self.state.locked().used
    }

    /// Takes `n` more for `c` if they fit now.
    fn try_grow(&self, c: &Charge, n: usize, share: Share) -> bool {
        let mut s = self.state.locked();
        if s.used + n > share.total {
            return false;
        }
        if let Some(p) = c.peer {
            let mine = s.by_peer.get(&p).copied().unwrap_or(0);
            let others = mine - c.bytes;
            if others > 0 && mine + n > share.per_peer {
                return false;
            }
            *s.by_peer.entry(p).or_default() += n;
        }
        s.used += n;
        true
    }

    fn give_back(&self, peer: Option<u32>, n: usize) {
        if n == 0 {
            return;
        }
        {
            let mut s = self.state.locked();
            s.used -= n;
            if let Some(p) = peer {
                if let Some(m) = s.by_peer.get_mut(&p) {
                    *m -= n;
                    if *m == 0 {
                        s.by_peer.remove(&p);
                    }
                }
            }
        }
        self.freed.notify_waiters();
    }
}

impl Charge {
    /// Bytes held.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `n` bytes more, waiting for room up to the share's wait.
    pub async fn grow(&mut self, n: usize, share: Share) -> Result<(), Refused> {
        if n == 0 {
            return Ok(());
        }
        let wanted = self.bytes.saturating_add(n);
        if wanted > share.total {
            return Err(Refused::NeverFits {
                wanted,
                total: share.total,
            });
        }
        let deadline = Instant::now() + share.wait;
        loop {
            // Registered before the check, so that a give-back between the check and
            // the wait still wakes it.
            let freed = self.budget.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.budget.try_grow(self, n, share) {
                self.bytes += n;
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(Refused::Busy {
                    wanted: n,
                    share,
                    peer: self.peer.is_some(),
                });
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.give_back(self.peer, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(total: usize, per_peer: usize) -> Share {
        Share {
            total,
            per_peer,
            wait: Duration::from_millis(20),
        }
    }

    #[tokio::test]
    async fn charges_fit_the_total_and_come_back_when_dropped() {
        let b = Arc::new(Budget::default());
        let s = share(100, 100);
        let mut one = b.open(None);
        one.grow(60, s).await.unwrap();
        let mut two = b.open(None);
        assert!(matches!(
            two.grow(50, s).await,
            Err(Refused::Busy { wanted: 50, .. })
        ));
        assert_eq!(two.bytes(), 0);
        two.grow(40, s).await.unwrap();
        assert_eq!(b.used(), 100);
        assert_eq!(
            b.open(None).grow(101, s).await,
            Err(Refused::NeverFits {
                wanted: 101,
                total: 100
            })
        );
        drop(one);
        assert_eq!(b.used(), 40);
        drop(two);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn a_waiting_charge_takes_the_room_given_back() {
        let b = Arc::new(Budget::default());
        let s = Share {
            wait: Duration::from_secs(60),
            ..share(100, 100)
        };
        let mut held = b.open(None);
        held.grow(100, s).await.unwrap();
        let b2 = b.clone();
        let waiter = tokio::spawn(async move {
            let mut c = b2.open(None);
            c.grow(30, s).await.map(|()| c.bytes())
        });
        // Given back at any point of the waiter's wait (before it starts, too).
        tokio::task::yield_now().await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Ok(30));
    }

    #[tokio::test]
    async fn one_peer_holds_its_share_beside_others_and_any_one_request_alone() {
        let b = Arc::new(Budget::default());
        let s = share(100, 30);
        // Alone, a request of a peer may take more than the share.
        let mut big = b.open(Some(1000));
        big.grow(50, s).await.unwrap();
        big.grow(10, s).await.unwrap();
        // Beside it, a second request of the same peer does not fit...
        let mut second = b.open(Some(1000));
        assert!(matches!(second.grow(1, s).await, Err(Refused::Busy { .. })));
        // ...while another peer and the server's own user do.
        let mut other = b.open(Some(1001));
        other.grow(30, s).await.unwrap();
        let mut own = b.open(None);
        own.grow(10, s).await.unwrap();
        drop(big);
        second.grow(20, s).await.unwrap();
        let mut third = b.open(Some(1000));
        third.grow(10, s).await.unwrap();
        assert!(matches!(third.grow(1, s).await, Err(Refused::Busy { .. })));
        drop((second, third, other, own));
        assert_eq!(b.used(), 0);
        assert!(b.state.lock().unwrap().by_peer.is_empty());
    }
}
