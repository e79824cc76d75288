//! Sandboxes booted ahead of their workspace (a root server's): the next sandbox of a
//! user takes one that is already running and gets its workspace by mount
//! propagation. Tried as that user would: the sandbox sees its own workspace and never
//! the one before it, cannot unmount it to see what is beneath, the host's staging
//! directory holds no workspace while one waits and propagates nothing to the host's
//! other namespaces, and a server that stops leaves no booted sandbox, process or stage
//! behind. And what a sandbox's process wrote to a file it holds open is in the
//! checkpoint after it, although the sandbox names its files from its own root.
use std::path::Path;
use std::time::Duration;

use crate::isolation::{bwrap_missing, exec, fails, members, sandbox, Members};

/// The mounts of this process's namespace under `/run/casfs-stage/`: (mount point,
/// file system type, optional fields).
fn staged() -> Vec<(String, String, String)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" - ")?;
            let f: Vec<&str> = head.split(' ').collect();
            let point = f.get(4)?.to_string();
            point.starts_with("/run/casfs-stage").then(|| {
                (
                    point,
                    tail.split(' ').next().unwrap_or("").to_string(),
                    f[6..].join(" "),
                )
            })
        })
        .collect()
}

/// The stages of server `pid` with a slot: sandboxes booted ahead, waiting.
fn waiting(pid: u32) -> Vec<String> {
    let mine = format!("/run/casfs-stage/{pid}.");
    staged()
        .into_iter()
        .filter(|(p, fs, _)| p.starts_with(&mine) && p.ends_with("/workspace") && fs == "tmpfs")
        .map(|(p, ..)| p)
        .collect()
}

/// The stage holds no workspace (only empty slots and the init), and is private. (A
/// stage whose workspace was attached is cleared on a thread of its own, the sandbox's
/// start not waiting for it: a moment is allowed.)
fn stage_holds_no_workspace() {
    let clear = || {
        staged().into_iter().all(|(point, fs, _)| {
            point == "/run/casfs-stage"
                || (point.ends_with("/workspace") && fs == "tmpfs")
                || point.ends_with("/init")
        })
    };
    let cleared = crate::wait_for(Duration::from_secs(5), clear);
    for (point, fs, opt) in staged() {
        if point == "/run/casfs-stage" {
            assert!(
                !opt.contains("shared:"),
                "the stage propagates to the host's other namespaces: {opt}"
            );
            continue;
        }
        let slot = point.ends_with("/workspace") && fs == "tmpfs";
        assert!(
            slot || point.ends_with("/init"),
            "a workspace is mounted in the stage: {point} ({fs})"
        );
    }
    assert!(cleared);
}

#[test]
fn a_sandbox_booted_ahead_gets_its_own_workspace_and_nothing_else() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&[]);
    let (s, a) = (&m.s, &m.a);
    let pid = s.child.id();

    // The first sandbox boots; the next ones of this user boot behind it, as many as
    // the server keeps (its default), while it answers nothing.
    let n = casfs::middleware::isolate::DEFAULT_AHEAD;
    let (k1, r1) = sandbox(a, s, "one");
    a.sh(&r1, "echo one > marker.txt");
    let (code, out, err) = exec(a, s, &k1, "cat /workspace/marker.txt");
    assert_eq!((code, out.as_str()), (0, "one\n"), "{err}");
    assert!(
        crate::wait_for(Duration::from_secs(30), || waiting(pid).len() == n),
        "not {n} sandboxes booted ahead: {:?}",
        staged()
    );
    let ahead = waiting(pid);
    stage_holds_no_workspace();

    // The second takes it, with its own workspace, and none of the first's.
    let (k2, r2) = sandbox(a, s, "two");
    a.sh(&r2, "echo two > marker.txt");
    let (code, out, err) = exec(
        a,
        s,
        &k2,
        "cat /workspace/marker.txt; pwd; echo made > inside.txt; ls /workspace",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "two\n/workspace\ninside.txt\nmarker.txt\n");
    assert_eq!(
        std::fs::read_to_string(r2.join("inside.txt")).unwrap(),
        "made\n"
    );
    assert!(!r1.join("inside.txt").exists());
    // It was one of those booted ahead (its stage went at the attach; another is
    // booted in its place), and the first sandbox still has its own workspace,
    // nothing of the second's.
    assert!(
        crate::wait_for(Duration::from_secs(30), || {
            let now = waiting(pid);
            let gone = ahead.iter().filter(|a| !now.contains(a)).count();
            now.len() == n && gone == 1
        }),
        "the second sandbox did not take one booted ahead: {ahead:?}, now {:?}",
        waiting(pid)
    );
    let (code, out, err) = exec(a, s, &k1, "cat /workspace/marker.txt; ls /workspace");
    assert_eq!((code, out.as_str()), (0, "one\nmarker.txt\n"), "{err}");
    // Its workspace stays where it is: no unmount shows what is beneath (it has no
    // capability, and the mount is locked in its namespace besides).
    fails(
        a,
        s,
        &k2,
        "unmounting the workspace",
        "umount /workspace || umount -l /workspace",
    );
    let (code, out, _) = exec(a, s, &k2, "cat /workspace/marker.txt");
    assert_eq!((code, out.as_str()), (0, "two\n"));
    // Its copy on the host's stage is gone (the next one waits with an empty slot).
    stage_holds_no_workspace();

    // Another member's sandbox never gets one booted for this user: it runs as its own
    // user, with its own workspace.
    let b = crate::users::TestUser::new(Some(&m.group));
    let (kb, rb) = sandbox(&b, s, "theirs");
    b.sh(&rb, "echo b > marker.txt");
    let (code, out, err) = exec(&b, s, &kb, "id -u; cat /workspace/marker.txt");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, format!("{}\nb\n", b.uid));
    let (code, out, _) = exec(a, s, &k2, "id -u; cat /workspace/marker.txt");
    assert_eq!((code, out), (0, format!("{}\ntwo\n", a.uid)));

    // A server that stops leaves no sandbox booted ahead, no process, no stage.
    let uids = [a.uid, b.uid];
    let Members { s, .. } = m;
    let (ended, _) = s.stop();
    assert!(ended, "the server did not stop by itself");
    let procs = || {
        let out = std::process::Command::new("ps")
            .args(["-o", "pid,args", "-u", &format!("{},{}", uids[0], uids[1])])
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
    };
    // (Its bubblewraps' own children go to the host's init, which reaps them.)
    assert!(
        crate::wait_for(Duration::from_secs(10), || procs().is_empty()),
        "processes of the sandboxes' user outlived the server: {:?}",
        procs()
    );
    let mine = format!("{pid}.");
    let left: Vec<_> = std::fs::read_dir(Path::new("/run/casfs-stage"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&mine))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "stages left: {left:?}");
    assert!(
        !staged()
            .iter()
            .any(|(p, _, _)| p.starts_with(&format!("/run/casfs-stage/{mine}"))),
        "mounts left in the stage: {:?}",
        staged()
    );
}

