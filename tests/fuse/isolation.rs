//! Sandboxes that isolate: a sandbox's processes, run through `casfs serve`
//! (`/v1/sandboxes/{key}/exec` and `/processes`) in bubblewrap with a control group and
//! a seccomp filter, tried from inside as code a model wrote would try: read a
//! root-only file of the host, write outside `/workspace`, see or signal the host's
//! processes, reach the server's socket or a 127.0.0.1 service of the host, mount,
//! ptrace, load a module, raise a limit, fork past the pids limit, allocate past the
//! memory limit, fill the disk past its bound, see another sandbox's files, keep a
//! process alive after the sandbox ends. Every attempt fails, and the host and the
//! other sandbox are unaffected. Real members of the socket's group (useradd) make the
//! sandboxes, on the pass's backend.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::serve::{call, start, Served};
use crate::users::{place, TestGroup, TestUser};
use crate::MountsUnder;

const HOST_SECRET: &str = "sk-host-only-7f3a9c";

pub(crate) fn bwrap_missing() -> bool {
    if !Path::new("/usr/bin/bwrap").exists() {
        eprintln!("skipped: bubblewrap is not installed (scripts/setup.sh installs it)");
        return true;
    }
    false
}

fn server(store: &Path, sandboxes: &Path, group: &TestGroup, extra: &[&str]) -> Served {
    let mut args = vec![
        "--socket-group",
        group.name.as_str(),
        "--mode",
        crate::mount_mode().as_str(),
    ];
    args.extend_from_slice(extra);
    start(store, sandboxes, &args, &[("OPENAI_API_KEY", HOST_SECRET)])
}

/// A root server whose socket's group has member `a` (and more flags), with everything
/// it made removed when dropped: the server first, then the mounts, the user, the group
/// and the directories.
pub(crate) struct Members {
    pub s: Served,
    _mounts: MountsUnder,
    pub a: TestUser,
    pub group: TestGroup,
    pub t: tempfile::TempDir,
    pub store: PathBuf,
    pub sandboxes: PathBuf,
}

pub(crate) fn members(extra: &[&str]) -> Members {
    let (t, store, sandboxes) = place();
    let group = TestGroup::new();
    let a = TestUser::new(Some(&group));
    let mounts = MountsUnder(sandboxes.clone());
    let s = server(&store, &sandboxes, &group, extra);
    Members {
        s,
        _mounts: mounts,
        a,
        group,
        t,
        store,
        sandboxes,
    }
}

/// A sandbox `user` makes on `thread`: its key and workspace on the host.
pub(crate) fn sandbox(user: &TestUser, s: &Served, thread: &str) -> (String, PathBuf) {
    let (st, v) = user.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({ "thread": thread })),
    );
    assert_eq!(st, 200, "{v}");
    (
        v["key"].as_str().unwrap().to_string(),
        PathBuf::from(v["path"].as_str().unwrap()),
    )
}

/// `script` run in sandbox `key` as `user`: exit code, stdout, stderr.
pub(crate) fn exec(user: &TestUser, s: &Served, key: &str, script: &str) -> (i64, String, String) {
    let (st, v) = user.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/exec"),
        Some(&json!({ "command": script, "timeout_ms": 60_000 })),
    );
    assert_eq!(st, 200, "{script}: {v}");
    (
        v["exit_code"].as_i64().unwrap(),
        v["stdout"].as_str().unwrap().to_string(),
        v["stderr"].as_str().unwrap().to_string(),
    )
}

/// `script` must fail inside the sandbox (what it tried did not happen).
pub(crate) fn fails(user: &TestUser, s: &Served, key: &str, what: &str, script: &str) {
    let (code, out, err) = exec(user, s, key, script);
    assert_ne!(code, 0, "{what} succeeded inside the sandbox: {out} {err}");
}

/// A Python one-liner's shell command.
pub(crate) fn py(code: &str) -> String {
    format!("python3 -c '{code}'")
}

