//! Sandboxes through `casfs serve`: what a sandbox's processes cost isolated (in
//! bubblewrap, `/v1/sandboxes/{key}/exec`) against host processes (a shell the agent
//! host starts itself in the mounted workspace, the TypeScript provider's host mode),
//! on workspaces of 1k / 10k / 100k files, in one run on one server.
//!
//! Rows, per workspace size (`files`) and `tool` (`casfs-isolated`, `casfs-host`):
//! - `create to first output`: `POST /v1/sandboxes` at a thread whose head holds the
//!   files, then `echo ready` run in it and its output read (isolated: the sandbox's
//!   bubblewrap, control group and init start with it);
//! - `exec round trip`: `true` in a live sandbox whose isolation runs, answered
//!   (isolated: an exec request over the server's socket; host: a `sh -c true` started
//!   in its workspace and waited for).
//!
//! Order alternates between the tools each repetition; every sandbox is destroyed
//! after its repetition. Docker's rows need a Docker engine: where none answers
//! (`docker info`), the run says so in its notes and measures casfs alone.
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
use common::work::make_files;
use common::*;

/// One HTTP/1.1 request over the server's socket: the status and the JSON answer.
fn call(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = UnixStream::connect(socket).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, rest) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(rest).unwrap_or(Value::Null))
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
        .stderr(Stdio::null())
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
    let docker = Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !docker {
        res.note("docker: no Docker engine answers `docker info` on this machine; its rows are not measured");
    }
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
        let _ = std::fs::remove_dir_all(&src);
    }
    let server = serve(&store, &t.path().join("sandboxes"), &mode);
    let socket = server.socket.clone();
    for &n in &args.sizes {
        let thread = format!("files-{n}");
        let (mut create_iso, mut create_host) = (Vec::new(), Vec::new());
        let (mut rt_iso, mut rt_host) = (Vec::new(), Vec::new());
        for rep in 0..args.reps {
            for isolated in [rep % 2 == 0, rep % 2 != 0] {
                let start = Instant::now();
                let v = ok(
                    &socket,
                    "POST",
                    "/v1/sandboxes",
                    Some(&json!({ "thread": thread })),
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
                ok(&socket, "DELETE", &format!("/v1/sandboxes/{key}"), None);
            }
        }
        for (op, tool, runs) in [
            ("create to first output", "casfs-isolated", &create_iso),
            ("create to first output", "casfs-host", &create_host),
            ("exec round trip", "casfs-isolated", &rt_iso),
            ("exec round trip", "casfs-host", &rt_host),
        ] {
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
