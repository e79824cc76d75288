//! `casfs mount` and `casfs unmount`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};

use casfs::checkpoint::{mount_dir, CheckpointId, OpenMode, Store, ThreadId};
use casfs::fs::{is_dead_mount, is_fuse_mount, is_overlay_mount, ViewOptions, WorkspaceOptions};
use casfs::mount::control::{control_socket, request, MountStatus, Request, Restored};
use casfs::mount::daemon::{self, DAEMON_WAIT};
use casfs::mount::namespace::{self, Holder};
use casfs::mount::{MountCheckpoint, MountMode};

use super::args::{resolve, thread_or_at, Cli};
use super::output::bytes;

#[allow(clippy::too_many_arguments)]
pub fn mount(
    cli: &Cli,
    mountpoint: &Path,
    thread: Option<&str>,
    at: Option<&str>,
    read_only: bool,
    foreground: bool,
    mode: MountMode,
    ws_opts: WorkspaceOptions,
) -> anyhow::Result<()> {
    let allow_other = ws_opts.allow_other;
    if is_dead_mount(mountpoint) {
        bail!(
            "{}: a casfs mount whose daemon is gone is still attached; run `casfs unmount --lazy {}` first",
            mountpoint.display(),
            mountpoint.display()
        );
    }
    if !mountpoint.is_dir() {
        bail!("{}: not a directory", mountpoint.display());
    }
    if is_fuse_mount(mountpoint) {
        bail!("{}: already a FUSE mount", mountpoint.display());
    }
    if socket_of(cli, mountpoint).is_some_and(|s| answers(&s)) {
        bail!("{}: already a casfs overlay mount", mountpoint.display());
    }
    let mountpoint = &std::fs::canonicalize(mountpoint)
        .with_context(|| format!("resolving {}", mountpoint.display()))?;
    if !read_only {
        return mount_writable(cli, mountpoint, thread, at, foreground, mode, &ws_opts);
    }
    // Read-only, without the store lock: a writer may keep using the store.
    let store = cli.open_store_read()?;
    let id = resolve(&store, &thread_or_at("mount", thread, at)?)?;
    let cp = store.checkpoints().get(&id)?;
    if !foreground {
        return spawn_background(
            mountpoint,
            &format!("{} read-only", id.short()),
            None,
            &tempfile_path(mountpoint),
            None,
        );
    }
    casfs::ignore_broken_pipes();
    let opts = ViewOptions {
        allow_other,
        fuse_uring: ws_opts.fuse_uring,
        ..ViewOptions::default()
    };
    Ok(daemon::serve_read_only(
        &store,
        cp.body.root,
        mountpoint,
        &opts,
        || {
            eprintln!(
                "casfs: serving {} read-only at {}",
                id.short(),
                mountpoint.display()
            )
        },
    )?)
}

