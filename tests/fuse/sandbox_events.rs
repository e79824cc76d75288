//! A sandbox's file events for changes to what its base holds, on either backend: the
//! same events whether the FUSE workspace announces them or the overlay's upper tells
//! them (where overlayfs's own moves, copy-ups and whiteouts are not the workspace's
//! events). Through `casfs serve`, as a client reads them.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::serve::{call, start};
use crate::serve_writers::proof;
use crate::MountGuard;

/// The events of sandbox `key` after number `after`, as (kind, path, to).
fn events(
    s: &crate::serve::Served,
    key: &str,
    after: u64,
) -> Vec<(String, String, Option<String>)> {
    // The writes returned; their events are queued: a short wait finds them all.
    std::thread::sleep(Duration::from_millis(300));
    let (st, v) = call(
        s,
        "GET",
        &format!("/v1/sandboxes/{key}/events?after={after}&wait_ms=2000"),
        None,
    );
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_string(),
                e["path"].as_str().unwrap().to_string(),
                e["to"].as_str().map(String::from),
            )
        })
        .collect()
}

/// Writes `data` to `path` (appended, or in place of what it held) from a process of
/// its own that opens it once, as an agent's tool would. A file written from this
/// process would be open here while other tests' threads start programs: each child
/// inherits the descriptor and closes it at its exec, and on the FUSE backend every
/// close of a writer's descriptor is a flush, announced as a change of its own (so is a
/// shell's `>>`, which closes a duplicate: a gap the docs name).
fn write_from_a_child(path: &std::path::Path, data: &str, append: bool) {
    let st = std::process::Command::new("python3")
        .arg("-c")
        .arg("import sys; f = open(sys.argv[1], sys.argv[3]); f.write(sys.argv[2]); f.close()")
        .arg(path)
        .arg(data)
        .arg(if append { "a" } else { "w" })
        .status()
        .unwrap();
    assert!(st.success(), "writing {}", path.display());
}

