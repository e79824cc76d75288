//! Sandboxes: where a run's workspace lives. The casfs provider mounts one writable
//! workspace per sandbox key, in this process; the directory provider uses plain
//! directories (for hosts without FUSE): captured by walking them, events from inotify.
//!
//! A sandbox key names a directory: [`sandbox_key`] makes it from the tenant and thread
//! so that two different (tenant, thread) pairs never share one, whatever characters
//! they hold. Destroying a sandbox discards its uncaptured work (upper files and dirty
//! set, or the plain directory): a sandbox created later for the same key starts at the
//! thread's head, or empty. Only a sandbox resumed alive keeps what the last run left.

use crate::sys::Locked;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod casfs;
mod dir;
mod handle;
pub(crate) mod live;

use crate::checkpoint::{Store, ThreadId};
use crate::fs::{Owner, WorkspaceOptions};
use crate::middleware::context::RunContext;
use crate::middleware::error::{MiddlewareError, MiddlewareResult};
use crate::middleware::secrets::Secrets;
use crate::mount::{discard_mount_state, MountMode, MountedThread};
pub use casfs::CasfsProvider;
pub use dir::DirProvider;
pub use handle::{DirWorkspace, EnsureOutcome, SandboxHandle, SandboxWorkspace, WeakSandboxHandle};
use live::{Entry, KeyGuard, KeyLocks, Live};

/// The longest sandbox key; longer ones end in a hash of the whole.
const MAX_KEY_LEN: usize = 200;

/// The sandbox key of a run on `thread` for `tenant`: a directory name that two
/// different pairs never share. Letters, digits, `_` and `-` stay, as does `.` but
/// first; every other byte is `%XX`. The thread's owner (a tenant's thread,
/// `alice/main`) comes first, joined by `@`, then the run's tenant label, joined by `+`
/// (the escaping never leaves either in a part), then the thread's name. A key that
/// would be longer than 200 bytes is cut and ends in `~` and a hash of the whole (`~`
/// never appears otherwise).
pub fn sandbox_key(tenant: Option<&str>, thread: &ThreadId) -> String {
    fn escape(part: &str, out: &mut String) {
        for (i, b) in part.bytes().enumerate() {
            let keep = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
            if keep {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    let mut key = String::new();
    if let Some(owner) = thread.tenant() {
        escape(owner, &mut key);
        key.push('@');
    }
    if let Some(t) = tenant {
        escape(t, &mut key);
        key.push('+');
    }
    escape(thread.name(), &mut key);
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let mut h = blake3::Hasher::new();
    if let Some(t) = tenant {
        h.update(&(t.len() as u64).to_le_bytes());
        h.update(t.as_bytes());
    }
    h.update(thread.as_str().as_bytes());
    let hash = h.finalize().to_hex();
    // Escaped keys are ASCII: any byte index is a character boundary.
    format!("{}~{}", &key[..MAX_KEY_LEN - 33], &hash[..32])
}

/// Checks a run's tenant: 1 to 200 bytes (any characters: the sandbox key escapes them).
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > 200 {
        return Err(format!("tenant {tenant:?}: use 1 to 200 bytes"));
    }
    Ok(())
}

/// The workspace's name inside its sandbox's gate: a sandbox of key `k` is the
/// directory (or mount) `<sandboxes>/<k>/workspace`.
pub const WORKSPACE_DIR: &str = "workspace";

/// Makes (or takes back) the gate of a sandbox, `gate`: a directory of the server's
/// own, mode 0700, that only `owner` (when it is another user) may pass through, with
/// an empty directory `workspace` in it for the sandbox. Every sandbox sits behind one,
/// so a member of the socket's group reaches their own workspaces and no one else's,
/// whatever its mode (`/proc/self/mountinfo` names every mountpoint).
fn make_gate(gate: &Path, owner: Owner) -> std::io::Result<PathBuf> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", gate.display()));
    match std::fs::DirBuilder::new().mode(0o700).create(gate) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(named(e)),
    }
    // The sandboxes directory is the server's: nobody else can have put a link here,
    // and O_NOFOLLOW makes sure.
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(gate)
        .map_err(named)?;
    let me = Owner::current();
    let m = dir.metadata().map_err(named)?;
    if m.uid() != me.uid {
        std::os::unix::fs::fchown(&dir, Some(me.uid), Some(me.gid)).map_err(named)?;
    }
    crate::fs::gate_directory(dir.as_fd(), owner.is_other().then_some(owner.uid)).map_err(named)?;
    let ws = gate.join(WORKSPACE_DIR);
    match std::fs::DirBuilder::new().mode(0o755).create(&ws) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(named(e)),
    }
    Ok(ws)
}

