//! The directory provider: plain directories for hosts without FUSE, captured by
//! walking them, with file events from inotify.
//!
//! As with the casfs provider, a sandbox lives as long as its live entry
//! (`super::live`): every end ends its processes and removes its directory, then drops
//! the entry and what hangs off it, after the map's lock is let go.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::gate::{make_gate, WORKSPACE_DIR};
use super::handle::{DirWorkspace, EnsureOutcome, SandboxHandle, SandboxWorkspace};
use super::keys::check_key;
use super::live::Entry;
use super::sandbox_provider::{Kept, SandboxProvider};
use crate::checkpoint::Store;
use crate::middleware::context::RunContext;
use crate::middleware::error::{MiddlewareError, MiddlewareResult};
use crate::middleware::secrets::Secrets;

/// Plain-directory sandboxes under `dir/<key>`, for hosts without FUSE. A checkpoint
/// walks the directory (every file is read: the policy and secret scrubbing see each),
/// and file events come from inotify.
pub struct DirProvider {
    store: Arc<Store>,
    dir: PathBuf,
    kept: Kept,
}

impl DirProvider {
    pub fn new(store: Arc<Store>, dir: &Path) -> DirProvider {
        DirProvider {
            store,
            dir: dir.to_path_buf(),
            kept: Kept::default(),
        }
    }

    /// As [`CasfsProvider::with_max_sandboxes`].
    pub fn with_max_sandboxes(self, n: usize) -> DirProvider {
        self.kept.live.set_max(n);
        self
    }

    /// As [`CasfsProvider::with_max_sandboxes_per_tenant`].
    pub fn with_max_sandboxes_per_tenant(self, n: usize) -> DirProvider {
        self.kept.live.set_max_per_tenant(n);
        self
    }

    /// The workspace of sandbox `key`, behind its gate.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key).join(WORKSPACE_DIR)
    }
}

fn remove_tree(key: &str, path: &Path) -> MiddlewareResult<()> {
    use crate::sys::dirfd;
    use std::os::unix::ffi::OsStrExt;
    let err = |e: std::io::Error| MiddlewareError::Sandbox {
        key: key.to_string(),
        detail: format!("removing {}: {e}", path.display()),
    };
    // The provider's own directory is opened by path; the sandbox in it is removed
    // through handles, no link in it followed.
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(err(std::io::Error::from(std::io::ErrorKind::InvalidInput)));
    };
    let dir = match dirfd::open_dir_path(parent) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(err(e)),
    };
    let name = std::ffi::CString::new(name.as_bytes())
        .map_err(|_| err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    dirfd::remove_entry(std::os::fd::AsFd::as_fd(&dir), &name).map_err(err)
}

impl SandboxProvider for DirProvider {
    fn ensure(
        &self,
        ctx: &RunContext,
        _secrets: &Secrets,
    ) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)> {
        let key = self.key(ctx);
        check_key(&key)?;
        // The entries evicted below, dropped after the map's lock (declared before it).
        let mut ended = Vec::new();
        let mut live = self.kept.live.lock();
        if let Some(e) = live.get_mut(&key) {
            e.used = std::time::Instant::now();
            return Ok((e.handle.clone(), EnsureOutcome::Resumed));
        }
        for (g, e) in self
            .kept
            .live
            .make_room(&mut live, &self.kept.keys, ctx.thread.tenant())?
        {
            self.kept.jails.end(g.key());
            let removed = remove_tree(g.key(), &self.dir.join(g.key()));
            ended.push(e);
            removed?;
        }
        let root = self.path(&key);
        // What an earlier sandbox of the key left is not the thread's state, nor are
        // its processes.
        self.kept.jails.end(&key);
        remove_tree(&key, &root)?;
        let err = |e: std::io::Error| MiddlewareError::Sandbox {
            key: key.clone(),
            detail: format!("{}: {e}", root.display()),
        };
        std::fs::create_dir_all(&self.dir).map_err(err)?;
        let owner = ctx.owner.unwrap_or_default();
        make_gate(&self.dir.join(&key), owner).map_err(err)?;
        let root = std::fs::canonicalize(&root).map_err(err)?;
        if owner.is_other() {
            owner.chown(&root).map_err(err)?;
        }
        let h = SandboxHandle::new(
            key.clone(),
            root,
            ctx.thread.clone(),
            owner,
            SandboxWorkspace::Dir(Arc::new(DirWorkspace {
                store: self.store.clone(),
                base: Mutex::new(None),
                owner,
            })),
        );
        live.insert(key, Entry::new(h.clone()));
        Ok((h, EnsureOutcome::Created))
    }

    fn kept(&self) -> Option<&Kept> {
        Some(&self.kept)
    }

    fn reap_idle(
        &self,
        idle: Duration,
        _secrets: &Secrets,
        spare: &dyn Fn(&str) -> bool,
    ) -> MiddlewareResult<usize> {
        // Removed under the lock: an ensure of the key meanwhile makes a new directory
        // only after this one is gone.
        let mut ended = Vec::new();
        let mut live = self.kept.live.lock();
        let idle = self.kept.live.idle(&mut live, &self.kept.keys, idle, spare);
        let n = idle.len();
        for (g, e) in idle {
            self.kept.jails.end(g.key());
            let removed = remove_tree(g.key(), &self.dir.join(g.key()));
            ended.push(e);
            removed?;
        }
        Ok(n)
    }

    fn destroy_unheld(&self, key: &str, _secrets: &Secrets) -> MiddlewareResult<bool> {
        let mut live = self.kept.live.lock();
        match super::live::take_unheld_from(&mut live, key)? {
            Some(e) => {
                self.kept.jails.end(key);
                let removed = remove_tree(key, &self.dir.join(key));
                drop(live);
                drop(e);
                removed.map(|()| true)
            }
            None => Ok(false),
        }
    }

    fn destroy(&self, key: &str, _secrets: &Secrets) -> MiddlewareResult<()> {
        let mut live = self.kept.live.lock();
        let Some(e) = live.remove(key) else {
            return Ok(());
        };
        self.kept.jails.end(key);
        let removed = remove_tree(key, &self.dir.join(key));
        drop(live);
        drop(e);
        removed
    }

    fn recover(&self, _secrets: &Secrets) -> MiddlewareResult<usize> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Ok(0);
        };
        let live = self.kept.live.keys();
        let mut cleaned = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if live.contains(&name) || check_key(&name).is_err() {
                continue;
            }
            remove_tree(&name, &e.path())?;
            cleaned += 1;
        }
        Ok(cleaned)
    }
}