fn mount_writable(
    cli: &Cli,
    mountpoint: &Path,
    thread: Option<&str>,
    at: Option<&str>,
    foreground: bool,
    mode: MountMode,
    opts: &WorkspaceOptions,
) -> anyhow::Result<()> {
    if thread.is_none() && at.is_none() {
        bail!("mount needs --thread (or --at CHECKPOINT) unless --read-only");
    }
    // An overlay mount by a user who is not root lives in the user's namespace.
    let rootless = mode == MountMode::Overlay && namespace::rootless();
    if rootless {
        if let Some(why) = namespace::rootless_overlay_blocked() {
            bail!(
                "--mode overlay as uid {}: {why}; mount with --mode fuse (or auto, which \
                 falls back to it)",
                namespace::euid()
            );
        }
    }
    if !foreground {
        let socket = control_socket(&cli.store_root(), mountpoint);
        let what = format!("thread {}", thread.or(at).unwrap_or("?"));
        // The daemon's log lives in the store: make the store first if it is new.
        if !cli.store_root().join("casfs.json").exists() {
            drop(cli.open_store(OpenMode::Create)?);
        }
        let dir = mount_dir(&cli.store_root(), mountpoint);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // A killed daemon's socket (its overlay may still be mounted): the new daemon's
        // socket appears once it serves, and that is what the wait below looks for.
        if socket.exists() && !answers(&socket) {
            let _ = std::fs::remove_file(&socket);
        }
        let holder = rootless.then(namespace::ensure_holder).transpose()?;
        return spawn_background(
            mountpoint,
            &what,
            Some(&socket),
            &dir.join("daemon.log"),
            holder,
        );
    }
    if rootless {
        // Before the store starts a thread: the kernel lets only a single-threaded
        // process join a user namespace.
        namespace::join_for_mounting()?;
    }
    casfs::ignore_broken_pipes();
    // A daemon does not wait long for a store another process holds: the command that
    // started it gives up after DAEMON_WAIT, and the holder's pid is the useful answer.
    let timeout = Duration::from_secs_f64(cli.lock_timeout.clamp(0.0, 10.0));
    casfs::cas::set_default_block_cache(8 << 20);
    let store = Arc::new(Store::open_with(
        &cli.store_root(),
        OpenMode::Create,
        timeout,
        &cli.backends(),
    )?);
    let at = at.map(|r| resolve(&store, r)).transpose()?;
    let thread = match (thread, at) {
        (Some(t), _) => ThreadId::new(t)?,
        (None, Some(id)) => store.checkpoints().get(&id)?.body.thread_id,
        (None, None) => bail!("mount needs --thread (or --at CHECKPOINT) unless --read-only"),
    };
    daemon::serve_writable(store, mountpoint, thread, at, opts, mode, |tag| {
        eprintln!(
            "casfs: serving thread {} at {} with {} (base {})",
            tag.thread,
            mountpoint.display(),
            mode.as_str(),
            tag.base
                .map(|b| b.short())
                .unwrap_or_else(|| "empty".into())
        )
    })
    .with_context(|| format!("serving {}", mountpoint.display()))
}

/// Whether `path` is a casfs mount's root (or in a FUSE mount) as this process sees it.
fn is_mount(path: &Path) -> bool {
    is_fuse_mount(path) || is_overlay_mount(path)
}

/// A process in the user's namespace through which this process, outside it, reaches
/// the mount at `path` it does not see: the namespace's holder, else the mount's own
/// daemon (by its pid file in `cli`'s store: a holder replaced since the mount was
/// made holds another namespace).
fn mounted_in_namespace(cli: &Cli, path: &Path) -> Option<Holder> {
    if !namespace::rootless() || is_mount(path) {
        return None;
    }
    let canon = std::fs::canonicalize(path).ok()?;
    let shows = |h: &Holder| !h.contains_self() && is_mount(&h.outside(&canon));
    if let Some(h) = Holder::find().filter(shows) {
        return Some(h);
    }
    let pid = std::fs::read_to_string(daemon::pid_file(&cli.store_root(), &canon)).ok()?;
    Holder::of_process(pid.trim().parse().ok()?)
        .ok()
        .filter(shows)
}

/// The control socket of the casfs mount at `path`, if it is one (here, or in the
/// user's namespace).
pub fn socket_of(cli: &Cli, path: &Path) -> Option<std::path::PathBuf> {
    if !is_mount(path) && mounted_in_namespace(cli, path).is_none() {
        return None;
    }
    let canon = std::fs::canonicalize(path).ok()?;
    let s = control_socket(&cli.store_root(), &canon);
    s.exists().then_some(s)
}

fn require_socket(cli: &Cli, path: &Path) -> anyhow::Result<std::path::PathBuf> {
    socket_of(cli, path).ok_or_else(|| {
        anyhow!(
            "{}: not a writable casfs mount of store {}",
            path.display(),
            cli.store_root().display()
        )
    })
}