/// Boundary of item 7: from inside a member's sandbox nothing of the host, the server or
/// another sandbox is reached, and what a process is (uid, capabilities, filter,
/// environment) is what the engine gave it.
#[test]
fn a_sandbox_reaches_nothing_of_the_host_or_another_sandbox() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&[]);
    let (s, a, t, store, sandboxes) = (&m.s, &m.a, &m.t, &m.store, &m.sandboxes);
    let b = TestUser::new(Some(&m.group));
    // A root-only file of the host, and a service of the host on loopback.
    let canary = t.path().join("root-only");
    std::fs::write(&canary, "root-only-canary").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();

    let (key_a, root_a) = sandbox(a, s, "work");
    // The probes below are Python: a missing interpreter must not pass them.
    let (code, out, err) = exec(a, s, &key_a, &py("print(6 * 7)"));
    assert_eq!(
        (code, out.as_str()),
        (0, "42\n"),
        "python3 in the sandbox: {err}"
    );
    let (key_b, root_b) = sandbox(&b, s, "other");
    b.sh(&root_b, "printf 'b-private\\n' > b-marker.txt");

    // Who a process is.
    let (code, out, _) = exec(
        a,
        s,
        &key_a,
        "id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; env",
    );
    assert_eq!(code, 0);
    assert!(out.starts_with(&format!("{}\n", a.uid)), "{out}");
    for want in [
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
    ] {
        assert!(out.contains(want), "{want} not in {out}");
    }
    assert!(
        !out.contains(HOST_SECRET),
        "the host's environment leaked: {out}"
    );
    assert!(!out.contains("OPENAI_API_KEY"), "{out}");

    // The workspace is the sandbox's and is writable; writes reach the host's mount.
    let (code, _, err) = exec(a, s, &key_a, "echo made-inside > /workspace/inside.txt");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read_to_string(root_a.join("inside.txt")).unwrap(),
        "made-inside\n"
    );

    // Files of the host.
    let c = canary.display().to_string();
    fails(
        a,
        s,
        &key_a,
        "reading a root-only host file",
        &format!("cat {c}"),
    );
    fails(a, s, &key_a, "reading /etc/shadow", "cat /etc/shadow");
    fails(a, s, &key_a, "listing /root", "ls /root");
    fails(a, s, &key_a, "listing /home", "ls /home");
    fails(
        a,
        s,
        &key_a,
        "reaching the store",
        &format!("ls {}", store.display()),
    );
    fails(
        a,
        s,
        &key_a,
        "reaching the sandboxes",
        &format!("ls {}", sandboxes.display()),
    );
    let (_, out, _) = exec(a, s, &key_a, "cat /etc/passwd");
    assert!(!out.contains(&a.name) && !out.contains(&b.name), "{out}");
    // Writes outside /workspace.
    for target in [
        "/usr/casfs-escape",
        "/etc/casfs-escape",
        "/casfs-escape",
        "/proc/casfs-escape",
    ] {
        fails(
            a,
            s,
            &key_a,
            "writing outside /workspace",
            &format!("touch {target}"),
        );
    }
    let (code, _, _) = exec(a, s, &key_a, "echo private > /tmp/casfs-private-tmp");
    assert_eq!(code, 0, "the sandbox's own /tmp is writable");
    assert!(
        !Path::new("/tmp/casfs-private-tmp").exists(),
        "its /tmp is the host's"
    );

    // The host's processes and the server.
    let server_pid = s.child.id();
    fails(
        a,
        s,
        &key_a,
        "signalling the server",
        &format!("kill -0 {server_pid}"),
    );
    let (_, out, _) = exec(a, s, &key_a, "ls /proc | grep -c '^[0-9]'");
    let visible: usize = out.trim().parse().unwrap();
    assert!(
        visible < 10,
        "{visible} processes visible: the host's are there"
    );
    let sock = s.socket.display().to_string();
    fails(
        a,
        s,
        &key_a,
        "reaching the server's socket",
        &format!("test -e {sock}"),
    );
    fails(
        a,
        s,
        &key_a,
        "connecting to a 127.0.0.1 service of the host",
        &py(&format!(
            "import socket; socket.create_connection((\"127.0.0.1\", {port}), 3)"
        )),
    );
    assert!(listener.accept().is_err(), "the host's service was reached");
    fails(
        a,
        s,
        &key_a,
        "reaching an outside address",
        &py("import socket; socket.create_connection((\"1.1.1.1\", 53), 3)"),
    );

    // What the filter and the missing capabilities refuse.
    fails(
        a,
        s,
        &key_a,
        "mounting",
        "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m",
    );
    fails(a, s, &key_a, "a new user namespace", "unshare -r true");
    // Each answered by the filter itself: without it, ptrace(TRACEME) and keyctl would
    // succeed, unshare(CLONE_NEWUSER) would meet bubblewrap's --disable-userns
    // (ENOSPC), and clone3 would read its argument (EFAULT); finit_module and bpf
    // would be refused for want of a capability anyway.
    for (what, call, errno) in [
        ("ptrace", "c.ptrace(0, 0, 0, 0)", libc::EPERM),
        ("keyctl", "c.syscall(250, 0, -1, 0, 0, 0)", libc::EPERM),
        (
            "unshare(CLONE_NEWUSER)",
            "c.syscall(272, 0x10000000)",
            libc::EPERM,
        ),
        ("setns", "c.syscall(308, 0, 0)", libc::EPERM),
        ("pidfd_getfd", "c.syscall(438, 0, 0, 0)", libc::EPERM),
        ("clone3", "c.syscall(435, 0, 0)", libc::ENOSYS),
        ("finit_module", "c.syscall(313, 0, b\"\", 0)", libc::EPERM),
        ("bpf", "c.syscall(321, 0, 0, 0)", libc::EPERM),
    ] {
        let (code, out, err) = exec(
            a,
            s,
            &key_a,
            &py(&format!(
                "import ctypes, sys; c = ctypes.CDLL(None, use_errno=True); r = {call}; \
                 print(r, ctypes.get_errno()); sys.exit(0 if r == -1 else 1)"
            )),
        );
        assert_eq!(code, 0, "{what} was allowed: {out} {err}");
        assert_eq!(out.trim(), format!("-1 {errno}"), "{what}");
    }
    // A call through the x32 ABI (getpid | 0x40000000) ends the process (SIGSYS).
    let (code, out, _) = exec(
        a,
        s,
        &key_a,
        &py("import ctypes; print(ctypes.CDLL(None).syscall(0x40000000 | 39))"),
    );
    assert_eq!(
        code,
        128 + libc::SIGSYS as i64,
        "an x32 call went through: {out}"
    );
    fails(
        a,
        s,
        &key_a,
        "raising a hard limit",
        &py(
            "import resource as r; s, h = r.getrlimit(r.RLIMIT_NOFILE); \
             r.setrlimit(r.RLIMIT_NOFILE, (h + 1, h + 1))",
        ),
    );

    // Another sandbox's files.
    let (_, out, _) = exec(
        a,
        s,
        &key_a,
        "find / -path /proc -prune -o -name b-marker.txt -print 2>/dev/null; \
         grep -rl b-private /workspace /tmp /etc 2>/dev/null | head -1",
    );
    assert!(
        out.trim().is_empty(),
        "another sandbox's file was seen: {out}"
    );
    let (code, out, _) = exec(&b, s, &key_b, "cat /workspace/b-marker.txt");
    assert_eq!(
        (code, out.as_str()),
        (0, "b-private\n"),
        "B's own sandbox works"
    );
    // Another member's sandbox's processes are not A's to run.
    let (st, _) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key_b}/exec"),
        Some(&json!({"command": "true"})),
    );
    assert_eq!(st, 404, "A ran a process in B's sandbox");

    // Another member's process is not theirs to read, feed or kill.
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key_a}/processes"),
        Some(&json!({"command": "sleep 30", "stdin": true})),
    );
    assert_eq!(st, 200, "{v}");
    let id = v["id"].as_u64().unwrap();
    for (method, path, body) in [
        ("GET", format!("/v1/sandboxes/{key_a}/processes/{id}"), None),
        (
            "POST",
            format!("/v1/sandboxes/{key_a}/processes/{id}/stdin"),
            Some(json!({"data": "x"})),
        ),
        (
            "POST",
            format!("/v1/sandboxes/{key_a}/processes/{id}/kill"),
            Some(json!({})),
        ),
        ("GET", format!("/v1/sandboxes/{key_b}/processes/{id}"), None),
    ] {
        let (st, v) = b.http(&s.socket, method, &path, body.as_ref());
        assert_eq!(st, 404, "B: {method} {path}: {v}");
    }

    // A process left behind is ended with its sandbox.
    let (code, _, err) = exec(
        a,
        s,
        &key_a,
        "setsid sh -c 'sleep 1234 </dev/null >/dev/null 2>&1 &'; nohup sleep 1235 >/dev/null 2>&1 &",
    );
    assert_eq!(code, 0, "{err}");
    let alive = |pattern: &str| {
        std::process::Command::new("pgrep")
            .args(["-u", &a.uid.to_string(), "-f", pattern])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(alive("sleep 123[45]"), "the test's processes did not start");
    let (st, v) = a.http(&s.socket, "DELETE", &format!("/v1/sandboxes/{key_a}"), None);
    assert_eq!(st, 200, "{v}");
    assert!(
        crate::wait_for(Duration::from_secs(10), || !alive("sleep 123[45]")),
        "a process outlived its sandbox"
    );
    assert!(std::fs::read_to_string(&canary).unwrap() == "root-only-canary");
    drop(m);
}

