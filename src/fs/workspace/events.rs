//! Changes announced to subscribers (a host's file events): numbered in the
//! order they were committed, sent while the table is held.

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
