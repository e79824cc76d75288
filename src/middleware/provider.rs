//! Sandboxes: where a run's workspace lives. The casfs provider mounts one writable
//! workspace per sandbox key, in this process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{MiddlewareError, MiddlewareResult, RunContext};
use crate::checkpoint::{MountedThread, Store};
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

/// A run's sandbox: its key, the workspace directory the agent works in, and the
/// mount through which casfs sees every change.
#[derive(Clone)]
pub struct SandboxHandle {
    pub key: String,
    pub root: PathBuf,
    pub mount: Arc<MountedThread>,
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

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, SandboxHandle>> {
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
        let mut live = self.live();
        if let Some(h) = live.get(&key) {
            if !h.mount.is_finished() && h.mount.tag().thread == ctx.thread {
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
            mount: Arc::new(mount),
        };
        live.insert(key, h.clone());
        Ok((h, EnsureOutcome::Created))
    }

    fn destroy(&self, key: &str) -> MiddlewareResult<()> {
        let Some(h) = self.live().remove(key) else {
            return Ok(());
        };
        // The last handle unmounts (a run may still hold a clone: then its drop does).
        match Arc::try_unwrap(h.mount) {
            Ok(m) => m.unmount().map_err(|e| MiddlewareError::Sandbox {
                key: key.to_string(),
                detail: format!("unmounting {}: {e}", h.root.display()),
            }),
            Err(_) => Ok(()),
        }
    }
}
