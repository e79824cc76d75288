//! Plain-directory capture and restore through the `casfs` CLI.

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::*;

fn setup() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let work = t.path().join("work");
    fs::create_dir(&work).unwrap();
    (t, store, work)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn round_trip_restores_every_byte_mode_mtime_symlink_and_xattr() {
    let (t, store, work) = setup();
    build_sample_tree(&work);
    let out = json(&store, &["capture", s(&work), "--thread", "main"]);
    let stats = &out["checkpoint"]["stats"];
    assert_eq!(stats["files"], 9);
    assert_eq!(stats["symlinks"], 3);
    assert_eq!(stats["special"], 1);

    let dest = t.path().join("restored");
    ok(&store, &["restore", s(&dest), "--thread", "main"]);
    assert_same_tree(&work, &dest);

    // Into a directory that differs in every way: extra files, a changed file, a
    // directory where a file should be, a symlink where a directory should be.
    fs::write(dest.join("extra"), b"remove me").unwrap();
    fs::create_dir_all(dest.join("extra-dir/x")).unwrap();
    fs::write(dest.join("src/main.rs"), b"changed").unwrap();
    fs::remove_file(dest.join("README.md")).unwrap();
    fs::create_dir(dest.join("README.md")).unwrap();
    let outside = t.path().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::remove_dir_all(dest.join("empty")).unwrap();
    std::os::unix::fs::symlink(&outside, dest.join("empty")).unwrap();
    fs::set_permissions(
        dest.join("script.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    // Those changes were never captured: a restore refuses to lose them.
    let err = fails(&store, &["restore", s(&dest), "--thread", "main"]);
    assert!(err.contains("changes no capture recorded"), "{err}");
    for p in ["README.md/", "empty", "extra", "extra-dir/", "..."] {
        assert!(err.contains(p), "{p} not named in: {err}");
    }
    assert_eq!(fs::read(dest.join("extra")).unwrap(), b"remove me");
    ok(
        &store,
        &["restore", s(&dest), "--thread", "main", "--force"],
    );
    assert_same_tree(&work, &dest);
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "wrote outside");
}

#[test]
fn recapture_reads_only_changed_files() {
    let (_t, store, work) = setup();
    for i in 0..200 {
        let d = work.join(format!("d{}", i % 7));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}.txt")), pattern(100 + i * 13, i as u64)).unwrap();
    }
    // Files changed within the timestamp granularity of a capture are read again
    // next time; let the clock move past them.
    std::thread::sleep(Duration::from_millis(250));
    let first = json(&store, &["capture", s(&work), "--thread", "t"]);
    assert_eq!(first["checkpoint"]["stats"]["files_hashed"], 200);

    let second = json(&store, &["capture", s(&work), "--thread", "t"]);
    assert_eq!(second["checkpoint"]["stats"]["files_hashed"], 0);
    assert_eq!(second["checkpoint"]["stats"]["files_skipped"], 200);
    assert_eq!(
        second["checkpoint"]["root"], first["checkpoint"]["root"],
        "same tree, same root"
    );

    let mut changed = Vec::new();
    for i in (0..200).step_by(20) {
        let p = work.join(format!("d{}", i % 7)).join(format!("f{i}.txt"));
        fs::write(&p, format!("changed {i}")).unwrap();
        changed.push(p);
    }
    let third = json(&store, &["capture", s(&work), "--thread", "t"]);
    let st = &third["checkpoint"]["stats"];
    assert_eq!(st["files_hashed"], 10, "{st}");
    assert_eq!(st["files_skipped"], 190, "{st}");
    assert_eq!(st["files"], 200);

    let diff = ok(&store, &["diff", "@t~1", "@t"]);
    assert_eq!(diff.lines().count(), 10, "{diff}");

    // Ignoring the cache reads everything and finds the same tree.
    let full = json(
        &store,
        &["capture", s(&work), "--thread", "t", "--no-stat-cache"],
    );
    assert_eq!(full["checkpoint"]["stats"]["files_hashed"], 200);
    assert_eq!(full["checkpoint"]["root"], third["checkpoint"]["root"]);
    assert!(diff.lines().all(|l| l.starts_with("M ")), "{diff}");

    // Deleting and adding files is seen too.
    fs::remove_file(&changed[0]).unwrap();
    fs::write(work.join("new.txt"), b"new").unwrap();
    let fourth = json(&store, &["diff", "@t", "@t"]);
    assert_eq!(fourth.as_array().unwrap().len(), 0);
    ok(&store, &["capture", s(&work), "--thread", "t"]);
    let diff = ok(&store, &["diff", "@t~1", "@t"]);
    assert!(diff.contains("A new.txt"), "{diff}");
    assert!(diff.contains("D d0/f0.txt"), "{diff}");
}

