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
