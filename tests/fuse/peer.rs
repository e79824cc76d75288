//! A sandbox made through `casfs serve`'s Unix socket is its caller's (`SO_PEERCRED`):
//! a real user who is not root, a member of the socket's group (`--socket-group`),
//! makes sandboxes as a run's and as a client's, writes, edits and renames in them (a
//! file restored from a checkpoint too), and the checkpoints hold what they wrote; a
//! user outside the group cannot connect. The users are made with useradd and removed
//! after, also when a test fails. The mount suite runs this on each backend; the
//! callers never open /dev/fuse (the server mounts), so its mode is left alone.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use serde_json::json;

use crate::common::ok;
use crate::serve::{call, start};
use crate::users::{owner_of, place, TestGroup, TestUser};

#[test]
fn a_member_of_the_socket_group_works_in_sandboxes_of_their_own() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let user = TestUser::new(Some(&group));
    let mode = crate::mount_mode().as_str();
    let _g = crate::MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &[
            "--socket-group",
            &group.name,
            "--mode",
            mode,
            "--destroy-on-complete",
        ],
        &[],
    );
    // The socket and the sandboxes directory are the group's (passage, no listing).
    let m = std::fs::metadata(&s.socket).unwrap();
    assert_eq!((m.mode() & 0o777, m.gid()), (0o660, group.gid()));
    let m = std::fs::metadata(&sandboxes).unwrap();
    assert_eq!((m.mode() & 0o777, m.gid()), (0o710, group.gid()));
    let mine = (user.uid, user.gid);

    // A run's sandbox: the workspace is the caller's, and what they write too.
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "peer", "run_id": "r1"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    assert!(crate::is_mounted(&root), "{}", root.display());
    assert_eq!(owner_of(&root), mine);
    user.sh(
        &root,
        "printf 'one\\n' > a.txt && mkdir -p d/e && printf 'deep\\n' > d/e/b.txt && \
         ln -s a.txt link && chmod 0600 d/e/b.txt",
    );
    for p in ["a.txt", "d", "d/e/b.txt", "link"] {
        assert_eq!(owner_of(&root.join(p)), mine, "{p}");
    }
    let (st, v) = user.http(&s.socket, "POST", "/v1/runs/r1/finish", None);
    assert_eq!(st, 200, "{v}");
    let first = v["checkpoint"].as_str().unwrap().to_string();
    assert!(v["changed_files"].as_u64().unwrap() >= 3, "{v}");

    // The next run's sandbox is restored from that checkpoint: the restored files are
    // the caller's to edit, rename and remove (copy-up on the overlay backend).
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "peer", "run_id": "r2"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    assert_eq!(owner_of(&root), mine);
    for p in ["a.txt", "d", "d/e", "d/e/b.txt"] {
        assert_eq!(owner_of(&root.join(p)), mine, "restored {p}");
    }
    user.sh(
        &root,
        "printf 'two\\n' >> a.txt && mv d/e/b.txt d/c.txt && printf 'more\\n' >> d/c.txt && \
         rm link && rmdir d/e && printf 'new\\n' > n.txt",
    );
    assert_eq!(owner_of(&root.join("n.txt")), mine);
    let (st, v) = user.http(&s.socket, "POST", "/v1/runs/r2/finish", None);
    assert_eq!(st, 200, "{v}");
    let second = v["checkpoint"].as_str().unwrap().to_string();
    assert_ne!(first, second);

    // Both checkpoints hold what the caller wrote.
    assert_eq!(ok(&store, &["cat", &first, "d/e/b.txt"]), "deep\n");
    assert_eq!(ok(&store, &["cat", &second, "a.txt"]), "one\ntwo\n");
    assert_eq!(ok(&store, &["cat", &second, "d/c.txt"]), "deep\nmore\n");
    assert_eq!(ok(&store, &["cat", &second, "n.txt"]), "new\n");
    let listed = ok(&store, &["ls", &second, "", "-r"]);
    assert!(
        !listed.contains("link") && !listed.contains("d/e"),
        "{listed}"
    );

    // A sandbox the client makes itself, at the head: theirs too.
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "peer"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["path"].as_str().unwrap());
    let key = v["key"].as_str().unwrap().to_string();
    assert_eq!(owner_of(&root.join("d/c.txt")), mine);
    user.sh(&root, "printf 'three\\n' >> a.txt");
    assert_eq!(
        std::fs::read_to_string(root.join("a.txt")).unwrap(),
        "one\ntwo\nthree\n"
    );
    let (st, v) = user.http(&s.socket, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!((st, v["destroyed"].as_bool()), (200, Some(true)), "{v}");

    // The server's own user (root here) still gets sandboxes, the stand-in's (its
    // processes are never root, and write their workspace).
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "by-root"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["path"].as_str().unwrap());
    assert_eq!(owner_of(&root), (65534, 65534));
}

#[test]
fn a_user_outside_the_socket_group_cannot_connect() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let member = TestUser::new(Some(&group));
    let outsider = TestUser::new(None);
    let s = start(&store, &sandboxes, &["--socket-group", &group.name], &[]);
    let sock = s.socket.display().to_string();
    let connect = "import socket, sys\n\
                   s = socket.socket(socket.AF_UNIX)\n\
                   try:\n    s.connect(sys.argv[1])\n\
                   except PermissionError:\n    sys.exit(13)\n";
    let out = outsider.run("python3", &["-c", connect, &sock]);
    assert_eq!(
        out.status.code(),
        Some(13),
        "an outsider connected: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = member.run("python3", &["-c", connect, &sock]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // And over HTTP: the member is answered, the outsider's curl cannot connect (7).
    let (st, v) = member.http(&s.socket, "GET", "/v1/health", None);
    assert_eq!((st, v["ok"].as_bool()), (200, Some(true)), "{v}");
    let out = outsider.run(
        "curl",
        &["-sS", "--unix-socket", &sock, "http://localhost/v1/health"],
    );
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_plain_sandbox_and_what_is_restored_into_it_are_the_callers() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    // The plain provider does not depend on the mount backend: once per suite run.
    if crate::overlay() {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let user = TestUser::new(Some(&group));
    let s = start(
        &store,
        &sandboxes,
        &[
            "--socket-group",
            &group.name,
            "--plain",
            "--destroy-on-complete",
        ],
        &[],
    );
    let mine = (user.uid, user.gid);
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "plain", "run_id": "r1"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    assert_eq!(owner_of(&root), mine);
    user.sh(&root, "mkdir d && printf 'x\\n' > d/f.txt");
    let (st, v) = user.http(&s.socket, "POST", "/v1/runs/r1/finish", None);
    assert_eq!(st, 200, "{v}");
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "plain", "run_id": "r2"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    for p in ["", "d", "d/f.txt"] {
        assert_eq!(owner_of(&root.join(p)), mine, "restored {p:?}");
    }
    user.sh(&root, "printf 'y\\n' >> d/f.txt");
    let (st, v) = user.http(&s.socket, "POST", "/v1/runs/r2/finish", None);
    assert_eq!(st, 200, "{v}");
    let id = v["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(ok(&store, &["cat", &id, "d/f.txt"]), "x\ny\n");
}
