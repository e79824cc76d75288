//! `casfs watch`: re-captures that look only where the watcher saw changes must store
//! exactly the tree a capture that reads every file stores.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Stops the watcher of `dir`, also when the test fails.
struct Watching<'a> {
    store: &'a Path,
    dir: &'a Path,
}

impl<'a> Watching<'a> {
    fn start(store: &'a Path, dir: &'a Path) -> Self {
        let out = ok(store, &["watch", s(dir)]);
        assert!(out.contains("watching"), "{out}");
        Watching { store, dir }
    }
}

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        casfs(self.store, &["watch", s(self.dir), "--stop"]);
    }
}

fn capture(store: &Path, dir: &Path) -> serde_json::Value {
    json(store, &["capture", s(dir), "--thread", "t"])["checkpoint"].clone()
}

/// The root a capture that reads every file stores, in a store of its own.
fn full_root(other: &Path, dir: &Path) -> String {
    let c = json(
        other,
        &["capture", s(dir), "--thread", "t", "--no-stat-cache"],
    );
    c["checkpoint"]["root"].as_str().unwrap().to_string()
}

fn tree(root: &Path) {
    for d in 0..12 {
        for e in 0..3 {
            let dir = root.join(format!("d{d}/e{e}"));
            fs::create_dir_all(&dir).unwrap();
            for f in 0..5 {
                fs::write(
                    dir.join(format!("f{f}.txt")),
                    pattern(200 + f * 37, d * 10 + e),
                )
                .unwrap();
            }
        }
    }
    std::os::unix::fs::symlink("d0/e0/f0.txt", root.join("link")).unwrap();
}

