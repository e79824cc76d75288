//! Sandboxes: where a run's workspace lives. The casfs provider mounts one writable
//! workspace per sandbox key, in this process; the directory provider uses plain
//! directories (for hosts without FUSE): captured by walking them, events from inotify.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{MiddlewareError, MiddlewareResult, RunContext};
use crate::cas::TreeId;
use crate::checkpoint::{CheckpointId, MountedThread, Store};
use crate::fs::WorkspaceOptions;

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
#[derive(Clone)]
pub struct SandboxHandle {
    pub key: String,
    pub root: PathBuf,
    pub workspace: SandboxWorkspace,
}

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
    base: Mutex<Option<(CheckpointId, TreeId)>>,
}

impl SandboxHandle {
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
            SandboxWorkspace::Dir(d) => d
                .base
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .map(|b| b.0),
        }
    }

    pub(crate) fn set_base(&self, id: CheckpointId, root: TreeId) {
        if let SandboxWorkspace::Dir(d) = &self.workspace {
            *d.base.lock().unwrap_or_else(|p| p.into_inner()) = Some((id, root));
        }
    }

    /// A file's content in the checkpoint the workspace started from.
    pub(crate) fn base_file(&self, path: &str) -> Result<Option<Vec<u8>>, String> {
        match &self.workspace {
            SandboxWorkspace::Mount(m) => m.workspace().base_file(path).map_err(|e| e.to_string()),
            SandboxWorkspace::Dir(d) => {
                let base = *d.base.lock().unwrap_or_else(|p| p.into_inner());
                let Some((_, root)) = base else {
                    return Ok(None);
                };
                crate::cas::file_at(d.store.objects(), &root, path).map_err(|e| e.to_string())
            }
        }
    }
}

pub trait SandboxProvider: Send + Sync {
    /// The sandbox key of a run (default: the tenant, if any, and the thread).
    fn key(&self, ctx: &RunContext) -> String {
        match &ctx.tenant {
            Some(t) => format!("{t}.{}", ctx.thread),
            None => ctx.thread.to_string(),
        }
    }

    fn ensure(&self, ctx: &RunContext) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)>;

    /// Tears the sandbox down (its uncaptured work goes with it).
    fn destroy(&self, key: &str) -> MiddlewareResult<()>;

    /// The live sandboxes this provider holds.
    fn live(&self) -> Vec<SandboxHandle> {
        Vec::new()
    }

    /// The provider's own snapshot of the sandbox, if it has such a thing: its id.
    fn snapshot(&self, _key: &str, _label: &str) -> Option<MiddlewareResult<String>> {
        None
    }
}

/// Mounts workspaces of one store under `dir/<key>`.
pub struct CasfsProvider {
    store: Arc<Store>,
    dir: PathBuf,
    opts: WorkspaceOptions,
    live: Mutex<HashMap<String, SandboxHandle>>,
}

