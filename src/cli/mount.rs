//! `casfs mount` and `casfs unmount`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use std::os::fd::AsRawFd;
use std::sync::Arc;

use casfs::checkpoint::mountd::{control_request, control_socket, mount_dir, Request};
use casfs::checkpoint::{CheckpointId, MountedThread, OpenMode, Store, ThreadId};
use casfs::fs::{is_dead_mount, is_fuse_mount, mount_tree, ViewOptions, WorkspaceOptions};

use super::output::bytes;

use super::commands::{resolve, thread_or_at};
use super::Cli;

/// How long a background mount may take to answer.
const MOUNT_WAIT: Duration = Duration::from_secs(20);

#[allow(clippy::too_many_arguments)]
pub fn mount(
    cli: &Cli,
    mountpoint: &Path,
    thread: Option<&str>,
    at: Option<&str>,
    read_only: bool,
    foreground: bool,
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
    let mountpoint = &std::fs::canonicalize(mountpoint)
        .with_context(|| format!("resolving {}", mountpoint.display()))?;
    if !read_only {
        return mount_writable(cli, mountpoint, thread, at, foreground, &ws_opts);
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
        );
    }
    let signals = block_signals();
    let opts = ViewOptions {
        allow_other,
        ..ViewOptions::default()
    };
    let mounted = mount_tree(store.objects_shared(), cp.body.root, mountpoint, &opts)
        .with_context(|| format!("mounting {}", mountpoint.display()))?;
    eprintln!(
        "casfs: serving {} read-only at {}",
        id.short(),
        mountpoint.display()
    );
    // Until a signal arrives or someone unmounts it.
    while !mounted.is_finished() {
        if wait_signal(&signals, 200) {
            break;
        }
    }
    mounted
        .unmount()
        .with_context(|| format!("unmounting {}", mountpoint.display()))
}

fn wait_signal(signals: &libc::sigset_t, ms: i64) -> bool {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: ms * 1_000_000,
    };
    // SAFETY: a valid signal set and timeout; the signals are blocked in this thread.
    let sig = unsafe { libc::sigtimedwait(signals, std::ptr::null_mut(), &ts) };
    sig > 0
}