/// Limits: a fork bomb stops at the pids limit, an allocation past the memory limit is
/// killed inside the sandbox, and the host, the server and another sandbox go on.
#[test]
fn limits_hold_inside_and_the_host_goes_on() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&["--sandbox-pids", "48", "--sandbox-memory", "134217728"]);
    let (s, a) = (&m.s, &m.a);
    let (key, _) = sandbox(a, s, "bomb");
    let (key2, _) = sandbox(a, s, "calm");
    // Forks until refused, then reports how many it got.
    let (code, out, err) = exec(
        a,
        s,
        &key,
        &py("import os, time\nn = 0\ntry:\n  for _ in range(500):\n    if os.fork() == 0:\n      time.sleep(30); os._exit(0)\n    n += 1\nexcept OSError as e:\n  print(\"refused\", n, e.errno)\n"),
    );
    assert_eq!(code, 0, "{out} {err}");
    let got: usize = out
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the fork bomb was not stopped: {out} {err}"));
    assert!(got < 48, "{got} processes started past the limit of 48");
    // The other sandbox and the host still start processes.
    let (code, out, _) = exec(a, s, &key2, "echo fine");
    assert_eq!((code, out.as_str()), (0, "fine\n"));
    assert!(std::process::Command::new("true")
        .status()
        .unwrap()
        .success());

    // 512 MiB in a sandbox of 128 MiB: killed there (or refused), never the host's.
    let (code, out, err) = exec(
        a,
        s,
        &key2,
        &py("b = bytearray(512 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(\"allocated\")"),
    );
    assert_ne!(
        code, 0,
        "512 MiB were allocated past a 128 MiB limit: {out} {err}"
    );
    assert!(!out.contains("allocated"));
    let (st, v) = call(s, "GET", "/v1/health", None);
    assert_eq!(st, 200, "{v}");
    let (code, out, _) = exec(a, s, &key, "echo after");
    assert_eq!(
        (code, out.as_str()),
        (0, "after\n"),
        "the sandbox went on after its OOM"
    );
}

