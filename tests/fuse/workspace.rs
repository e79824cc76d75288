//! Writable mounts: POSIX operations through the mount, O(changed) checkpoints, root
//! swap restores, and a daemon killed with SIGKILL losing nothing.

use std::ffi::CString;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use crate::{wait_for, MountGuard};

pub(crate) struct Ws {
    pub(crate) _t: tempfile::TempDir,
    pub(crate) store: PathBuf,
    pub(crate) mp: PathBuf,
    pub(crate) guard: MountGuard,
}

pub(crate) fn mount(thread: &str, extra: &[&str]) -> Ws {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let guard = MountGuard::new(&mp);
    let mut args = vec!["mount", mp.to_str().unwrap(), "-t", thread];
    args.extend_from_slice(extra);
    ok(&store, &args);
    assert!(crate::is_mounted(&mp));
    Ws {
        _t: t,
        store,
        mp,
        guard,
    }
}

impl Ws {
    pub(crate) fn p(&self, rel: &str) -> PathBuf {
        self.mp.join(rel)
    }
    pub(crate) fn checkpoint(&self) -> serde_json::Value {
        json(&self.store, &["checkpoint", self.mp.to_str().unwrap()])
    }
    pub(crate) fn status(&self) -> serde_json::Value {
        json(&self.store, &["status", self.mp.to_str().unwrap()])
    }
    pub(crate) fn unmount(&self) {
        ok(&self.store, &["unmount", self.mp.to_str().unwrap()]);
        // The daemon lets the store go when it exits.
        wait_for_daemons_to_exit(&self.store);
    }
}

/// Waits until every mount daemon of `store` has exited (it removes its pid file after
/// closing the store), so other commands can open the store.
fn wait_for_daemons_to_exit(store: &Path) {
    assert!(wait_for(Duration::from_secs(10), || !store
        .join("mounts")
        .read_dir()
        .unwrap()
        .flatten()
        .any(|d| d.path().join("pid").exists())));
}

fn errno_of(r: std::io::Result<impl Sized>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn renameat2(a: &Path, b: &Path, flags: u32) -> i32 {
    let (a, b) = (cpath(a), cpath(b));
    // SAFETY: NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap()
    }
}

#[test]
fn a_tree_copied_in_checkpoints_and_restores_exactly() {
    let ws = mount("copy", &[]);
    let src = ws._t.path().join("src");
    fs::create_dir(&src).unwrap();
    build_sample_tree(&src);
    // cp -a: create, write, mkdir, symlink, mknod (fifo), chmod, utimens, setxattr.
    let st = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(&ws.mp)
        .status()
        .unwrap();
    assert!(st.success());
    assert_same_tree(&src, &ws.mp);
    let st = ws.status();
    assert!(st["dirty_files"].as_u64().unwrap() >= 10, "{st}");

    let cp = ws.checkpoint();
    assert_eq!(cp["ok"], true);
    assert_eq!(ws.status()["dirty_files"], 0);
    // Still the same after the checkpoint (files now clean, served from the store or
    // their local copies).
    assert_same_tree(&src, &ws.mp);

    ws.unmount();
    let out = ws._t.path().join("out");
    ok(&ws.store, &["restore", out.to_str().unwrap(), "-t", "copy"]);
    assert_same_tree(&src, &out);

    // Mounting again serves the checkpoint lazily: same tree.
    ok(&ws.store, &["mount", ws.mp.to_str().unwrap(), "-t", "copy"]);
    assert_same_tree(&src, &ws.mp);
    drop(ws.guard);
}

