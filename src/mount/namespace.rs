//! Rootless mounts: the kernel's overlayfs for a user who is not root, inside a user and
//! mount namespace of that user's own.
//!
//! An ordinary user may create a user namespace, in which it holds every capability
//! over what the namespace owns, and a mount namespace owned by it; there, FUSE and
//! overlayfs (with `userxattr`) can be mounted. So each user gets **one** such
//! namespace, made and kept by a small holder process (`casfs namespace-holder`, in
//! the manner of rootless Podman's pause process): it maps the user's uid and gid to
//! themselves, then waits. Every rootless casfs mount of that user is made inside it
//! (the mount daemon joins it before it starts a thread), and so is every sandbox of a
//! `casfs serve` the user runs. `casfs exec` and `casfs shell` enter it with the
//! caller's uid, groups and working directory, and without the namespace's
//! capabilities: a program inside sees every casfs mount of its user at its
//! mountpoint. A process outside sees the mountpoint as the plain directory it was;
//! the same files are reachable from outside, at kernel speed, under
//! `/proc/<holder>/root/<mountpoint>` (for the same user or root, as
//! `/proc/<pid>/root` always is).
//!
//! The holder's pid, with the identities of its two namespaces, is kept in the user's
//! runtime directory (`$XDG_RUNTIME_DIR/casfs`, else `/tmp/casfs-<uid>`), which must be
//! the user's own and closed to others: a pid file another user could write would let
//! them choose the namespace our mounts are made in.
//!
//! Depends on nothing of casfs but `sys`; every function is safe to call from a process with
//! threads except [`enter`], which the kernel allows only to a single-threaded one.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{Access, FlockOperation};
use rustix::thread::{
    configure_capability_in_ambient_set, move_into_link_name_space,
    remove_capability_from_bounding_set, CapabilitySet, CapabilitySets, LinkNameSpaceType,
};

use crate::sys;
use crate::sys::signal::Blocked;

/// Why the user's namespace cannot be made, entered or used.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    /// The host forbids unprivileged user namespaces; names the setting.
    #[error("this host does not let an ordinary user create a user namespace ({0})")]
    Forbidden(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
}