pub fn status(cli: &Cli, mountpoint: &Path) -> anyhow::Result<()> {
    let socket = require_socket(cli, mountpoint)?;
    let st: MountStatus = request(&socket, &Request::Status)?;
    if cli.json {
        return super::output::json(&Replied {
            ok: true,
            body: &st,
        });
    }
    println!("{} (pid {})", mountpoint.display(), st.pid);
    println!("  thread:     {}", st.thread);
    println!(
        "  base:       {}",
        st.base
            .map(|b| b.short())
            .unwrap_or_else(|| "(empty)".into())
    );
    let dirs = st.dirty_nodes.saturating_sub(st.dirty_files);
    println!(
        "  dirty:      {} files, {}; {dirs} directories changed",
        st.dirty_files,
        bytes(st.dirty_bytes)
    );
    println!("  mode:       {}", st.mode.as_str());
    if let Some(why) = &st.mode_fallback {
        println!("              (auto chose fuse: {why})");
    }
    if let Some(ns) = &st.namespace {
        println!(
            "  namespace:  uid {}'s own (held by pid {}): enter it with `casfs exec {} -- CMD` \
             or `casfs shell {}`; outside it, the files are at {}",
            ns.uid,
            ns.holder,
            mountpoint.display(),
            mountpoint.display(),
            ns.outside.display()
        );
    }
    println!("  transport:  {}", st.fuse_transport);
    println!(
        "  reads:      {}",
        serde_json::to_value(st.read_mode)?.as_str().unwrap_or("?")
    );
    for p in st.dirty_paths.iter().take(20) {
        println!("    M {p}");
    }
    Ok(())
}

pub fn checkpoint(cli: &Cli, mountpoint: &Path, reason: &str) -> anyhow::Result<()> {
    let socket = require_socket(cli, mountpoint)?;
    // Writes the kernel still holds go to the daemon first (an overlay's upper is read
    // by the daemon through the page cache: nothing to hand over).
    if is_fuse_mount(mountpoint) {
        let dir = std::fs::File::open(mountpoint)
            .with_context(|| format!("opening {}", mountpoint.display()))?;
        if let Err(e) = rustix::fs::syncfs(&dir) {
            return Err(anyhow!(std::io::Error::from(e)))
                .with_context(|| format!("syncfs {}", mountpoint.display()));
        }
    }
    let c: MountCheckpoint = request(
        &socket,
        &Request::Checkpoint {
            reason: Some(reason.to_string()),
        },
    )?;
    if cli.json {
        return super::output::json(&Replied { ok: true, body: &c });
    }
    println!("{}", c.checkpoint);
    // Files an overlay mount read when it took over a killed daemon's upper (to tell it
    // from its base) count as hashed for this checkpoint, and the line says so.
    let ahead = match c.stats.hashed_ahead {
        0 => String::new(),
        n => format!(", {n} of them read ahead by the mount"),
    };
    println!(
        "  {} changed ({} removed; {} files hashed, {}{ahead}), {} dirs written, took {:.1} ms",
        c.changed_files,
        c.stats.removed_paths.len(),
        c.stats.files_hashed,
        bytes(c.stats.bytes_hashed),
        c.stats.dirs_written,
        c.duration_us as f64 / 1000.0
    );
    Ok(())
}

/// Restore of a mount: swaps its root to `checkpoint` (default: its base).
pub fn restore_mount(
    cli: &Cli,
    socket: &Path,
    mountpoint: &Path,
    checkpoint: Option<&str>,
    thread: Option<&str>,
    force: bool,
) -> anyhow::Result<()> {
    let id = match (checkpoint, thread) {
        // A full id needs no lookup (and no opening of the store).
        (Some(r), _) if r.len() == 64 && r.parse::<CheckpointId>().is_ok() => r.parse()?,
        (Some(r), _) => {
            let store = cli.open_store_read()?;
            resolve(&store, r)?
        }
        (None, Some(t)) => {
            let store = cli.open_store_read()?;
            resolve(&store, &format!("@{t}"))?
        }
        (None, None) => {
            let st: MountStatus = request(socket, &Request::Status)?;
            st.base.ok_or_else(|| {
                anyhow!("{}: the mount has no base checkpoint", mountpoint.display())
            })?
        }
    };
    let r: Restored = request(
        socket,
        &Request::Restore {
            checkpoint: id,
            thread: thread.map(str::to_string),
            force,
        },
    )?;
    if cli.json {
        return super::output::json(&Replied { ok: true, body: &r });
    }
    println!(
        "restored {} at {} in {:.1} ms",
        id,
        mountpoint.display(),
        r.duration_us as f64 / 1000.0
    );
    Ok(())
}