#[test]
fn rename_link_unlink_and_xattr_edge_cases() {
    let ws = mount("edges", &[]);
    fs::write(ws.p("a"), b"A").unwrap();
    fs::write(ws.p("b"), b"B").unwrap();
    fs::create_dir_all(ws.p("d1/sub")).unwrap();
    fs::create_dir(ws.p("d2")).unwrap();
    fs::write(ws.p("d2/x"), b"x").unwrap();
    ws.checkpoint();

    // Rename over an existing file replaces it.
    fs::rename(ws.p("a"), ws.p("b")).unwrap();
    assert_eq!(fs::read(ws.p("b")).unwrap(), b"A");
    assert!(!ws.p("a").exists());
    // A directory onto a non-empty one; onto a file; a file onto a directory.
    assert_eq!(
        renameat2(&ws.p("d1"), &ws.p("d2"), 0),
        libc::ENOTEMPTY,
        "dir onto non-empty dir"
    );
    assert_eq!(renameat2(&ws.p("d1"), &ws.p("b"), 0), libc::ENOTDIR);
    assert_eq!(renameat2(&ws.p("b"), &ws.p("d1"), 0), libc::EISDIR);
    // Into its own subdirectory.
    assert_eq!(
        renameat2(&ws.p("d1"), &ws.p("d1/sub/inside"), 0),
        libc::EINVAL
    );
    // RENAME_NOREPLACE and RENAME_EXCHANGE.
    assert_eq!(
        renameat2(&ws.p("b"), &ws.p("d2/x"), libc::RENAME_NOREPLACE),
        libc::EEXIST
    );
    assert_eq!(
        renameat2(&ws.p("b"), &ws.p("d2/x"), libc::RENAME_EXCHANGE),
        0
    );
    assert_eq!(fs::read(ws.p("b")).unwrap(), b"x");
    assert_eq!(fs::read(ws.p("d2/x")).unwrap(), b"A");
    assert_eq!(
        renameat2(&ws.p("d1"), &ws.p("d2"), libc::RENAME_EXCHANGE),
        0
    );
    assert!(ws.p("d2/sub").is_dir());
    assert!(ws.p("d1/x").is_file());
    // A directory moves with its content.
    fs::rename(ws.p("d2"), ws.p("moved")).unwrap();
    assert!(ws.p("moved/sub").is_dir());
    assert_eq!(fs::metadata(ws.p("moved")).unwrap().nlink(), 3);

    // Hard links share content and count.
    fs::write(ws.p("h1"), b"one").unwrap();
    fs::hard_link(ws.p("h1"), ws.p("moved/h2")).unwrap();
    assert_eq!(fs::metadata(ws.p("h1")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(ws.p("h1")).unwrap().ino(),
        fs::metadata(ws.p("moved/h2")).unwrap().ino()
    );
    fs::OpenOptions::new()
        .append(true)
        .open(ws.p("moved/h2"))
        .unwrap()
        .write_all(b"+two")
        .unwrap();
    assert_eq!(fs::read(ws.p("h1")).unwrap(), b"one+two");
    fs::remove_file(ws.p("h1")).unwrap();
    assert_eq!(fs::metadata(ws.p("moved/h2")).unwrap().nlink(), 1);
    assert_eq!(fs::read(ws.p("moved/h2")).unwrap(), b"one+two");
    // Directories cannot be hard-linked.
    assert_ne!(errno_of(fs::hard_link(ws.p("moved"), ws.p("dl"))), 0);

    // An open file that is unlinked stays readable and writable through its fd.
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(ws.p("ghost"))
        .unwrap();
    f.write_all(b"boo").unwrap();
    fs::remove_file(ws.p("ghost")).unwrap();
    assert!(!ws.p("ghost").exists());
    f.write_all(b"!").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "boo!");
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    drop(f);

    // rmdir of a non-empty directory; unlink of a directory.
    assert_eq!(errno_of(fs::remove_dir(ws.p("moved"))), libc::ENOTEMPTY);
    assert_eq!(errno_of(fs::remove_file(ws.p("moved"))), libc::EISDIR);

    // Extended attributes, with create/replace semantics.
    set_xattr(&ws.p("b"), "user.k", b"v1");
    set_xattr(&ws.p("b"), "user.k", b"v2");
    let x = crate::common::xattrs(&ws.p("b"));
    assert_eq!(x, vec![(b"user.k".to_vec(), b"v2".to_vec())]);
    let (p, n) = (cpath(&ws.p("b")), CString::new("user.k").unwrap());
    // SAFETY: NUL-terminated strings and a valid buffer.
    let rc = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            b"v3".as_ptr().cast(),
            2,
            libc::XATTR_CREATE,
        )
    };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EEXIST)
    );
    // SAFETY: as above.
    assert_eq!(unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) }, 0);
    assert!(crate::common::xattrs(&ws.p("b")).is_empty());

    // Sparse files: a hole reads as zeros and is found by SEEK_HOLE.
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(ws.p("sparse"))
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(b"end", 10 << 20).unwrap();
    assert_eq!(f.metadata().unwrap().len(), (10 << 20) + 3);
    let mut buf = [1u8; 16];
    f.read_exact_at(&mut buf, 5 << 20).unwrap();
    assert_eq!(buf, [0u8; 16]);
    // SAFETY: a valid fd.
    let hole = unsafe { libc::lseek(f.as_raw_fd_(), 0, libc::SEEK_HOLE) };
    assert!((0..(10 << 20)).contains(&hole), "hole at {hole}");
    f.set_len(4).unwrap();
    assert_eq!(fs::read(ws.p("sparse")).unwrap(), vec![0u8; 4]);
    drop(f);

    // statfs reports the space of the disk the upper files live on.
    // SAFETY: zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath(&ws.mp).as_ptr(), &mut sv) }, 0);
    assert!(sv.f_blocks > 0 && sv.f_bsize > 0, "statvfs");
    assert_eq!(sv.f_namemax, 255);
    // access(2): existence and the caller's permissions.
    // SAFETY: NUL-terminated paths.
    assert_eq!(
        unsafe { libc::access(cpath(&ws.p("b")).as_ptr(), libc::R_OK | libc::W_OK) },
        0
    );
    assert_eq!(
        unsafe { libc::access(cpath(&ws.p("nope")).as_ptr(), libc::F_OK) },
        -1
    );

    // Everything above survives a checkpoint and a restore into a plain directory.
    let before = snapshot(&ws.mp);
    ws.checkpoint();
    ws.unmount();
    let out = ws._t.path().join("out");
    ok(
        &ws.store,
        &["restore", out.to_str().unwrap(), "-t", "edges"],
    );
    let after = snapshot(&out);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (k, v) in &before {
        assert_eq!(v, &after[k], "{}", k.display());
    }
    drop(ws.guard);
}

