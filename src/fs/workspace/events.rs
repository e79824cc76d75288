//! Changes announced to subscribers (a host's file events): numbered in the
//! order they were committed, sent while the table is held.

use super::*;

/// Subscribers to the workspace's changes, and the last sequence number given out.
#[derive(Default)]
pub(super) struct Events {
    pub(super) seq: u64,
    pub(super) subscribers: Vec<std::sync::mpsc::Sender<FsEvent>>,
}

/// A change to the workspace as the mount saw it. Sequence numbers grow by one per
/// event in the order the changes were made.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FsEvent {
    pub seq: u64,
    pub kind: FsEventKind,
    /// Relative to the workspace root; for a rename, where it was.
    pub path: String,
    /// For a rename, where it is now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    pub is_dir: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FsEventKind {
    Create,
    /// Content changed: a handle that was open for writing was closed (writes through
    /// passthrough never reach the daemon, the close does), or a file was truncated by
    /// path (a truncate through a writing handle is announced by its close).
    Modify,
    Delete,
    Rename,
}

impl<'a> Tx<'a> {
    /// Whether anyone listens for changes (paths are worked out only then).
    pub(super) fn watched(&self) -> bool {
        !self.st.events.subscribers.is_empty()
    }

    /// The path of entry `name` of directory `dir`.
    pub(super) fn entry_path(&self, dir: u64, name: &[u8]) -> String {
        let d = self.path_of(dir);
        let n = String::from_utf8_lossy(name);
        if d.is_empty() {
            n.into_owned()
        } else {
            format!("{d}/{n}")
        }
    }

    /// Announces that entry `n1` of `p` becomes entry `n2` of `np`.
    pub(super) fn rename_event(&mut self, p: u64, n1: &[u8], np: u64, n2: &[u8], is_dir: bool) {
        if self.watched() {
            let (from, to) = (self.entry_path(p, n1), self.entry_path(np, n2));
            self.events
                .push((FsEventKind::Rename, from, Some(to), is_dir));
        }
    }

    /// Announces a change to entry `name` of `dir` when the transaction commits.
    pub(super) fn event(&mut self, kind: FsEventKind, dir: u64, name: &[u8], is_dir: bool) {
        if self.watched() {
            let path = self.entry_path(dir, name);
            self.events.push((kind, path, None, is_dir));
        }
    }
}

impl Workspace {
    /// Receives every change made from now on, in order, until the receiver is dropped;
    /// also returns the sequence number of the last change before.
    pub fn subscribe(&self) -> (std::sync::mpsc::Receiver<FsEvent>, u64) {
        let (tx, rx) = std::sync::mpsc::channel();
        (rx, self.subscribe_with(tx))
    }

    /// [`Workspace::subscribe`] into a channel of the caller's (who may send into it
    /// too); returns the sequence number of the last change before.
    pub fn subscribe_with(&self, tx: std::sync::mpsc::Sender<FsEvent>) -> u64 {
        let mut st = self.lock();
        st.events.subscribers.push(tx);
        st.events.seq
    }

    /// The sequence number of the last change announced.
    pub fn last_event(&self) -> u64 {
        self.lock().events.seq
    }
}