#[test]
fn watched_recaptures_look_only_where_changes_were_and_store_the_same_tree() {
    let t = tempfile::tempdir().unwrap();
    let (store, other, work) = (t.path().join("s"), t.path().join("o"), t.path().join("w"));
    tree(&work);
    let first = capture(&store, &work);
    assert!(first["stats"].get("watcher").is_none());

    let w = Watching::start(&store, &work);
    // Already watched: a second watcher is refused.
    let err = fails(&store, &["watch", s(&work)]);
    assert!(err.contains("already watched"), "{err}");
    // The first capture with the watcher has no token yet: it looks at everything.
    let c = capture(&store, &work);
    let why = c["stats"]["watcher"].as_str().unwrap();
    assert!(why.starts_with("full: no earlier capture"), "{why}");

    // Changes of every kind, captured right after they are made (no pause: inotify
    // queues each event before the system call returns).
    fs::write(work.join("d1/e0/f1.txt"), b"changed content").unwrap();
    fs::write(work.join("d2/e1/new.txt"), b"a new file").unwrap();
    fs::remove_file(work.join("d3/e2/f4.txt")).unwrap();
    fs::set_permissions(work.join("d4/e0/f0.txt"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::rename(work.join("d5/e1"), work.join("d6/moved")).unwrap();
    fs::create_dir_all(work.join("fresh/a/b")).unwrap();
    fs::write(work.join("fresh/a/b/deep.txt"), b"deep").unwrap();
    fs::remove_file(work.join("link")).unwrap();
    std::os::unix::fs::symlink("d1/e0/f1.txt", work.join("link")).unwrap();
    set_mtime(&work.join("d7/e2/f2.txt"), 1_000_000_000, 5);
    let c = capture(&store, &work);
    let st = &c["stats"];
    assert_eq!(st["watcher"], "changes", "{st}");
    // d0, d8..d11 whole, and the untouched subdirectories of the changed ones.
    let reused = st["dirs_reused"].as_u64().unwrap();
    assert!(reused >= 5 + 3 * 2, "{st}");
    // Read: the written, new, chmod-ed and re-timed files (their fingerprints
    // changed) and the 5 files of the moved directory (the cache is by path): 10,
    // as a capture without the watcher reads.
    assert_eq!(st["files_hashed"], 10, "{st}");
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));

    // Nothing changed: nothing is looked at beyond the root.
    let c = capture(&store, &work);
    assert_eq!(c["stats"]["files_hashed"], 0);
    assert_eq!(c["stats"]["dirs"], 0, "{}", c["stats"]);
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));

    // Many quick rounds: every one stores what a full read stores.
    for round in 0..4u64 {
        let d = work.join(format!("d{}/e{}", 8 + round, round % 3));
        fs::write(d.join("f3.txt"), pattern(999, round)).unwrap();
        fs::create_dir(d.join(format!("sub{round}"))).unwrap();
        fs::write(d.join(format!("sub{round}/x")), b"x").unwrap();
        let c = capture(&store, &work);
        assert_eq!(c["stats"]["watcher"], "changes");
        assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));
    }

    // A directory moved away and another one made under its old name, with a
    // subdirectory of the same name as before: nothing of it comes from the cache.
    fs::rename(work.join("d10"), work.join("renamed10")).unwrap();
    fs::create_dir_all(work.join("d10/e0")).unwrap();
    fs::write(work.join("d10/e0/f0.txt"), b"another").unwrap();
    let c = capture(&store, &work);
    assert_eq!(c["stats"]["watcher"], "changes");
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));

    // A hard link: a write through one name shows only in that name's directory, so
    // the watcher asks for a full look from now on.
    fs::hard_link(work.join("d0/e0/f0.txt"), work.join("d9/e0/hard")).unwrap();
    let c = capture(&store, &work);
    let why = c["stats"]["watcher"].as_str().unwrap();
    assert!(why.contains("hard links"), "{why}");
    fs::write(work.join("d9/e0/hard"), b"through the other name").unwrap();
    let c = capture(&store, &work);
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));
    fs::remove_file(work.join("d9/e0/hard")).unwrap();

    // Without the watcher the capture walks everything and forgets the token; a new
    // watcher's first answer is a full look again.
    drop(w);
    fs::write(work.join("d0/e1/f1.txt"), b"while unwatched").unwrap();
    let c = capture(&store, &work);
    assert!(c["stats"].get("watcher").is_none());
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));
    let _w = Watching::start(&store, &work);
    let c = capture(&store, &work);
    assert!(c["stats"]["watcher"].as_str().unwrap().starts_with("full"));
    fs::write(work.join("d0/e1/f1.txt"), b"watched again").unwrap();
    let c = capture(&store, &work);
    assert_eq!(c["stats"]["watcher"], "changes");
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));
}

#[test]
fn a_restore_drops_the_token_and_bad_input_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let (store, other, work) = (t.path().join("s"), t.path().join("o"), t.path().join("w"));
    tree(&work);
    capture(&store, &work);
    let _w = Watching::start(&store, &work);
    let base = capture(&store, &work);
    fs::write(work.join("d1/e1/f1.txt"), b"later").unwrap();
    capture(&store, &work);
    // The restore rewrites the directory cache: the next capture looks at everything.
    ok(
        &store,
        &[
            "restore",
            s(&work),
            "--at",
            base["id"].as_str().unwrap(),
            "--force",
        ],
    );
    let c = capture(&store, &work);
    assert!(
        c["stats"]["watcher"].as_str().unwrap().starts_with("full"),
        "{}",
        c["stats"]
    );
    assert_eq!(c["root"], base["root"]);
    assert_eq!(c["root"].as_str().unwrap(), full_root(&other, &work));

    // Not a directory, not a store, and a stop with nothing running: named errors.
    let f = work.join("d0/e0/f0.txt");
    let err = fails(&store, &["watch", s(&f)]);
    assert!(err.contains("not a directory"), "{err}");
    let err = fails(&t.path().join("nostore"), &["watch", s(&work)]);
    assert!(err.contains("no store at"), "{err}");
    let err = fails(&store, &["watch", s(&work.join("d0")), "--stop"]);
    assert!(err.contains("is not watched"), "{err}");
}