trait RawFdExt {
    fn as_raw_fd_(&self) -> i32;
}
impl RawFdExt for fs::File {
    fn as_raw_fd_(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.as_raw_fd()
    }
}

#[test]
fn permissions_are_enforced_for_other_users() {
    if crate::needs_root("it acts as another user") {
        return;
    }
    let ws = mount("perm", &["--allow-other"]);
    fs::write(ws.p("mine"), b"root's").unwrap();
    fs::set_permissions(ws.p("mine"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::create_dir(ws.p("closed")).unwrap();
    fs::set_permissions(ws.p("closed"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::create_dir(ws.p("open")).unwrap();
    fs::set_permissions(ws.p("open"), fs::Permissions::from_mode(0o777)).unwrap();
    let as_nobody = |script: &str| {
        use std::os::unix::process::CommandExt;
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(&ws.mp)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    assert!(as_nobody("cat mine").status.success());
    let w = as_nobody("echo x >> mine");
    assert!(!w.status.success());
    assert!(String::from_utf8_lossy(&w.stderr).contains("Permission denied"));
    assert!(!as_nobody("ls closed").status.success());
    assert!(!as_nobody("touch closed/f").status.success());
    assert!(!as_nobody("chmod 777 mine").status.success());
    assert!(as_nobody("echo hi > open/theirs").status.success());
    let m = fs::metadata(ws.p("open/theirs")).unwrap();
    assert_eq!((m.uid(), m.gid()), (65534, 65534));
    assert_eq!(fs::read(ws.p("mine")).unwrap(), b"root's");

    // One writable mount per store for now: a second one is refused, naming the holder.
    let other = ws._t.path().join("other");
    fs::create_dir(&other).unwrap();
    let _other_guard = MountGuard::new(&other);
    let err = fails(
        &ws.store,
        &[
            "--lock-timeout",
            "1",
            "mount",
            other.to_str().unwrap(),
            "-t",
            "other",
        ],
    );
    assert!(err.contains("in use by another casfs process"), "{err}");
    drop(ws.guard);
}

#[test]
fn checkpoints_read_only_what_changed_and_restore_swaps_the_root() {
    let ws = mount("o1", &[]);
    for i in 0..300 {
        let d = ws.p(&format!("dir{}", i % 10));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}")), format!("v1 {i}")).unwrap();
    }
    let first = ws.checkpoint();
    assert_eq!(first["changed_files"], 300);

    fs::write(ws.p("dir3/f3"), b"v2").unwrap();
    fs::write(ws.p("dir4/new"), b"new").unwrap();
    fs::remove_file(ws.p("dir5/f5")).unwrap();
    let st = ws.status();
    assert_eq!(st["dirty_files"], 2, "{st}");
    let second = ws.checkpoint();
    assert_eq!(second["stats"]["files_hashed"], 2, "{second}");
    assert_eq!(
        second["stats"]["removed_paths"],
        serde_json::json!(["dir5/f5"])
    );
    assert_eq!(second["changed_files"], 3, "{second}");
    // Only the dirty directories (and the root) got new trees.
    assert_eq!(second["stats"]["dirs_written"], 4, "{second}");
    assert_eq!(second["parent"], first["checkpoint"]);

    // Listed before the restore, so the kernel has these listings cached.
    assert_eq!(fs::read_dir(&ws.mp).unwrap().count(), 10);
    assert_eq!(fs::read_dir(ws.p("dir4")).unwrap().count(), 31);

    // An open file keeps what it had open across a restore.
    let mut held = fs::File::open(ws.p("dir3/f3")).unwrap();

    // Uncaptured work blocks a restore.
    fs::write(ws.p("dir0/f0"), b"uncaptured").unwrap();
    let first_id = first["checkpoint"].as_str().unwrap();
    let err = fails(&ws.store, &["restore", ws.mp.to_str().unwrap(), first_id]);
    assert!(err.contains("uncaptured"), "{err}");
    assert_eq!(fs::read(ws.p("dir0/f0")).unwrap(), b"uncaptured");

    let r = json(
        &ws.store,
        &["restore", ws.mp.to_str().unwrap(), first_id, "--force"],
    );
    assert_eq!(r["base"], first["checkpoint"]);
    assert_eq!(fs::read(ws.p("dir3/f3")).unwrap(), b"v1 3");
    assert_eq!(fs::read(ws.p("dir0/f0")).unwrap(), b"v1 0");
    assert_eq!(fs::read(ws.p("dir5/f5")).unwrap(), b"v1 5");
    assert!(!ws.p("dir4/new").exists());
    // Listings too (the kernel caches them; a swap invalidates them).
    let names = |d: &Path| {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&ws.mp).len(), 10);
    assert!(!names(&ws.p("dir4")).contains(&"new".to_string()));
    assert!(names(&ws.p("dir5")).contains(&"f5".to_string()));
    assert_eq!(ws.status()["dirty_files"], 0);
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "v2");

    // The next checkpoint goes on the thread after its head, with the restored content.
    fs::write(ws.p("after"), b"a").unwrap();
    let third = ws.checkpoint();
    assert_eq!(third["parent"], second["checkpoint"]);
    let t3 = third["checkpoint"].as_str().unwrap();
    drop(held);

    // Switching to a new thread forks it from the checkpoint, with no copying.
    let second_id = second["checkpoint"].as_str().unwrap();
    let r = json(
        &ws.store,
        &[
            "restore",
            ws.mp.to_str().unwrap(),
            second_id,
            "-t",
            "o1-fork",
        ],
    );
    assert_eq!(r["thread"], "o1-fork");
    assert_eq!(fs::read(ws.p("dir4/new")).unwrap(), b"new");
    fs::write(ws.p("on-fork"), b"f").unwrap();
    let forked = ws.checkpoint();
    assert_eq!(forked["thread"], "o1-fork");
    let log = ok(&ws.store, &["log", "-t", "o1-fork"]);
    assert!(log.contains(&second_id[..12]), "{log}");
    assert_eq!(ws.status()["thread"], "o1-fork");

    // A deletion alone is uncaptured work too.
    fs::remove_file(ws.p("dir1/f1")).unwrap();
    let st = ws.status();
    assert_eq!(st["dirty_files"], 0);
    assert!(st["dirty_nodes"].as_u64().unwrap() > 0, "{st}");
    let forked_id = forked["checkpoint"].as_str().unwrap();
    let err = fails(&ws.store, &["restore", ws.mp.to_str().unwrap(), forked_id]);
    assert!(err.contains("uncaptured") && err.contains("dir1"), "{err}");
    assert!(!ws.p("dir1/f1").exists());
    ok(
        &ws.store,
        &["restore", ws.mp.to_str().unwrap(), forked_id, "--force"],
    );
    assert!(ws.p("dir1/f1").exists());
    ws.unmount();
    let cat = ok(&ws.store, &["cat", t3, "dir3/f3"]);
    assert_eq!(cat, "v1 3");
    drop(ws.guard);
}

#[test]
fn a_killed_daemon_loses_no_write_that_returned() {
    let ws = mount("crash", &[]);
    fs::create_dir_all(ws.p("keep/deep")).unwrap();
    fs::write(ws.p("keep/deep/clean"), b"captured").unwrap();
    fs::write(ws.p("keep/gone"), b"to delete").unwrap();
    fs::write(ws.p("big"), pattern(3 << 20, 9)).unwrap();
    ws.checkpoint();

    // Uncaptured work of every kind.
    fs::write(ws.p("keep/deep/clean"), b"changed after checkpoint").unwrap();
    fs::remove_file(ws.p("keep/gone")).unwrap();
    fs::rename(ws.p("keep/deep"), ws.p("renamed")).unwrap();
    fs::create_dir(ws.p("newdir")).unwrap();
    fs::write(ws.p("newdir/new"), b"new file").unwrap();
    std::os::unix::fs::symlink("newdir/new", ws.p("ln")).unwrap();
    fs::set_permissions(ws.p("big"), fs::Permissions::from_mode(0o600)).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new()
            .write(true)
            .open(ws.p("big"))
            .unwrap();
        f.write_all_at(b"PATCH", (2 << 20) + 5).unwrap();
    }
    // A file still open for writing when the daemon dies.
    let mut open = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o640)
        .open(ws.p("open-at-crash"))
        .unwrap();
    open.write_all(b"written before the crash").unwrap();
    let expect = snapshot(&ws.mp);

    let pid = ws.status()["pid"].as_u64().unwrap();
    // SAFETY: killing the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    drop(open);
    assert!(wait_for(Duration::from_secs(10), || {
        // SAFETY: probing whether the process still exists.
        unsafe { libc::kill(pid as i32, 0) != 0 }
    }));
    if !crate::overlay() {
        // The dead mount says so; `unmount --lazy` clears it. (An overlay outlives its
        // daemon, only its lower is gone: mounting again takes it over.)
        let err = fails(
            &ws.store,
            &["mount", ws.mp.to_str().unwrap(), "-t", "crash"],
        );
        assert!(err.contains("unmount --lazy"), "{err}");
        ok(&ws.store, &["unmount", "--lazy", ws.mp.to_str().unwrap()]);
    }

    ok(
        &ws.store,
        &["mount", ws.mp.to_str().unwrap(), "-t", "crash"],
    );
    let got = snapshot(&ws.mp);
    assert_eq!(
        expect.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>()
    );
    for (k, v) in &expect {
        assert_eq!(v, &got[k], "{} after the crash", k.display());
    }
    let st = ws.status();
    assert!(st["dirty_files"].as_u64().unwrap() >= 5, "{st}");
    // And it checkpoints as usual.
    let cp = ws.checkpoint();
    assert_eq!(cp["ok"], true);
    assert_eq!(ws.status()["dirty_files"], 0);
    drop(ws.guard);
}

