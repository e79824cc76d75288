//! A process started in a sandbox: its output as it comes (kept up to a bound), its
//! exit, and its whole tree killed when it is dropped.

use crate::sys::Locked;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, Notify};

/// The most output a process keeps; older output is dropped (and counted) first.
pub const MAX_OUTPUT: usize = 8 << 20;

/// The most output all processes of one sandbox keep together: a process that writes
/// more drops its own oldest output first.
pub const MAX_SANDBOX_OUTPUT: usize = 64 << 20;

/// Which stream a chunk of output came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What a process has done so far.
#[derive(Default)]
pub(super) struct State {
    pub(super) pid: Option<i32>,
    /// Output chunks from number `first` on.
    pub(super) chunks: VecDeque<(Stream, Vec<u8>)>,
    pub(super) first: u64,
    pub(super) bytes: usize,
    pub(super) dropped_bytes: u64,
    /// Streams still open (stdout, stderr).
    pub(super) open: u8,
    pub(super) exit: Option<i32>,
    pub(super) error: Option<String>,
}

/// One process of a sandbox.
pub struct Process {
    pub id: u64,
    pub(super) state: Mutex<State>,
    /// The bytes its sandbox's processes keep, together.
    kept: Arc<AtomicUsize>,
    changed: Notify,
    pub(super) stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    pub(super) started: Mutex<Option<oneshot::Sender<io::Result<i32>>>>,
}

/// Output from a cursor on, and where the process stands.
#[derive(Debug, serde::Serialize)]
pub struct Output {
    pub chunks: Vec<(Stream, Vec<u8>)>,
    /// The cursor after these chunks.
    pub next: u64,
    /// Bytes dropped before the first chunk still kept (the process wrote more than
    /// [`MAX_OUTPUT`] that nobody read meanwhile).
    pub dropped_bytes: u64,
    pub pid: Option<i32>,
    /// The exit code, once the process has ended and its output is all in.
    pub exit_code: Option<i32>,
    pub error: Option<String>,
}

impl Process {
    pub(super) fn new(id: u64, kept: Arc<AtomicUsize>) -> Arc<Process> {
        Arc::new(Process {
            id,
            kept,
            state: Mutex::new(State {
                open: 2,
                ..State::default()
            }),
            changed: Notify::new(),
            stdin: tokio::sync::Mutex::new(None),
            started: Mutex::new(None),
        })
    }

    pub(super) fn push(&self, stream: Stream, data: Vec<u8>) {
        let mut s = self.state.locked();
        s.bytes += data.len();
        self.kept.fetch_add(data.len(), Ordering::Relaxed);
        s.chunks.push_back((stream, data));
        while (s.bytes > MAX_OUTPUT || self.kept.load(Ordering::Relaxed) > MAX_SANDBOX_OUTPUT)
            && s.chunks.len() > 1
        {
            let (_, old) = s.chunks.pop_front().expect("a chunk");
            s.bytes -= old.len();
            self.kept.fetch_sub(old.len(), Ordering::Relaxed);
            s.dropped_bytes += old.len() as u64;
            s.first += 1;
        }
        drop(s);
        self.changed.notify_waiters();
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.locked());
        self.changed.notify_waiters();
    }

    pub(super) fn done(s: &State) -> bool {
        s.exit.is_some() && s.open == 0
    }

    /// Output from `cursor` on; when there is none yet and the process runs, waits up
    /// to `wait` for some.
    pub async fn output(&self, cursor: u64, wait: Duration) -> Output {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.changed.notified();
            {
                let s = self.state.locked();
                let end = s.first + s.chunks.len() as u64;
                if cursor < end || Self::done(&s) || tokio::time::Instant::now() >= deadline {
                    let from = cursor.max(s.first);
                    let skip = (from - s.first) as usize;
                    return Output {
                        chunks: s.chunks.iter().skip(skip).cloned().collect(),
                        next: end.max(cursor),
                        dropped_bytes: s.dropped_bytes,
                        pid: s.pid,
                        exit_code: Self::done(&s).then_some(s.exit).flatten(),
                        error: s.error.clone(),
                    };
                }
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// Waits until the process has ended and its output is all in; its exit code.
    pub async fn wait(&self) -> i32 {
        loop {
            let notified = self.changed.notified();
            {
                let s = self.state.locked();
                if Self::done(&s) {
                    return s.exit.unwrap_or(-1);
                }
            }
            notified.await;
        }
    }

    /// Its exit code, once it has ended (its output may still be coming in).
    pub fn exit_code(&self) -> Option<i32> {
        self.state.locked().exit
    }

    /// Everything it wrote (as kept) on each stream.
    pub fn collected(&self) -> (Vec<u8>, Vec<u8>) {
        let s = self.state.locked();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        for (stream, d) in &s.chunks {
            match stream {
                Stream::Stdout => out.extend_from_slice(d),
                Stream::Stderr => err.extend_from_slice(d),
            }
        }
        (out, err)
    }

    /// Writes `data` to its stdin, then closes it when `end`.
    pub async fn write_stdin(&self, data: &[u8], end: bool) -> io::Result<()> {
        let mut stdin = self.stdin.lock().await;
        let Some(w) = stdin.as_mut() else {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the process's stdin is closed",
            ));
        };
        w.write_all(data).await?;
        if end {
            *stdin = None;
        }
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let bytes = self.state.locked().bytes;
        self.kept.fetch_sub(bytes, Ordering::Relaxed);
    }
}
