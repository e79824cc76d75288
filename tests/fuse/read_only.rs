//! `casfs mount --read-only`: a checkpoint served lazily from the store.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::time::Duration;

use crate::common::*;
use crate::{wait_for, MountGuard};

#[test]
fn a_mounted_checkpoint_reads_back_exactly() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let work = t.path().join("work");
    let mp = t.path().join("mnt");
    fs::create_dir(&work).unwrap();
    fs::create_dir(&mp).unwrap();
    build_sample_tree(&work);
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "main"]);
    // A second checkpoint, so that mounting the first one is a real choice.
    fs::write(work.join("README.md"), b"changed").unwrap();
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "main"]);
    let first = t.path().join("first");
    ok(
        &store,
        &["restore", first.to_str().unwrap(), "--at", "@main~1"],
    );

    let _guard = MountGuard::new(&mp);
    let out = ok(
        &store,
        &[
            "mount",
            mp.to_str().unwrap(),
            "--at",
            "@main~1",
            "--read-only",
        ],
    );
    assert!(out.contains("read-only"), "{out}");
    assert!(casfs::fs::is_fuse_mount(&mp));

    // Every byte, mode, mtime, symlink, fifo and xattr as captured.
    assert_same_tree(&first, &mp);

    // Random access inside a multi-chunk file.
    let big = mp.join("src/deep/er/still/data.bin");
    let want = fs::read(first.join("src/deep/er/still/data.bin")).unwrap();
    let mut f = fs::File::open(&big).unwrap();
    for off in [0u64, 1 << 20, (1 << 20) - 7, 3 * (1 << 20) - 100] {
        f.seek(SeekFrom::Start(off)).unwrap();
        let mut buf = vec![0u8; 4096];
        let n = f.read(&mut buf).unwrap();
        let end = (off as usize + 4096).min(want.len());
        assert_eq!(&buf[..n], &want[off as usize..end], "offset {off}");
    }
    // An open file keeps the mount busy: unmount says so instead of hanging.
    let err = fails(&store, &["unmount", mp.to_str().unwrap()]);
    assert!(err.contains("busy"), "{err}");
    drop(f);

    // Read-only: writes are refused, and the store stays usable by other commands.
    let err = fs::write(mp.join("new-file"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let log = ok(&store, &["log", "-t", "main"]);
    assert_eq!(log.lines().count(), 2);

    // Bad requests are named errors.
    let err = fails(
        &store,
        &["mount", mp.to_str().unwrap(), "-t", "main", "--read-only"],
    );
    assert!(err.contains("already a FUSE mount"), "{err}");
    let err = fails(&store, &["mount", work.to_str().unwrap()]);
    assert!(err.contains("--thread"), "{err}");

    ok(&store, &["unmount", mp.to_str().unwrap()]);
    assert!(!casfs::fs::is_fuse_mount(&mp));
    let err = fails(&store, &["unmount", mp.to_str().unwrap()]);
    assert!(err.contains("not a casfs mount"), "{err}");
}

#[test]
fn a_corrupt_object_reads_as_eio_not_wrong_bytes() {
    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    let work = t.path().join("work");
    let mp = t.path().join("mnt");
    fs::create_dir(&work).unwrap();
    fs::create_dir(&mp).unwrap();
    fs::write(work.join("victim"), pattern(50_000, 3)).unwrap();
    fs::write(work.join("fine"), b"fine").unwrap();
    ok(
        &store_dir,
        &["capture", work.to_str().unwrap(), "-t", "main"],
    );
    {
        use casfs::cas::kv::OBJECTS_CF;
        let store = casfs::checkpoint::Store::open(
            &store_dir,
            casfs::checkpoint::OpenMode::MustExist,
            Duration::from_secs(5),
        )
        .unwrap();
        let id = casfs::cas::file::file_id_of(&pattern(50_000, 3));
        let db = store.database();
        let col = db.column(OBJECTS_CF);
        let mut raw = col.get(id.0.as_bytes()).unwrap().unwrap();
        let n = raw.len() / 2;
        raw[n] ^= 0x10;
        col.put(id.0.as_bytes(), &raw, true).unwrap();
        col.flush().unwrap();
    }
    let _guard = MountGuard::new(&mp);
    ok(
        &store_dir,
        &["mount", mp.to_str().unwrap(), "-t", "main", "--read-only"],
    );
    let err = fs::read(mp.join("victim")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert_eq!(fs::read(mp.join("fine")).unwrap(), b"fine");
    ok(&store_dir, &["unmount", mp.to_str().unwrap()]);
    assert!(wait_for(Duration::from_secs(5), || {
        !casfs::fs::is_fuse_mount(&mp)
    }));
}

/// A view lists files by name only until lookups show their attributes are wanted, then
/// lists everything with attributes and has the kernel drop the listings it holds
/// (`Listings` in src/fs/view.rs). Whatever the order of walks, from one thread or
/// several, every name, kind, size, mode, mtime and byte is the captured one.
#[test]
fn listings_then_lookups_see_the_captured_tree() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let work = t.path().join("work");
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    // More files in each directory than the lookups that switch a view to full
    // listings, odd names among them, and directories among the files.
    for d in 0..6 {
        let dir = work.join(format!("d{d}")).join("inner dir");
        fs::create_dir_all(&dir).unwrap();
        for f in 0..150 {
            let p = dir.parent().unwrap().join(format!("f {f}\n\u{e9}"));
            fs::write(&p, pattern(f * 7 + d, f as u64)).unwrap();
            if f % 10 == 0 {
                fs::write(dir.join(format!("g{f}")), format!("{d}/{f}")).unwrap();
                std::os::unix::fs::symlink(format!("../f {f}"), dir.join(format!("l{f}"))).unwrap();
            }
        }
    }
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "main"]);
    let _guard = MountGuard::new(&mp);
    ok(
        &store,
        &["mount", mp.to_str().unwrap(), "-t", "main", "--read-only"],
    );
    // Names and kinds only, as `find` reads them (d_type): every directory listed
    // before any file is looked at.
    fn names(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<(String, bool)>) {
        let mut here: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap()).collect();
        here.sort_by_key(|e| e.file_name());
        for e in here {
            let is_dir = e.file_type().unwrap().is_dir();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            out.push((rel, is_dir));
            if is_dir {
                names(root, &e.path(), out);
            }
        }
    }
    let (mut want, mut got) = (Vec::new(), Vec::new());
    names(&work, &work, &mut want);
    names(&mp, &mp, &mut got);
    assert_eq!(got, want);
    // Then every file looked at, from two threads at once (the switch to full
    // listings happens during it), then the whole tree compared again.
    std::thread::scope(|s| {
        for half in 0..2 {
            let (work, mp, want) = (&work, &mp, &want);
            s.spawn(move || {
                for (i, (rel, _)) in want.iter().enumerate() {
                    if i % 2 != half {
                        continue;
                    }
                    let (a, b) = (work.join(rel), mp.join(rel));
                    let (ma, mb) = (
                        fs::symlink_metadata(&a).unwrap(),
                        fs::symlink_metadata(&b).unwrap(),
                    );
                    assert_eq!(ma.file_type(), mb.file_type(), "{rel}");
                    if !ma.is_dir() {
                        assert_eq!(ma.len(), mb.len(), "{rel}");
                    }
                    use std::os::unix::fs::MetadataExt;
                    assert_eq!(ma.mode(), mb.mode(), "{rel}");
                    assert_eq!(ma.mtime(), mb.mtime(), "{rel}");
                    if ma.is_file() {
                        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap(), "{rel}");
                    }
                }
            });
        }
    });
    let mut again = Vec::new();
    names(&mp, &mp, &mut again);
    assert_eq!(again, want);
    assert_same_tree(&work, &mp);
    ok(&store, &["unmount", mp.to_str().unwrap()]);
}

