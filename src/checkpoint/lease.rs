//! Writer leases: one writer per thread, with a fencing token that only grows; holder
//! names that tell a dead holder (`keeper.rs` renews a lease in the background).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ids::ThreadId;

/// Proof that its holder may append to a thread until `expires_at`.
///
/// Every acquisition gets a fencing token larger than any before it on the thread; the
/// store refuses an append whose token is not the current one, so a writer that stalled
/// past its expiry cannot publish after another writer took over. The token is a
/// number anyone can guess, so every renew, release and append also presents the
/// lease's [`OwnerToken`], a secret only its acquirer was told. A store reads only the
/// `thread`, `token` and `owner_token` of a lease it is handed: holder and TTL are
/// its own record's, fixed when the lease was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterLease {
    pub thread: ThreadId,
    pub holder: String,
    pub token: u64,
    pub acquired_at_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
    pub owner_token: OwnerToken,
}

impl WriterLease {
    /// A lease as a writer presents it (its thread, fencing token and owner secret):
    /// what a store checks. The other fields are left empty; the store's answer fills
    /// them from its own record.
    pub fn presented(thread: ThreadId, token: u64, owner_token: OwnerToken) -> WriterLease {
        WriterLease {
            thread,
            holder: String::new(),
            token,
            acquired_at_ms: 0,
            expires_at_ms: 0,
            ttl_ms: 0,
            owner_token,
        }
    }

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

/// A fresh secret: 32 bytes from the system's random source, in hex.
pub fn secret_hex() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the system's random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether secrets `a` and `b` are equal, in time that depends on their lengths only.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A lease's owner secret: 32 random bytes in hex, told only to the writer that took
/// the lease. Stores keep only its hash ([`OwnerToken::digest`]), so reading a store's
/// files does not give it away either; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnerToken(String);

impl OwnerToken {
    /// A fresh secret from the system's random source.
    pub fn generate() -> OwnerToken {
        OwnerToken(secret_hex())
    }

    /// A secret as a client sent it.
    pub fn from_client(s: String) -> OwnerToken {
        OwnerToken(s)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What a store keeps: the blake3 hash of the secret, in hex.
    pub fn digest(&self) -> String {
        crate::cas::Hash::of(self.0.as_bytes()).to_hex()
    }
}

impl std::fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnerToken(<secret>)")
    }
}

/// A thread's lease as a store keeps it: the lease with its owner secret replaced by
/// the secret's hash. A record written before leases had owners has an empty hash,
/// which no secret matches: such a lease can only expire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub thread: ThreadId,
    pub holder: String,
    pub token: u64,
    pub acquired_at_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
    #[serde(default)]
    pub owner_digest: String,
}

impl LeaseRecord {
    pub fn of(l: &WriterLease) -> LeaseRecord {
        LeaseRecord {
            thread: l.thread.clone(),
            holder: l.holder.clone(),
            token: l.token,
            acquired_at_ms: l.acquired_at_ms,
            expires_at_ms: l.expires_at_ms,
            ttl_ms: l.ttl_ms,
            owner_digest: l.owner_token.digest(),
        }
    }

    /// Whether `l` presents this lease's owner secret.
    pub fn owned_by(&self, l: &WriterLease) -> bool {
        let given = l.owner_token.digest();
        // Compared in constant time, though both are hashes.
        !self.owner_digest.is_empty() && same_secret(given.as_bytes(), self.owner_digest.as_bytes())
    }

    /// The lease this record is, as told to the writer that presented `owner`.
    pub fn to_lease(&self, owner: &OwnerToken) -> WriterLease {
        WriterLease {
            thread: self.thread.clone(),
            holder: self.holder.clone(),
            token: self.token,
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: self.expires_at_ms,
            ttl_ms: self.ttl_ms,
            owner_token: owner.clone(),
        }
    }

    pub fn expires_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.expires_at_ms)
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

/// This host's name (empty if it cannot be read).
pub(crate) fn this_host() -> String {
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
    // Signal 0 sends nothing; it only asks whether the process exists.
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return false;
    };
    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
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
