//! The casfs provider: one writable workspace mounted per sandbox key, in this
//! process, on the backend the provider was made with.
//!
//! A sandbox's lifetime is its live entry's (`super::live`): every end (destroy,
//! eviction, reaping) takes the entry out under its key's lock, ends its processes,
//! unmounts and discards its workspace, then drops the entry and what hangs off it. A
//! mount that cannot be unmounted yet (files open in it) outlives its sandbox only as
//! remains on the doomed list: no longer live, discarded before its key is used again.

use crate::sys::Locked;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::gate::{make_gate, WORKSPACE_DIR};
use super::handle::{EnsureOutcome, SandboxHandle, SandboxWorkspace};
use super::keys::check_key;
use super::live::{Entry, KeyGuard};
use super::sandbox_provider::{purge, Kept, SandboxProvider};
use crate::checkpoint::Store;
use crate::fs::WorkspaceOptions;
use crate::middleware::context::RunContext;
use crate::middleware::error::{MiddlewareError, MiddlewareResult};
use crate::middleware::secrets::Secrets;
use crate::mount::{discard_mount_state, MountMode, MountedThread};

/// Mounts workspaces of one store under `dir/<key>`.
pub struct CasfsProvider {
    store: Arc<Store>,
    dir: PathBuf,
    opts: WorkspaceOptions,
    mode: MountMode,
    kept: Kept,
    /// The remains of sandboxes destroyed while busy (files open in them): ended (out of
    /// the live map, their extras dropped), their mounts discarded before their key is
    /// used again.
    doomed: Mutex<HashMap<String, Arc<MountedThread>>>,
}

impl CasfsProvider {
    pub fn new(store: Arc<Store>, dir: &Path, opts: WorkspaceOptions) -> CasfsProvider {
        // Mountpoints are named from the canonical directory: a mountpoint's key in the
        // store must not depend on how the directory was spelled.
        let _ = std::fs::create_dir_all(dir);
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        CasfsProvider {
            store,
            dir,
            opts,
            mode: MountMode::Fuse,
            kept: Kept::default(),
            doomed: Mutex::new(HashMap::new()),
        }
    }

    /// Mounts sandboxes with backend `mode` (default FUSE). With overlay, file events
    /// come from inotify on the sandbox (as for a plain directory), and the mount
    /// outlives a killed server (the next server detaches and discards it).
    pub fn with_mode(mut self, mode: MountMode) -> CasfsProvider {
        self.mode = mode;
        self
    }

    /// At most `n` live sandboxes (0: no limit): making one more first destroys the
    /// least recently used idle one; with none idle, a new sandbox is refused
    /// ([`MiddlewareError::AtCapacity`]).
    pub fn with_max_sandboxes(self, n: usize) -> CasfsProvider {
        self.kept.live.set_max(n);
        self
    }

    /// At most `n` live sandboxes of one tenant (0: no limit): making one more first
    /// destroys that tenant's least recently used idle one; with none idle, refused.
    /// Administrators' sandboxes are held only to the cap of all.
    pub fn with_max_sandboxes_per_tenant(self, n: usize) -> CasfsProvider {
        self.kept.live.set_max_per_tenant(n);
        self
    }

    fn doomed_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<MountedThread>>> {
        self.doomed.locked()
    }

    /// The mountpoint of sandbox `key`, behind its gate.
    pub fn mountpoint(&self, key: &str) -> PathBuf {
        self.dir.join(key).join(WORKSPACE_DIR)
    }

    /// Unmounts and discards `m` (its key's lock held by the caller); a busy mount is
    /// kept on the doomed list, discarded before the key is used again.
    fn discard(&self, key: &str, m: Arc<MountedThread>, secrets: &Secrets) -> MiddlewareResult<()> {
        // Its processes first: their namespace holds the workspace's mount.
        self.kept.jails.end(key);
        match m.discard(purge(secrets)) {
            Ok(_) => {
                self.doomed_map().remove(key);
                // The empty mountpoint and its gate go too (a later sandbox of the key
                // makes them).
                let _ = std::fs::remove_dir(self.mountpoint(key));
                let _ = std::fs::remove_dir(self.dir.join(key));
                Ok(())
            }
            Err(e) => {
                self.doomed_map().insert(key.to_string(), m);
                Err(MiddlewareError::SandboxBusy {
                    key: key.to_string(),
                    detail: format!(
                        "destroyed, but unmounting it failed ({e}); processes still use it: \
                         it is discarded when they have let go"
                    ),
                })
            }
        }
    }

