//! casfs: a content-addressed workspace filesystem for agent sandboxes.
//!
//! Layers, lowest first: [`cas`] (objects, chunks, trees, the embedded database),
//! [`fs`] (the FUSE filesystem: read-only views and the writable workspace),
//! [`checkpoint`] (checkpoint records, threads, heads, writer leases, plain-directory
//! capture and restore, maintenance), [`mount`] (a thread's mounted workspace, its
//! control protocol and daemon), [`middleware`] (agent runs on threads, `casfs serve`),
//! and the command line in `cli`. A layer never reaches up; [`memory`] (giving freed
//! memory back) and [`sys`] (what every layer uses of the OS and std) serve them all.

pub mod cas;
pub mod checkpoint;
pub mod fs;
#[doc(hidden)]
pub mod fuzzing;
pub mod memory;
pub mod middleware;
pub mod mount;
pub mod sys;

/// A Unix socket listener at `path` that is already listening and private (0600) when
/// the path appears: bound and chmod-ed under a side name, then renamed into place. A
/// client that waits for the path never meets ECONNREFUSED (bound, not yet listening),
/// and no other user can connect in between. A stale socket at `path` is replaced.
pub fn bind_private_socket(
    path: &std::path::Path,
) -> std::io::Result<std::os::unix::net::UnixListener> {
    bind_socket(path, 0o600, None)
}

/// [`bind_private_socket`] with permissions `mode` and, if given, group `group`: both
/// set under the side name, so that nobody connects before the socket has them.
pub fn bind_socket(
    path: &std::path::Path,
    mode: u32,
    group: Option<u32>,
) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let mut side = path.as_os_str().to_owned();
    side.push(".binding");
    let side = std::path::PathBuf::from(side);
    let _ = std::fs::remove_file(&side);
    let l = std::os::unix::net::UnixListener::bind(&side).map_err(named)?;
    let placed = std::os::unix::fs::chown(&side, None, group)
        .and_then(|()| std::fs::set_permissions(&side, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std::fs::rename(&side, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&side);
        return Err(named(e));
    }
    Ok(l)
}

/// The stack of a thread that may walk a tree as deep as casfs stores
/// ([`cas::MAX_TREE_DEPTH`] directories, a few frames a level): `casfs serve`'s
/// workers and the capture pool. Only the pages a walk touches are ever resident.
pub const DEEP_STACK: usize = 64 << 20;

/// Runs `f` on the pool captures and restores walk trees with: one nested task a
/// directory level, so its threads have [`DEEP_STACK`]. The pool starts on first use,
/// not at process start: a process that must join a user namespace first is still
/// single-threaded until then. Where its threads cannot start, `f` runs where it is.
pub fn on_deep_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("casfs-walk-{i}"))
            .stack_size(DEEP_STACK)
            .build()
            .map_err(|e| tracing::warn!("starting the tree-walk pool: {e}"))
            .ok()
    });
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Lets a long-lived server (`casfs serve`, a mount daemon, a watcher) outlive any
/// client: a peer that closes its socket before the reply makes write(2) fail with
/// EPIPE, which ends that one connection, instead of killing the whole process with
/// SIGPIPE (a Unix socket's write has no `MSG_NOSIGNAL`, unlike TCP's `send`).
/// Programs it starts get SIGPIPE's default back (`std::process::Command` resets it).
pub fn ignore_broken_pipes() {
    sys::signal::ignore(libc::SIGPIPE);
}

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
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixStream;

    /// The path appears only once it accepts connections and is private; a stale socket
    /// (bound by a dead process) is replaced; a bad path is an error naming it.
    #[test]
    fn a_private_socket_appears_listening() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("s.sock");
        let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(UnixStream::connect(&path).is_err());
        let replaced = super::bind_private_socket(&path).unwrap();
        UnixStream::connect(&path).expect("the stale socket is replaced");
        drop(replaced);
        for _ in 0..200 {
            // The last round's socket goes first: the watcher must see only the new one.
            let _ = std::fs::remove_file(&path);
            let path2 = path.clone();
            let watcher = std::thread::spawn(move || loop {
                if let Ok(m) = std::fs::symlink_metadata(&path2) {
                    assert_eq!(m.permissions().mode() & 0o777, 0o600, "seen before chmod");
                    return UnixStream::connect(&path2).map(|_| ());
                }
                std::thread::yield_now();
            });
            let l = super::bind_private_socket(&path).unwrap();
            watcher
                .join()
                .unwrap()
                .expect("connect as soon as the path exists");
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            drop(l);
        }
        let names: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["s.sock"]);
        let bad = t.path().join("missing/dir/s.sock");
        let e = super::bind_private_socket(&bad).unwrap_err();
        assert!(e.to_string().contains("missing/dir/s.sock"), "{e}");
    }
}
