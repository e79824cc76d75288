//! Races a client meets in `casfs serve`: a DELETE racing the POST that makes the same
//! sandbox, and a capture while the workspace's entries change type under it. Each is
//! answered as what happened (200, or a 4xx that names the path inside the
//! workspace), never a spurious `sandbox_busy` or a 500 naming the server's store.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};

use serde_json::json;

use crate::serve::{call, start};
use crate::MountsUnder;

/// Boundary 8 (races): a DELETE racing the POST that makes the same sandbox never
/// answers `sandbox_busy` (no run or capture holds it): it waits for the sandbox to be
/// made, then destroys it, or finds none; over many rounds.
#[test]
fn a_delete_racing_a_create_is_never_busy() {
    let t = tempfile::tempdir().unwrap();
    let (store, sandboxes) = (t.path().join("store"), t.path().join("sb"));
    let _g = MountsUnder(sandboxes.clone());
    let s = Arc::new(start(
        &store,
        &sandboxes,
        &["--mode", crate::mount_mode().as_str()],
        &[],
    ));
    for round in 0..60 {
        let go = Arc::new(Barrier::new(2));
        let (s1, g1) = (s.clone(), go.clone());
        let maker = std::thread::spawn(move || {
            g1.wait();
            call(
                &s1,
                "POST",
                "/v1/sandboxes",
                Some(&json!({"thread": "t", "events": false})),
            )
        });
        go.wait();
        let (st, v) = call(&s, "DELETE", "/v1/sandboxes/t", None);
        assert_eq!(st, 200, "round {round}: {v}");
        let (st, v) = maker.join().unwrap();
        assert_eq!(st, 200, "round {round}: {v}");
        let (st, v) = call(&s, "DELETE", "/v1/sandboxes/t", None);
        assert_eq!(st, 200, "round {round}: {v}");
    }
}

/// A process changing entries of `dir` from one type to another as fast as it can
/// (a file, a directory, a symlink, a directory with a file in it), killed when
/// dropped.
struct Flipper(Child);

impl Flipper {
    fn start(dir: &std::path::Path) -> Flipper {
        // Pairs of names whose entries trade places in one step (a directory with
        // files and directories in it, and a file or a symlink): the type at a name
        // changes under any walk of it.
        let script = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
pairs = []
for i in range(8):
    d, f = b"d%d" % i, b"f%d" % i
    os.makedirs(d + b"/sub/deeper")
    for k in range(4):
        open(d + b"/file%d" % k, "w").write("in a directory")
        open(d + b"/sub/deeper/file%d" % k, "w").write("deeper")
    if i % 2:
        open(f, "w").write("a file")
    else:
        os.symlink(b"nowhere", f)
    pairs.append((d, f))
print("ready", flush=True)
while True:
    for d, f in pairs:
        libc.renameat2(-100, d, -100, f, 2)
"#;
        let mut child = Command::new("python3")
            .args(["-c", script])
            .arg(dir)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python3");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ready");
        Flipper(child)
    }
}

impl Drop for Flipper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Boundary 8 (races): a capture while entries of the workspace change type under it
/// (directories and files or links trading places, over and over) ends, and is
/// answered 200 or refused with a 4xx naming the path inside the workspace: never a
/// 500, never the server's own paths, never a capture that waits for the workspace to
/// be still.
#[test]
fn a_capture_while_entries_change_type_is_never_a_500() {
    let t = tempfile::tempdir().unwrap();
    let (store, sandboxes) = (t.path().join("store"), t.path().join("sb"));
    let _g = MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &["--mode", crate::mount_mode().as_str()],
        &[],
    );
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "t", "events": false})),
    );
    assert_eq!(st, 200, "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = std::path::PathBuf::from(v["path"].as_str().unwrap());
    let (st, w) = call(
        &s,
        "POST",
        "/v1/threads/t/writer",
        Some(&json!({"ttl_ms": 600_000})),
    );
    assert_eq!(st, 200, "{w}");
    let proof = json!({"token": w["token"], "owner_token": w["owner_token"]});
    let flipping = Flipper::start(&root);
    let store_path = std::fs::canonicalize(&store).unwrap().display().to_string();
    let mut head = serde_json::Value::Null;
    let mut published = 0;
    for round in 0..40 {
        let body = json!({"sandbox": key, "expected_head": head, "writer": proof});
        // Bounded: a capture that never ends (the build before, whose watch kept its lock
        // while events kept coming) fails the test instead of hanging it.
        let stream = std::os::unix::net::UnixStream::connect(&s.socket).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(120)))
            .unwrap();
        let (st, v) = crate::serve::http(
            stream,
            "POST",
            "/v1/threads/t/checkpoints",
            Some(&body),
            None,
        );
        let text = v.to_string();
        assert!(!text.contains(&store_path), "round {round}: {text}");
        match st {
            200 => {
                head = v["checkpoint"]["id"].clone();
                published += 1;
            }
            400..=499 => assert!(v["error"]["kind"].is_string(), "round {round}: {v}"),
            _ => panic!("round {round}: {st} {v}"),
        }
    }
    drop(flipping);
    assert!(published > 0, "no capture published");
}