/// Disk: a sandbox's writes past its bound (`--sandbox-disk`) fail inside it with
/// ENOSPC, in one large file and in many small ones, and in its /tmp past its size; what it wrote takes no more of
/// the host than the bound; another sandbox, the host and the sandbox itself (once it
/// frees room) go on; destroying it leaves no file system or image behind.
#[test]
fn writes_past_the_disk_bound_fail_inside_and_nothing_else_fills() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    const BOUND: u64 = 64 << 20;
    let m = members(&[
        "--sandbox-disk",
        &BOUND.to_string(),
        "--sandbox-tmp",
        &(16u64 << 20).to_string(),
    ]);
    let (s, a) = (&m.s, &m.a);
    let (key, _) = sandbox(a, s, "full");
    let (key2, _) = sandbox(a, s, "roomy");
    let images = || -> Vec<std::fs::Metadata> {
        std::fs::read_dir(m.store.join("mounts"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".disk"))
            .map(|e| e.metadata().unwrap())
            .collect()
    };
    assert_eq!(images().len(), 2, "each sandbox has a disk of its own");

    // Directories: rows of the store's database on FUSE, inodes of the disk on
    // overlay; either way one per 8 KiB of the bound at most.
    let (code, out, err) = exec(
        a,
        s,
        &key,
        &py("import os\nn = 0\ntry:\n  for i in range(100000): os.mkdir(f\"/workspace/d{i}\"); n += 1\nexcept OSError as e: print(n, e.errno)"),
    );
    let got: Vec<u64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        code == 0 && got.len() == 2 && got[1] == 28 && got[0] <= BOUND / 8192,
        "directories past the bound: {out} {err}"
    );
    let (code, _, err) = exec(a, s, &key, "rm -rf /workspace/d*");
    assert_eq!(code, 0, "{err}");
    // 200 MiB into a disk of 64.
    let (_, out, err) = exec(
        a,
        s,
        &key,
        "dd if=/dev/zero of=/workspace/big bs=1M count=200 2>&1; echo rc=$?; stat -c %s /workspace/big",
    );
    assert!(
        out.contains("No space left on device") && !out.contains("rc=0"),
        "200 MiB were written into a 64 MiB disk: {out} {err}"
    );
    let written: u64 = out.lines().last().unwrap().trim().parse().unwrap();
    assert!(written < BOUND, "{written} bytes written past the bound");
    // Many small files: refused too once the disk is full.
    fails(
        a,
        s,
        &key,
        "small files past the bound",
        &py("import os\nfor i in range(100000):\n  with open(f\"/workspace/f{i}\", \"w\") as f: f.write(\"x\" * 100)"),
    );
    // Its private /tmp is bounded too.
    fails(
        a,
        s,
        &key,
        "a /tmp past its size",
        "dd if=/dev/zero of=/tmp/big bs=1M count=64",
    );
    // The host holds no more of it than the bound.
    for md in images() {
        use std::os::unix::fs::MetadataExt;
        assert!(
            md.blocks() * 512 <= BOUND,
            "a sandbox's disk takes {} bytes of the host",
            md.blocks() * 512
        );
    }
    // The other sandbox writes more than the first's whole bound could hold over time.
    let (code, out, err) = exec(
        a,
        s,
        &key2,
        "dd if=/dev/zero of=/workspace/a bs=1M count=40 2>&1 && rm /workspace/a && dd if=/dev/zero of=/workspace/b bs=1M count=40 2>&1 && echo ok",
    );
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.ends_with("ok\n"), "{out}");
    // Freed room is room again.
    let (code, out, err) = exec(
        a,
        s,
        &key,
        "rm -f /workspace/big /workspace/f* && echo again > /workspace/after && cat /workspace/after",
    );
    assert_eq!((code, out.as_str()), (0, "again\n"), "{err}");
    // A new sandbox's disk is one formatted ahead; another is made in its place.
    let spares = || -> std::collections::BTreeSet<String> {
        std::fs::read_dir(m.store.join("mounts/.spare")).map_or(Default::default(), |rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(&format!("-{BOUND}-")) && n.ends_with(".disk"))
                .collect()
        })
    };
    assert!(
        crate::wait_for(Duration::from_secs(30), || spares().len() == 4),
        "no spare disks were made ahead ({:?})",
        spares()
    );
    let before = spares();
    let (key3, _) = sandbox(a, s, "third");
    let (code, out, err) = exec(a, s, &key3, "echo fine > /workspace/f && cat /workspace/f");
    assert_eq!((code, out.as_str()), (0, "fine\n"), "{err}");
    assert!(
        crate::wait_for(Duration::from_secs(30), || {
            let now = spares();
            now.len() == 4 && now != before
        }),
        "no spare was taken, or the one taken was not made again ({before:?}, now {:?})",
        spares()
    );

    // Every disk mounted in the store, each sandbox's and the spares' (mounted ahead),
    // is nosuid,nodev.
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let under = format!("{}/", m.store.display());
    let disks: Vec<(&str, &str)> = info
        .lines()
        .filter(|l| l.contains(" - ext4 "))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f[4].starts_with(&under).then_some((f[4], f[5]))
        })
        .collect();
    assert!(disks.len() >= 3 + 4, "{disks:?}");
    for (at, opts) in &disks {
        let opts: Vec<&str> = opts.split(',').collect();
        assert!(
            opts.contains(&"nosuid") && opts.contains(&"nodev"),
            "{at}: {opts:?}"
        );
    }

    // Destroyed: no disk, image or loop device of it is left.
    for k in [&key, &key2, &key3] {
        let (st, v) = a.http(&s.socket, "DELETE", &format!("/v1/sandboxes/{k}"), None);
        assert_eq!(st, 200, "{v}");
    }
    assert!(images().is_empty(), "a destroyed sandbox's image is left");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let store = m.store.to_string_lossy().into_owned();
    let spares = format!("{store}/mounts/.spare/");
    assert!(
        !mounts
            .lines()
            .any(|l| l.contains(&store) && l.contains(" ext4 ") && !l.contains(&spares)),
        "a destroyed sandbox's disk is still mounted"
    );
    // A server that stops leaves no spare, mounted or not.
    let s = m.s;
    let (ended, left) = s.stop();
    assert!(
        ended && left.is_empty(),
        "ended: {ended}, left mounted: {left:?}"
    );
    assert!(!m.store.join("mounts/.spare").exists());
}

