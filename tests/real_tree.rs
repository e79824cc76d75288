//! A real tree of tens of thousands of files (a copy of /usr/share): capture, restore into
//! an empty directory, and compare everything a checkpoint keeps. Then change 10 files
//! and check that a re-capture reads exactly those.

mod common;

use std::fs;
use std::process::Command;

use common::*;

#[test]
fn usr_share_round_trip_and_recapture() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("share");
    let status = Command::new("cp")
        .args(["-a", "/usr/share"])
        .arg(&src)
        .status()
        .unwrap();
    assert!(status.success(), "copy /usr/share");
    let store = t.path().join("store");
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    // Let the clock move past the copy's timestamps (see the directory cache).
    std::thread::sleep(std::time::Duration::from_millis(200));

    let first = json(&store, &["capture", &s(&src), "-t", "share"]);
    let files = first["checkpoint"]["stats"]["files"].as_u64().unwrap();
    assert!(files >= 20_000, "only {files} files in /usr/share");

    let dest = t.path().join("restored");
    ok(&store, &["restore", &s(&dest), "-t", "share"]);
    assert_same_tree(&src, &dest);
    let diff = Command::new("diff")
        .args(["-r", "--no-dereference"])
        .arg(&src)
        .arg(&dest)
        .output()
        .unwrap();
    assert!(
        diff.status.success(),
        "diff -r: {}",
        String::from_utf8_lossy(&diff.stdout)
    );

    // Change 10 files: a re-capture hashes those 10 and nothing else.
    let mut changed = 0;
    for entry in walk_files(&src) {
        if changed == 10 {
            break;
        }
        let meta = fs::symlink_metadata(&entry).unwrap();
        if meta.is_file() && meta.len() > 0 {
            let mut data = fs::read(&entry).unwrap();
            data.extend_from_slice(b"\nchanged by casfs test\n");
            fs::write(&entry, data).unwrap();
            changed += 1;
        }
    }
    let second = json(&store, &["capture", &s(&src), "-t", "share"]);
    let st = &second["checkpoint"]["stats"];
    assert_eq!(st["files_hashed"], 10, "{st}");
    assert_eq!(st["files_skipped"].as_u64().unwrap(), files - 10, "{st}");
    let diff = ok(&store, &["diff", "@share~1", "@share"]);
    assert_eq!(diff.lines().count(), 10, "{diff}");

    // Restoring the first checkpoint over the changed tree rewrites exactly those 10.
    let r = json(&store, &["restore", &s(&src), "--at", "@share~1"]);
    assert_eq!(r["stats"]["files_written"], 10, "{}", r["stats"]);
    assert_same_tree(&src, &dest);
}

fn walk_files(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let mut entries: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() {
                out.push(p);
            }
        }
    }
    out
}
