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
    let host = this_host();
    format!("{program}@{host}:{}:{tag}", std::process::id())
}

fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Whether a lease holder named by [`holder_name`] is a process of this host that no
/// longer exists (killed, crashed): its lease can be taken over at once instead of
/// after its TTL, since a process that is gone can never publish. A holder of another
/// host, of this process, or named otherwise is presumed alive.
pub fn holder_is_dead(holder: &str) -> bool {
    let Some((_, rest)) = holder.rsplit_once('@') else {
        return false;
    };
    let mut parts = rest.rsplitn(3, ':');
    let (Some(_tag), Some(pid), Some(host)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<i32>() else {
        return false;
    };
    if pid <= 0 || pid as u32 == std::process::id() || host != this_host() {
        return false;
    }
    // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_dead_only_when_its_process_on_this_host_is_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let host = this_host();
        assert!(holder_is_dead(&format!("casfs@{host}:{pid}:abcd1234")));
        // This process, another host, or a name of another form: presumed alive.
        let me = holder_name("casfs");
        assert!(!holder_is_dead(&me));
        assert!(!holder_is_dead(&format!("casfs@{host}x:{pid}:abcd1234")));
        assert!(!holder_is_dead("writer-a"));
        assert!(!holder_is_dead("a@b"));
        let init = format!("casfs@{host}:1:abcd1234");
        assert!(!holder_is_dead(&init));
    }
}
