//! What one request, one client or one member may make `casfs serve` hold, tried over
//! its Unix socket against the real server: bodies over their route's limit, JSON too
//! deep or with too many elements (refused before any value is made of them), several
//! large bodies at once (the server's peak resident memory stays bounded), the memory
//! for requests shared out (503 `busy` past it, served again once it is given back),
//! and a member's idle connections, which never turn another member or root away.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use serde_json::{json, Value};

use crate::serve::{call, start, Served};
use crate::trust::conforms;
use crate::users::{place, TestGroup, TestUser};

fn openapi() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json"))
            .unwrap(),
    )
    .unwrap()
}

/// The status and JSON body of an answer read whole.
fn answer(resp: &[u8]) -> (u16, Value) {
    let text = String::from_utf8_lossy(resp);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {text:.200}"));
    let body = serde_json::from_str(body).unwrap_or(Value::String(body.into()));
    (status, body)
}

/// Sends a request whose body is `body` (written on a thread of its own, whatever the
/// server does with it: it may answer and close before reading it all) and returns
/// the answer.
fn send(socket: &Path, method: &str, path: &str, body: Arc<Vec<u8>>) -> (u16, Value) {
    let mut c = UnixStream::connect(socket).unwrap();
    // A server that never answers fails the test rather than hanging it.
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    let mut w = c.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for part in body.chunks(64 << 10) {
            if w.write_all(part).is_err() {
                break;
            }
        }
    });
    let mut resp = Vec::new();
    let _ = c.read_to_end(&mut resp);
    // Closed by the server: the writer's next write fails, if it is still writing.
    drop(c);
    writer.join().unwrap();
    answer(&resp)
}

/// `[0,0,...,0]` of `len` bytes (give an odd length).
fn zeros(len: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(len);
    b.push(b'[');
    while b.len() + 2 < len {
        b.extend_from_slice(b"0,");
    }
    b.extend_from_slice(b"0]");
    b
}

/// The server's peak resident memory in bytes (VmHWM).
fn peak_rss(s: &Served) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb << 10
}

/// Boundary 7 (bounded memory): three 30 MiB bodies of `[0,0,...]` sent at once to a
/// route that carries data are refused, and the server's peak resident memory stays
/// far below what their values would take (the build before made 2.4 GB of them and
/// answered 200).
#[test]
fn three_large_bodies_at_once_are_refused_and_memory_stays_bounded() {
    let t = tempfile::tempdir().unwrap();
    let s = start(&t.path().join("store"), &t.path().join("sb"), &[], &[]);
    assert_eq!(call(&s, "GET", "/v1/health", None).0, 200);
    let body = Arc::new(zeros((30 << 20) + 1));
    let doc = openapi();
    let at_once = Arc::new(Barrier::new(3));
    let senders: Vec<_> = (0..3)
        .map(|i| {
            let (socket, body, at_once) = (s.socket.clone(), body.clone(), at_once.clone());
            std::thread::spawn(move || {
                at_once.wait();
                send(
                    &socket,
                    "PUT",
                    &format!("/v1/threads/big{i}/messages"),
                    body,
                )
            })
        })
        .collect();
    let answers: Vec<(u16, Value)> = senders.into_iter().map(|h| h.join().unwrap()).collect();
    let peak = peak_rss(&s);
    eprintln!("the server's peak resident memory: {} MiB", peak >> 20);
    for (i, (st, v)) in answers.into_iter().enumerate() {
        assert!(
            matches!(st, 400 | 413 | 503),
            "body {i}: {st} {:.300}",
            v.to_string()
        );
        conforms(&doc, "PUT", &format!("/v1/threads/big{i}/messages"), st, &v);
    }
    // Nothing was stored.
    let (st, v) = call(&s, "GET", "/v1/threads/big0/messages", None);
    assert!(st == 404 || v == json!([]), "{st} {v}");
    assert!(
        peak < 300 << 20,
        "the server's peak resident memory was {} MiB",
        peak >> 20
    );
}

