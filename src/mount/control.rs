//! The control protocol of a mount: one JSON line of [`Request`] to the mount's socket
//! (`<store>/mounts/<key>/control.sock`), one JSON line back. A reply is the answer's
//! fields with `"ok": true`, or `{"ok": false, "error": message}`. Both ends are typed:
//! [`serve`] answers with the reply types below, [`request`] reads them back.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{MountCheckpoint, MountMode, MountedThread};
use crate::cas::TreeId;
use crate::checkpoint::maintenance::{MaintainOp, MaintainReport};
use crate::checkpoint::{mount_dir, CheckpointId, CheckpointResult, ThreadId};
use crate::fs::ReadMode;

/// The control socket of the mount at `mountpoint` (canonical path).
pub fn control_socket(store_root: &Path, mountpoint: &Path) -> PathBuf {
    mount_dir(store_root, mountpoint).join("control.sock")
}

/// A control request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Answered with [`MountStatus`].
    Status,
    /// Answered with [`MountCheckpoint`].
    Checkpoint { reason: Option<String> },
    /// Answered with [`Restored`].
    Restore {
        checkpoint: CheckpointId,
        thread: Option<String>,
        #[serde(default)]
        force: bool,
    },
    /// Store maintenance, run by the process that has the store open; answered with a
    /// [`MaintainReport`].
    Maintain(MaintainOp),
}

/// A mount at a glance.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MountStatus {
    pub mountpoint: PathBuf,
    pub pid: u32,
    pub thread: ThreadId,
    pub base: Option<CheckpointId>,
    pub expected_head: Option<CheckpointId>,
    pub dirty_files: usize,
    pub dirty_bytes: u64,
    pub dirty_nodes: usize,
    pub dirty_paths: Vec<String>,
    pub nodes_loaded: usize,
    pub read_mode: ReadMode,
    /// The backend serving the mount.
    pub mode: MountMode,
    /// How the kernel reaches the daemon: `io_uring` or `classic` (`/dev/fuse`); for an
    /// overlay, the FUSE view under it.
    #[serde(default)]
    pub fuse_transport: String,
    /// The base tree.
    pub root: TreeId,
    /// Why `auto` chose FUSE (none: it did not, or the mode was asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_fallback: Option<String>,
    /// A rootless overlay mount's namespace: where it is seen and how to reach it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<NamespaceInfo>,
}

/// The user namespace a rootless mount lives in ([`super::namespace`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// The user whose namespace it is.
    pub uid: u32,
    /// A process in it that lives as long as the mount: its daemon, or the `casfs serve`
    /// whose sandbox it is (`casfs exec --holder PID` enters its namespaces).
    pub holder: i32,
    /// The mountpoint as a process outside the namespace reaches it.
    pub outside: PathBuf,
}

impl NamespaceInfo {
    /// The namespace of a mount at `mountpoint` made by this process, if it is a
    /// rootless one. It is entered, and reached from outside, through this process
    /// (the mount's daemon, or `casfs serve`), which lives as long as the mount does,
    /// rather than through the namespace's holder, which may have been replaced.
    pub fn of_mount(mode: MountMode, mountpoint: &std::path::Path) -> Option<NamespaceInfo> {
        if mode != MountMode::Overlay || !super::namespace::rootless() {
            return None;
        }
        let me = super::namespace::Holder::of_process(std::process::id() as i32).ok()?;
        Some(NamespaceInfo {
            uid: super::namespace::euid(),
            holder: me.pid,
            outside: me.outside(mountpoint),
        })
    }
}

/// What a restore did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Restored {
    pub thread: ThreadId,
    pub base: Option<CheckpointId>,
    pub expected_head: Option<CheckpointId>,
    pub duration_us: u64,
}

/// Why a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{}: no casfs mount answers here ({source})", socket.display())]
    Unreachable {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", socket.display())]
    Io {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: bad reply {reply:?}: {detail}", socket.display())]
    BadReply {
        socket: PathBuf,
        reply: String,
        detail: String,
    },
    /// The mount answered with an error.
    #[error("{0}")]
    Refused(String),
}

/// The outcome fields every reply has.
#[derive(Deserialize)]
struct Outcome {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
}

/// A successful reply on the wire: the answer's fields and `"ok": true`.
#[derive(Serialize)]
struct OkReply<'a, T> {
    ok: bool,
    #[serde(flatten)]
    answer: &'a T,
}

#[derive(Serialize)]
struct ErrReply {
    ok: bool,
    error: String,
}

