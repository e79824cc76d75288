//! The FUSE transport a mount uses is the one asked for and the one `casfs status`
//! names; the whole suite runs on both (scripts/test.sh), these check the choice itself.

use std::fs;
use std::path::{Path, PathBuf};

use casfs::fs::fuse_uring_enabled as kernel_uring_enabled;

use crate::common::*;
use crate::MountGuard;

fn mount_fuse(store: &Path, mp: &Path, transport: &str) -> std::process::Output {
    casfs_env(
        store,
        &[
            "mount",
            mp.to_str().unwrap(),
            "-t",
            "w",
            "--mode",
            "fuse",
            "--fuse-transport",
            transport,
        ],
        &[],
    )
}

/// A store under `t` with thread `w` captured from `files`, and an empty mountpoint.
fn captured(t: &Path, files: &[(&str, &[u8])]) -> (PathBuf, PathBuf) {
    let src = t.join("src");
    fs::create_dir(&src).unwrap();
    for (name, data) in files {
        fs::write(src.join(name), data).unwrap();
    }
    let store = t.join("store");
    ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
    let mp = t.join("mnt");
    fs::create_dir(&mp).unwrap();
    (store, mp)
}

#[test]
fn status_names_the_transport_each_mount_asked_for() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    for i in 0..50 {
        fs::write(src.join(format!("d/f{i}")), format!("file {i}\n")).unwrap();
    }
    let auto = if kernel_uring_enabled() {
        "io_uring"
    } else {
        "classic"
    };
    for (asked, want) in [("classic", "classic"), ("auto", auto)] {
        let store = t.path().join(format!("store-{asked}"));
        ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
        let mp = t.path().join(format!("mnt-{asked}"));
        fs::create_dir(&mp).unwrap();
        let _g = MountGuard::new(&mp);
        let out = mount_fuse(&store, &mp, asked);
        assert!(
            out.status.success(),
            "mount --fuse-transport {asked}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let st = json(&store, &["status", mp.to_str().unwrap()]);
        assert_eq!(st["fuse_transport"], want, "{asked}: {st}");
        // Requests from several threads at once (the rings are per CPU), reads,
        // writes, a checkpoint and a restore's invalidations all answer.
        std::thread::scope(|s| {
            for k in 0..4 {
                let mp = &mp;
                s.spawn(move || {
                    for i in (k..50).step_by(4) {
                        let p = mp.join(format!("d/f{i}"));
                        assert_eq!(fs::read_to_string(&p).unwrap(), format!("file {i}\n"));
                        fs::write(&p, format!("changed {i}\n")).unwrap();
                    }
                });
            }
        });
        let cp = json(&store, &["checkpoint", mp.to_str().unwrap()]);
        assert_eq!(cp["ok"], true, "{cp}");
        ok(&store, &["restore", mp.to_str().unwrap(), "--force"]);
        for i in 0..50 {
            assert_eq!(
                fs::read_to_string(mp.join(format!("d/f{i}"))).unwrap(),
                format!("changed {i}\n"),
                "{asked}: after the restore"
            );
        }
        ok(&store, &["unmount", mp.to_str().unwrap()]);
    }
}

#[test]
fn io_uring_asked_for_where_the_kernel_has_it_off_is_refused_by_name() {
    if kernel_uring_enabled() {
        eprintln!("skipped: FUSE over io_uring is enabled on this host");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (store, mp) = captured(t.path(), &[]);
    let _g = MountGuard::new(&mp);
    let out = mount_fuse(&store, &mp, "io_uring");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("enable_uring"), "{err}");
    assert!(!crate::is_mounted(&mp));
}

/// The scheduling policy of each of a process's threads whose name starts with
/// `prefix`: (name, policy) from /proc (field 41 of `stat`).
fn thread_policies(pid: u64, prefix: &str) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for t in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        let Ok(name) = fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let name = name.trim().to_string();
        if !name.starts_with(prefix) {
            continue;
        }
        let stat = fs::read_to_string(dir.join("stat")).unwrap();
        // Fields after the command name, which ends with the last ')'.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let policy = rest.split(' ').nth(41 - 3).unwrap().parse().unwrap();
        out.push((name, policy));
    }
    out
}

#[test]
fn ring_threads_wait_for_requests_at_idle_policy() {
    if !kernel_uring_enabled() {
        eprintln!("skipped: FUSE over io_uring is off on this host");
        return;
    }
    const SCHED_IDLE: u32 = 5;
    let t = tempfile::tempdir().unwrap();
    let (store, mp) = captured(t.path(), &[("f", &[7u8; 1 << 20])]);
    let _g = MountGuard::new(&mp);
    let out = mount_fuse(&store, &mp, "io_uring");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = json(&store, &["status", mp.to_str().unwrap()]);
    let pid = st["pid"].as_u64().unwrap();
    // Metadata, then file data opened, read and written (served at the normal
    // policy), then metadata again: between requests every ring thread waits at idle.
    for i in 0..20 {
        assert!(mp.join("f").metadata().unwrap().len() == 1 << 20);
        assert_eq!(fs::read(mp.join("f")).unwrap().len(), 1 << 20);
        fs::write(mp.join(format!("new{i}")), b"x").unwrap();
        let _ = fs::symlink_metadata(mp.join("missing"));
    }
    let rings = thread_policies(pid, "fuser-ring");
    assert!(!rings.is_empty(), "no ring threads in {pid}");
    // An ordinary user's thread may go to idle but (at RLIMIT_NICE 0) not back: there
    // the rings wait at the normal policy, none stuck at idle.
    let want = if crate::root() { SCHED_IDLE } else { 0 };
    for (name, policy) in &rings {
        assert_eq!(*policy, want, "{name} waits at policy {policy}");
    }
    // The classic loop's threads (forgets, interrupts, notifications) keep the normal
    // policy.
    for (name, policy) in thread_policies(pid, "fuser-") {
        if !name.starts_with("fuser-ring") {
            assert_eq!(policy, 0, "{name}");
        }
    }
    ok(&store, &["unmount", mp.to_str().unwrap()]);
}