/// A server killed with its spare disks mounted (no stop removed them) leaves them to
/// the next server on its store, which unmounts and removes them and makes its own; a
/// server that stops leaves none.
#[test]
fn a_killed_server_s_spare_disks_are_removed_by_the_next() {
    if crate::needs_root("it mounts ext4 on loop devices") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (store, sb) = (t.path().join("store"), t.path().join("sb"));
    let _g = MountsUnder(t.path().to_path_buf());
    let bound = (64u64 << 20).to_string();
    let spares = store.join("mounts").join(".spare");
    let mounted = || crate::mounts_under(&spares);
    let s = start(&store, &sb, &["--sandbox-disk", &bound], &[]);
    assert!(
        crate::wait_for(Duration::from_secs(30), || mounted().len() == 4),
        "no spares were mounted ahead: {:?}",
        mounted()
    );
    let first = mounted();
    // Killed: nothing of it runs to remove them.
    let mut s = std::mem::ManuallyDrop::new(s);
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    assert_eq!(mounted(), first);
    let s = start(&store, &sb, &["--sandbox-disk", &bound], &[]);
    assert!(
        crate::wait_for(Duration::from_secs(30), || {
            let now = mounted();
            now.len() == 4 && now.iter().all(|m| !first.contains(m))
        }),
        "the killed server's spares were not replaced: before {first:?}, now {:?}",
        mounted()
    );
    let names: Vec<String> = std::fs::read_dir(&spares)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for old in &first {
        let stem = old.file_stem().unwrap().to_string_lossy().into_owned();
        assert!(
            !names.iter().any(|n| n.starts_with(&stem)),
            "{stem} is left in {names:?}"
        );
    }
    let (ended, left) = s.stop();
    assert!(
        ended && left.is_empty(),
        "ended: {ended}, left mounted: {left:?}"
    );
    assert!(!spares.exists());
}