#[test]
fn log_show_ls_cat_fork_and_refs() {
    let (_t, store, work) = setup();
    fs::write(work.join("a.txt"), b"one").unwrap();
    ok(&store, &["capture", s(&work), "-t", "main", "-r", "first"]);
    fs::write(work.join("a.txt"), b"two").unwrap();
    ok(&store, &["capture", s(&work), "-t", "main", "-r", "second"]);

    assert_eq!(ok(&store, &["cat", "@main", "a.txt"]), "two");
    assert_eq!(ok(&store, &["cat", "@main~1", "a.txt"]), "one");
    let log = json(&store, &["log", "-t", "main"]);
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0]["reason"], "second");
    assert_eq!(log[0]["parent_id"], log[1]["id"]);

    let first = log[1]["id"].as_str().unwrap();
    assert_eq!(ok(&store, &["cat", &first[..10], "a.txt"]), "one");
    let shown = json(&store, &["show", &first[..8]]);
    assert_eq!(shown["reason"], "first");

    let ls = ok(&store, &["ls", "@main"]);
    assert!(ls.contains("a.txt"), "{ls}");

    let forked = json(&store, &["fork", "experiment", "--from", "@main~1"]);
    assert_eq!(forked["parent_id"], first);
    assert_eq!(ok(&store, &["cat", "@experiment", "a.txt"]), "one");
    let err = fails(&store, &["fork", "experiment", "--from", "@main"]);
    assert!(err.contains("already exists"), "{err}");
    let threads = ok(&store, &["threads"]);
    assert!(threads.contains("experiment") && threads.contains("main"));

    // Errors are one line and name what was wrong.
    let err = fails(&store, &["cat", "@main", "missing.txt"]);
    assert!(err.contains("missing.txt"), "{err}");
    let err = fails(&store, &["log", "-t", "nope"]);
    assert!(err.contains("\"nope\""), "{err}");
    let err = fails(&store, &["capture", s(&work), "-t", "bad name"]);
    assert!(err.contains("thread name"), "{err}");
    let err = fails(&store, &["show", "@main~5"]);
    assert!(err.contains("no parent"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let err = fails(&work.join("no-store"), &["log", "-t", "main"]);
    assert!(err.contains("no casfs store"), "{err}");
}

#[test]
fn restore_refuses_uncaptured_work_but_not_captured_or_deleted_files() {
    let (t, store, work) = setup();
    fs::create_dir(work.join("d")).unwrap();
    fs::write(work.join("d/a.txt"), b"one").unwrap();
    fs::write(work.join("b.txt"), b"two").unwrap();
    ok(&store, &["capture", s(&work), "-t", "w"]);
    // Captured just now (fingerprints not yet trusted): still recognized as captured.
    ok(&store, &["restore", s(&work), "-t", "w"]);
    fs::write(work.join("b.txt"), b"changed").unwrap();
    ok(&store, &["capture", s(&work), "-t", "w"]);
    // Everything captured: restoring the older checkpoint is allowed.
    ok(&store, &["restore", s(&work), "--at", "@w~1"]);
    assert_eq!(fs::read(work.join("b.txt")).unwrap(), b"two");
    // A deleted file is no loss; an edit is.
    fs::remove_file(work.join("b.txt")).unwrap();
    ok(&store, &["restore", s(&work), "--at", "@w"]);
    assert_eq!(fs::read(work.join("b.txt")).unwrap(), b"changed");
    fs::write(work.join("d/a.txt"), b"edited, not captured").unwrap();
    let err = fails(&store, &["restore", s(&work), "--at", "@w~1"]);
    assert!(err.contains("d/a.txt"), "{err}");
    assert_eq!(
        fs::read(work.join("d/a.txt")).unwrap(),
        b"edited, not captured"
    );
    // A directory casfs never saw is not overwritten either; an empty or missing one is fine.
    let other = t.path().join("other");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("mine"), b"x").unwrap();
    let err = fails(&store, &["restore", s(&other), "-t", "w"]);
    assert!(err.contains("mine"), "{err}");
    ok(&store, &["restore", s(&t.path().join("new")), "-t", "w"]);
}

#[test]
fn capturing_into_a_foreign_directory_is_refused() {
    let (t, _store, work) = setup();
    let not_a_store = t.path().join("docs");
    fs::create_dir(&not_a_store).unwrap();
    fs::write(not_a_store.join("important.txt"), b"keep").unwrap();
    let err = fails(&not_a_store, &["capture", s(&work), "-t", "main"]);
    assert!(err.contains("not a casfs store"), "{err}");
    assert_eq!(
        fs::read(not_a_store.join("important.txt")).unwrap(),
        b"keep"
    );
}

/// The captured directory's own mode and mtime come back too (set after its entries,
/// which move its mtime), into a new directory and over an existing one.
#[test]
fn restore_sets_the_directory_s_own_mode_and_mtime() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (t, store, work) = setup();
    build_sample_tree(&work);
    fs::set_permissions(&work, fs::Permissions::from_mode(0o750)).unwrap();
    set_mtime(&work, 1_600_000_000, 123_456_789);
    let cp = json(&store, &["capture", s(&work), "--thread", "main"]);
    assert_eq!(cp["checkpoint"]["root_meta"]["mode"], 0o750, "{cp}");
    let own = |p: &Path| {
        let m = fs::metadata(p).unwrap();
        (m.mode() & 0o7777, m.mtime(), m.mtime_nsec())
    };
    let want = (0o750, 1_600_000_000, 123_456_789);
    assert_eq!(own(&work), want);
    let fresh = t.path().join("fresh");
    ok(&store, &["restore", s(&fresh), "--thread", "main"]);
    assert_same_tree(&work, &fresh);
    assert_eq!(own(&fresh), want);
    // Over a directory whose own mode and mtime differ, and whose entries change.
    let old = t.path().join("old");
    fs::create_dir(&old).unwrap();
    fs::set_permissions(&old, fs::Permissions::from_mode(0o700)).unwrap();
    ok(&store, &["restore", s(&old), "--thread", "main", "--force"]);
    assert_eq!(own(&old), want);
}
