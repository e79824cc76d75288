//! The FUSE backend's inode table follows what the kernel holds: nodes it forgot are
//! unloaded (clean ones only) and come back, under the same inode numbers, when used.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use crate::workspace::Ws;
use crate::{overlay, wait_for, MountGuard};

/// Every regular file under `root` (relative path -> content).
fn contents(root: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    snapshot(root)
        .into_iter()
        .filter_map(|(p, n)| Some((p, n.content()?.to_vec())))
        .collect()
}

/// Drops the kernel's dentries and inodes (root only), then waits for the daemon to
/// have unloaded what they held: returns the node count it settled at.
fn drop_kernel_caches(ws: &Ws, below: u64) -> u64 {
    let loaded = || ws.status()["nodes_loaded"].as_u64().unwrap();
    let settled = wait_for(Duration::from_secs(20), || {
        // SAFETY: sync cannot fail.
        unsafe { libc::sync() };
        fs::write("/proc/sys/vm/drop_caches", b"2").unwrap();
        loaded() < below
    });
    let n = loaded();
    assert!(
        settled,
        "{n} nodes still loaded, expected fewer than {below}"
    );
    n
}

#[test]
fn nodes_the_kernel_forgets_are_unloaded_and_read_back_the_same() {
    // The FUSE backend's inode table (overlayfs holds no table of casfs's).
    if overlay() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let native = t.path().join("native");
    for d in 0..20 {
        let dir = native.join(format!("d{d:02}"));
        fs::create_dir_all(dir.join("sub")).unwrap();
        for f in 0..50 {
            fs::write(
                dir.join(format!("f{f}")),
                format!("{d}/{f}\n").repeat(f + 1),
            )
            .unwrap();
        }
        fs::write(dir.join("sub/deep"), format!("deep {d}")).unwrap();
    }
    let store = t.path().join("s");
    let first = json(&store, &["capture", native.to_str().unwrap(), "-t", "fg"])["checkpoint"]
        ["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let guard = MountGuard::new(&mp);
    ok(
        &store,
        &["mount", mp.to_str().unwrap(), "-t", "fg", "--mode", "fuse"],
    );
    let ws = Ws {
        _t: t,
        store,
        mp,
        guard,
    };
    let expected = contents(&native);
    assert_eq!(contents(&ws.mp), expected);
    let all = ws.status()["nodes_loaded"].as_u64().unwrap();
    assert!(all > 1_000, "{all} nodes after reading every file");
    let inos: Vec<u64> = (0..20)
        .map(|d| fs::metadata(ws.p(&format!("d{d:02}/f7"))).unwrap().ino())
        .collect();

    // What must stay: a file held open, a changed (dirty) file, a hard link.
    let mut held = fs::File::open(ws.p("d03/f3")).unwrap();
    fs::write(ws.p("d04/f4"), b"changed, not captured").unwrap();
    fs::hard_link(ws.p("d05/f5"), ws.p("d06/link")).unwrap();

    let left = drop_kernel_caches(&ws, all / 4);
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "3/3\n".repeat(4));
    assert_eq!(fs::read(ws.p("d04/f4")).unwrap(), b"changed, not captured");
    let (a, b) = (
        fs::metadata(ws.p("d05/f5")).unwrap(),
        fs::metadata(ws.p("d06/link")).unwrap(),
    );
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));
    // Unchanged files keep their inode numbers across an unload (git's index notices).
    let again: Vec<u64> = (0..20)
        .map(|d| fs::metadata(ws.p(&format!("d{d:02}/f7"))).unwrap().ino())
        .collect();
    assert_eq!(inos, again);
    let mut now = expected.clone();
    now.insert("d04/f4".into(), b"changed, not captured".to_vec());
    now.insert("d06/link".into(), expected[Path::new("d05/f5")].clone());
    assert_eq!(contents(&ws.mp), now);
    assert!(left < all / 4, "{left}");

    // The dirty set survived the unload: the checkpoint finds exactly the changes (the
    // linked file's new name; its old one holds what the parent has there).
    let c = ws.checkpoint();
    assert_eq!(
        c["stats"]["changed_paths"],
        serde_json::json!(["d04/f4", "d06/link"]),
        "{c}"
    );
    let id = c["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(
        ok(&ws.store, &["cat", &id, "d06/link"]).as_bytes(),
        &expected[Path::new("d05/f5")][..]
    );

    // A restore in between, then the kernel forgets again: still the right files.
    ok(&ws.store, &["restore", ws.mp.to_str().unwrap(), &first]);
    assert_eq!(contents(&ws.mp), expected);
    drop_kernel_caches(&ws, all / 4);
    assert_eq!(contents(&ws.mp), expected);
    ok(&ws.store, &["restore", ws.mp.to_str().unwrap(), &id]);
    drop_kernel_caches(&ws, all / 4);
    assert_eq!(contents(&ws.mp), now);
    // The handle opened before both restores still reads what it opened.
    held.seek(SeekFrom::Start(0)).unwrap();
    s.clear();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "3/3\n".repeat(4));
    drop(held);
    ws.unmount();
    drop(ws.guard);
}