/// What every provider keeps of its sandboxes, and the one place their lifetime is
/// decided: the live ones (capped in all and per tenant), a lock per key (held while a
/// key's sandbox is made, resumed or destroyed) and the isolation of their processes.
#[derive(Default)]
pub struct Kept {
    pub(crate) live: Live,
    pub(crate) keys: KeyLocks,
    pub(crate) jails: Arc<crate::middleware::isolate::Jails>,
}

pub trait SandboxProvider: Send + Sync {
    /// The sandbox key of a run (default: [`sandbox_key`] of its tenant and thread).
    fn key(&self, ctx: &RunContext) -> String {
        sandbox_key(ctx.tenant.as_deref(), &ctx.thread)
    }

    /// The run's sandbox: the live one of its key, or a new one. A new sandbox holds
    /// nothing that was not checkpointed (a provider cleans what an earlier sandbox of
    /// the key left). `secrets` are the workspace's: see [`SandboxProvider::destroy`].
    fn ensure(
        &self,
        ctx: &RunContext,
        secrets: &Secrets,
    ) -> MiddlewareResult<(SandboxHandle, EnsureOutcome)>;

    /// Tears the sandbox down and discards its uncaptured work, so that nothing of it
    /// reaches a later sandbox of the key. Whatever of it held one of `secrets`
    /// (names, link targets, attributes kept in the store's records) is purged from
    /// the store's files.
    fn destroy(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<()>;

    /// [`SandboxProvider::destroy`] of a sandbox nobody holds (no run, no capture in
    /// progress): one that is held is refused (`SandboxBusy`) and kept. Checked and
    /// done under the key's lock, so a run that takes the sandbox meanwhile either
    /// holds it before (refused) or gets a new one after. Returns whether a live
    /// sandbox was destroyed (of two callers at once, one is told `true`).
    fn destroy_unheld(&self, key: &str, secrets: &Secrets) -> MiddlewareResult<bool>;

    /// What this provider keeps of its sandboxes ([`Kept`]): the methods below answer
    /// from it. None: it keeps nothing itself (they answer that nothing is live).
    fn kept(&self) -> Option<&Kept> {
        None
    }

    /// Notes that sandbox `key` was used now (a client asked about it): the least
    /// recently used idle sandbox is the first made room for at the cap.
    fn touch(&self, key: &str) {
        if let Some(k) = self.kept() {
            k.live.touch(key);
        }
    }

    /// The isolation of its sandboxes' processes (`middleware::isolate`): ended before
    /// a sandbox's workspace goes.
    fn jails(&self) -> Option<&Arc<crate::middleware::isolate::Jails>> {
        self.kept().map(|k| &k.jails)
    }

    /// The live sandboxes this provider holds, as handles that look at them without
    /// holding them ([`SandboxHandle::look`]).
    fn live(&self) -> Vec<SandboxHandle> {
        self.kept().map(|k| k.live.handles()).unwrap_or_default()
    }

    /// Live sandbox `key`, held while the handle returned lives (a capture of it).
    fn get(&self, key: &str) -> Option<SandboxHandle> {
        self.kept()?.live.get(key)
    }

    /// Live sandbox `key`, looked at without holding it (a client's file operation in
    /// it: a DELETE meanwhile is not refused for it).
    fn look(&self, key: &str) -> Option<SandboxHandle> {
        match self.kept() {
            Some(k) => k.live.look(key),
            None => self.live().into_iter().find(|h| h.key == key),
        }
    }

    /// Cleans what sandboxes of an earlier process left behind (a server killed
    /// mid-run): mounts, uncaptured work. Live sandboxes of this one are not touched.
    /// Returns how many it cleaned.
    fn recover(&self, _secrets: &Secrets) -> MiddlewareResult<usize> {
        Ok(0)
    }

    /// Destroys the sandboxes no run has held for `idle` (a server's reaper calls it
    /// every second at most), but those `spare` says to keep. Returns how many.
    fn reap_idle(
        &self,
        _idle: Duration,
        _secrets: &Secrets,
        _spare: &dyn Fn(&str) -> bool,
    ) -> MiddlewareResult<usize> {
        Ok(0)
    }

    /// Destroys every live sandbox (a server stopping): tries each, reports the first
    /// failure.
    fn destroy_all(&self, secrets: &Secrets) -> MiddlewareResult<()> {
        let mut first = Ok(());
        for h in self.live() {
            if let Err(e) = self.destroy(&h.key, secrets) {
                tracing::warn!("destroying sandbox {:?}: {e}", h.key);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// Whether discarding a sandbox must purge the store's files of its records: whenever
/// there are secrets, since its names, link targets and attributes may have held one.
fn purge(secrets: &Secrets) -> bool {
    !secrets.is_empty()
}

/// Checks a sandbox key a provider made: it names one directory under the provider's.
fn check_key(key: &str) -> MiddlewareResult<()> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && !key.starts_with('.')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-:@%+~".contains(c));
    if ok {
        Ok(())
    } else {
        Err(MiddlewareError::Sandbox {
            key: key.to_string(),
            detail: "a sandbox key is 1 to 200 of A-Z a-z 0-9 _ . - : @ % + ~, not starting \
                     with '.' (it names a directory)"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> ThreadId {
        ThreadId::new(s).unwrap()
    }

    #[test]
    fn sandbox_keys_never_collide_and_name_one_directory() {
        let pairs: Vec<(Option<&str>, &str)> = vec![
            (None, "t"),
            (Some("a"), "b.c"),
            (Some("a.b"), "c"),
            (Some("a+b"), "c"),
            (Some("a"), "b+c"),
            (None, "a+b"),
            (None, "a%2Bb"),
            (Some("../.."), "x"),
            (Some("/etc"), "passwd"),
            (None, ".."),
            (None, ".hidden"),
            (None, "üñï"),
            (None, "alice/main"),
            (Some("alice"), "main"),
            (None, "alice/b.c"),
            (Some("x"), "alice/main"),
            (None, "alice@main"),
        ];
        let mut seen = std::collections::HashMap::new();
        for (tenant, thread) in &pairs {
            let k = sandbox_key(*tenant, &t(thread));
            check_key(&k).unwrap();
            assert!(!k.contains('/') && k != "." && k != "..", "{k}");
            if let Some(prev) = seen.insert(k.clone(), (tenant, thread)) {
                panic!("{k} for both {prev:?} and {:?}", (tenant, thread));
            }
        }
        assert_eq!(sandbox_key(None, &t("t")), "t");
        assert_eq!(sandbox_key(Some("acme"), &t("t-1")), "acme+t-1");
        assert_eq!(sandbox_key(None, &t("alice/main")), "alice@main");
        assert_eq!(
            sandbox_key(Some("tanstack"), &t("alice/t-1")),
            "alice@tanstack+t-1"
        );
        let long = "x".repeat(200);
        let a = sandbox_key(Some(&long), &t(&long));
        let b = sandbox_key(Some(&long), &t(&format!("{}y", &long[..199])));
        assert!(a.len() <= MAX_KEY_LEN && a.contains('~'), "{a}");
        assert_ne!(a, b);
        check_key(&a).unwrap();
    }

    #[test]
    fn only_holding_handles_keep_a_sandbox_from_being_destroyed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            &dir.path().join("store"),
            crate::checkpoint::OpenMode::Create,
            Duration::from_secs(5),
        )
        .unwrap();
        let p = DirProvider::new(Arc::new(store), &dir.path().join("sb"));
        let none = Secrets::default();
        let ctx = RunContext::new(t("t"), "r1");
        let (run, _) = p.ensure(&ctx, &none).unwrap();
        // A run holds it: refused, and kept.
        let busy = p.destroy_unheld(&run.key, &none).unwrap_err();
        assert!(
            matches!(busy, MiddlewareError::SandboxBusy { .. }),
            "{busy}"
        );
        drop(run);
        // A capture holds it too.
        let capture = p.get("t").unwrap();
        assert!(p.destroy_unheld("t", &none).is_err());
        drop(capture);
        // What looks does not: listings, an observer's upgraded weak handle, a look.
        let listed = p.live();
        let weak = listed[0].downgrade();
        let upgraded = weak.upgrade().unwrap();
        let looked = listed[0].look();
        assert!(p.destroy_unheld("t", &none).unwrap());
        assert!(!listed[0].root.exists());
        drop((listed, upgraded, looked));
        assert!(p.get("t").is_none());
        assert!(weak.upgrade().is_none());
    }
}