fn last_seq(s: &crate::serve::Served, key: &str) -> u64 {
    let (_, v) = call(
        s,
        "GET",
        &format!("/v1/sandboxes/{key}/events?after=0"),
        None,
    );
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

/// Makes a sandbox for `thread`: its key and workspace path.
pub(crate) fn sandbox(s: &crate::serve::Served, thread: &str) -> (String, PathBuf) {
    let (st, v) = call(s, "POST", "/v1/sandboxes", Some(&json!({"thread": thread})));
    assert_eq!(st, 200, "{v}");
    (
        v["key"].as_str().unwrap().to_string(),
        PathBuf::from(v["path"].as_str().unwrap()),
    )
}

#[test]
fn changes_to_the_base_are_told_as_the_workspace_sees_them() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("base").join("workspace"));
    let s = start(&store, &sb, &[], &[]);
    // A base: files and directories, published.
    let (key, root) = sandbox(&s, "base");
    fs::create_dir_all(root.join("dir/sub")).unwrap();
    for f in [
        "a.txt",
        "gone.txt",
        "moved.txt",
        "dir/one",
        "dir/sub/two",
        "keep/x",
    ] {
        if let Some(p) = root.join(f).parent() {
            fs::create_dir_all(p).unwrap();
        }
        fs::write(root.join(f), f).unwrap();
    }
    let (st, lease) = call(&s, "POST", "/v1/threads/base/writer", Some(&json!({})));
    assert_eq!(st, 200);
    let body = json!({"sandbox": key, "expected_head": null, "writer": proof(&lease)});
    let (st, v) = call(&s, "POST", "/v1/threads/base/checkpoints", Some(&body));
    assert_eq!(st, 200, "{v}");
    call(
        &s,
        "POST",
        "/v1/threads/base/writer/release",
        Some(&proof(&lease)),
    );
    // A new sandbox at that head: everything is the lower's now.
    let (st, _) = call(&s, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(st, 200);
    let (key, root) = sandbox(&s, "base");
    assert_eq!(fs::read_to_string(root.join("a.txt")).unwrap(), "a.txt");
    let s0 = last_seq(&s, &key);
    let ev = |kind: &str, path: &str, to: Option<&str>| {
        (kind.to_string(), path.to_string(), to.map(String::from))
    };

    // A base file written: one modify (a copy-up is no event).
    write_from_a_child(&root.join("a.txt"), " more", true);
    assert_eq!(events(&s, &key, s0), vec![ev("modify", "a.txt", None)]);

    // Removed, renamed, a directory removed whole.
    let s1 = last_seq(&s, &key);
    fs::remove_file(root.join("gone.txt")).unwrap();
    fs::rename(root.join("moved.txt"), root.join("here.txt")).unwrap();
    fs::remove_dir_all(root.join("dir")).unwrap();
    let got = events(&s, &key, s1);
    assert_eq!(got[0], ev("delete", "gone.txt", None), "{got:?}");
    assert_eq!(
        got[1],
        ev("rename", "moved.txt", Some("here.txt")),
        "{got:?}"
    );
    let mut rest: Vec<_> = got[2..].to_vec();
    rest.sort();
    assert_eq!(
        rest,
        vec![
            ev("delete", "dir", None),
            ev("delete", "dir/one", None),
            ev("delete", "dir/sub", None),
            ev("delete", "dir/sub/two", None),
        ],
        "{got:?}"
    );

    // Made again where they were: creates.
    let s2 = last_seq(&s, &key);
    fs::create_dir(root.join("dir")).unwrap();
    write_from_a_child(&root.join("gone.txt"), "back", false);
    let got = events(&s, &key, s2);
    assert_eq!(
        got,
        vec![
            ev("create", "dir", None),
            ev("create", "gone.txt", None),
            ev("modify", "gone.txt", None),
        ]
    );
    // A base directory renamed, and a new directory with a file.
    let s3 = last_seq(&s, &key);
    if crate::rootless() {
        // overlayfs in a user namespace has no redirects: a directory of the lower
        // cannot be renamed (`mv` copies it instead).
        let e = fs::rename(root.join("keep"), root.join("kept")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EXDEV), "{e}");
        let (st, v): (u16, Value) = call(&s, "DELETE", &format!("/v1/sandboxes/{key}"), None);
        assert_eq!(st, 200, "{v}");
        return;
    }
    fs::rename(root.join("keep"), root.join("kept")).unwrap();
    fs::create_dir(root.join("new")).unwrap();
    write_from_a_child(&root.join("new/f"), "f", false);
    let got = events(&s, &key, s3);
    assert_eq!(got[0], ev("rename", "keep", Some("kept")), "{got:?}");
    assert_eq!(got[1], ev("create", "new", None), "{got:?}");
    assert!(got[2..].contains(&ev("create", "new/f", None)), "{got:?}");
    assert!(
        got.iter().all(|e| e.1 != "keep" || e.0 == "rename"),
        "a rename is told once: {got:?}"
    );
    let (st, v): (u16, Value) = call(&s, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(st, 200, "{v}");
}

#[test]
fn events_false_records_from_the_first_events_request() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("lazy").join("workspace"));
    let s = start(&store, &sb, &[], &[]);
    let body = json!({"thread": "lazy", "events": false});
    let (st, v) = call(&s, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["events"], "from_first_read", "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = PathBuf::from(v["path"].as_str().unwrap());
    // Before any events request: not recorded.
    fs::write(root.join("before.txt"), "b").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        last_seq(&s, &key),
        0,
        "nothing recorded before the first read"
    );
    // From the first request on, everything is.
    fs::write(root.join("after.txt"), "a").unwrap();
    fs::remove_file(root.join("before.txt")).unwrap();
    let got = events(&s, &key, 0);
    let got: Vec<_> = got.iter().map(|e| (e.0.as_str(), e.1.as_str())).collect();
    assert_eq!(
        got,
        vec![
            ("create", "after.txt"),
            ("modify", "after.txt"),
            ("delete", "before.txt")
        ]
    );
    // Resumed (asking for events from now): it goes on recording, numbers unbroken.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "lazy"})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["key"].as_str(), &v["events"]),
        (Some(key.as_str()), &json!("recording"))
    );
    fs::write(root.join("third.txt"), "c").unwrap();
    let more = events(&s, &key, 3);
    assert_eq!(more[0].1, "third.txt", "{more:?}");
    // A bad value of the option is refused, naming it.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "lazy", "events": "no"})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("events"), "{v}");
    let (st, v) = call(&s, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(st, 200, "{v}");
}