fn mount_writable(
    cli: &Cli,
    mountpoint: &Path,
    thread: Option<&str>,
    at: Option<&str>,
    foreground: bool,
    opts: &WorkspaceOptions,
) -> anyhow::Result<()> {
    if thread.is_none() && at.is_none() {
        bail!("mount needs --thread (or --at CHECKPOINT) unless --read-only");
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
        return spawn_background(mountpoint, &what, Some(&socket), &dir.join("daemon.log"));
    }
    let signals = block_signals();
    // A daemon does not wait long for a store another process holds: the command that
    // started it gives up after MOUNT_WAIT, and the holder's pid is the useful answer.
    let timeout = Duration::from_secs_f64(cli.lock_timeout.clamp(0.0, 10.0));
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
    let dir = mount_dir(store.root(), mountpoint);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let socket = control_socket(store.root(), mountpoint);
    if socket.as_os_str().len() >= 100 {
        bail!(
            "{}: control socket path too long for a Unix socket; use a shorter --store path",
            socket.display()
        );
    }
    let mounted = MountedThread::mount(store, mountpoint, thread, at, opts)
        .with_context(|| format!("mounting {}", mountpoint.display()))?;
    std::fs::write(dir.join("pid"), std::process::id().to_string())
        .with_context(|| format!("writing {}", dir.join("pid").display()))?;
    let tag = mounted.tag();
    eprintln!(
        "casfs: serving thread {} at {} (base {})",
        tag.thread,
        mountpoint.display(),
        tag.base
            .map(|b| b.short())
            .unwrap_or_else(|| "empty".into())
    );
    let stop = || wait_signal(&signals, 0);
    let served = mounted.serve_control(&socket, &stop);
    let detached = !mounted.is_finished();
    if detached {
        // Stopped by a signal: detach even if files are open (their next access fails
        // with ENOTCONN); every write that returned is in the dirty set already.
        if let Ok(c) = CString::new(mountpoint.as_os_str().as_bytes()) {
            // SAFETY: a NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
    // Unmounting drops the workspace and the store: the pid file goes last, so whoever
    // waits for it finds the store closed.
    let unmounted = mounted
        .unmount()
        .with_context(|| format!("unmounting {}", mountpoint.display()));
    drop(mounted);
    let _ = std::fs::remove_file(dir.join("pid"));
    if !detached {
        unmounted?;
    }
    served.with_context(|| format!("control socket {}", socket.display()))
}

/// The control socket of the casfs mount at `path`, if it is one.
pub fn socket_of(cli: &Cli, path: &Path) -> Option<std::path::PathBuf> {
    if !is_fuse_mount(path) {
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

fn request(socket: &Path, req: &Request) -> anyhow::Result<serde_json::Value> {
    control_request(socket, req).map_err(|e| anyhow!(e))
}

pub fn status(cli: &Cli, mountpoint: &Path) -> anyhow::Result<()> {
    let socket = require_socket(cli, mountpoint)?;
    let v = request(&socket, &Request::Status)?;
    if cli.json {
        return super::output::json(&v);
    }
    println!("{} (pid {})", mountpoint.display(), v["pid"]);
    println!("  thread:     {}", v["thread"].as_str().unwrap_or("?"));
    println!(
        "  base:       {}",
        v["base"].as_str().map(|s| &s[..12]).unwrap_or("(empty)")
    );
    let files = v["dirty_files"].as_u64().unwrap_or(0);
    let dirs = v["dirty_nodes"].as_u64().unwrap_or(0).saturating_sub(files);
    println!(
        "  dirty:      {files} files, {}; {dirs} directories changed",
        bytes(v["dirty_bytes"].as_u64().unwrap_or(0))
    );
    println!("  reads:      {}", v["read_mode"].as_str().unwrap_or("?"));
    if let Some(paths) = v["dirty_paths"].as_array() {
        for p in paths.iter().take(20) {
            println!("    M {}", p.as_str().unwrap_or(""));
        }
    }
    Ok(())
}

pub fn checkpoint(cli: &Cli, mountpoint: &Path, reason: &str) -> anyhow::Result<()> {
    let socket = require_socket(cli, mountpoint)?;
    // Writes the kernel still holds go to the daemon first.
    let dir = std::fs::File::open(mountpoint)
        .with_context(|| format!("opening {}", mountpoint.display()))?;
    // SAFETY: a valid fd.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
        return Err(anyhow!(std::io::Error::last_os_error()))
            .with_context(|| format!("syncfs {}", mountpoint.display()));
    }
    let v = request(
        &socket,
        &Request::Checkpoint {
            reason: Some(reason.to_string()),
        },
    )?;
    if cli.json {
        return super::output::json(&v);
    }
    println!("{}", v["checkpoint"].as_str().unwrap_or("?"));
    println!(
        "  {} changed ({} removed; {} files hashed, {}), {} dirs written, took {:.1} ms",
        v["changed_files"],
        v["stats"]["removed_paths"]
            .as_array()
            .map(|a| a.len())
            .unwrap_or(0),
        v["stats"]["files_hashed"],
        bytes(v["stats"]["bytes_hashed"].as_u64().unwrap_or(0)),
        v["stats"]["dirs_written"],
        v["duration_us"].as_u64().unwrap_or(0) as f64 / 1000.0
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
            let v = request(socket, &Request::Status)?;
            let base = v["base"].as_str().ok_or_else(|| {
                anyhow!("{}: the mount has no base checkpoint", mountpoint.display())
            })?;
            base.parse()?
        }
    };
    let v = request(
        socket,
        &Request::Restore {
            checkpoint: id,
            thread: thread.map(str::to_string),
            force,
        },
    )?;
    if cli.json {
        return super::output::json(&v);
    }
    println!(
        "restored {} at {} in {:.1} ms",
        id,
        mountpoint.display(),
        v["duration_us"].as_u64().unwrap_or(0) as f64 / 1000.0
    );
    Ok(())
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and the threads it starts), so
/// they can be waited for.
fn block_signals() -> libc::sigset_t {
    // SAFETY: initializing and using a local signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Runs this command again with `--foreground` as a detached process (its own
/// session, no terminal, stderr to `log`) and waits until `ready` says it answers;
/// returns its pid. A child that exits first has its log reported as the error; one
/// that does not answer within `wait` is killed.
pub(super) fn start_detached(
    log: &Path,
    what: &str,
    wait: Duration,
    mut ready: impl FnMut() -> bool,
) -> anyhow::Result<u32> {
    let exe = std::env::current_exe().context("finding the casfs executable")?;
    let err = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    args.push("--foreground".into());
    let mut cmd = Command::new(exe);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err);
    // SAFETY: setsid in the child before exec detaches it from our session.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    let start = Instant::now();
    loop {
        if ready() {
            return Ok(child.id());
        }
        if let Some(status) = child.try_wait()? {
            let msg = std::fs::read_to_string(log).unwrap_or_default();
            let _ = std::fs::remove_file(log);
            let msg = msg.trim().trim_start_matches("casfs: error: ");
            bail!("{what} exited ({status}): {msg}");
        }
        if start.elapsed() > wait {
            let _ = child.kill();
            bail!("{what} did not answer within {wait:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `casfs mount --foreground` as a detached process and waits until the mount
/// answers (and its control socket, if it has one, exists).
/// The daemon's stderr (its log) goes to `log`.
fn spawn_background(
    mountpoint: &Path,
    what: &str,
    socket: Option<&Path>,
    log: &Path,
) -> anyhow::Result<()> {
    let pid = start_detached(log, "the mount process", MOUNT_WAIT, || {
        is_fuse_mount(mountpoint) && socket.is_none_or(|s| s.exists())
    })?;
    println!("mounted {what} at {} (pid {pid})", mountpoint.display());
    Ok(())
}

/// Waits (at most MOUNT_WAIT) for the daemon named by `pid_file` to remove it or end.
pub(super) fn wait_daemon_exit(pid_file: &Path) {
    let Some(pid) = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.trim().parse::<libc::pid_t>().ok())
    else {
        return;
    };
    let start = Instant::now();
    // SAFETY: kill with signal 0 only checks that the process exists.
    while pid_file.exists() && unsafe { libc::kill(pid, 0) } == 0 {
        if start.elapsed() > MOUNT_WAIT {
            eprintln!("casfs: the mount daemon (pid {pid}) is still closing its store");
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Where a read-only mount's daemon logs (it does not write to the store).
fn tempfile_path(mountpoint: &Path) -> std::path::PathBuf {
    let tag = casfs::cas::Hash::of(mountpoint.as_os_str().as_bytes()).short(12);
    std::env::temp_dir().join(format!("casfs-mount-{tag}.log"))
}

pub fn unmount(cli: &Cli, mountpoint: &Path, lazy: bool) -> anyhow::Result<()> {
    if !is_fuse_mount(mountpoint) && !is_dead_mount(mountpoint) {
        bail!("{}: not a FUSE mount", mountpoint.display());
    }
    let c = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{}: path contains NUL", mountpoint.display()))?;
    // A writable mount's daemon of this store: waited for, so that "unmounted" means its
    // store is closed and the next mount may start.
    let pid_file = std::fs::canonicalize(mountpoint)
        .ok()
        .map(|c| mount_dir(&cli.store_root(), &c).join("pid"));
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        if let Some(p) = pid_file.filter(|_| !lazy) {
            wait_daemon_exit(&p);
        }
        println!("unmounted {}", mountpoint.display());
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
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
