//! File events of a run: the mount announces every create, modify, delete and rename
//! (a plain directory or an overlay: inotify, see [`super::dir_watch`]); a dispatcher hands them to the host
//! in order, with a unified diff against the checkpoint the workspace started from when
//! asked. Draining at finish, pause, abort and error delivers every change made before
//! it.
//!
//! A modify is announced when a handle that wrote is closed (or a file is truncated by
//! path): every close after a write is an event, however soon after the last. The one
//! coalescing: modifies of one file already queued back to back when the first of them
//! is delivered become one event (see [`coalesce`]). A diff is read when its event is
//! delivered, so it shows the file as it is then: after the change, never before it.

use crate::sys::Locked;
use std::collections::VecDeque;
use std::ffi::CString;
use std::io::Read;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::dir_watch::{watch_dir, DirWatch, MARKER_PREFIX};
use super::provider::{SandboxHandle, SandboxWorkspace, WeakSandboxHandle};
use crate::fs::{FsEvent, FsEventKind};
use crate::sys::dirfd;

/// A change in a run's workspace, as the host receives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileEvent {
    #[serde(flatten)]
    pub event: FsEvent,
    /// The unified diff of the file against the run's base checkpoint (create and
    /// modify of files, when diffs are asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
}

/// Where a run's file events go.
#[derive(Clone)]
pub struct FileEvents {
    pub on_event: Arc<dyn Fn(&FileEvent) + Send + Sync>,
    pub diff: bool,
}

/// The largest file a diff is made of.
const MAX_DIFF_BYTES: usize = 1 << 20;

/// Delivers one run's events until drained.
pub(crate) struct Watcher {
    delivered: Arc<(Mutex<Delivered>, Condvar)>,
    /// The dispatcher's channel: [`stop_event`] sent into it ends the dispatcher.
    wake: Sender<FsEvent>,
    thread: Option<JoinHandle<()>>,
    /// Weak: watching a sandbox does not keep it in use (a client's watcher lives as
    /// long as the sandbox, which stays idle for eviction and reaping).
    handle: WeakSandboxHandle,
    /// A plain directory's or an overlay's inotify watch (dropped with the watcher).
    _notify: Option<DirWatch>,
}

#[derive(Default)]
struct Delivered {
    seq: u64,
    /// Drain markers of a plain directory that came through.
    markers: Vec<String>,
}