/// What `--json` prints for a mount's answer: its fields and `"ok": true`, as the
/// control socket sends them.
#[derive(serde::Serialize)]
struct Replied<'a, T> {
    ok: bool,
    #[serde(flatten)]
    body: &'a T,
}

/// Starts `casfs mount --foreground` as a detached process and waits until the mount
/// answers (and its control socket, if it has one, exists).
/// The daemon's stderr (its log) goes to `log`.
/// With `holder`, the mount is made in the user's namespace (and looked for there).
fn spawn_background(
    mountpoint: &Path,
    what: &str,
    socket: Option<&Path>,
    log: &Path,
    holder: Option<Holder>,
) -> anyhow::Result<()> {
    let outside = holder.filter(|h| !h.contains_self());
    let seen = outside.map_or_else(|| mountpoint.to_path_buf(), |h| h.outside(mountpoint));
    let pid = daemon::start_detached(log, "the mount process", DAEMON_WAIT, || {
        is_mount(&seen) && socket.is_none_or(|s| s.exists())
    })?;
    println!("mounted {what} at {} (pid {pid})", mountpoint.display());
    if outside.is_some() {
        println!(
            "  in uid {}'s own namespace: enter it with `casfs exec {} -- CMD` or `casfs shell \
             {}`; from outside, the files are at {}",
            namespace::euid(),
            mountpoint.display(),
            mountpoint.display(),
            seen.display()
        );
    }
    Ok(())
}

/// How `casfs exec` finds the namespace to enter.
pub struct ExecVia {
    /// The user's namespace (started if none runs), whatever the mountpoint is.
    pub namespace: bool,
    /// The namespaces of this process (a mount's daemon, a `casfs serve`).
    pub holder: Option<i32>,
    /// With `namespace`: the command may mount there.
    pub keep_mount_rights: bool,
}

/// `casfs exec` and `casfs shell`: runs `command` in place of this process where the
/// mount at `mountpoint` is seen: here, or inside the namespace it lives in, with no
/// capabilities (and none to gain) unless `via.keep_mount_rights`.
pub fn exec(
    cli: &Cli,
    mountpoint: &Path,
    cwd: Option<&Path>,
    via: ExecVia,
    command: &[std::ffi::OsString],
) -> anyhow::Result<()> {
    if via.keep_mount_rights && !via.namespace {
        bail!("--keep-mount-rights goes with --namespace");
    }
    let holder = if via.namespace {
        let h = namespace::ensure_holder()?;
        (!h.contains_self()).then_some(h)
    } else if let Some(pid) = via.holder {
        let h = Holder::of_process(pid)?;
        (!h.contains_self()).then_some(h)
    } else if is_mount(mountpoint) {
        None
    } else {
        match mounted_in_namespace(cli, mountpoint) {
            Some(h) => Some(h),
            None => bail!(
                "{}: not a casfs mount (neither here nor in the namespace of uid {})",
                mountpoint.display(),
                namespace::euid()
            ),
        }
    };
    let entered = holder.is_some() || namespace::inside().is_some();
    if let Some(h) = &holder {
        namespace::enter(h)?;
        if via.holder.is_some() && !is_mount(mountpoint) {
            bail!(
                "{}: not a mount in the namespace of process {}",
                mountpoint.display(),
                h.pid
            );
        }
    }
    if let Some(d) = cwd {
        std::env::set_current_dir(d).with_context(|| format!("entering {}", d.display()))?;
    }
    if via.keep_mount_rights {
        if holder.is_none() && !namespace::can_mount() {
            bail!(
                "--keep-mount-rights: this process is inside the namespace already, without them"
            );
        }
        namespace::keep_mount_rights()?;
    } else if entered {
        namespace::drop_privileges()?;
    }
    Err(namespace::exec(command).into())
}