/// What a process that mounts overlayfs in the namespace needs of it: to mount
/// (`CAP_SYS_ADMIN`), and what overlayfs does with the mounter's credentials — its work
/// directory is mode 0, and copy-up keeps owners, modes and times (`CAP_CHOWN`,
/// `CAP_DAC_OVERRIDE`, `CAP_DAC_READ_SEARCH`, `CAP_FOWNER`, `CAP_FSETID`), whiteouts are
/// character devices (`CAP_MKNOD`). All of them bear only on what the namespace owns
/// (the user's own files and mounts).
const MOUNTER_CAPS: u64 = 0b1_1111 | (1 << 21) | (1 << 27);

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NamespaceError {
    let what = what.into();
    move |source| NamespaceError::Io { what, source }
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The effective gid of this process.
fn egid() -> u32 {
    rustix::process::getegid().as_raw()
}

/// Whether mounts of this process are rootless ones (made in the user's namespace).
pub fn rootless() -> bool {
    euid() != 0
}

/// The user's runtime directory for casfs: `/run/user/<uid>/casfs` where systemd-logind
/// made that directory for the user, else `$XDG_RUNTIME_DIR/casfs` when that is the
/// user's, else `/tmp/casfs-<uid>`. So every session of a user (a desktop, ssh, cron, a
/// service started with an empty environment) finds the same namespace wherever logind
/// runs. Made (mode 0700) if missing, refused unless it is a directory of this user
/// that no one else may write.
pub fn runtime_dir() -> Result<PathBuf, NamespaceError> {
    this_users_runtime_dir(true)
}

/// [`runtime_dir`], made only if `create`.
fn this_users_runtime_dir(create: bool) -> Result<PathBuf, NamespaceError> {
    runtime_dir_from(
        Path::new(&format!("/run/user/{}", euid())),
        std::env::var_os("XDG_RUNTIME_DIR"),
        &std::env::temp_dir(),
        create,
    )
}

/// [`runtime_dir`] where `logind` is `/run/user/<uid>`, `xdg` is `$XDG_RUNTIME_DIR` and
/// `tmp` the temporary directory; made only if `create`.
fn runtime_dir_from(
    logind: &Path,
    xdg: Option<std::ffi::OsString>,
    tmp: &Path,
    create: bool,
) -> Result<PathBuf, NamespaceError> {
    let uid = euid();
    let private = |x: &PathBuf| {
        x.is_absolute()
            && std::fs::symlink_metadata(x)
                .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0)
    };
    let base = Some(logind.to_path_buf())
        .filter(private)
        .or_else(|| xdg.map(PathBuf::from).filter(private));
    let dir = match base {
        Some(x) => x.join("casfs"),
        None => tmp.join(format!("casfs-{uid}")),
    };
    if create {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(format!("creating {}", dir.display()))(e)),
        }
    }
    let m = std::fs::symlink_metadata(&dir).map_err(io(format!("reading {}", dir.display())))?;
    if !m.is_dir() || m.uid() != uid || m.permissions().mode() & 0o022 != 0 {
        return Err(NamespaceError::Refused(format!(
            "{}: not a directory of uid {uid} closed to others (it holds the pid of casfs's \
             namespace); remove it or set XDG_RUNTIME_DIR",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The identity of namespace `kind` (`user`, `mnt`) of process `pid` ("self" for this
/// one): the inode of its nsfs file.
fn ns_id(pid: &str, kind: &str) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/{kind}"))
        .ok()
        .map(|m| m.ino())
}

/// Whether process `pid`'s user namespace was made by this user from this process's own
/// user namespace: its owner is our euid and its parent our namespace (the
/// `NS_GET_OWNER_UID` and `NS_GET_PARENT` ioctls of nsfs). A process inside casfs's
/// namespace (an agent) can make a namespace of its own inside it and name it in the pid
/// file; that one's parent is casfs's, not ours, and it is never joined from here.
fn made_here(pid: i32) -> bool {
    let Ok(f) = File::open(format!("/proc/{pid}/ns/user")) else {
        return false;
    };
    if sys::ns::owner_uid(f.as_fd()).ok() != Some(euid()) {
        return false;
    }
    let Ok(parent) = sys::ns::parent(f.as_fd()) else {
        return false;
    };
    File::from(parent).metadata().ok().map(|m| m.ino()) == ns_id("self", "user")
}

/// The holder of the user's namespace, as its pid file names it: verified alive and
/// still in the namespaces it recorded (a reused pid is in other ones), and, seen from
/// outside, made by this user from here ([`made_here`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub pid: i32,
    user_ns: u64,
    mnt_ns: u64,
}

impl Holder {
    /// The holder named by the user's pid file, if it is alive.
    pub fn find() -> Option<Holder> {
        // Root's mounts are never in a namespace of casfs's.
        if !rootless() {
            return None;
        }
        let dir = this_users_runtime_dir(false).ok()?;
        let text = std::fs::read_to_string(dir.join("namespace.pid")).ok()?;
        let mut f = text.split_whitespace().map(|w| w.parse::<u64>().ok());
        let (pid, user_ns, mnt_ns) = (f.next()??, f.next()??, f.next()??);
        let h = Holder {
            pid: i32::try_from(pid).ok()?,
            user_ns,
            mnt_ns,
        };
        (h.alive() && (h.contains_self() || made_here(h.pid))).then_some(h)
    }

    /// The namespaces process `pid` is in, as a holder to enter: a mount's daemon (or a
    /// `casfs serve`), which lives as long as its mounts do. Refused unless it is in
    /// this process's namespaces already or in ones this user made from here.
    pub fn of_process(pid: i32) -> Result<Holder, NamespaceError> {
        let p = pid.to_string();
        let (Some(user_ns), Some(mnt_ns)) = (ns_id(&p, "user"), ns_id(&p, "mnt")) else {
            return Err(NamespaceError::Refused(format!(
                "process {pid}: gone, or not this user's"
            )));
        };
        let h = Holder {
            pid,
            user_ns,
            mnt_ns,
        };
        if h.contains_self() || made_here(pid) {
            Ok(h)
        } else {
            Err(NamespaceError::Refused(format!(
                "process {pid} is not in a namespace this user made from here"
            )))
        }
    }

    fn alive(&self) -> bool {
        let p = self.pid.to_string();
        ns_id(&p, "user") == Some(self.user_ns) && ns_id(&p, "mnt") == Some(self.mnt_ns)
    }

    /// Whether this process is in the holder's namespaces.
    pub fn contains_self(&self) -> bool {
        ns_id("self", "user") == Some(self.user_ns) && ns_id("self", "mnt") == Some(self.mnt_ns)
    }

    /// `path` (absolute) as a process outside the namespace reaches it.
    pub fn outside(&self, path: &Path) -> PathBuf {
        let rel = path.strip_prefix("/").unwrap_or(path);
        PathBuf::from(format!("/proc/{}/root", self.pid)).join(rel)
    }
}

/// Whether this process is inside the user's casfs namespace, and the holder if so.
pub fn inside() -> Option<Holder> {
    Holder::find().filter(|h| h.contains_self())
}

/// Whether this process may mount overlayfs in its mount namespace: it holds
/// [`MOUNTER_CAPS`] (in the user namespace owning it; outside any, only root does).
pub fn can_mount() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & MOUNTER_CAPS == MOUNTER_CAPS)
}

/// Why this host keeps an ordinary user from making a user namespace (the setting that
/// does, where one says so), or None if it lets them: the settings are read, then a
/// child process tries.
pub fn userns_blocked() -> Option<String> {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
    };
    if read("/proc/sys/user/max_user_namespaces") == Some(0) {
        return Some("sysctl user.max_user_namespaces = 0".into());
    }
    if read("/proc/sys/kernel/unprivileged_userns_clone") == Some(0) {
        return Some("sysctl kernel.unprivileged_userns_clone = 0".into());
    }
    let apparmor = read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == Some(1);
    match try_unshare() {
        Ok(()) => None,
        Err(_) if apparmor => Some(
            "sysctl kernel.apparmor_restrict_unprivileged_userns = 1, and no AppArmor profile \
             lets casfs"
                .into(),
        ),
        Err(e) => Some(format!(
            "a user namespace of this user's cannot be made and used: {e}"
        )),
    }
}