/// A member's checkpoint of their sandbox (the provider's `snapshot()`): its lease, the
/// head, the append, the release. The append's answer.
fn snapshot(
    a: &crate::users::TestUser,
    s: &crate::serve::Served,
    thread: &str,
    key: &str,
) -> serde_json::Value {
    use serde_json::json;
    let (st, lease) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/threads/{thread}/writer"),
        Some(&json!({})),
    );
    assert_eq!(st, 200, "{lease}");
    let proof = json!({ "token": lease["token"], "owner_token": lease["owner_token"] });
    let (st, head) = a.http(
        &s.socket,
        "GET",
        &format!("/v1/threads/{thread}/head"),
        None,
    );
    assert_eq!(st, 200, "{head}");
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/threads/{thread}/checkpoints"),
        Some(&json!({
            "sandbox": key,
            "expected_head": head["head"],
            "writer": proof,
            "reason": "test",
            "conversation": [],
        })),
    );
    assert_eq!(st, 200, "{v}");
    let (st, r) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/threads/{thread}/writer/release"),
        Some(&proof),
    );
    assert_eq!(st, 200, "{r}");
    v
}

/// A write a sandbox's process made to a file it still holds open (no close announced
/// it) is in the checkpoint taken after it: the server finds the sandbox's open files
/// although their names are the sandbox's own (`/workspace/...`), not the host's. It
/// looks among the sandbox's processes alone: a host process's write through a handle
/// it holds is in the first checkpoint after its close.
#[test]
fn a_write_still_open_in_a_sandbox_is_in_the_checkpoint() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&[]);
    let (s, a) = (&m.s, &m.a);
    let (key, path) = sandbox(a, s, "open");
    let (code, _, err) = exec(a, s, &key, "echo base > log.txt; echo host > host.txt");
    assert_eq!(code, 0, "{err}");
    snapshot(a, s, "open", &key);
    // Held open by a process of the host (this test's), written, not closed yet.
    let mut host = std::fs::OpenOptions::new()
        .append(true)
        .open(path.join("host.txt"))
        .unwrap();
    std::io::Write::write_all(&mut host, b"more\n").unwrap();
    // Opened, written, and held open (a log a server appends to, say).
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes"),
        Some(&serde_json::json!({
            "command": "exec 3>>log.txt; echo more >&3; touch written; exec sleep 60"
        })),
    );
    assert_eq!(st, 200, "{v}");
    assert!(crate::wait_for(Duration::from_secs(10), || {
        exec(a, s, &key, "test -e written").0 == 0
    }));
    // What a checkpoint of the sandbox holds, read in a sandbox made from it on thread
    // `into`.
    let checkpointed = |into: &str| {
        let v = snapshot(a, s, "open", &key);
        let (st, f) = a.http(
            &s.socket,
            "POST",
            &format!("/v1/threads/{into}/fork"),
            Some(&serde_json::json!({ "from": v["checkpoint"]["id"] })),
        );
        assert_eq!(st, 200, "{f}");
        let (back, _) = sandbox(a, s, into);
        let (code, out, err) = exec(a, s, &back, "cat log.txt; cat host.txt");
        assert_eq!(code, 0, "{err}");
        out
    };
    // (A FUSE mount sees every write as it is made, the host's too.)
    let held = if crate::overlay() { "" } else { "more\n" };
    assert_eq!(
        checkpointed("from-open"),
        format!("base\nmore\nhost\n{held}")
    );

    // Closed: in the next checkpoint.
    drop(host);
    assert_eq!(checkpointed("from-closed"), "base\nmore\nhost\nmore\n");
}
