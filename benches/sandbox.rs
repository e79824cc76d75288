//! Sandboxes through `casfs serve`: what a sandbox's processes cost isolated (in
//! bubblewrap, `/v1/sandboxes/{key}/exec`) against host processes (a shell the agent
//! host starts itself in the mounted workspace, the TypeScript provider's host mode),
//! on workspaces of 1k / 10k / 100k files, in one run on one server.
//!
//! Rows, per workspace size (`files`) and `tool` (`casfs-isolated`, `casfs-host`):
//! - `create to first output`: `POST /v1/sandboxes` at a thread whose head holds the
//!   files, as the TypeScript provider makes them (`events: false`: file events are
//!   recorded from the first events request, so creation walks no tree), then `echo
//!   ready` run in it and its output read (isolated: the sandbox's bubblewrap, control
//!   group and init start with it);
//! - `exec round trip`: `true` in a live sandbox whose isolation runs, answered
//!   (isolated: an exec request over the server's socket; host: a `sh -c true` started
//!   in its workspace and waited for);
//! - `snapshot, 10 files changed`: after 10 files were written in the sandbox (by its
//!   processes), the TypeScript provider's `snapshot()`: the thread's writer lease, its
//!   head, the checkpoint, the lease's release;
//! - `restore to first output`: the provider's `restoreSnapshot()` of that snapshot (a
//!   fork of it onto a new thread, a sandbox made there) and `echo ready` in it;
//! - `fork to first output`: the provider's `fork()`: a snapshot, then the restore.
//!
//! Each repetition's sandbox is on a thread of its own forked from the size's head, so
//! that what one repetition checkpoints is not the next one's base.
//!
//! Docker (`docker`): the same operations through the Docker Engine API on its socket,
//! as TanStack's Docker provider (dockerode) makes them, no CLI in between: a
//! container (`--network none`) of an image imported from a local root file system
//! (busybox, static) holding the workspace's files at `/workspace`, started, then `echo
//! ready` run in it by an exec; `true` by an exec; `docker commit` of the container
//! after 10 files changed by an exec; a container of the committed image, started, and
//! `echo ready`; a commit, then that. No registry is reached.
//!
//! Order alternates between the tools each repetition; every sandbox is destroyed
//! after its repetition, and each tool's turn starts on a quiet machine (data synced,
//! the CPUs 90% idle: `settle`), so that what one tool leaves running behind it is not
//! charged to the next. Docker's rows need a Docker engine: where none answers on
//! `/var/run/docker.sock`, the run says so in its notes and measures casfs alone.
//!
//! Run (root, /dev/fuse, bubblewrap): `cargo bench --bench sandbox -- [--sizes
//! 1k,10k,100k] [--reps 15] [--mode overlay|fuse] [--out FILE]`

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "common/mod.rs"]
mod common;
use common::work::{make_files, settle};
use common::*;

/// One HTTP/1.1 request over a Unix socket (a JSON body, `Connection: close`): the
/// status and the body's bytes (a chunked one put back together).
fn request(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
    let mut s = UnixStream::connect(socket).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let rest = out[end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        return (status, unchunk(&rest));
    }
    (status, rest)
}

fn unchunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[i + 2 + n + 2..];
    }
    out
}