/// Sends one request to the control socket at `socket` and reads the answer as `T`.
pub fn request<T: DeserializeOwned>(socket: &Path, req: &Request) -> Result<T, ControlError> {
    use crate::sys::line_socket::{ask_line, AskError, Timeouts};
    let reply = ask_line(socket, req, Timeouts::default()).map_err(|e| match e {
        AskError::Connect(source) => ControlError::Unreachable {
            socket: socket.to_path_buf(),
            source,
        },
        AskError::Io(source) => ControlError::Io {
            socket: socket.to_path_buf(),
            source,
        },
    })?;
    let bad = |detail: String| ControlError::BadReply {
        socket: socket.to_path_buf(),
        reply: reply.trim().to_string(),
        detail,
    };
    let outcome: Outcome = serde_json::from_str(&reply).map_err(|e| bad(e.to_string()))?;
    if !outcome.ok {
        return Err(ControlError::Refused(
            outcome.error.unwrap_or_else(|| "unknown error".into()),
        ));
    }
    serde_json::from_str(&reply).map_err(|e| bad(e.to_string()))
}

/// Serves control requests for `mount` on `socket` until `stop` returns true (checked
/// between requests and every 200 ms) or the mount is gone.
pub fn serve(mount: &MountedThread, socket: &Path, stop: &dyn Fn() -> bool) -> std::io::Result<()> {
    let listener = crate::bind_private_socket(socket)?;
    listener.set_nonblocking(true)?;
    loop {
        if stop() || mount.is_finished() {
            break;
        }
        // Wait for a connection (or 200 ms, to check for a stop) without spinning.
        let mut pfd = [rustix::event::PollFd::new(
            &listener,
            rustix::event::PollFlags::IN,
        )];
        let tick = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        if !matches!(rustix::event::poll(&mut pfd, Some(&tick)), Ok(n) if n > 0) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                if let Err(e) = handle(mount, stream) {
                    tracing::warn!("control connection: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // Out of descriptors and the like: the mount must keep serving.
            Err(e) => {
                tracing::warn!("control socket: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    let _ = std::fs::remove_file(socket);
    Ok(())
}

fn handle(mount: &MountedThread, stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut out = match serde_json::from_str::<Request>(&line) {
        Ok(req) => answer(mount, req),
        Err(e) => refused(format!("bad request {:?}: {e}", line.trim())),
    };
    out.push(b'\n');
    let mut w = stream;
    w.write_all(&out)
}

fn reply<T: Serialize>(r: CheckpointResult<T>) -> Vec<u8> {
    match r {
        Ok(answer) => serde_json::to_vec(&OkReply {
            ok: true,
            answer: &answer,
        })
        .expect("a reply serializes"),
        Err(e) => refused(e.to_string()),
    }
}

fn refused(error: String) -> Vec<u8> {
    serde_json::to_vec(&ErrReply { ok: false, error }).expect("a reply serializes")
}

fn answer(mount: &MountedThread, req: Request) -> Vec<u8> {
    match req {
        Request::Status => {
            let (tag, st) = mount.status();
            reply(Ok(MountStatus {
                mountpoint: mount.mountpoint().to_path_buf(),
                pid: std::process::id(),
                thread: tag.thread,
                base: tag.base,
                expected_head: tag.expected_head,
                dirty_files: st.dirty_files,
                dirty_bytes: st.dirty_bytes,
                dirty_nodes: st.dirty_nodes,
                dirty_paths: st.dirty_paths,
                nodes_loaded: st.nodes_loaded,
                read_mode: st.read_mode,
                mode: mount.mode(),
                fuse_transport: mount.fuse_transport().to_string(),
                root: st.base,
                mode_fallback: (mount.mode() == MountMode::Fuse)
                    .then(MountMode::auto_fallback)
                    .flatten()
                    .map(str::to_string),
                namespace: NamespaceInfo::of_mount(mount.mode(), mount.mountpoint()),
            }))
        }
        Request::Checkpoint { reason } => {
            reply::<MountCheckpoint>(mount.checkpoint(reason.as_deref().unwrap_or("checkpoint")))
        }
        Request::Maintain(op) => {
            let live: std::collections::HashSet<[u8; 8]> = [mount.key()].into_iter().collect();
            reply::<MaintainReport>(op.run(mount.store(), &live))
        }
        Request::Restore {
            checkpoint,
            thread,
            force,
        } => reply((|| {
            let thread = thread.map(|t| ThreadId::new(&t)).transpose()?;
            let (tag, us) = mount.restore(checkpoint, thread, force)?;
            Ok(Restored {
                thread: tag.thread,
                base: tag.base,
                expected_head: tag.expected_head,
                duration_us: us,
            })
        })()),
    }
}
