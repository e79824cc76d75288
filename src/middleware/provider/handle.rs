//! A sandbox as its users hold it: the handle (key, workspace directory, thread and
//! owner) whose clones keep the sandbox in use, the weak handle of an observer that
//! does not, and what the workspace is (a casfs mount or a plain directory).

use crate::sys::Locked;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::cas::TreeId;
use crate::checkpoint::{CheckpointId, Store, ThreadId};
use crate::fs::Owner;
use crate::mount::MountedThread;

/// How [`SandboxProvider::ensure`] got the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// A live sandbox of this key, as the last run left it.
    Resumed,
    /// Brought back from the provider's own snapshot.
    NativeRestored,
    /// New.
    Created,
}

/// A run's sandbox: its key, the workspace directory the agent works in, and what
/// that directory is.
///
/// A clone holds the sandbox while it lives: a run, a capture in progress. Such a
/// sandbox is in use, and [`SandboxProvider::destroy_unheld`] refuses it. What only
/// looks at a sandbox (a listing, an event's diff) takes [`SandboxHandle::look`]
/// instead, so that a destroy at the same moment is not refused because of it.
#[derive(Clone)]
pub struct SandboxHandle {
    pub key: String,
    pub root: PathBuf,
    /// The thread it is a workspace of (whose tenant owns it: [`ThreadId::tenant`]).
    pub thread: ThreadId,
    /// Whose its files are: what the server does in it for a client, it does as them.
    pub owner: Owner,
    pub workspace: SandboxWorkspace,
    /// Shared by the holding clones: more than the provider's own one means in use.
    hold: Arc<Hold>,
}

/// The token a holding [`SandboxHandle`] shares with the provider's.
#[derive(Debug, Default)]
struct Hold;

#[derive(Clone)]
pub enum SandboxWorkspace {
    /// A casfs mount: every change passes through it.
    Mount(Arc<MountedThread>),
    /// A plain directory.
    Dir(Arc<DirWorkspace>),
}

/// A plain-directory workspace: which checkpoint it was restored at or last captured.
pub struct DirWorkspace {
    pub(crate) store: Arc<Store>,
    /// The checkpoint and its root tree.
    pub(super) base: Mutex<Option<(CheckpointId, TreeId)>>,
    /// Whose the directory and what is restored into it are.
    pub(crate) owner: Owner,
}

/// A sandbox handle that does not keep the sandbox in use: what a long-lived observer
/// of a sandbox (a client's file-event watcher) holds, so that the sandbox stays idle
/// for eviction and reaping. [`WeakSandboxHandle::upgrade`] gives the handle while the
/// sandbox lives.
#[derive(Clone)]
pub struct WeakSandboxHandle {
    pub key: String,
    pub root: PathBuf,
    pub thread: ThreadId,
    pub owner: Owner,
    workspace: WeakWorkspace,
}

#[derive(Clone)]
enum WeakWorkspace {
    Mount(std::sync::Weak<MountedThread>),
    Dir(std::sync::Weak<DirWorkspace>),
}

impl WeakSandboxHandle {
    /// Whether this is a handle of the very sandbox `h` (not of an earlier one of its
    /// key).
    pub fn is(&self, h: &SandboxHandle) -> bool {
        match (&self.workspace, &h.workspace) {
            (WeakWorkspace::Mount(w), SandboxWorkspace::Mount(m)) => {
                std::ptr::eq(w.as_ptr(), Arc::as_ptr(m))
            }
            (WeakWorkspace::Dir(w), SandboxWorkspace::Dir(d)) => {
                std::ptr::eq(w.as_ptr(), Arc::as_ptr(d))
            }
            _ => false,
        }
    }

    pub fn upgrade(&self) -> Option<SandboxHandle> {
        let workspace = match &self.workspace {
            WeakWorkspace::Mount(m) => SandboxWorkspace::Mount(m.upgrade()?),
            WeakWorkspace::Dir(d) => SandboxWorkspace::Dir(d.upgrade()?),
        };
        // An observer's handle: it does not hold the sandbox.
        Some(SandboxHandle::new(
            self.key.clone(),
            self.root.clone(),
            self.thread.clone(),
            self.owner,
            workspace,
        ))
    }
}

impl SandboxHandle {
    pub(super) fn new(
        key: String,
        root: PathBuf,
        thread: ThreadId,
        owner: Owner,
        workspace: SandboxWorkspace,
    ) -> SandboxHandle {
        SandboxHandle {
            key,
            root,
            thread,
            owner,
            workspace,
            hold: Arc::default(),
        }
    }

    /// Which sandbox this is, told apart from an earlier or later one of its key (while
    /// it lives).
    pub fn instance(&self) -> usize {
        match &self.workspace {
            SandboxWorkspace::Mount(m) => Arc::as_ptr(m) as usize,
            SandboxWorkspace::Dir(d) => Arc::as_ptr(d) as usize,
        }
    }

    /// A handle to the same sandbox that does not hold it (see [`SandboxHandle`]).
    pub fn look(&self) -> SandboxHandle {
        SandboxHandle::new(
            self.key.clone(),
            self.root.clone(),
            self.thread.clone(),
            self.owner,
            self.workspace.clone(),
        )
    }

    /// Whether anyone besides the provider holds this sandbox (a run, a capture in
    /// progress): called on the provider's own handle.
    pub(crate) fn in_use(&self) -> bool {
        Arc::strong_count(&self.hold) > 1
    }

    pub fn downgrade(&self) -> WeakSandboxHandle {
        WeakSandboxHandle {
            key: self.key.clone(),
            root: self.root.clone(),
            thread: self.thread.clone(),
            owner: self.owner,
            workspace: match &self.workspace {
                SandboxWorkspace::Mount(m) => WeakWorkspace::Mount(Arc::downgrade(m)),
                SandboxWorkspace::Dir(d) => WeakWorkspace::Dir(Arc::downgrade(d)),
            },
        }
    }

    /// The mount, for a casfs sandbox.
    pub fn mount(&self) -> Option<&Arc<MountedThread>> {
        match &self.workspace {
            SandboxWorkspace::Mount(m) => Some(m),
            SandboxWorkspace::Dir(_) => None,
        }
    }

    /// The head the next checkpoint of this workspace goes on.
    pub fn expected_head(&self) -> Option<CheckpointId> {
        match &self.workspace {
            SandboxWorkspace::Mount(m) => m.tag().expected_head,
            SandboxWorkspace::Dir(d) => d.base.locked().map(|b| b.0),
        }
    }

    pub(crate) fn set_base(&self, id: CheckpointId, root: TreeId) {
        if let SandboxWorkspace::Dir(d) = &self.workspace {
            *d.base.locked() = Some((id, root));
        }
    }

    /// A file's content in the checkpoint the workspace started from.
    pub(crate) fn base_file(&self, path: &str) -> Result<Option<Vec<u8>>, String> {
        match &self.workspace {
            SandboxWorkspace::Mount(m) => m.base_file(path).map_err(|e| e.to_string()),
            SandboxWorkspace::Dir(d) => {
                let base = *d.base.locked();
                let Some((_, root)) = base else {
                    return Ok(None);
                };
                crate::cas::file_at(d.store.objects(), &root, path).map_err(|e| e.to_string())
            }
        }
    }
}
