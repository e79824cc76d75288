//! casfs: a content-addressed workspace filesystem for agent sandboxes.
//!
//! Layers, lowest first: [`cas`] (objects, chunks, trees, the embedded database),
//! [`fs`] (the FUSE filesystem: read-only views and the writable workspace),
//! [`checkpoint`] (checkpoint records, threads, heads, writer leases, plain-directory
//! capture and restore, maintenance), [`mount`] (a thread's mounted workspace, its
//! control protocol and daemon), [`middleware`] (agent runs on threads, `casfs serve`),
//! and the command line in `cli`. A layer never reaches up.

pub mod cas;
pub mod checkpoint;
pub mod fs;
#[doc(hidden)]
pub mod fuzzing;
pub mod middleware;
pub mod mount;

/// A crash-test hook: when the environment variable `CASFS_CRASH_AT` is `NAME` or
/// `NAME:N`, the process kills itself with SIGKILL the first (or Nth) time it reaches
/// the point `NAME`, as a power cut or an OOM kill would at that instant. The crash
/// safety tests use it to stop a capture, an append, a mount's dirty-set write or a
/// collection exactly there. Unset, it costs one load.
pub fn crashpoint(name: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static AT: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let at = AT.get_or_init(|| {
        let v = std::env::var("CASFS_CRASH_AT").ok()?;
        let (point, n) = match v.split_once(':') {
            Some((p, n)) => (p.to_string(), n.parse().unwrap_or(1)),
            None => (v, 1),
        };
        Some((point, n.max(1)))
    });
    if let Some((point, n)) = at {
        if point == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *n {
            // SAFETY: signalling our own process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }
}