/// Checkpoints taken while another thread writes, renames and deletes: no deadlock, and
/// the last checkpoint (taken after the writer stopped) is exactly what the mount shows.
#[test]
fn checkpoints_race_with_writers() {
    let ws = mount("race", &[]);
    let mp = ws.mp.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || i < 300 {
                let d = mp.join(format!("d{}", i % 7));
                fs::create_dir_all(&d).unwrap();
                let f = d.join(format!("f{}", i % 50));
                fs::write(&f, pattern(100 + (i as usize % 5000), i)).unwrap();
                if i % 5 == 0 {
                    let _ = fs::rename(&f, d.join(format!("r{}", i % 13)));
                }
                if i % 7 == 0 {
                    let _ = fs::remove_file(d.join(format!("f{}", (i / 7) % 50)));
                }
                i += 1;
                if i > 5000 {
                    break;
                }
            }
            i
        })
    };
    let mut ids = Vec::new();
    for _ in 0..8 {
        let cp = ws.checkpoint();
        assert_eq!(cp["ok"], true, "{cp}");
        ids.push(cp["checkpoint"].as_str().unwrap().to_string());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let ops = writer.join().unwrap();
    assert!(ops >= 300);
    let last = ws.checkpoint();
    let shown = snapshot(&ws.mp);
    ws.unmount();
    let out = ws._t.path().join("out");
    ok(
        &ws.store,
        &[
            "restore",
            out.to_str().unwrap(),
            "--at",
            last["checkpoint"].as_str().unwrap(),
        ],
    );
    let restored = snapshot(&out);
    assert_eq!(
        shown.keys().collect::<Vec<_>>(),
        restored.keys().collect::<Vec<_>>()
    );
    for (k, v) in &shown {
        assert_eq!(v, &restored[k], "{}", k.display());
    }
    // Every intermediate checkpoint is intact and on the thread, in order.
    let log = ok(&ws.store, &["log", "-t", "race"]);
    for id in &ids {
        assert!(log.contains(&id[..12]), "{id} missing from\n{log}");
    }
    drop(ws.guard);
}