/// What an xattr call wrote into a buffer, or its errno.
fn xattr_call(call: impl FnOnce(&mut [u8]) -> isize) -> Result<Vec<u8>, i32> {
    let mut buf = vec![0u8; 1024];
    let rc = call(&mut buf);
    if rc < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    buf.truncate(rc as usize);
    Ok(buf)
}

fn c_path(path: &std::path::Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap()
}

/// `getxattr(path, name)`: the value, or the errno.
fn get_xattr(path: &std::path::Path, name: &str) -> Result<Vec<u8>, i32> {
    let (c, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    // SAFETY: NUL-terminated strings and a buffer of the length passed.
    xattr_call(|b| unsafe {
        libc::getxattr(c.as_ptr(), n.as_ptr(), b.as_mut_ptr().cast(), b.len())
    })
}

/// `listxattr(path)`: the names, or the errno.
fn list_xattrs(path: &std::path::Path) -> Result<Vec<u8>, i32> {
    let c = c_path(path);
    // SAFETY: a NUL-terminated path and a buffer of the length passed.
    xattr_call(|b| unsafe { libc::listxattr(c.as_ptr(), b.as_mut_ptr().cast(), b.len()) })
}

/// A checkpoint without extended attributes anywhere is served as a filesystem without
/// xattr support (ENOTSUP, which the kernel then answers itself); one with an extended
/// attribute anywhere below (here three directories down) serves them all as captured,
/// and ENODATA for the others.
#[test]
fn a_view_says_whether_its_tree_has_extended_attributes() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let work = t.path().join("work");
    fs::create_dir_all(work.join("a/b/c")).unwrap();
    fs::write(work.join("top.txt"), b"top").unwrap();
    fs::write(work.join("a/b/c/deep.txt"), b"deep").unwrap();
    // A host that labels files (SELinux) gives every captured file an attribute.
    if list_xattrs(&work.join("top.txt")).is_ok_and(|l| !l.is_empty()) {
        eprintln!("skipped: the host gives files extended attributes of its own");
        return;
    }
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "plain"]);
    set_xattr(&work.join("a/b/c/deep.txt"), "user.k", b"v");
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "xattrs"]);

    for (thread, has) in [("plain", false), ("xattrs", true), ("plain", false)] {
        let mp = t.path().join(format!("mnt-{thread}-{has}"));
        fs::create_dir_all(&mp).unwrap();
        let _guard = MountGuard::new(&mp);
        ok(
            &store,
            &["mount", mp.to_str().unwrap(), "-t", thread, "--read-only"],
        );
        let deep = mp.join("a/b/c/deep.txt");
        assert_eq!(fs::read(&deep).unwrap(), b"deep");
        if has {
            assert_eq!(get_xattr(&deep, "user.k"), Ok(b"v".to_vec()));
            assert_eq!(get_xattr(&deep, "user.none"), Err(libc::ENODATA));
            assert_eq!(get_xattr(&mp.join("top.txt"), "user.k"), Err(libc::ENODATA));
            assert_eq!(list_xattrs(&deep), Ok(b"user.k\0".to_vec()));
            assert_eq!(list_xattrs(&mp.join("top.txt")), Ok(Vec::new()));
        } else {
            for p in [&deep, &mp.join("top.txt"), &mp.join("a")] {
                // Twice: the daemon's answer, then the kernel's own.
                for _ in 0..2 {
                    assert_eq!(get_xattr(p, "user.k"), Err(libc::EOPNOTSUPP), "{p:?}");
                    assert_eq!(list_xattrs(p), Err(libc::EOPNOTSUPP), "{p:?}");
                }
            }
        }
        ok(&store, &["unmount", mp.to_str().unwrap()]);
    }
}