/// Boundary 7 (bounded memory): within the size limit, a body nested deeper than
/// `--max-json-depth` or holding more than `--max-json-elements` elements is refused
/// with 400 naming the limit, before any value is made of it; a body over its route's
/// limit gets 413 naming the route's setting (most routes take little, the routes that
/// carry data much more); a large ordinary conversation is still taken.
#[test]
fn json_too_deep_or_too_many_and_bodies_over_their_route_limit_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let s = start(&t.path().join("store"), &t.path().join("sb"), &[], &[]);
    let doc = openapi();
    let check = |method: &str, path: &str, body: Vec<u8>, status: u16, kind: &str, names: &str| {
        let (st, v) = send(&s.socket, method, path, Arc::new(body));
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (status, Some(kind)),
            "{method} {path}: {:.300}",
            v.to_string()
        );
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(names), "{method} {path}: {m}");
        conforms(&doc, method, path, st, &v);
    };
    let nested = |depth: usize| {
        let mut b = "[".repeat(depth).into_bytes();
        b.extend_from_slice(&b"]".repeat(depth));
        b
    };
    // Within serde_json's own limit of 128 (which the build before took), and far past it.
    for depth in [100, 100_000] {
        check(
            "PUT",
            "/v1/threads/deep/messages",
            nested(depth),
            400,
            "invalid",
            "--max-json-depth",
        );
    }
    // 1.2 million elements in 2.4 MB (and as objects' members, on a portable record).
    check(
        "PUT",
        "/v1/threads/many/messages",
        zeros(2_400_001),
        400,
        "invalid",
        "--max-json-elements",
    );
    let mut record = br#"{"checkpoint": {"files": ["#.to_vec();
    for i in 0..600_000 {
        record
            .extend_from_slice(format!("{}{{\"a\":{i}}}", if i > 0 { "," } else { "" }).as_bytes());
    }
    record.extend_from_slice(br#"]}, "expected_head_id": null, "writer": {}}"#);
    check(
        "POST",
        "/v1/stores/s/checkpoints",
        record,
        400,
        "invalid",
        "--max-json-elements",
    );
    // Over a route's own limit: 413 naming it.
    let run = format!(
        r#"{{"thread": "t", "run_id": "r", "tenant": "{}"}}"#,
        "x".repeat(300 << 10)
    );
    check(
        "POST",
        "/v1/runs",
        run.into_bytes(),
        413,
        "too_large",
        "--max-body",
    );
    check(
        "PUT",
        "/v1/threads/huge/messages",
        zeros((33 << 20) + 1),
        413,
        "too_large",
        "--max-data-body",
    );
    // What an agent host sends is taken: 5,000 messages of 1 KiB with their parts.
    let conversation: Vec<Value> = (0..5000)
        .map(|i| {
            json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                   "content": [{"type": "text", "text": format!("{i}{}", "y".repeat(1000))}]})
        })
        .collect();
    let (st, v) = call(
        &s,
        "PUT",
        "/v1/threads/long/messages",
        Some(&Value::Array(conversation)),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["messages"], 5000);
}

