//! Writer leases: one writer per thread, with a fencing token that only grows.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ThreadId;

/// Proof that its holder may append to a thread until `expires_at`.
///
/// Every acquisition gets a fencing token larger than any before it on the thread; the
/// store refuses an append whose token is not the current one, so a writer that stalled
/// past its expiry cannot publish after another writer took over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterLease {
    pub thread: ThreadId,
    pub holder: String,
    pub token: u64,
    pub acquired_at_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
}

impl WriterLease {
    pub fn expires_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.expires_at_ms)
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// When the holder should renew: a third of the TTL after the last renewal.
    pub fn renew_after(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.expires_at_ms - self.ttl_ms * 2 / 3)
    }

    pub fn is_expired_at(&self, now: SystemTime) -> bool {
        millis(now) >= self.expires_at_ms
    }
}

/// A lease holder's name: the program, its pid and a random tag, so two processes never
/// share one.
pub fn holder_name(program: &str) -> String {
    let tag = crate::cas::Hash::of(
        format!(
            "{}-{:?}-{:?}",
            std::process::id(),
            SystemTime::now(),
            std::thread::current().id()
        )
        .as_bytes(),
    )
    .short(8);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    format!("{program}@{host}:{}:{tag}", std::process::id())
}

pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}