/// One request to the server: the status and the JSON answer.
fn call(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let (status, b) = request(socket, method, path, body);
    (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

fn ok(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> Value {
    let (st, v) = call(socket, method, path, body);
    assert_eq!(st, 200, "{method} {path}: {v}");
    v
}

struct Server {
    child: Child,
    socket: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn serve(store: &Path, sandboxes: &Path, mode: &str) -> Server {
    let socket = store.parent().unwrap().join("serve.sock");
    let child = Command::new(casfs_bin())
        .arg("--store")
        .arg(store)
        .args(["serve", "--mode", mode, "--socket"])
        .arg(&socket)
        .arg("--sandboxes")
        .arg(sandboxes)
        .env_remove("CASFS_STORE")
        .stdout(Stdio::null())
        // `CASFS_BENCH_LOG=FILE` keeps the server's log (with `RUST_LOG=casfs=debug`,
        // where each checkpoint's and start's time goes).
        .stderr(match std::env::var_os("CASFS_BENCH_LOG") {
            Some(f) => Stdio::from(std::fs::File::create(f).unwrap()),
            None => Stdio::null(),
        })
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !socket.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Server { child, socket }
}

/// The TypeScript provider's `snapshot()` of sandbox `key` on `thread`: its id.
fn snapshot(socket: &Path, thread: &str, key: &str) -> String {
    let lease = ok(
        socket,
        "POST",
        &format!("/v1/threads/{thread}/writer"),
        Some(&json!({ "holder": "bench snapshot" })),
    );
    let proof = json!({ "token": lease["token"], "owner_token": lease["owner_token"] });
    let head = ok(socket, "GET", &format!("/v1/threads/{thread}/head"), None);
    let v = ok(
        socket,
        "POST",
        &format!("/v1/threads/{thread}/checkpoints"),
        Some(&json!({
            "sandbox": key,
            "expected_head": head["head"],
            "writer": proof,
            "reason": "snapshot",
            "conversation": [],
        })),
    );
    ok(
        socket,
        "POST",
        &format!("/v1/threads/{thread}/writer/release"),
        Some(&proof),
    );
    v["checkpoint"]["id"].as_str().unwrap().to_string()
}

/// The TypeScript provider's `restoreSnapshot()` of checkpoint `cp` onto the new thread
/// `thread`, then `echo ready` in it: the new sandbox's key.
fn restore(socket: &Path, cp: &str, thread: &str, isolated: bool) -> String {
    ok(
        socket,
        "POST",
        &format!("/v1/threads/{thread}/fork"),
        Some(&json!({ "from": cp })),
    );
    let v = ok(
        socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({ "thread": thread, "events": false })),
    );
    let key = v["key"].as_str().unwrap().to_string();
    if isolated {
        isolated_echo(socket, &key);
    } else {
        host_echo(Path::new(v["path"].as_str().unwrap()));
    }
    key
}

/// `echo ready` in sandbox `key`, isolated; its output checked.
fn isolated_echo(socket: &Path, key: &str) {
    let v = ok(
        socket,
        "POST",
        &format!("/v1/sandboxes/{key}/exec"),
        Some(&json!({"command": "echo ready"})),
    );
    assert_eq!(v["stdout"], "ready\n", "{v}");
}

/// `echo ready` on the host, in the workspace; its output checked.
fn host_echo(root: &Path) {
    let out = Command::new("/bin/sh")
        .args(["-c", "echo ready"])
        .current_dir(root)
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"ready\n");
}

fn main() {
    let args = parse_bench_args(15);
    let mode = args
        .flags
        .iter()
        .position(|f| f == "--mode")
        .and_then(|i| args.flags.get(i + 1).cloned())
        .unwrap_or_else(|| "overlay".into());
    let mut res = Results::cargo_bench("sandbox");
    res.param("sizes", &args.sizes);
    res.param("reps", args.reps);
    res.param("mode", &mode);
    let docker = docker::version();
    match &docker {
        Some(v) => res.note(format!(
            "docker: Docker Engine {v} (Engine API on /var/run/docker.sock)"
        )),
        None => res.note(
            "docker: no Docker engine answers on /var/run/docker.sock; its rows are not measured",
        ),
    }
    let docker = docker.is_some();
    let t = tempfile::tempdir().unwrap();
    res.bench_dir(t.path());
    let store = t.path().join("store");
    // Each size's tree, captured as the head of a thread of its own.
    for &n in &args.sizes {
        let src = t.path().join(format!("src-{n}"));
        make_files(&src, n);
        casfs_with(
            &store,
            &[
                "capture",
                src.to_str().unwrap(),
                "--thread",
                &format!("files-{n}"),
            ],
            &[],
        );
        if docker {
            docker::import(&src, &format!("casfs-bench/ws-{n}"));
        }
        let _ = std::fs::remove_dir_all(&src);
    }
    let server = serve(&store, &t.path().join("sandboxes"), &mode);
    let socket = server.socket.clone();
    for &n in &args.sizes {
        let thread = format!("files-{n}");
        let (mut create_iso, mut create_host) = (Vec::new(), Vec::new());
        let (mut rt_iso, mut rt_host) = (Vec::new(), Vec::new());
        let (mut snap_iso, mut snap_host) = (Vec::new(), Vec::new());
        let (mut restore_iso, mut restore_host) = (Vec::new(), Vec::new());
        let (mut fork_iso, mut fork_host) = (Vec::new(), Vec::new());
        let mut dk: [Vec<Duration>; 5] = Default::default();
        let head = ok(&socket, "GET", &format!("/v1/threads/{thread}/head"), None)["head"]
            .as_str()
            .unwrap()
            .to_string();
        for rep in 0..args.reps {
            if docker && rep % 2 == 0 {
                settle();
                docker::rep(&format!("casfs-bench/ws-{n}"), rep, &mut dk);
            }
            for isolated in [rep % 2 == 0, rep % 2 != 0] {
                settle();
                let tool = if isolated { "iso" } else { "host" };
                let mine = format!("{thread}-{rep}-{tool}");
                ok(
                    &socket,
                    "POST",
                    &format!("/v1/threads/{mine}/fork"),
                    Some(&json!({ "from": head })),
                );
                let start = Instant::now();
                let v = ok(
                    &socket,
                    "POST",
                    "/v1/sandboxes",
                    Some(&json!({ "thread": mine, "events": false })),
                );
                let key = v["key"].as_str().unwrap().to_string();
                let root = PathBuf::from(v["path"].as_str().unwrap());
                if isolated {
                    isolated_echo(&socket, &key);
                    create_iso.push(start.elapsed());
                } else {
                    host_echo(&root);
                    create_host.push(start.elapsed());
                }
                // A warm sandbox's round trip (its isolation started by the echo), both
                // ways on the same sandbox, in alternating order.
                let order = if rep % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for first in order.into_iter().filter(|_| isolated) {
                    let s = Instant::now();
                    if first {
                        let v = ok(
                            &socket,
                            "POST",
                            &format!("/v1/sandboxes/{key}/exec"),
                            Some(&json!({"command": "true"})),
                        );
                        assert_eq!(v["exit_code"], 0, "{v}");
                        rt_iso.push(s.elapsed());
                    } else {
                        let st = Command::new("/bin/sh")
                            .args(["-c", "true"])
                            .current_dir(&root)
                            .status()
                            .unwrap();
                        assert!(st.success());
                        rt_host.push(s.elapsed());
                    }
                }
                // 10 files changed by the sandbox's processes, then the provider's
                // snapshot, restore and fork.
                let change =
                    format!("for i in 0 1 2 3 4 5 6 7 8 9; do echo {rep} > changed-$i; done");
                if isolated {
                    let v = ok(
                        &socket,
                        "POST",
                        &format!("/v1/sandboxes/{key}/exec"),
                        Some(&json!({ "command": change })),
                    );
                    assert_eq!(v["exit_code"], 0, "{v}");
                } else {
                    let st = Command::new("/bin/sh")
                        .args(["-c", &change])
                        .current_dir(&root)
                        .status()
                        .unwrap();
                    assert!(st.success());
                }
                let s = Instant::now();
                let cp = snapshot(&socket, &mine, &key);
                if isolated {
                    &mut snap_iso
                } else {
                    &mut snap_host
                }
                .push(s.elapsed());
                let s = Instant::now();
                let back = restore(&socket, &cp, &format!("{mine}-restored"), isolated);
                if isolated {
                    &mut restore_iso
                } else {
                    &mut restore_host
                }
                .push(s.elapsed());
                ok(&socket, "DELETE", &format!("/v1/sandboxes/{back}"), None);
                let s = Instant::now();
                let cp = snapshot(&socket, &mine, &key);
                let forked = restore(&socket, &cp, &format!("{mine}-forked"), isolated);
                if isolated {
                    &mut fork_iso
                } else {
                    &mut fork_host
                }
                .push(s.elapsed());
                ok(&socket, "DELETE", &format!("/v1/sandboxes/{forked}"), None);
                ok(&socket, "DELETE", &format!("/v1/sandboxes/{key}"), None);
            }
            if docker && rep % 2 != 0 {
                settle();
                docker::rep(&format!("casfs-bench/ws-{n}"), rep, &mut dk);
            }
        }
        let [d_create, d_rt, d_snap, d_restore, d_fork] = &dk;
        for (op, tool, runs) in [
            ("create to first output", "casfs-isolated", &create_iso),
            ("create to first output", "casfs-host", &create_host),
            ("exec round trip", "casfs-isolated", &rt_iso),
            ("exec round trip", "casfs-host", &rt_host),
            ("snapshot, 10 files changed", "casfs-isolated", &snap_iso),
            ("snapshot, 10 files changed", "casfs-host", &snap_host),
            ("restore to first output", "casfs-isolated", &restore_iso),
            ("restore to first output", "casfs-host", &restore_host),
            ("fork to first output", "casfs-isolated", &fork_iso),
            ("fork to first output", "casfs-host", &fork_host),
            ("create to first output", "docker", d_create),
            ("exec round trip", "docker", d_rt),
            ("snapshot, 10 files changed", "docker", d_snap),
            ("restore to first output", "docker", d_restore),
            ("fork to first output", "docker", d_fork),
        ] {
            if runs.is_empty() {
                continue;
            }
            let m = res.times(json!({"op": op, "tool": tool, "files": n}), runs);
            println!(
                "{n:>7} files  {op:<24} {tool:<16} {:>8.2} ms",
                m.as_secs_f64() * 1e3
            );
        }
    }
    drop(server);
    res.finish();
}

/// Docker through its Engine API, as a provider on dockerode drives it.
mod docker {
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use serde_json::{json, Value};

    const SOCKET: &str = "/var/run/docker.sock";

    /// One request to the engine: the status and the body's bytes (a raw stream for
    /// an exec).
    fn request(method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
        super::request(Path::new(SOCKET), method, path, body)
    }

    fn api(method: &str, path: &str, body: Option<&Value>) -> Value {
        let (st, b) = request(method, path, body);
        assert!(
            (200..300).contains(&st),
            "docker {method} {path}: {st} {}",
            String::from_utf8_lossy(&b)
        );
        serde_json::from_slice(&b).unwrap_or(Value::Null)
    }

    /// The engine's version, if one answers.
    pub fn version() -> Option<String> {
        UnixStream::connect(SOCKET).ok()?;
        let v = api("GET", "/version", None);
        v["Version"].as_str().map(str::to_string)
    }

    /// An image of a static busybox root with `workspace`'s files at `/workspace`,
    /// imported (`docker import`) as `name`.
    pub fn import(workspace: &Path, name: &str) {
        let root = workspace.with_extension("docker-root");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("tmp")).unwrap();
        std::fs::copy("/bin/busybox", root.join("bin/busybox"))
            .expect("busybox-static (/bin/busybox) for Docker's image");
        for c in ["sh", "echo", "true", "sleep", "cat", "ls"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(c)).unwrap();
        }
        let st = Command::new("cp")
            .arg("-a")
            .arg(workspace)
            .arg(root.join("workspace"))
            .status()
            .unwrap();
        assert!(st.success());
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(&root)
            .args(["-c", "."])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let st = Command::new("docker")
            .args(["import", "-", name])
            .stdin(tar.stdout.take().unwrap())
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(tar.wait().unwrap().success(), "tar of Docker's image");
        assert!(st.success(), "docker import");
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A container of `image`, started: its id.
    fn run(image: &str) -> String {
        let c = api(
            "POST",
            "/containers/create",
            Some(&json!({
                "Image": image,
                "Cmd": ["sleep", "86400"],
                "WorkingDir": "/workspace",
                "HostConfig": { "NetworkMode": "none" },
            })),
        );
        let id = c["Id"].as_str().unwrap().to_string();
        api("POST", &format!("/containers/{id}/start"), None);
        id
    }

    /// `argv` run in container `id` to its end: its standard output.
    fn exec(id: &str, argv: &[&str]) -> String {
        let e = api(
            "POST",
            &format!("/containers/{id}/exec"),
            Some(&json!({ "Cmd": argv, "AttachStdout": true, "AttachStderr": true })),
        );
        let eid = e["Id"].as_str().unwrap();
        let (st, raw) = request(
            "POST",
            &format!("/exec/{eid}/start"),
            Some(&json!({ "Detach": false, "Tty": false })),
        );
        assert_eq!(st, 200, "docker exec start");
        // Frames: a stream byte, three zeros, a big-endian length, the bytes.
        let (mut out, mut b) = (Vec::new(), &raw[..]);
        while b.len() >= 8 {
            let n = u32::from_be_bytes([b[4], b[5], b[6], b[7]]) as usize;
            if b[0] == 1 {
                out.extend_from_slice(&b[8..8 + n]);
            }
            b = &b[8 + n..];
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn commit(id: &str, repo: &str) -> String {
        let v = api(
            "POST",
            &format!("/commit?container={id}&repo={repo}&tag=snap"),
            None,
        );
        v["Id"].as_str().unwrap().to_string()
    }

    fn remove(id: &str) {
        api("DELETE", &format!("/containers/{id}?force=true"), None);
    }

    /// One repetition of every row, each appended to `into` (create, exec round trip,
    /// snapshot, restore, fork).
    pub fn rep(image: &str, rep: usize, into: &mut [Vec<Duration>; 5]) {
        let t = Instant::now();
        let id = run(image);
        assert_eq!(exec(&id, &["echo", "ready"]), "ready\n");
        into[0].push(t.elapsed());
        let t = Instant::now();
        exec(&id, &["true"]);
        into[1].push(t.elapsed());
        let change = format!("for i in 0 1 2 3 4 5 6 7 8 9; do echo {rep} > changed-$i; done");
        exec(&id, &["sh", "-c", &change]);
        let t = Instant::now();
        let snap = commit(&id, &format!("casfs-bench/snap-{rep}"));
        into[2].push(t.elapsed());
        let t = Instant::now();
        let back = run(&snap);
        assert_eq!(exec(&back, &["echo", "ready"]), "ready\n");
        into[3].push(t.elapsed());
        remove(&back);
        let t = Instant::now();
        let snap2 = commit(&id, &format!("casfs-bench/fork-{rep}"));
        let forked = run(&snap2);
        assert_eq!(exec(&forked, &["echo", "ready"]), "ready\n");
        into[4].push(t.elapsed());
        remove(&forked);
        remove(&id);
        for img in [snap, snap2] {
            api("DELETE", &format!("/images/{img}?force=true"), None);
        }
    }
}