/// Overlayfs can be mounted in a user namespace since Linux 5.11.
fn kernel_too_old() -> Option<String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut v = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next()?, v.next().unwrap_or(0));
    ((major, minor) < (5, 11)).then(|| {
        format!(
            "kernel {}: overlayfs can be mounted in a user namespace from 5.11 on",
            release.trim()
        )
    })
}

/// Does in a child process what the holder does, then exits: a user and mount
/// namespace, this user's uid and gid mapped, and a tmpfs mounted in it (where a
/// namespace is made but given no rights, as under AppArmor's restriction, that fails).
fn try_unshare() -> std::io::Result<()> {
    sys::ns::probe_user_namespace(euid(), egid())
}

/// Why the user cannot have rootless overlay mounts here (None: they can): overlayfs
/// and a `/dev/fuse` the user may open are needed, and a user namespace, made now or
/// already held.
pub fn rootless_overlay_blocked() -> Option<String> {
    let overlay = std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| {
        f.lines()
            .any(|l| l.split_whitespace().last() == Some("overlay"))
    });
    if !overlay {
        return Some("the kernel has no overlayfs (modprobe overlay)".into());
    }
    if let Err(e) = rustix::fs::access("/dev/fuse", Access::READ_OK | Access::WRITE_OK) {
        return Some(format!(
            "/dev/fuse is not readable and writable by uid {} ({})",
            euid(),
            std::io::Error::from(e)
        ));
    }
    if let Err(e) = runtime_dir() {
        return Some(e.to_string());
    }
    if Holder::find().is_some() {
        return None;
    }
    if let Some(why) = kernel_too_old() {
        return Some(why);
    }
    userns_blocked().map(|why| format!("no user namespace: {why}"))
}

