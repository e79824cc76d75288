//! `casfs watch DIR`: the watcher process that lets re-captures of DIR skip every
//! directory in which nothing changed (see `casfs::checkpoint::sync::watch`).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};

use casfs::checkpoint::sync::watch;

use super::args::Cli;

/// How long a new watcher may take to watch every directory before it answers.
const START_WAIT: Duration = Duration::from_secs(300);

pub fn watch(cli: &Cli, dir: &Path, foreground: bool, stop: bool) -> anyhow::Result<()> {
    let root = std::fs::canonicalize(dir).with_context(|| format!("{}", dir.display()))?;
    if !root.is_dir() {
        bail!("{} is not a directory", root.display());
    }
    let store = cli.store_root();
    if !store.is_dir() {
        bail!(
            "no store at {} (create one with `casfs init`)",
            store.display()
        );
    }
    let socket = watch::socket_path(&store, &root);
    let pid_file = socket.with_extension("pid");
    if stop {
        return stop_watcher(&root, &socket, &pid_file);
    }
    if foreground {
        casfs::ignore_broken_pipes();
        let r = watch::serve(&store, &root, |w| {
            let _ = std::fs::write(&pid_file, std::process::id().to_string());
            println!(
                "watching {} ({} directories; socket {})",
                w.root().display(),
                w.watched(),
                socket.display()
            );
            let _ = std::io::stdout().flush();
        });
        let _ = std::fs::remove_file(&pid_file);
        return r.with_context(|| format!("watching {}", root.display()));
    }
    if watch::ask(&store, &root, None).is_some() {
        bail!("{} is already watched", root.display());
    }
    let log = socket.with_extension("log");
    std::fs::create_dir_all(log.parent().expect("in the store"))?;
    let pid = casfs::mount::daemon::start_detached(&log, "the watcher", START_WAIT, || {
        watch::ask(&store, &root, None).is_some()
    })?;
    println!("watching {} (pid {pid})", root.display());
    Ok(())
}

fn stop_watcher(root: &Path, socket: &Path, pid_file: &Path) -> anyhow::Result<()> {
    let pid = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.trim().parse::<libc::pid_t>().ok());
    let Some(pid) = pid else {
        bail!("{} is not watched", root.display());
    };
    // SIGTERM to the pid the watcher recorded (none it could be: gone).
    let signalled = rustix::process::Pid::from_raw(pid)
        .is_some_and(|p| rustix::process::kill_process(p, rustix::process::Signal::TERM).is_ok());
    if !signalled {
        let _ = std::fs::remove_file(pid_file);
        let _ = std::fs::remove_file(socket);
        bail!("{} is not watched (its watcher is gone)", root.display());
    }
    if !casfs::mount::daemon::wait_daemon_exit(pid_file) {
        eprintln!("casfs: the watcher is still closing");
    }
    println!("stopped watching {}", root.display());
    Ok(())
}