/// Where a read-only mount's daemon logs (it does not write to the store): a name of
/// this user's in the temporary directory, opened without following a link
/// ([`daemon::start_detached`]).
fn tempfile_path(mountpoint: &Path) -> std::path::PathBuf {
    let tag = casfs::cas::Hash::of(mountpoint.as_os_str().as_bytes()).short(12);
    let uid = namespace::euid();
    std::env::temp_dir().join(format!("casfs-mount-{uid}-{tag}.log"))
}

pub fn unmount(cli: &Cli, mountpoint: &Path, lazy: bool) -> anyhow::Result<()> {
    // A rootless mount is unmounted from inside the user's namespace, where this
    // process (its user's) may.
    if let Some(h) = mounted_in_namespace(cli, mountpoint) {
        namespace::enter(&h)?;
    }
    if !is_fuse_mount(mountpoint) && !is_dead_mount(mountpoint) && !is_overlay_mount(mountpoint) {
        bail!("{}: not a casfs mount", mountpoint.display());
    }
    let c = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{}: path contains NUL", mountpoint.display()))?;
    // A writable mount's daemon of this store: waited for, so that "unmounted" means its
    // store is closed and the next mount may start.
    let pid_file = std::fs::canonicalize(mountpoint)
        .ok()
        .map(|c| daemon::pid_file(&cli.store_root(), &c));
    let flags = if lazy {
        rustix::mount::UnmountFlags::DETACH
    } else {
        rustix::mount::UnmountFlags::empty()
    };
    // A descriptor held for an instant is let go: another process's child between its
    // fork and its exec holds copies of every descriptor its parent had open.
    let mut tries = 0;
    let unmounted = loop {
        let Err(e) = rustix::mount::unmount(c.as_c_str(), flags) else {
            break Ok(());
        };
        let e = std::io::Error::from(e);
        tries += 1;
        if e.raw_os_error() != Some(libc::EBUSY) || tries >= 20 {
            break Err(e);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    if unmounted.is_ok() {
        if let Some(p) = pid_file.filter(|_| !lazy) {
            if !daemon::wait_daemon_exit(&p) {
                eprintln!("casfs: the mount daemon is still closing its store");
            }
        }
        println!("unmounted {}", mountpoint.display());
        return Ok(());
    }
    let e = unmounted.unwrap_err();
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES)
            if is_overlay_mount(mountpoint) && namespace::inside().is_some() =>
        {
            bail!(
                "{}: a process inside casfs's namespace (entered by `casfs exec`) may not \
                 unmount; run `casfs unmount` outside it",
                mountpoint.display()
            )
        }
        Some(libc::EPERM) | Some(libc::EACCES) => {
            // Not root: the setuid helper can unmount the user's own FUSE mounts.
            let mut cmd = Command::new("fusermount3");
            cmd.arg("-u");
            if lazy {
                cmd.arg("-z");
            }
            let status = cmd
                .arg(mountpoint)
                .status()
                .context("running fusermount3 (Debian package fuse3)")?;
            if !status.success() {
                bail!("fusermount3 -u {} failed ({status})", mountpoint.display());
            }
            println!("unmounted {}", mountpoint.display());
            Ok(())
        }
        Some(libc::EBUSY) => bail!(
            "{}: busy (files are open or a process is inside it); close them or pass --lazy",
            mountpoint.display()
        ),
        _ => Err(anyhow!(e).context(format!("unmounting {}", mountpoint.display()))),
    }
}

/// Whether a mount's control socket answers (its daemon is alive).
fn answers(socket: &Path) -> bool {
    request::<MountStatus>(socket, &Request::Status).is_ok()
}