/// The user's namespace holder: the one running, or one started now (and waited for).
pub fn ensure_holder() -> Result<Holder, NamespaceError> {
    if let Some(h) = Holder::find() {
        return Ok(h);
    }
    let dir = runtime_dir()?;
    // One starter at a time: two would make two namespaces.
    let lock = File::create(dir.join("namespace.lock")).map_err(io(format!(
        "creating {}",
        dir.join("namespace.lock").display()
    )))?;
    // The lock goes with the descriptor.
    rustix::fs::flock(&lock, FlockOperation::LockExclusive)
        .map_err(|e| io("locking casfs's namespace")(e.into()))?;
    if let Some(h) = Holder::find() {
        return Ok(h);
    }
    if let Some(why) = userns_blocked() {
        return Err(NamespaceError::Forbidden(why));
    }
    let exe = std::env::current_exe().map_err(io("finding the casfs executable"))?;
    let log = dir.join("namespace.log");
    let err = File::create(&log).map_err(io(format!("creating {}", log.display())))?;
    let mut cmd = std::process::Command::new(exe);
    // Nothing of the starter's environment (a `casfs serve`'s token, a fleet's
    // passwords): the holder has no capabilities, so a program inside the namespace may
    // read its /proc/<pid>/environ.
    cmd.arg("namespace-holder")
        .env_clear()
        .envs(
            ["XDG_RUNTIME_DIR", "TMPDIR", "LANG"]
                .iter()
                .filter_map(|k| std::env::var_os(k).map(|v| (*k, v))),
        )
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(err);
    // Its own session (the holder outlives ours), and no descriptor above stderr.
    sys::process::detach(&mut cmd, true);
    let mut child = cmd
        .spawn()
        .map_err(io("starting casfs's namespace holder"))?;
    let start = Instant::now();
    loop {
        if let Some(h) = Holder::find().filter(|h| h.pid as u32 == child.id()) {
            // Reaped by init once we are gone; until then it is ours, and a zombie of
            // it would be harmless (it never exits while it holds the namespace).
            std::mem::forget(child);
            return Ok(h);
        }
        if let Ok(Some(status)) = child.try_wait() {
            let msg = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(NamespaceError::Refused(format!(
                "casfs's namespace holder exited ({status}): {}",
                msg.trim()
            )));
        }
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            return Err(NamespaceError::Refused(
                "casfs's namespace holder did not start within 10 s".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `casfs namespace-holder`: makes the user and mount namespace (uid and gid mapped to
/// themselves), records itself, and waits until SIGTERM or SIGINT. Must run in a fresh,
/// single-threaded process.
pub fn run_holder() -> Result<(), NamespaceError> {
    let (uid, gid) = (euid(), egid());
    if uid == 0 {
        return Err(NamespaceError::Refused(
            "root mounts need no namespace of their own".into(),
        ));
    }
    single_threaded()?;
    if let Err(e) = sys::ns::unshare_user_and_mount() {
        return Err(match userns_blocked() {
            Some(why) => NamespaceError::Forbidden(why),
            None => io("unshare(CLONE_NEWUSER | CLONE_NEWNS)")(e),
        });
    }
    let write = |file: &str, text: String| {
        std::fs::write(format!("/proc/self/{file}"), text)
            .map_err(io(format!("writing /proc/self/{file}")))
    };
    write("setgroups", "deny".into())?;
    write("uid_map", format!("{uid} {uid} 1\n"))?;
    write("gid_map", format!("{gid} {gid} 1\n"))?;
    let dir = runtime_dir()?;
    let me = Holder {
        pid: std::process::id() as i32,
        user_ns: ns_id("self", "user").unwrap_or(0),
        mnt_ns: ns_id("self", "mnt").unwrap_or(0),
    };
    let tmp = dir.join(format!("namespace.pid.{}", me.pid));
    let mut f = File::create(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
    writeln!(f, "{} {} {}", me.pid, me.user_ns, me.mnt_ns)
        .map_err(io(format!("writing {}", tmp.display())))?;
    drop(f);
    let pid_file = dir.join("namespace.pid");
    std::fs::rename(&tmp, &pid_file).map_err(io(format!("writing {}", pid_file.display())))?;
    // The holder needs none of the capabilities the namespace gave it. Holding them
    // would also keep the processes inside, which have fewer, from reading its
    // /proc/<pid>/ns (the kernel lets a process inspect one of the same namespace only
    // if it has every capability that one has).
    set_capabilities(0, 0)?;
    eprintln!(
        "casfs: holding the user and mount namespace of uid {uid} (pid {})",
        me.pid
    );
    // Blocked in this (only) thread, then waited for.
    let signals = Blocked::block(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP]);
    loop {
        let sig = signals.wait(None);
        if sig == Some(libc::SIGINT) || sig == Some(libc::SIGTERM) {
            break;
        }
    }
    // Only our own record goes: a newer holder's stays.
    if Holder::find().is_some_and(|h| h == me) {
        let _ = std::fs::remove_file(&pid_file);
    }
    Ok(())
}

fn single_threaded() -> Result<(), NamespaceError> {
    let threads = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse::<u32>().ok())
        });
    if threads != Some(1) {
        return Err(NamespaceError::Refused(format!(
            "entering casfs's namespace needs a single-threaded process (this one has {})",
            threads.map_or("?".into(), |t| t.to_string())
        )));
    }
    Ok(())
}

/// Moves this process into the namespaces of `holder` (its working directory kept by
/// path). Outside them, the caller gets every capability over what the user namespace
/// owns (it is the user's); inside already, nothing changes. The kernel allows this only
/// to a single-threaded process: call it before anything starts a thread.
pub fn enter(holder: &Holder) -> Result<(), NamespaceError> {
    if holder.contains_self() {
        return Ok(());
    }
    single_threaded()?;
    let cwd = std::env::current_dir().map_err(io("reading the working directory"))?;
    for (kind, flag) in [
        ("user", LinkNameSpaceType::User),
        ("mnt", LinkNameSpaceType::Mount),
    ] {
        if ns_id("self", kind) == ns_id(&holder.pid.to_string(), kind) {
            continue;
        }
        let path = format!("/proc/{}/ns/{kind}", holder.pid);
        let f = File::open(&path).map_err(io(format!("opening {path}")))?;
        move_into_link_name_space(f.as_fd(), Some(flag))
            .map_err(|e| io(format!("joining {path}"))(e.into()))?;
    }
    if !holder.contains_self() {
        return Err(NamespaceError::Refused(format!(
            "the holder (pid {}) left its namespaces while we joined them",
            holder.pid
        )));
    }
    // Joining a mount namespace moves the working directory to its root.
    std::env::set_current_dir(&cwd).map_err(io(format!("returning to {}", cwd.display())))?;
    Ok(())
}

/// This process's capability sets.
fn capabilities() -> Result<CapabilitySets, NamespaceError> {
    rustix::thread::capabilities(None).map_err(|e| io("capget")(e.into()))
}

fn set_cap_sets(sets: CapabilitySets) -> Result<(), NamespaceError> {
    rustix::thread::set_capabilities(None, sets).map_err(|e| io("capset")(e.into()))
}

/// Sets this process's effective and permitted capabilities to `effective` and
/// `permitted` (bit masks of the first 32), none inheritable.
fn set_capabilities(effective: u32, permitted: u32) -> Result<(), NamespaceError> {
    set_cap_sets(CapabilitySets {
        effective: CapabilitySet::from_bits_retain(effective.into()),
        permitted: CapabilitySet::from_bits_retain(permitted.into()),
        inheritable: CapabilitySet::empty(),
    })
}

/// Raises [`MOUNTER_CAPS`] (held over the user's namespace once [`enter`] joined it)
/// into the ambient set, so that the programs this process runs may mount there too: what a
/// test harness needs whose tests start mount daemons from inside. Never for an agent's
/// programs: they could move mounts under the daemons.
pub fn keep_mount_rights() -> Result<(), NamespaceError> {
    let mut sets = capabilities()?;
    sets.inheritable |= CapabilitySet::from_bits_retain(MOUNTER_CAPS);
    set_cap_sets(sets)?;
    for cap in (0..32).filter(|c| MOUNTER_CAPS & (1 << c) != 0) {
        configure_capability_in_ambient_set(CapabilitySet::from_bits_retain(1 << cap), true)
            .map_err(|e| io(format!("raising capability {cap} to the ambient set"))(e.into()))?;
    }
    Ok(())
}

/// The user's namespace for a process that is to mount there: entered (the holder
/// started first if none runs) when outside it; refused when inside it without the
/// right to mount. Returns the holder.
pub fn join_for_mounting() -> Result<Holder, NamespaceError> {
    if let Some(h) = inside() {
        if can_mount() {
            return Ok(h);
        }
        return Err(NamespaceError::Refused(
            "this process runs inside casfs's namespace (entered by `casfs exec` or `casfs \
             shell`), where it may not mount; start casfs mounts and `casfs serve` outside it"
                .into(),
        ));
    }
    let h = ensure_holder()?;
    enter(&h)?;
    // Of the capabilities joining gave, only those a mounter needs are kept.
    set_capabilities(MOUNTER_CAPS as u32, MOUNTER_CAPS as u32)?;
    Ok(h)
}

/// Gives up, for good, every capability this process holds and any it could gain:
/// the bounding set emptied, no new privileges (a program's file capabilities are not
/// granted on exec), nothing effective, permitted or inheritable. For a program run in
/// the namespace on an agent's behalf.
pub fn drop_privileges() -> Result<(), NamespaceError> {
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(40);
    for cap in 0..=last.min(63) {
        // A capability not in the set is fine.
        let _ = remove_capability_from_bounding_set(CapabilitySet::from_bits_retain(1 << cap));
    }
    rustix::thread::set_no_new_privs(true).map_err(|e| io("setting no_new_privs")(e.into()))?;
    set_capabilities(0, 0)
}

/// The program `argv` run in place of this process (execvp): only returns on failure.
pub fn exec(argv: &[std::ffi::OsString]) -> NamespaceError {
    let Some(first) = argv.first() else {
        return NamespaceError::Refused("no command to run".into());
    };
    let c: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(c) = c else {
        return NamespaceError::Refused("a NUL byte in the command".into());
    };
    let e = sys::process::exec(&c);
    io(format!("running {}", Path::new(first).display()))(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_paths_go_through_the_holders_root() {
        let h = Holder {
            pid: 42,
            user_ns: 1,
            mnt_ns: 2,
        };
        assert_eq!(
            h.outside(Path::new("/tmp/ws")),
            PathBuf::from("/proc/42/root/tmp/ws")
        );
    }

    /// A directory of this user's, mode `mode`, at `path`.
    fn dir(path: &Path, mode: u32) -> PathBuf {
        std::fs::create_dir(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        path.to_path_buf()
    }

    #[test]
    fn a_runtime_dir_others_may_write_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let xdg = dir(&t.path().join("xdg"), 0o700);
        dir(&xdg.join("casfs"), 0o777);
        let no_logind = t.path().join("no-logind");
        let r = runtime_dir_from(&no_logind, Some(xdg.into_os_string()), t.path(), false);
        assert!(matches!(r, Err(NamespaceError::Refused(_))), "{r:?}");
        // The same in the temporary directory, where nothing better is found.
        dir(&t.path().join(format!("casfs-{}", euid())), 0o777);
        let r = runtime_dir_from(&no_logind, None, t.path(), false);
        assert!(matches!(r, Err(NamespaceError::Refused(_))), "{r:?}");
    }

    #[test]
    fn the_runtime_dir_is_logind_s_then_xdg_s_then_a_temporary_one() {
        let t = tempfile::tempdir().unwrap();
        let logind = dir(&t.path().join("logind"), 0o700);
        let xdg = dir(&t.path().join("xdg"), 0o700);
        let tmp = dir(&t.path().join("tmp"), 0o755);
        let xdg_os = || Some(xdg.clone().into_os_string());
        let got = runtime_dir_from(&logind, xdg_os(), &tmp, true).unwrap();
        assert_eq!(got, logind.join("casfs"));
        assert_eq!(
            std::fs::metadata(&got).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // logind's directory open to others is passed over, and so is a relative XDG.
        std::fs::set_permissions(&logind, std::fs::Permissions::from_mode(0o755)).unwrap();
        let got = runtime_dir_from(&logind, xdg_os(), &tmp, true).unwrap();
        assert_eq!(got, xdg.join("casfs"));
        let got = runtime_dir_from(&logind, Some("run/rel".into()), &tmp, true).unwrap();
        assert_eq!(got, tmp.join(format!("casfs-{}", euid())));
    }
}
