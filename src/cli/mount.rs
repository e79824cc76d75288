//! `casfs mount` and `casfs unmount`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use casfs::checkpoint::Store;
use casfs::fs::{is_fuse_mount, mount_tree, ViewOptions};

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
    allow_other: bool,
) -> anyhow::Result<()> {
    if !read_only {
        bail!("writable mounts are not available yet; pass --read-only to serve a checkpoint");
    }
    if !mountpoint.is_dir() {
        bail!("{}: not a directory", mountpoint.display());
    }
    if is_fuse_mount(mountpoint) {
        bail!("{}: already a FUSE mount", mountpoint.display());
    }
    // Read-only, without the store lock: a writer may keep using the store.
    let store = Store::open_read_only(&cli.store_root())?;
    let id = resolve(&store, &thread_or_at("mount", thread, at)?)?;
    let cp = store.checkpoints().get(&id)?;
    if !foreground {
        return spawn_background(mountpoint, &id.to_hex());
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
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        // SAFETY: a valid signal set and timeout; the signals are blocked in this thread.
        let sig = unsafe { libc::sigtimedwait(&signals, std::ptr::null_mut(), &ts) };
        if sig > 0 {
            break;
        }
    }
    mounted
        .unmount()
        .with_context(|| format!("unmounting {}", mountpoint.display()))
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

/// Starts `casfs mount --foreground` as a detached process and waits until the mount
/// answers; a child that fails first has its error reported.
fn spawn_background(mountpoint: &Path, checkpoint: &str) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding the casfs executable")?;
    let log = tempfile_path(mountpoint);
    let err = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
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
    let mut child = cmd.spawn().context("starting the mount process")?;
    let start = Instant::now();
    loop {
        if is_fuse_mount(mountpoint) {
            println!(
                "mounted {} read-only at {} (pid {})",
                &checkpoint[..12],
                mountpoint.display(),
                child.id()
            );
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let msg = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            let msg = msg.trim().trim_start_matches("casfs: error: ");
            bail!("the mount process exited ({status}): {msg}");
        }
        if start.elapsed() > MOUNT_WAIT {
            let _ = child.kill();
            bail!(
                "{} did not answer as a mount within {:?}",
                mountpoint.display(),
                MOUNT_WAIT
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tempfile_path(mountpoint: &Path) -> std::path::PathBuf {
    let tag = casfs::cas::Hash::of(mountpoint.as_os_str().as_bytes()).short(12);
    std::env::temp_dir().join(format!("casfs-mount-{tag}-{}.log", std::process::id()))
}

pub fn unmount(mountpoint: &Path, lazy: bool) -> anyhow::Result<()> {
    if !is_fuse_mount(mountpoint) {
        bail!("{}: not a FUSE mount", mountpoint.display());
    }
    let c = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{}: path contains NUL", mountpoint.display()))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
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