/// A read-only mount's daemon logs in the temporary directory, which others may write
/// to. A name planted there first by another user, a symlink to a file of root's or a
/// file of theirs, is never followed or written to: the mount fails and names the file
/// in the way; once it is gone the log is root's own, mode 0600. The directory is the
/// other user's (mode 1777), where the kernel's `protected_symlinks` would follow the
/// link: only casfs's own care stands in the way.
#[test]
fn a_log_name_planted_by_another_user_is_never_followed() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if crate::needs_root("it makes a second user with useradd") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (store, work, mp, tmp) = (
        t.path().join("store"),
        t.path().join("work"),
        t.path().join("mnt"),
        t.path().join("tmp"),
    );
    for d in [&work, &mp, &tmp] {
        fs::create_dir(d).unwrap();
    }
    fs::write(work.join("f"), b"checkpointed").unwrap();
    ok(&store, &["capture", work.to_str().unwrap(), "-t", "main"]);
    let other = crate::users::TestUser::new(None);
    std::os::unix::fs::chown(&tmp, Some(other.uid), Some(other.gid)).unwrap();
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = t.path().join("roots-file");
    fs::write(&victim, b"root's").unwrap();
    let canonical = fs::canonicalize(&mp).unwrap();
    let tag = casfs::cas::Hash::of(canonical.as_os_str().as_encoded_bytes()).short(12);
    let name = format!("casfs-mount-0-{tag}.log");
    let log = tmp.join(&name);
    let tmpdir = tmp.to_str().unwrap();
    let mount = || {
        casfs_env(
            &store,
            &["mount", mp.to_str().unwrap(), "-t", "main", "--read-only"],
            &[("TMPDIR", tmpdir)],
        )
    };
    let _guard = MountGuard::new(&mp);

    other.sh(&tmp, &format!("ln -s '{}' {name}", victim.display()));
    let out = mount();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&name), "{err}");
    assert!(!casfs::fs::is_fuse_mount(&mp));
    assert_eq!(fs::read(&victim).unwrap(), b"root's", "followed the link");

    other.sh(
        &tmp,
        &format!("rm {name} && echo theirs > {name} && chmod 666 {name}"),
    );
    let out = mount();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(&name) && err.contains("not this user's"),
        "{err}"
    );
    assert_eq!(fs::read(&log).unwrap(), b"theirs\n");
    assert!(!casfs::fs::is_fuse_mount(&mp));

    other.sh(&tmp, &format!("rm {name}"));
    let out = mount();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(fs::read(mp.join("f")).unwrap(), b"checkpointed");
    let m = fs::symlink_metadata(&log).unwrap();
    assert!(m.file_type().is_file());
    assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600));
    ok(&store, &["unmount", mp.to_str().unwrap()]);
}