/// Boundary 7 (bounded memory): request bodies share one budget of memory
/// (`--max-request-memory`): while one request holds most of it (its body on its way),
/// another that does not fit waits `--request-memory-wait` and is answered 503 `busy`;
/// once the first is answered, the second is served.
#[test]
fn requests_past_the_memory_for_requests_wait_then_get_busy() {
    let t = tempfile::tempdir().unwrap();
    let s = start(
        &t.path().join("store"),
        &t.path().join("sb"),
        &[
            "--max-body",
            "65536",
            "--max-data-body",
            "900000",
            "--max-request-memory",
            "1000000",
            "--request-memory-wait",
            "0.2",
        ],
        &[],
    );
    let doc = openapi();
    let small = {
        let mut b = br#"[""#.to_vec();
        b.extend_from_slice(&b"s".repeat(200_000));
        b.extend_from_slice(br#""]"#);
        Arc::new(b)
    };
    // The first request: its head says 890,000 bytes, of which it sends a few.
    let mut first = UnixStream::connect(&s.socket).unwrap();
    first
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    first
        .write_all(
            b"PUT /v1/threads/first/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
              Content-Type: application/json\r\nContent-Length: 890000\r\n\r\n[\"",
        )
        .unwrap();
    // Until the server holds the first's memory, the second may get in first (and be
    // answered 200): a race, tried until the second is refused.
    // Tried for a bounded time, not a number of rounds: on a loaded machine the server
    // may take a while to read the first's head.
    let mut refused = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while std::time::Instant::now() < deadline {
        let (st, v) = send(
            &s.socket,
            "PUT",
            "/v1/threads/second/messages",
            small.clone(),
        );
        match st {
            200 => continue,
            _ => {
                refused = Some((st, v));
                break;
            }
        }
    }
    let (st, v) = refused.expect("the second request was never refused");
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (503, Some("busy")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-request-memory"),
        "{v}"
    );
    conforms(&doc, "PUT", "/v1/threads/second/messages", st, &v);
    // The first ends its body and is served; its memory comes back.
    let mut rest = b"f".repeat(890_000 - 4);
    rest.extend_from_slice(b"\"]");
    first.write_all(&rest).unwrap();
    let mut resp = Vec::new();
    first.read_to_end(&mut resp).unwrap();
    assert_eq!(answer(&resp).0, 200, "{}", String::from_utf8_lossy(&resp));
    let (st, v) = send(&s.socket, "PUT", "/v1/threads/second/messages", small);
    assert_eq!(st, 200, "{v}");
}

/// The status of `GET /v1/health` made by `user`'s own process, or why there was none
/// (a connection turned away before the request was sent: curl cannot tell).
fn health_as(user: &TestUser, socket: &Path) -> Result<u16, String> {
    let sock = socket.display().to_string();
    let out = user.run(
        "curl",
        &[
            "-sS",
            "--unix-socket",
            &sock,
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "http://localhost/v1/health",
        ],
    );
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("{e}"))
}

/// A member's process holding `n` connections to the socket open, idle, until dropped.
struct Holder {
    child: std::process::Child,
}

impl Holder {
    /// Opens `n` connections as `user`; returns once the server has taken the last one
    /// (its answer to a request on it, whatever it is, says so: connections are
    /// accepted in order) with that answer's status.
    fn open(user: &TestUser, socket: &Path, n: usize) -> (Holder, u16) {
        let script = format!(
            "import socket, sys\n\
             cs = []\n\
             for i in range({n}):\n\
             \x20   s = socket.socket(socket.AF_UNIX)\n\
             \x20   s.connect({socket:?})\n\
             \x20   cs.append(s)\n\
             cs[-1].sendall(b'GET /v1/health HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
             got = cs[-1].recv(4096)\n\
             print(got.split(b' ')[1].decode(), flush=True)\n\
             sys.stdin.read()\n",
            socket = socket.display().to_string()
        );
        let mut child = Command::new("setpriv")
            .arg(format!("--reuid={}", user.name))
            .arg(format!("--regid={}", user.gid))
            .arg("--init-groups")
            .args(["--", "python3", "-c", &script])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut out = child.stdout.take().unwrap();
        let mut b = [0u8; 1];
        while out.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
            line.push(b[0] as char);
        }
        let status = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the holder said {line:?}"));
        (Holder { child }, status)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Boundary 7 (bounded memory): a member who opens 300 idle connections holds at most
/// `--max-connections-per-peer` of them (the rest are answered 503
/// `too_many_connections`); another member and root are still served (the build
/// before let one member take all 256 and turned everyone else away).
#[test]
fn one_members_idle_connections_never_turn_another_member_or_root_away() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let hostile = TestUser::new(Some(&group));
    let other = TestUser::new(Some(&group));
    let s = start(&store, &sandboxes, &["--socket-group", &group.name], &[]);
    let (holder, last) = Holder::open(&hostile, &s.socket, 300);
    // The last of the 300 was beyond what the member may hold.
    assert_eq!(last, 503);
    assert_eq!(health_as(&other, &s.socket), Ok(200), "another member");
    let (st, v) = call(&s, "GET", "/v1/health", None);
    assert_eq!(st, 200, "root: {v}");
    // The member's next connection is turned away, saying why.
    let (st, v) = hostile.http(&s.socket, "GET", "/v1/health", None);
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (503, Some("too_many_connections")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-connections-per-peer"),
        "{v}"
    );
    // Once they close, the member is served again.
    drop(holder);
    assert!(crate::wait_for(Duration::from_secs(10), || {
        hostile.http(&s.socket, "GET", "/v1/health", None).0 == 200
    }));
}