impl Watcher {
    pub fn start(handle: &SandboxHandle, cfg: &FileEvents) -> Result<Watcher, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (seq, notify) = match &handle.workspace {
            SandboxWorkspace::Mount(m) if m.workspace().is_some() => {
                let ws = m.workspace().expect("a FUSE mount");
                (ws.subscribe_with(tx.clone()), None)
            }
            // A plain directory, or an overlay mount (changes reach the kernel only).
            _ => (0, Some(watch_dir(&handle.root, tx.clone())?)),
        };
        let delivered = Arc::new((
            Mutex::new(Delivered {
                seq,
                ..Delivered::default()
            }),
            Condvar::new(),
        ));
        let (d, h, c) = (delivered.clone(), handle.downgrade(), cfg.clone());
        let thread = std::thread::Builder::new()
            .name("casfs-events".into())
            .spawn(move || dispatch(&rx, &d, &h, &c))
            .map_err(|e| format!("starting the event dispatcher: {e}"))?;
        Ok(Watcher {
            delivered,
            wake: tx,
            thread: Some(thread),
            handle: handle.downgrade(),
            _notify: notify,
        })
    }

    /// Delivers every change made so far, then stops. Gives up after `limit` (a host
    /// callback that never returns), saying what was not delivered.
    pub fn drain(mut self, limit: Duration) -> Result<(), String> {
        // A sandbox destroyed meanwhile: nothing more can change in it.
        let Some(handle) = self.handle.upgrade() else {
            return Ok(());
        };
        let done: Box<dyn Fn(&Delivered) -> bool> = match &handle.workspace {
            SandboxWorkspace::Mount(m) if m.workspace().is_some() => {
                let target = m.workspace().expect("a FUSE mount").last_event();
                Box::new(move |d| d.seq >= target)
            }
            // An overlay sandbox unmounted behind the run's back: no change can reach
            // its watch any more, and a marker would land in the directory underneath.
            SandboxWorkspace::Mount(m) if m.is_finished() => Box::new(|_| true),
            _ => {
                // inotify has one queue: once a file made now is reported, so is every
                // change made before it. Made through the root's handle, never through
                // what stands under its name (`O_CREAT | O_EXCL | O_NOFOLLOW`): a name
                // taken already is passed over for the next.
                static NEXT: AtomicU64 = AtomicU64::new(0);
                let root = dirfd::open_dir_path(&handle.root)
                    .map_err(|e| format!("{}: {e}", handle.root.display()))?;
                let name = loop {
                    let name = format!(
                        "{MARKER_PREFIX}{}-{}",
                        std::process::id(),
                        NEXT.fetch_add(1, Ordering::Relaxed)
                    );
                    let c = CString::new(name.clone()).expect("no NUL in a marker's name");
                    match dirfd::create_at(root.as_fd(), &c, 0o600) {
                        Ok(_) => break name,
                        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                        Err(e) => {
                            return Err(format!("{}: {e}", handle.root.join(&name).display()))
                        }
                    }
                };
                Box::new(move |d| d.markers.contains(&name))
            }
        };
        let (lock, cvar) = &*self.delivered;
        let start = Instant::now();
        let mut got = lock.locked();
        let mut result = Ok(());
        while !done(&got) {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                result = Err(format!(
                    "file events not all delivered in {limit:?} (last delivered: {})",
                    got.seq
                ));
                // A host callback that does not return: leave its thread be.
                drop(self.thread.take());
                break;
            }
            got = cvar
                .wait_timeout(got, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let markers = std::mem::take(&mut got.markers);
        drop(got);
        if let Ok(root) = dirfd::open_dir_path(&handle.root) {
            for m in markers {
                if let Ok(c) = CString::new(m) {
                    let _ = dirfd::unlink_at(root.as_fd(), &c);
                }
            }
        }
        result
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // The dispatcher ends at the stop event, after the events before it: joined, so
        // that nothing of the run is left running.
        let _ = self.wake.send(stop_event());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What ends a dispatcher: no change has an empty path (the root itself is never
/// announced).
fn stop_event() -> FsEvent {
    FsEvent {
        seq: 0,
        kind: FsEventKind::Delete,
        path: String::new(),
        to: None,
        is_dir: true,
    }
}

fn dispatch(
    rx: &Receiver<FsEvent>,
    delivered: &(Mutex<Delivered>, Condvar),
    h: &WeakSandboxHandle,
    cfg: &FileEvents,
) {
    // Events taken off the channel to look behind a modify, not delivered yet.
    let mut queued: VecDeque<FsEvent> = VecDeque::new();
    loop {
        let next = match queued.pop_front() {
            Some(e) => Some(e),
            None => rx.recv().ok(),
        };
        match next {
            Some(e) if e.path.is_empty() => return,
            Some(mut e) => {
                if e.kind == FsEventKind::Modify && !e.is_dir {
                    e = coalesce(e, rx, &mut queued);
                }
                let (lock, cvar) = delivered;
                if e.path.starts_with(MARKER_PREFIX) && !e.path.contains('/') {
                    if e.kind == FsEventKind::Create {
                        lock.locked().markers.push(e.path);
                        cvar.notify_all();
                    }
                    continue;
                }
                let seq = e.seq;
                // Held only while the diff is read.
                let diff = match h.upgrade() {
                    Some(h) if cfg.diff => diff_of(&h, &e),
                    _ => None,
                };
                (cfg.on_event)(&FileEvent { event: e, diff });
                lock.locked().seq = seq;
                cvar.notify_all();
            }
            None => return,
        }
    }
}

/// Modifies of the file of `e` that are already queued right behind it (nothing else
/// between them) are delivered as one event, numbered as the last of them: its diff,
/// read when it is delivered, covers all of them. Nothing waits for more to come.
fn coalesce(mut e: FsEvent, rx: &Receiver<FsEvent>, queued: &mut VecDeque<FsEvent>) -> FsEvent {
    while let Ok(n) = rx.try_recv() {
        queued.push_back(n);
    }
    while queued
        .front()
        .is_some_and(|n| n.kind == FsEventKind::Modify && n.path == e.path && !n.is_dir)
    {
        e = queued.pop_front().expect("looked at");
    }
    e
}

/// The unified diff of a created or modified file against the base checkpoint, as the
/// file is when the event is delivered (which is after the change it reports).
fn diff_of(h: &SandboxHandle, e: &FsEvent) -> Option<String> {
    if e.is_dir || !matches!(e.kind, FsEventKind::Create | FsEventKind::Modify) {
        return None;
    }
    let path = &e.path;
    let old = match h.base_file(path) {
        Ok(o) => o.unwrap_or_default(),
        Err(err) => return Some(format!("(base of {path} unreadable: {err})\n")),
    };
    let new = match read_beneath(&h.root, path) {
        Ok(n) => n,
        // Gone, or replaced by a directory or a link since: a later event tells.
        Err(_) => return None,
    };
    if old.len() > MAX_DIFF_BYTES || new.len() > MAX_DIFF_BYTES {
        return Some(format!(
            "(a/{path} or b/{path} is over {MAX_DIFF_BYTES} bytes: no diff)\n"
        ));
    }
    match (std::str::from_utf8(&old), std::str::from_utf8(&new)) {
        (Ok(o), Ok(n)) => Some(
            similar::TextDiff::from_lines(o, n)
                .unified_diff()
                .context_radius(3)
                .header(&format!("a/{path}"), &format!("b/{path}"))
                .to_string(),
        ),
        _ if old == new => Some(String::new()),
        _ => Some(format!("Binary files a/{path} and b/{path} differ\n")),
    }
}

/// The content of the regular file `rel` beneath the sandbox's root `root`, read through
/// handles: no link followed, nothing outside the root, only a regular file opened, and
/// at most one byte more than a diff is made of.
fn read_beneath(root: &std::path::Path, rel: &str) -> std::io::Result<Vec<u8>> {
    let dir = dirfd::open_dir_path(root)?;
    let entry = dirfd::Entry::open_beneath(dir.as_fd(), rel.as_bytes())?;
    let f = entry.open_read()?;
    let mut out = Vec::new();
    f.take(MAX_DIFF_BYTES as u64 + 1).read_to_end(&mut out)?;
    Ok(out)
}