/// Every kind of change to nodes that start clean (loaded from the store, not created in
/// the mount) gives the tree ext4 gives; it survives SIGKILL of the daemon, and the
/// checkpoint restores to the same tree.
#[test]
fn changes_to_clean_nodes_match_ext4_and_survive_a_crash() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let native = t.path().join("native");
    let mp = t.path().join("mnt");
    fs::create_dir(&native).unwrap();
    fs::create_dir(&mp).unwrap();
    build_sample_tree(&native);
    ok(
        &store,
        &["capture", native.to_str().unwrap(), "-t", "clean"],
    );
    let _guard = MountGuard::new(&mp);
    ok(&store, &["mount", mp.to_str().unwrap(), "-t", "clean"]);
    assert_same_tree(&native, &mp);

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuse/mutate.py");
    for dir in [&native, &mp] {
        let out = Command::new("python3")
            .arg(&script)
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mutate.py {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_same_tree(&native, &mp);

    // SIGKILL, remount: the same tree, from the dirty set alone.
    let st = json(&store, &["status", mp.to_str().unwrap()]);
    let pid = st["pid"].as_u64().unwrap() as i32;
    // SAFETY: killing the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // SAFETY: probing whether the process still exists.
    assert!(wait_for(Duration::from_secs(10), || unsafe {
        libc::kill(pid, 0) != 0
    }));
    ok(&store, &["unmount", "--lazy", mp.to_str().unwrap()]);
    ok(&store, &["mount", mp.to_str().unwrap(), "-t", "clean"]);
    assert_same_tree(&native, &mp);

    // The checkpoint of it restores to the same tree.
    let cp = json(&store, &["checkpoint", mp.to_str().unwrap()]);
    assert_eq!(cp["ok"], true);
    ok(&store, &["unmount", mp.to_str().unwrap()]);
    wait_for_daemons_to_exit(&store);
    let out = t.path().join("out");
    ok(&store, &["restore", out.to_str().unwrap(), "-t", "clean"]);
    assert_same_tree(&native, &out);
}

/// Mounting a mountpoint again without uncaptured work shows the thread's current head,
/// even if another mount moved it meanwhile.
#[test]
fn a_clean_remount_follows_the_head() {
    let ws = mount("head", &[]);
    fs::write(ws.p("a"), b"a").unwrap();
    ws.checkpoint();
    ws.unmount();

    let other = ws._t.path().join("other");
    fs::create_dir(&other).unwrap();
    let _other_guard = MountGuard::new(&other);
    ok(&ws.store, &["mount", other.to_str().unwrap(), "-t", "head"]);
    assert_eq!(fs::read(other.join("a")).unwrap(), b"a");
    fs::write(other.join("b"), b"b").unwrap();
    json(&ws.store, &["checkpoint", other.to_str().unwrap()]);
    ok(&ws.store, &["unmount", other.to_str().unwrap()]);
    wait_for_daemons_to_exit(&ws.store);

    ok(&ws.store, &["mount", ws.mp.to_str().unwrap(), "-t", "head"]);
    assert_eq!(fs::read(ws.p("b")).unwrap(), b"b");
    drop(ws.guard);
}

/// Someone unmounts a workspace and mounts another at the same path at once: the first
/// daemon, exiting, must leave the new mount alone (fuser 0.18 on its own unmounts the
/// path again; see `casfs::fs::Mounted`).
#[test]
fn an_exiting_daemon_leaves_the_next_mount_at_its_path_alone() {
    let t = tempfile::tempdir().unwrap();
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    for i in 0..5 {
        let (a, b) = (
            t.path().join(format!("a{i}")),
            t.path().join(format!("b{i}")),
        );
        ok(&a, &["mount", mp.to_str().unwrap(), "-t", "one"]);
        fs::write(mp.join("f"), b"a").unwrap();
        // Not through casfs: a plain umount, as an admin or a container runtime does
        // (again while busy: the kernel holds the mount until the daemon has answered
        // the asynchronous release of the file just closed).
        // SAFETY: a NUL-terminated path.
        let umount = || unsafe { libc::umount2(cpath(&mp).as_ptr(), 0) } == 0;
        assert!(
            crate::wait_for(std::time::Duration::from_secs(5), umount),
            "round {i}: umount: {}",
            std::io::Error::last_os_error()
        );
        ok(&b, &["mount", mp.to_str().unwrap(), "-t", "two"]);
        wait_for_daemons_to_exit(&a);
        assert!(
            crate::is_mounted(&mp),
            "round {i}: the first daemon unmounted the second mount"
        );
        assert!(
            !mp.join("f").exists(),
            "round {i}: the second mount is another store"
        );
        ok(&b, &["unmount", mp.to_str().unwrap()]);
        wait_for_daemons_to_exit(&b);
    }
}

/// A large file opened for writing is written through the daemon, which notes the
/// chunks each write, truncate and fallocate touches: its checkpoint reads only those
/// (`bytes_hashed`), and stores exactly what the same changes give on ext4. A writer
/// through passthrough, or a remount after SIGKILL, makes it read the file whole.
#[test]
fn a_large_file_checkpoint_reads_only_the_chunks_written() {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let native = t.path().join("native");
    let mp = t.path().join("mnt");
    fs::create_dir(&native).unwrap();
    fs::create_dir(&mp).unwrap();
    fs::write(native.join("big.bin"), pattern(40 * MIB as usize + 123, 9)).unwrap();
    ok(&store, &["capture", native.to_str().unwrap(), "-t", "big"]);
    let _guard = MountGuard::new(&mp);
    // Chunk-exact tracking is the FUSE backend's (overlayfs copies a file up whole).
    ok(
        &store,
        &["mount", mp.to_str().unwrap(), "-t", "big", "--mode", "fuse"],
    );
    let st = json(&store, &["status", mp.to_str().unwrap()]);
    let passthrough = st["read_mode"] == "passthrough";
    let pid = st["pid"].as_u64().unwrap();
    // Whether the test keeps a handle of the mount's file open across rounds.
    let kept = std::cell::Cell::new(false);
    // Whether the daemon has a file of the mount's upper open (a handle on it is).
    let holds_upper_file = |pid: u64| {
        fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| fs::read_link(e.path()).ok())
            .any(|l| l.starts_with(&store) && l.to_string_lossy().contains("/upper/"))
    };

    let open_rw = |dir: &Path| {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("big.bin"))
            .unwrap()
    };
    // Applies `change` to both copies, checkpoints the mount, and checks what was read
    // and that the stored file is the native one.
    let round = |what: &str, change: &dyn Fn(&Path), hashed: Option<u64>| {
        for dir in [&native, &mp] {
            change(dir);
        }
        let cp = json(&store, &["checkpoint", mp.to_str().unwrap()]);
        assert_eq!(cp["ok"], true, "{what}: {cp}");
        let id = cp["checkpoint"].as_str().unwrap().to_string();
        let want = fs::read(native.join("big.bin")).unwrap();
        if let Some(h) = hashed {
            assert_eq!(cp["stats"]["bytes_hashed"], h, "{what}: {cp}");
        } else {
            assert_eq!(
                cp["stats"]["bytes_hashed"],
                want.len() as u64,
                "{what}: {cp}"
            );
        }
        let stored = casfs(&store, &["cat", &id, "big.bin"]);
        assert!(
            stored.status.success(),
            "{what}: cat failed: {}",
            String::from_utf8_lossy(&stored.stderr)
        );
        assert!(
            stored.stdout == want,
            "{what}: stored content differs from ext4's"
        );
        assert!(
            fs::read(mp.join("big.bin")).unwrap() == want,
            "{what}: mount differs"
        );
        // The kernel releases that read's handle after close returns: until the daemon
        // has let go of the file, the next round's writer would share the reader's
        // passthrough (the kernel allows no other kind of handle beside it) and its
        // checkpoint would read the file whole.
        assert!(
            kept.get() || wait_for(Duration::from_secs(10), || !holds_upper_file(pid)),
            "{what}: the daemon still holds the file"
        );
    };

    // The first write copies the file up; only chunk 5 is read back.
    round(
        "a write inside chunk 5",
        &|d| open_rw(d).write_all_at(b"hello", 5 * MIB + 100).unwrap(),
        Some(MIB),
    );
    // Across a chunk boundary, from a handle kept open over the checkpoint before.
    let keep = open_rw(&mp);
    let keep_native = open_rw(&native);
    kept.set(true);
    round(
        "a write across chunks 7 and 8",
        &|d| {
            let f = if d == mp { &keep } else { &keep_native };
            f.write_all_at(&[7u8; 64], 8 * MIB - 32).unwrap();
        },
        Some(2 * MIB),
    );
    round(
        "the same handle after a checkpoint",
        &|d| {
            let f = if d == mp { &keep } else { &keep_native };
            f.write_all_at(b"again", 30 * MIB).unwrap();
        },
        Some(MIB),
    );
    drop((keep, keep_native));
    kept.set(false);
    assert!(wait_for(Duration::from_secs(10), || !holds_upper_file(pid)));
    // Past the end: the hole before the write changed too (chunk 40 grows, 41-44 new).
    round(
        "a write past the end",
        &|d| open_rw(d).write_all_at(b"tail", 45 * MIB - 2).unwrap(),
        Some(5 * MIB + 2),
    );
    // Truncate into chunk 20, then grow again: chunks 20.. read.
    round(
        "truncate down and up",
        &|d| {
            let f = open_rw(d);
            f.set_len(20 * MIB + 5).unwrap();
            f.set_len(24 * MIB).unwrap();
        },
        Some(4 * MIB),
    );
    // Shortened, then written past its new end: the zeros between lie in chunks the
    // truncate noted (21 and 22; 23 is written and shorter now).
    round(
        "truncate down, then a write past the new end",
        &|d| {
            let f = open_rw(d);
            f.set_len(21 * MIB + 7).unwrap();
            f.write_all_at(b"past", 23 * MIB).unwrap();
        },
        Some(2 * MIB + 4),
    );
    // fallocate: punch a hole in chunk 2, zero a range in chunk 3.
    round(
        "fallocate",
        &|d| {
            let f = open_rw(d);
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            let keep = libc::FALLOC_FL_KEEP_SIZE;
            // SAFETY: a valid fd; ranges inside the file.
            unsafe {
                assert_eq!(
                    libc::fallocate(
                        fd,
                        libc::FALLOC_FL_PUNCH_HOLE | keep,
                        2 * MIB as i64 + 4096,
                        8192
                    ),
                    0
                );
                assert_eq!(
                    libc::fallocate(fd, libc::FALLOC_FL_ZERO_RANGE, 3 * MIB as i64 + 10, 100),
                    0
                );
            }
        },
        Some(2 * MIB),
    );
    // A shared writable mapping: its pages reach the daemon as writes (syncfs).
    round(
        "a write through mmap",
        &|d| {
            let f = open_rw(d);
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            // SAFETY: mapping 4 KiB of a file at least that long, written and unmapped here.
            unsafe {
                let m = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    (12 * MIB) as i64,
                );
                assert_ne!(m, libc::MAP_FAILED);
                std::ptr::copy_nonoverlapping(b"mapped".as_ptr(), m as *mut u8, 6);
                assert_eq!(libc::msync(m, 4096, libc::MS_SYNC), 0);
                assert_eq!(libc::munmap(m, 4096), 0);
            }
        },
        Some(MIB),
    );
    // A reader through passthrough is open when the writer comes: the writer must use
    // passthrough too, its writes are not seen, and the file is read whole.
    round(
        "a writer sharing a passthrough reader's backing file",
        &|d| {
            let r = fs::File::open(d.join("big.bin")).unwrap();
            open_rw(d).write_all_at(b"unseen", 17 * MIB).unwrap();
            drop(r);
        },
        if passthrough { None } else { Some(MIB) },
    );
    // The kernel sends a closed writer's release asynchronously: if it reached the
    // daemon only after that checkpoint, the file stayed dirty and untracked, and this
    // checkpoint reads it whole once more; otherwise nothing is dirty.
    let settle = json(&store, &["checkpoint", mp.to_str().unwrap()]);
    let read = settle["stats"]["bytes_hashed"].as_u64().unwrap_or(0);
    let size = fs::metadata(native.join("big.bin")).unwrap().len();
    assert!(read == 0 || read == size, "{settle}");
    round(
        "tracked again after that checkpoint",
        &|d| open_rw(d).write_all_at(b"seen", 19 * MIB).unwrap(),
        Some(MIB),
    );

    // SIGKILL: the remount cannot know which chunks changed, so it reads the file whole.
    for dir in [&native, &mp] {
        open_rw(dir).write_all_at(b"before the kill", MIB).unwrap();
    }
    let pid = json(&store, &["status", mp.to_str().unwrap()])["pid"]
        .as_u64()
        .unwrap() as i32;
    // SAFETY: killing the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // SAFETY: probing whether the process still exists.
    assert!(wait_for(Duration::from_secs(10), || unsafe {
        libc::kill(pid, 0) != 0
    }));
    ok(&store, &["unmount", "--lazy", mp.to_str().unwrap()]);
    ok(
        &store,
        &["mount", mp.to_str().unwrap(), "-t", "big", "--mode", "fuse"],
    );
    round("after a remount", &|_| {}, None);
    round(
        "tracked after the remount's checkpoint",
        &|d| open_rw(d).write_all_at(b"x", 22 * MIB).unwrap(),
        Some(MIB),
    );
    // Emptied by truncate(2), grown back, one byte written: nothing of the old content
    // may be taken for the zeros.
    round(
        "emptied and grown",
        &|d| {
            let f = open_rw(d);
            f.set_len(0).unwrap();
            f.set_len(18 * MIB).unwrap();
            f.write_all_at(b"y", 3 * MIB).unwrap();
        },
        Some(18 * MIB),
    );
}
