//! File events of a run: the mount announces every create, modify, delete and rename;
//! a dispatcher hands them to the host in order, with a unified diff against the
//! checkpoint the workspace started from when asked. Draining at finish, pause, abort
//! and error delivers every change made before it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::SandboxHandle;
use crate::fs::{FsEvent, FsEventKind};

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
    delivered: Arc<(Mutex<u64>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    handle: SandboxHandle,
}

impl Watcher {
    pub fn start(handle: &SandboxHandle, cfg: &FileEvents) -> Watcher {
        let (rx, seq) = handle.mount.workspace().subscribe();
        let delivered = Arc::new((Mutex::new(seq), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s, h, c) = (delivered.clone(), stop.clone(), handle.clone(), cfg.clone());
        let thread = std::thread::Builder::new()
            .name("casfs-events".into())
            .spawn(move || dispatch(&rx, &d, &s, &h, &c))
            .expect("spawning the event dispatcher");
        Watcher {
            delivered,
            stop,
            thread: Some(thread),
            handle: handle.clone(),
        }
    }

    /// Delivers every change made so far, then stops. Gives up after `limit` (a host
    /// callback that never returns), saying how many were not delivered.
    pub fn drain(mut self, limit: Duration) -> Result<(), String> {
        let target = self.handle.mount.workspace().last_event();
        let (lock, cvar) = &*self.delivered;
        let start = Instant::now();
        let mut got = lock.lock().unwrap_or_else(|p| p.into_inner());
        while *got < target {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing = target - *got;
                drop(got);
                self.stop.store(true, Ordering::SeqCst);
                // A host callback that does not return: leave its thread be.
                drop(self.thread.take());
                return Err(format!(
                    "{missing} file event(s) not delivered in {limit:?}"
                ));
            }
            got = cvar
                .wait_timeout(got, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(got);
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        Ok(())
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // Joined (within one poll interval), so that the dispatcher's handle on the
        // sandbox is gone when the run is: the last handle unmounts.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn dispatch(
    rx: &Receiver<FsEvent>,
    delivered: &(Mutex<u64>, Condvar),
    stop: &AtomicBool,
    h: &SandboxHandle,
    cfg: &FileEvents,
) {
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(e) => {
                let seq = e.seq;
                let diff = if cfg.diff { diff_of(h, &e) } else { None };
                (cfg.on_event)(&FileEvent { event: e, diff });
                let (lock, cvar) = delivered;
                *lock.lock().unwrap_or_else(|p| p.into_inner()) = seq;
                cvar.notify_all();
            }
            Err(RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The unified diff of a created or modified file against the base checkpoint, as the
/// file is when the event is delivered.
fn diff_of(h: &SandboxHandle, e: &FsEvent) -> Option<String> {
    if e.is_dir || !matches!(e.kind, FsEventKind::Create | FsEventKind::Modify) {
        return None;
    }
    let path = &e.path;
    let old = match h.mount.workspace().base_file(path) {
        Ok(o) => o.unwrap_or_default(),
        Err(err) => return Some(format!("(base of {path} unreadable: {err})\n")),
    };
    let new = match std::fs::read(h.root.join(path)) {
        Ok(n) => n,
        // Gone or replaced by a directory since: a later event tells.
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