    /// Discards the sandboxes `victims` (taken out of the live map with their keys
    /// locked); each entry, with its extras, goes after its workspace.
    fn discard_all(
        &self,
        victims: Vec<(KeyGuard<'_>, Entry)>,
        secrets: &Secrets,
    ) -> MiddlewareResult<usize> {
        let n = victims.len();
        for (g, e) in victims {
            if let Some(m) = e.handle.mount() {
                self.discard(g.key(), m.clone(), secrets)?;
            }
            drop(e);
        }
        Ok(n)
    }
}

/// Detaches whatever FUSE mount (live or dead) sits at `path`.
fn detach_mount(path: &Path) {
    let _ = crate::fs::detach(path);
}

impl SandboxProvider for CasfsProvider {
    fn ensure(
        &self,
        ctx: &RunContext,
        secrets: &Secrets,
    ) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)> {
        let key = self.key(ctx);
        check_key(&key)?;
        let _k = self.kept.keys.lock(&key);
        let (stale, ended, victims) = {
            let mut live = self.kept.live.lock();
            let mut stale = None;
            let mut ended = None;
            if let Some(e) = live.get_mut(&key) {
                let m = e
                    .handle
                    .mount()
                    .expect("casfs sandboxes are mounts")
                    .clone();
                if !m.is_finished() && m.tag().thread == ctx.thread {
                    e.used = std::time::Instant::now();
                    return Ok((e.handle.clone(), EnsureOutcome::Resumed));
                }
                // Unmounted behind our back, or another thread's: not this run's.
                ended = live.remove(&key);
                stale = Some(m);
            }
            let tenant = ctx.thread.tenant();
            (
                stale,
                ended,
                self.kept
                    .live
                    .make_room(&mut live, &self.kept.keys, tenant)?,
            )
        };
        self.discard_all(victims, secrets)?;
        let doomed = stale.or_else(|| self.doomed_map().get(&key).cloned());
        if let Some(m) = doomed {
            self.discard(&key, m, secrets)?;
        }
        // The stale sandbox's entry goes after its workspace, outside the map's lock.
        drop(ended);
        // An earlier sandbox's processes of the key are not this one's.
        self.kept.jails.end(&key);
        let sandbox_err = |detail: String| MiddlewareError::Sandbox {
            key: key.clone(),
            detail,
        };
        // The workspace is the run's owner's, when it names one.
        let opts = WorkspaceOptions {
            owner: ctx.owner.unwrap_or(self.opts.owner),
            ..self.opts.clone()
        };
        let mp = self.mountpoint(&key);
        if crate::fs::is_dead_mount(&mp) {
            detach_mount(&mp);
        }
        make_gate(&self.dir.join(&key), opts.owner).map_err(|e| sandbox_err(e.to_string()))?;
        if crate::fs::is_fuse_mount(&mp) {
            return Err(sandbox_err(format!(
                "{} is already a mount this provider does not own",
                mp.display()
            )));
        }
        // A created sandbox starts at the head: uncaptured work an earlier sandbox of
        // this key left (a process that died before destroying it) is not the thread's.
        discard_mount_state(&self.store, &mp, purge(secrets)).map_err(|e| {
            sandbox_err(format!("discarding earlier work in {}: {e}", mp.display()))
        })?;
        let mount = MountedThread::mount_mode(
            self.store.clone(),
            &mp,
            ctx.thread.clone(),
            None,
            &opts,
            self.mode,
        )
        .map_err(|e| sandbox_err(format!("mounting {}: {e}", mp.display())))?;
        let h = SandboxHandle::new(
            key.clone(),
            mp,
            ctx.thread.clone(),
            opts.owner,
            SandboxWorkspace::Mount(Arc::new(mount)),
        );
        self.kept.live.lock().insert(key, Entry::new(h.clone()));
        Ok((h, EnsureOutcome::Created))
    }

    fn kept(&self) -> Option<&Kept> {
        Some(&self.kept)
    }

    fn reap_idle(
        &self,
        idle: Duration,
        secrets: &Secrets,
        spare: &dyn Fn(&str) -> bool,
    ) -> MiddlewareResult<usize> {
        let victims = {
            let mut live = self.kept.live.lock();
            self.kept.live.idle(&mut live, &self.kept.keys, idle, spare)
        };
        self.discard_all(victims, secrets)
    }

    fn destroy_unheld(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<bool> {
        let _k = self.kept.keys.lock(key);
        let taken = self.kept.live.take_unheld(key)?;
        match taken.as_ref().and_then(|e| e.handle.mount()) {
            Some(m) => {
                // The entry and its extras go whether or not the mount could go.
                let discarded = self.discard(key, m.clone(), secrets);
                drop(taken);
                discarded?;
                Ok(true)
            }
            None => {
                // One destroyed while busy earlier: discarded now if it can be.
                if let Some(m) = self.doomed_map().get(key).cloned() {
                    self.discard(key, m, secrets)?;
                }
                Ok(false)
            }
        }
    }

    fn destroy(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<()> {
        let _k = self.kept.keys.lock(key);
        let taken = self.kept.live.lock().remove(key);
        let m = match taken.as_ref().and_then(|e| e.handle.mount()) {
            Some(m) => m.clone(),
            None => match self.doomed_map().get(key).cloned() {
                Some(m) => m,
                None => return Ok(()),
            },
        };
        // Whoever else holds the mount (an event dispatcher, a listing) sees it gone.
        let discarded = self.discard(key, m, secrets);
        // Then the entry, with what hangs off it.
        drop(taken);
        discarded
    }

    fn recover(&self, secrets: &Secrets) -> MiddlewareResult<usize> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => {
                return Err(MiddlewareError::Sandbox {
                    key: String::new(),
                    detail: format!("listing {}: {e}", self.dir.display()),
                })
            }
        };
        let live = self.kept.live.keys();
        let mut cleaned = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if live.contains(&name) || check_key(&name).is_err() {
                continue;
            }
            // Behind its gate; an earlier casfs mounted right at `<dir>/<key>`.
            let gate = self.dir.join(&name);
            for mp in [gate.join(WORKSPACE_DIR), gate.clone()] {
                if crate::fs::is_dead_mount(&mp) || crate::fs::is_fuse_mount(&mp) {
                    detach_mount(&mp);
                }
                discard_mount_state(&self.store, &mp, purge(secrets)).map_err(|err| {
                    MiddlewareError::Sandbox {
                        key: name.clone(),
                        detail: format!("discarding what {} held: {err}", mp.display()),
                    }
                })?;
                let _ = std::fs::remove_dir(&mp);
            }
            cleaned += 1;
        }
        Ok(cleaned)
    }
}