/// Removes its directories, however deep, when dropped: every mount under them
/// detached first (a server killed mid-test leaves its lowers mounted), then each
/// removed without recursion.
struct RemovedFlat(Vec<std::path::PathBuf>);

impl Drop for RemovedFlat {
    fn drop(&mut self) {
        for p in &self.0 {
            for m in crate::mounts_under(p) {
                drop(crate::MountGuard::new(&m));
            }
            let _ = casfs::sys::dirfd::remove_path(p);
        }
    }
}

/// Makes a chain of `depth` directories `d/d/d/...` in `dir`, as a program in a
/// sandbox may.
fn deep_chain(dir: &std::path::Path, depth: usize) {
    // As the sandbox's own user would make it: each directory the workspace owner's.
    let script = "import os, sys\nos.chdir(sys.argv[1])\nst = os.stat('.')\nfor i in range(int(sys.argv[2])):\n    os.mkdir('d')\n    os.chown('d', st.st_uid, st.st_gid)\n    os.chdir('d')\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .arg(depth.to_string())
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Boundary 8 (races and errors): a tree deeper than anything real (20,000
/// directories, made in a sandbox on purpose) takes the server down in no walk: its
/// listing answers, a capture of it is refused (422, naming the limit), its client
/// removes it through the server, and the sandbox is destroyed with it, the server
/// serving all along.
#[test]
fn a_tree_too_deep_crashes_nothing_and_is_removed() {
    let t = tempfile::tempdir().unwrap();
    let (store, sandboxes) = (t.path().join("store"), t.path().join("sb"));
    // Whatever is left of the deep chains goes without recursion (the temporary
    // directory's own removal would overflow this thread's stack), after the mounts.
    let _deep = RemovedFlat(vec![store.clone(), sandboxes.clone()]);
    let _g = MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &["--mode", crate::mount_mode().as_str()],
        &[],
    );
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "t", "events": false})),
    );
    assert_eq!(st, 200, "{v}");
    let root = std::path::PathBuf::from(v["path"].as_str().unwrap());
    deep_chain(&root, 20_000);
    let (st, v) = call(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(st, 200, "{v}");
    let (st, w) = call(&s, "POST", "/v1/threads/t/writer", Some(&json!({})));
    assert_eq!(st, 200, "{w}");
    let proof = json!({"token": w["token"], "owner_token": w["owner_token"]});
    let body = json!({"sandbox": "t", "expected_head": null, "writer": proof});
    let (st, v) = call(&s, "POST", "/v1/threads/t/checkpoints", Some(&body));
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (422, Some("policy")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("directories deep"),
        "{v}"
    );
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes/t/fs/remove",
        Some(&json!({"path": "d"})),
    );
    assert_eq!((st, v["removed"].as_bool()), (200, Some(true)), "{v}");
    assert!(!root.join("d").exists());
    deep_chain(&root, 20_000);
    let (st, v) = call(&s, "DELETE", "/v1/sandboxes/t", None);
    assert_eq!((st, v["destroyed"].as_bool()), (200, Some(true)), "{v}");
    let (st, _) = call(&s, "GET", "/v1/health", None);
    assert_eq!(st, 200);
}