/// A background process streams its output from any cursor, takes stdin, and a kill
/// ends it with everything it started.
#[test]
fn background_processes_stream_take_stdin_and_die_with_their_group() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&[]);
    let (s, a) = (&m.s, &m.a);
    let (key, _) = sandbox(a, s, "bg");
    let b64 = base64::engine::general_purpose::STANDARD;
    let start = |body: Value| -> u64 {
        let (st, v) = a.http(
            &s.socket,
            "POST",
            &format!("/v1/sandboxes/{key}/processes"),
            Some(&body),
        );
        assert_eq!(st, 200, "{v}");
        assert!(v["pid"].as_i64().unwrap() > 0, "{v}");
        v["id"].as_u64().unwrap()
    };
    let output = |id: u64, after: u64| -> Value {
        let (st, v) = a.http(
            &s.socket,
            "GET",
            &format!("/v1/sandboxes/{key}/processes/{id}?after={after}&wait_ms=5000"),
            None,
        );
        assert_eq!(st, 200, "{v}");
        v
    };
    // What one stream carried (the two streams are two pipes: no order between them).
    let stream = |v: &Value, which: &str| -> String {
        v["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["stream"] == which)
            .map(|c| {
                String::from_utf8(b64.decode(c["data_base64"].as_str().unwrap()).unwrap()).unwrap()
            })
            .collect()
    };
    let text = |v: &Value| stream(v, "stdout");

    // stdin in, stdout out, in order, then the exit code once stdin ends.
    let id = start(
        json!({"command": "while read l; do echo \"got $l\"; done; echo done >&2", "stdin": true}),
    );
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes/{id}/stdin"),
        Some(&json!({"data": "one\n"})),
    );
    assert_eq!(st, 200, "{v}");
    let v = output(id, 0);
    assert_eq!(text(&v), "got one\n");
    let next = v["next"].as_u64().unwrap();
    let (st, _) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes/{id}/stdin"),
        Some(&json!({"data": "two\n", "end": true})),
    );
    assert_eq!(st, 200);
    let (mut out, mut err) = (String::new(), String::new());
    let mut cursor = next;
    let exit = loop {
        let v = output(id, cursor);
        out.push_str(&text(&v));
        err.push_str(&stream(&v, "stderr"));
        cursor = v["next"].as_u64().unwrap();
        if let Some(c) = v["exit_code"].as_i64() {
            break c;
        }
    };
    assert_eq!(
        (exit, out.as_str(), err.as_str()),
        (0, "got two\n", "done\n")
    );
    // Read again from the start: everything is still there.
    let v = output(id, 0);
    assert_eq!(
        (text(&v), stream(&v, "stderr")),
        ("got one\ngot two\n".to_string(), "done\n".to_string())
    );

    // A kill ends the process and what it started in its group.
    let id = start(json!({"command": "sleep 1200 & sleep 1201; echo never"}));
    let alive = || {
        std::process::Command::new("pgrep")
            .args(["-u", &a.uid.to_string(), "-f", "sleep 120[01]"])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(crate::wait_for(Duration::from_secs(5), alive));
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes/{id}/kill"),
        Some(&json!({"signal": "SIGKILL"})),
    );
    assert_eq!(st, 200, "{v}");
    let v = output(id, 0);
    assert_eq!(v["exit_code"].as_i64(), Some(137), "{v}");
    assert!(!text(&v).contains("never"));
    assert!(
        crate::wait_for(Duration::from_secs(5), || !alive()),
        "the group outlived the kill"
    );

    // A sandbox outlives the server thread that started it (a blocking-pool thread
    // ends after 10 s idle): its process still runs 12 s on.
    let id = start(json!({"command": "sleep 40"}));
    std::thread::sleep(Duration::from_secs(12));
    let v = output(id, 0);
    assert!(
        v["exit_code"].is_null(),
        "the sandbox ended with an idle thread: {v}"
    );

    // A program that does not exist is a clear error; the sandbox goes on.
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes"),
        Some(&json!({"argv": ["/no/such/program"]})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/no/such/program"),
        "{v}"
    );
}