impl CasfsProvider {
    pub fn new(store: Arc<Store>, dir: &Path, opts: WorkspaceOptions) -> CasfsProvider {
        CasfsProvider {
            store,
            dir: dir.to_path_buf(),
            opts,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn live_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, SandboxHandle>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The mountpoint of sandbox `key`.
    pub fn mountpoint(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }
}

fn check_key(key: &str) -> MiddlewareResult<()> {
    let ok = !key.is_empty()
        && key.len() <= 200
        && key != "."
        && key != ".."
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-:@".contains(c));
    if ok {
        Ok(())
    } else {
        Err(MiddlewareError::Sandbox {
            key: key.to_string(),
            detail: "a sandbox key is 1 to 200 of A-Z a-z 0-9 _ . - : @ (it names a directory)"
                .into(),
        })
    }
}

impl SandboxProvider for CasfsProvider {
    fn ensure(&self, ctx: &RunContext) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)> {
        let key = self.key(ctx);
        check_key(&key)?;
        let mut live = self.live_map();
        if let Some(h) = live.get(&key) {
            let m = h.mount().expect("casfs sandboxes are mounts");
            if !m.is_finished() && m.tag().thread == ctx.thread {
                return Ok((h.clone(), EnsureOutcome::Resumed));
            }
            live.remove(&key);
        }
        let sandbox_err = |detail: String| MiddlewareError::Sandbox {
            key: key.clone(),
            detail,
        };
        let mp = self.mountpoint(&key);
        std::fs::create_dir_all(&mp).map_err(|e| sandbox_err(format!("{}: {e}", mp.display())))?;
        let mp = std::fs::canonicalize(&mp)
            .map_err(|e| sandbox_err(format!("{}: {e}", mp.display())))?;
        if crate::fs::is_fuse_mount(&mp) {
            return Err(sandbox_err(format!(
                "{} is already a mount this provider does not own",
                mp.display()
            )));
        }
        let mount = MountedThread::mount(
            self.store.clone(),
            &mp,
            ctx.thread.clone(),
            None,
            &self.opts,
        )
        .map_err(|e| sandbox_err(format!("mounting {}: {e}", mp.display())))?;
        let h = SandboxHandle {
            key: key.clone(),
            root: mp,
            workspace: SandboxWorkspace::Mount(Arc::new(mount)),
        };
        live.insert(key, h.clone());
        Ok((h, EnsureOutcome::Created))
    }

    fn live(&self) -> Vec<SandboxHandle> {
        self.live_map().values().cloned().collect()
    }

    fn destroy(&self, key: &str) -> MiddlewareResult<()> {
        let Some(h) = self.live_map().remove(key) else {
            return Ok(());
        };
        let SandboxWorkspace::Mount(m) = h.workspace else {
            return Ok(());
        };
        // The last handle unmounts (a run may still hold a clone: then its drop does).
        match Arc::try_unwrap(m) {
            Ok(m) => m.unmount().map_err(|e| MiddlewareError::Sandbox {
                key: key.to_string(),
                detail: format!("unmounting {}: {e}", h.root.display()),
            }),
            Err(_) => Ok(()),
        }
    }
}

/// Plain-directory sandboxes under `dir/<key>`, for hosts without FUSE. A checkpoint
/// walks the directory (every file is read: the policy and secret scrubbing see each),
/// and file events come from inotify.
pub struct DirProvider {
    store: Arc<Store>,
    dir: PathBuf,
    live: Mutex<HashMap<String, SandboxHandle>>,
}

impl DirProvider {
    pub fn new(store: Arc<Store>, dir: &Path) -> DirProvider {
        DirProvider {
            store,
            dir: dir.to_path_buf(),
            live: Mutex::new(HashMap::new()),
        }
    }

    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }
}

impl SandboxProvider for DirProvider {
    fn ensure(&self, ctx: &RunContext) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)> {
        let key = self.key(ctx);
        check_key(&key)?;
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = live.get(&key) {
            return Ok((h.clone(), EnsureOutcome::Resumed));
        }
        let root = self.path(&key);
        let err = |e: std::io::Error| MiddlewareError::Sandbox {
            key: key.clone(),
            detail: format!("{}: {e}", root.display()),
        };
        std::fs::create_dir_all(&root).map_err(err)?;
        let root = std::fs::canonicalize(&root).map_err(err)?;
        let h = SandboxHandle {
            key: key.clone(),
            root,
            workspace: SandboxWorkspace::Dir(Arc::new(DirWorkspace {
                store: self.store.clone(),
                base: Mutex::new(None),
            })),
        };
        live.insert(key, h.clone());
        Ok((h, EnsureOutcome::Created))
    }

    fn destroy(&self, key: &str) -> MiddlewareResult<()> {
        let Some(h) = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key)
        else {
            return Ok(());
        };
        std::fs::remove_dir_all(&h.root).map_err(|e| MiddlewareError::Sandbox {
            key: key.to_string(),
            detail: format!("removing {}: {e}", h.root.display()),
        })
    }
}
