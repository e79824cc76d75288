//! `casfs serve` against hostile and careless clients, over its Unix socket and over
//! loopback TCP: connections closed at every stage of a request and of a reply, slow
//! and idle clients, malformed HTTP, forged writer leases, secrets in thread names, a
//! run's sandbox destroyed under it, the sandbox cap, and a bounded storm of arbitrary
//! bytes and disconnects. After each, the server answers the next request, and its
//! descriptors come back to where they started.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::serve::{http, start, Served};
use crate::serve_writers::proof;
use crate::wait_for;

const TOKEN: &str = "tok-hostile-0123456789abcdef";

/// How a test reaches the server.
#[derive(Clone)]
enum Via {
    Unix(PathBuf),
    Tcp(String),
}

/// A raw connection to the server.
enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Conn {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(b),
            Conn::Tcp(s) => s.read(b),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Unix(s) => s.write(b),
            Conn::Tcp(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Conn {
    fn set_timeout(&self, d: Duration) {
        match self {
            Conn::Unix(s) => s.set_read_timeout(Some(d)).unwrap(),
            Conn::Tcp(s) => s.set_read_timeout(Some(d)).unwrap(),
        }
    }

    fn shutdown_write(&self) {
        let _ = match self {
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        };
    }
}

impl Via {
    fn connect(&self) -> Conn {
        match self {
            Via::Unix(p) => Conn::Unix(UnixStream::connect(p).unwrap()),
            Via::Tcp(a) => Conn::Tcp(TcpStream::connect(a).unwrap()),
        }
    }

    /// The `Authorization` header line this transport needs (with its CRLF).
    fn auth(&self) -> String {
        match self {
            Via::Unix(_) => String::new(),
            Via::Tcp(_) => format!("Authorization: Bearer {TOKEN}\r\n"),
        }
    }

    fn token(&self) -> Option<&'static str> {
        matches!(self, Via::Tcp(_)).then_some(TOKEN)
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        http(self.connect(), method, path, body, self.token())
    }
}

/// A server for `via`'s transport, with `extra` flags.
fn serve_on(t: &Path, tcp: bool, extra: &[&str], env: &[(&str, &str)]) -> (Served, Via) {
    let store = t.join("store");
    let sb = t.join("sb");
    if !tcp {
        let s = start(&store, &sb, extra, env);
        let via = Via::Unix(s.socket.clone());
        return (s, via);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec!["--listen", addr.as_str()];
    args.extend_from_slice(extra);
    let mut env: Vec<(&str, &str)> = env.to_vec();
    env.push(("CASFS_TOKEN", TOKEN));
    let s = start(&store, &sb, &args, &env);
    assert!(
        wait_for(Duration::from_secs(20), || TcpStream::connect(&addr)
            .is_ok()),
        "the server listens on {addr}"
    );
    (s, Via::Tcp(addr))
}

/// The server still runs and answers.
fn answers(s: &mut Served, via: &Via, after: &str) {
    assert!(
        matches!(s.child.try_wait(), Ok(None)),
        "the server exited after {after}: {:?}",
        s.child.try_wait()
    );
    let (st, v) = via.call("GET", "/v1/health", None);
    assert_eq!((st, v["ok"].clone()), (200, json!(true)), "after {after}");
}

fn fds(s: &Served) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", s.child.id()))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Waits until the server's descriptors are back to `before`.
fn fds_back(s: &Served, before: usize, what: &str) {
    let ok = wait_for(Duration::from_secs(10), || fds(s) <= before);
    assert!(ok, "{what}: {} descriptors open, {before} before", fds(s));
}

/// Sends `bytes`, then (if `read`) reads the answer to its end: status and body.
fn raw(via: &Via, bytes: &[u8]) -> (u16, Value) {
    let mut c = via.connect();
    c.set_timeout(Duration::from_secs(20));
    let _ = c.write_all(bytes);
    let mut resp = Vec::new();
    let _ = c.read_to_end(&mut resp);
    parse_answer(&resp)
}

fn parse_answer(resp: &[u8]) -> (u16, Value) {
    let text = String::from_utf8_lossy(resp).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let v = serde_json::from_str(rest).unwrap_or_else(|_| Value::String(rest.to_string()));
    (status, v)
}

fn spec() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json"))
            .unwrap(),
    )
    .unwrap()
}

/// A client-made sandbox of `thread`: its key and path.
fn sandbox(via: &Via, thread: &str) -> (String, PathBuf) {
    let (st, v) = via.call("POST", "/v1/sandboxes", Some(&json!({"thread": thread})));
    assert_eq!(st, 200, "{v}");
    (
        v["key"].as_str().unwrap().to_string(),
        PathBuf::from(v["path"].as_str().unwrap()),
    )
}

fn disconnects_at_every_stage(tcp: bool) {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (mut s, via) = serve_on(t.path(), tcp, &[], &[]);
    answers(&mut s, &via, "start");
    // A live sandbox whose mount must stay readable whatever the clients do.
    let (key, root) = sandbox(&via, "live");
    std::fs::write(root.join("kept.txt"), "still here").unwrap();
    // A large answer to walk away from: 2 MB of messages.
    let big: Vec<Value> = (0..2000)
        .map(|i| json!({"role": "user", "content": format!("{i:04}{}", "x".repeat(1000))}))
        .collect();
    assert_eq!(
        via.call("PUT", "/v1/threads/big/messages", Some(&json!(big)))
            .0,
        200
    );
    let before = fds(&s);
    let auth = via.auth();
    let writer = format!(
        "POST /v1/threads/sp/writer HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n{{\"holder\":"
    );
    type Stage<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let stages: Vec<Stage> = vec![
        ("a connect closed at once", Box::new(|| drop(via.connect()))),
        (
            "a head cut short",
            Box::new(|| {
                let mut c = via.connect();
                c.write_all(b"POST /v1/threads/sp/writer HTTP/1.1\r\nHost: x\r\nContent-Le")
                    .unwrap();
            }),
        ),
        (
            "a body cut short after 0.5 s",
            Box::new(|| {
                let mut c = via.connect();
                c.write_all(writer.as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(500));
            }),
        ),
        (
            "20 replies never read",
            Box::new(|| {
                let conns: Vec<Conn> = (0..20)
                    .map(|_| {
                        let mut c = via.connect();
                        let r = format!("GET /v1/health HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
                        c.write_all(r.as_bytes()).unwrap();
                        c
                    })
                    .collect();
                std::thread::sleep(Duration::from_millis(200));
                drop(conns);
            }),
        ),
        (
            "a long poll left",
            Box::new(|| {
                let mut c = via.connect();
                let r = format!(
                    "GET /v1/sandboxes/{key}/events?after=1000000&wait_ms=5000 HTTP/1.1\r\n\
                     Host: x\r\n{auth}\r\n"
                );
                c.write_all(r.as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
            }),
        ),
        (
            "a large reply read in part",
            Box::new(|| {
                let mut c = via.connect();
                let r = format!("GET /v1/threads/big/messages HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
                c.write_all(r.as_bytes()).unwrap();
                let mut b = [0u8; 100];
                c.set_timeout(Duration::from_secs(10));
                let _ = c.read(&mut b);
            }),
        ),
        (
            "a large reply never read",
            Box::new(|| {
                let mut c = via.connect();
                let r = format!("GET /v1/threads/big/messages HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
                c.write_all(r.as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
            }),
        ),
        (
            "a request half-closed",
            Box::new(|| {
                let mut c = via.connect();
                let r = format!("GET /v1/threads HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
                c.write_all(r.as_bytes()).unwrap();
                c.shutdown_write();
            }),
        ),
    ];
    for _ in 0..3 {
        for (what, stage) in &stages {
            stage();
            answers(&mut s, &via, what);
        }
    }
    fds_back(&s, before, "after the disconnects");
    assert_eq!(
        std::fs::read_to_string(root.join("kept.txt")).unwrap(),
        "still here",
        "the sandbox's mount outlived every client"
    );
}

#[test]
fn a_client_closing_at_any_stage_never_ends_the_unix_server() {
    disconnects_at_every_stage(false);
}

#[test]
fn a_client_closing_at_any_stage_never_ends_the_tcp_server() {
    disconnects_at_every_stage(true);
}

#[test]
fn a_lease_is_used_only_by_the_writer_that_took_it() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (s, via) = serve_on(t.path(), false, &["--lease-ttl", "30"], &[]);
    let (st, alice) = via.call(
        "POST",
        "/v1/threads/t2/writer",
        Some(&json!({"holder": "alice", "ttl_ms": 60_000})),
    );
    assert_eq!(st, 200, "{alice}");
    let owner = alice["owner_token"].as_str().unwrap().to_string();
    assert_eq!(owner.len(), 64);
    let (key, root) = sandbox(&via, "t2");
    std::fs::write(root.join("f.txt"), "alice's").unwrap();

    // Carol knows the token (they count 1, 2, 3) but not the owner secret.
    let forged = json!({"token": alice["token"], "owner_token": "0".repeat(64)});
    for (path, body) in [
        ("/v1/threads/t2/writer/renew", forged.clone()),
        ("/v1/threads/t2/writer/release", forged.clone()),
        (
            "/v1/threads/t2/checkpoints",
            json!({"sandbox": key, "expected_head": null, "writer": forged}),
        ),
    ] {
        let (st, v) = via.call("POST", path, Some(&body));
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (409, Some("lease_lost")),
            "{path}: {v}"
        );
        assert!(v.to_string().contains("owner"), "{v}");
    }
    // Holder and TTL are fixed at acquire.
    for field in [("holder", json!("carol")), ("ttl_ms", json!(86_400_000u64))] {
        let mut b = proof(&alice);
        b[field.0] = field.1.clone();
        let (st, _) = via.call("POST", "/v1/threads/t2/writer/renew", Some(&b));
        assert_eq!(st, 400, "renew with {}", field.0);
    }
    // The lease is still alice's: nobody else takes the thread...
    let (st, v) = via.call(
        "POST",
        "/v1/threads/t2/writer",
        Some(&json!({"holder": "carol"})),
    );
    assert_eq!((st, v["error"]["kind"].as_str()), (409, Some("lease_held")));
    assert!(v["error"]["message"].as_str().unwrap().contains("alice"));
    // ...her renewal keeps her holder and TTL, and her append publishes.
    let (st, renewed) = via.call("POST", "/v1/threads/t2/writer/renew", Some(&proof(&alice)));
    assert_eq!(st, 200, "{renewed}");
    assert_eq!(
        (&renewed["holder"], &renewed["ttl_ms"], &renewed["token"]),
        (&json!("alice"), &json!(60_000), &alice["token"])
    );
    assert_eq!(renewed["owner_token"], alice["owner_token"]);
    let body = json!({"sandbox": key, "expected_head": null, "writer": proof(&alice)});
    let (st, v) = via.call("POST", "/v1/threads/t2/checkpoints", Some(&body));
    assert_eq!(st, 200, "{v}");
    // Released by alice, the next lease has a larger fencing token and a new secret.
    let (st, _) = via.call(
        "POST",
        "/v1/threads/t2/writer/release",
        Some(&proof(&alice)),
    );
    assert_eq!(st, 200);
    let (st, bob) = via.call(
        "POST",
        "/v1/threads/t2/writer",
        Some(&json!({"holder": "bob"})),
    );
    assert_eq!(st, 200);
    assert!(bob["token"].as_u64() > alice["token"].as_u64());
    assert_ne!(bob["owner_token"], alice["owner_token"]);
    // Alice's old secret does nothing to bob's lease.
    let old = json!({"token": bob["token"], "owner_token": owner});
    let (st, _) = via.call("POST", "/v1/threads/t2/writer/release", Some(&old));
    assert_eq!(st, 409);

    // A running run's lease never leaves the server: a guessed release is refused and
    // the run publishes.
    let (st, run) = via.call(
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "t3", "run_id": "r1"})),
    );
    assert_eq!(st, 200, "{run}");
    let rroot = PathBuf::from(run["sandbox"]["path"].as_str().unwrap());
    std::fs::write(rroot.join("run.txt"), "the run's").unwrap();
    let guess = json!({"token": run["lease_token"], "owner_token": "f".repeat(64)});
    let (st, _) = via.call("POST", "/v1/threads/t3/writer/release", Some(&guess));
    assert_eq!(st, 409);
    let (st, v) = via.call("POST", "/v1/runs/r1/finish", None);
    assert_eq!(st, 200, "{v}");
    assert!(v["checkpoint"].is_string(), "{v}");
    drop(s);
    // The store keeps the owner secret's hash, never the secret.
    let found = files_holding(&t.path().join("store"), owner.as_bytes());
    assert!(found.is_empty(), "the owner secret is in {found:?}");
}

/// Files under `dir` (recursively) whose bytes contain `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(files_holding(&e.path(), needle));
        } else if ft.is_file() {
            let data = std::fs::read(e.path()).unwrap_or_default();
            if data.windows(needle.len()).any(|w| w == needle) {
                out.push(e.path());
            }
        }
    }
    out
}

#[test]
fn a_secret_in_a_thread_name_is_refused_by_every_route() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let secret = "sk-live-0a9b8c7d6e5f";
    let (s, via) = serve_on(
        t.path(),
        false,
        &["--secret", "API_KEY"],
        &[("API_KEY", secret)],
    );
    let thread = format!("t-{secret}");
    let (st, lease) = via.call("POST", "/v1/threads/ok/writer", Some(&json!({})));
    assert_eq!(st, 200);
    let w = proof(&lease);
    let enc = |p: &str| p.replace("{t}", &thread);
    let routes: Vec<(&str, String, Option<Value>)> = vec![
        ("POST", enc("/v1/threads/{t}/writer"), Some(json!({}))),
        ("POST", enc("/v1/threads/{t}/writer/renew"), Some(w.clone())),
        (
            "POST",
            enc("/v1/threads/{t}/writer/release"),
            Some(w.clone()),
        ),
        (
            "POST",
            enc("/v1/threads/{t}/checkpoints"),
            Some(json!({"sandbox": "x", "expected_head": null, "writer": w})),
        ),
        ("GET", enc("/v1/threads/{t}/checkpoints"), None),
        ("GET", enc("/v1/threads/{t}/head"), None),
        ("GET", enc("/v1/threads/{t}/messages"), None),
        (
            "PUT",
            enc("/v1/threads/{t}/messages"),
            Some(json!([{"role": "user", "content": "hi"}])),
        ),
        ("GET", enc("/v1/threads/{t}/artifacts"), None),
        (
            "POST",
            enc("/v1/threads/{t}/artifacts"),
            Some(
                json!({"artifact_id": "a", "run_id": "r", "name": "n", "mime_type": "text/plain", "content_base64": ""}),
            ),
        ),
        ("GET", enc("/v1/checkpoints/@{t}"), None),
        (
            "POST",
            "/v1/sandboxes".into(),
            Some(json!({"thread": thread})),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(json!({"thread": thread, "run_id": "r"})),
        ),
    ];
    for (method, path, body) in &routes {
        let (st, v) = via.call(method, path, body.as_ref());
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (400, Some("invalid")),
            "{method} {path}: {v}"
        );
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("API_KEY") && !m.contains(secret), "{m}");
    }
    drop(s);
    let found = files_holding(&t.path().join("store"), secret.as_bytes());
    assert!(found.is_empty(), "the secret is in {found:?}");
}

#[test]
fn a_run_s_sandbox_is_not_destroyed_under_it() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (s, via) = serve_on(t.path(), false, &[], &[]);
    let (st, run) = via.call(
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "held", "run_id": "r-held"})),
    );
    assert_eq!(st, 200, "{run}");
    let key = run["sandbox"]["key"].as_str().unwrap().to_string();
    let root = PathBuf::from(run["sandbox"]["path"].as_str().unwrap());
    let (st, v) = via.call("DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (409, Some("sandbox_busy")),
        "{v}"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("r-held"),
        "{v}"
    );
    std::fs::write(root.join("work.txt"), "the run's work").unwrap();
    let (st, v) = via.call("POST", "/v1/runs/r-held/finish", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["changed_files"], 1, "{v}");
    // Ended, the sandbox is idle: now it goes, and leaves no directory behind.
    let (st, v) = via.call("DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!((st, v["destroyed"].clone()), (200, json!(true)), "{v}");
    assert!(!root.exists(), "{} is left behind", root.display());
    drop(s);
}

#[test]
fn at_the_cap_the_least_recently_used_idle_sandbox_makes_room() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (s, via) = serve_on(t.path(), false, &["--max-sandboxes", "2"], &[]);
    let (ka, pa) = sandbox(&via, "a");
    std::thread::sleep(Duration::from_millis(20));
    let (kb, _) = sandbox(&via, "b");
    // A third sandbox: `a`, the least recently used, makes room.
    let (kc, _) = sandbox(&via, "c");
    let (_, list) = via.call("GET", "/v1/sandboxes", None);
    let keys: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec![kb.as_str(), kc.as_str()], "{list}");
    assert!(!pa.exists() || std::fs::read_dir(&pa).unwrap().next().is_none());
    let (st, _) = via.call("GET", &format!("/v1/sandboxes/{ka}/events"), None);
    assert!(
        wait_for(Duration::from_secs(3), || via
            .call("GET", &format!("/v1/sandboxes/{ka}/events"), None)
            .0
            == 404),
        "the evicted sandbox's events answer 404 (first: {st})"
    );
    // A run finds room too, and a run's sandbox is never the one evicted.
    let (st, v) = via.call(
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "d", "run_id": "rd"})),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = via.call(
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "e", "run_id": "re"})),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = via.call("POST", "/v1/sandboxes", Some(&json!({"thread": "f"})));
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (429, Some("too_many_sandboxes")),
        "both live sandboxes are runs': {v}"
    );
    for r in ["rd", "re"] {
        assert_eq!(
            via.call("POST", &format!("/v1/runs/{r}/finish"), None).0,
            200
        );
    }
    drop(s);
}

#[test]
fn malformed_http_is_answered_with_the_documented_json_error() {
    let doc = spec();
    for tcp in [false, true] {
        let t = tempfile::tempdir().unwrap();
        let (mut s, via) = serve_on(t.path(), tcp, &[], &[]);
        let auth = via.auth();
        let long_header = format!("X-Big: {}\r\n", "y".repeat(70 << 10));
        let many: String = (0..150).map(|i| format!("X-{i}: v\r\n")).collect();
        let cases: Vec<(Vec<u8>, u16, &str)> = vec![
            (b"NOT HTTP AT ALL\r\n\r\n".to_vec(), 400, "invalid"),
            (b"GET\r\n\r\n".to_vec(), 400, "invalid"),
            (
                format!("GET /v1/health HTTP/1.1\r\n{long_header}\r\n").into_bytes(),
                431,
                "headers_too_large",
            ),
            (
                format!("GET /v1/health HTTP/1.1\r\n{many}\r\n").into_bytes(),
                431,
                "headers_too_large",
            ),
            (
                format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(9000)).into_bytes(),
                414,
                "uri_too_long",
            ),
            (
                format!(
                    "POST /v1/threads/t/writer HTTP/1.1\r\n{auth}Content-Length: 2\r\n\
                     Content-Length: 3\r\n\r\n{{}}"
                )
                .into_bytes(),
                400,
                "invalid",
            ),
            (
                format!(
                    "POST /v1/threads/t/writer HTTP/1.1\r\n{auth}Content-Length: -2\r\n\r\n{{}}"
                )
                .into_bytes(),
                400,
                "invalid",
            ),
            (
                b"GET /v1/health\xff HTTP/1.1\r\n\r\n".to_vec(),
                400,
                "invalid",
            ),
        ];
        for (bytes, status, kind) in &cases {
            let (st, v) = raw(&via, bytes);
            let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(60)]).into_owned();
            assert_eq!(
                (st, v["error"]["kind"].as_str()),
                (*status, Some(*kind)),
                "{shown:?}: {v}"
            );
            crate::trust::conforms(
                &doc,
                "GET",
                "/no/such/route",
                404,
                &json!({"error": v["error"]}),
            );
            answers(&mut s, &via, &shown);
        }
        // A good request before a bad one on the same connection: the good one is
        // answered, then the bad one refused.
        let two =
            format!("GET /v1/health HTTP/1.1\r\nHost: x\r\n{auth}\r\nGARBAGE GARBAGE\r\n\r\n");
        let mut c = via.connect();
        c.set_timeout(Duration::from_secs(10));
        c.write_all(two.as_bytes()).unwrap();
        let mut resp = Vec::new();
        let _ = c.read_to_end(&mut resp);
        let text = String::from_utf8_lossy(&resp);
        assert!(
            text.starts_with("HTTP/1.1 200") && text.contains("HTTP/1.1 400"),
            "{text}"
        );
        // Content-Length beside Transfer-Encoding: chunked, in either order. hyper frames
        // the body by its chunks alone (a bad chunk size fails the handler's read) and
        // closes the connection after the one answer, an error: what a front end framing
        // by the length took for the body, a request behind it, is never served.
        let behind = format!("GET /v1/health HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
        let te = "Transfer-Encoding: chunked";
        for (framing, chunks) in [
            (format!("{te}\r\nContent-Length: 2"), "{}"),
            (format!("Content-Length: 2\r\n{te}"), "{}"),
            (
                format!("{te}\r\nContent-Length: {}", 5 + behind.len()),
                "0\r\n\r\n",
            ),
        ] {
            let smuggled = format!(
                "POST /v1/threads/t/writer HTTP/1.1\r\nHost: x\r\n{auth}\
                 Content-Type: application/json\r\n{framing}\r\n\r\n{chunks}{behind}"
            );
            let mut c = via.connect();
            c.set_timeout(Duration::from_secs(10));
            c.write_all(smuggled.as_bytes()).unwrap();
            let mut resp = Vec::new();
            let _ = c.read_to_end(&mut resp);
            let text = String::from_utf8_lossy(&resp);
            let (st, v) = parse_answer(&resp);
            assert_eq!(
                (st, v["error"]["kind"].as_str()),
                (400, Some("invalid")),
                "{framing:?}: {text}"
            );
            assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{framing:?}: {text}");
            answers(&mut s, &via, &framing);
        }
        // A chunked body is framed and served.
        let chunked = format!(
            "POST /v1/threads/ch/writer HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
        );
        let (st, v) = raw(&via, chunked.as_bytes());
        assert_eq!(st, 200, "{v}");
        assert!(v["owner_token"].is_string(), "{v}");
        drop(s);
    }
}

#[test]
fn events_beyond_the_last_number_are_none_and_nothing_is_lost() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (s, via) = serve_on(t.path(), false, &[], &[]);
    let (key, root) = sandbox(&via, "ev");
    std::fs::write(root.join("a"), "x").unwrap();
    let (st, run) = via.call(
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "ev2", "run_id": "re"})),
    );
    assert_eq!(st, 200, "{run}");
    for path in [
        format!("/v1/sandboxes/{key}/events?after=18446744073709551615"),
        "/v1/runs/re/events?after=18446744073709551615".to_string(),
        format!("/v1/sandboxes/{key}/events?after=18446744073709551614"),
    ] {
        let (st, v) = via.call("GET", &path, None);
        assert_eq!((st, v.clone()), (200, json!([])), "{path}");
    }
    let (st, v) = via.call(
        "GET",
        &format!("/v1/sandboxes/{key}/events?after=18446744073709551616"),
        None,
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(via.call("POST", "/v1/runs/re/finish", None).0, 200);
    drop(s);
}

#[test]
fn sandbox_destroys_race_cleanly_and_wake_long_polls() {
    let t = tempfile::tempdir().unwrap();
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (s, via) = serve_on(t.path(), false, &[], &[]);
    for round in 0..2 {
        let (key, root) = sandbox(&via, &format!("race{round}"));
        // A long poll waiting on it is answered when it goes, not after its 20 s.
        let v2 = via.clone();
        let k2 = key.clone();
        let poll = std::thread::spawn(move || {
            let start = Instant::now();
            let r = v2.call(
                "GET",
                &format!("/v1/sandboxes/{k2}/events?after=1000&wait_ms=20000"),
                None,
            );
            (r, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        let results: Vec<(u16, Value)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..20)
                .map(|_| sc.spawn(|| via.call("DELETE", &format!("/v1/sandboxes/{key}"), None)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let destroyed = results
            .iter()
            .filter(|(st, v)| *st == 200 && v["destroyed"] == json!(true))
            .count();
        assert!(results.iter().all(|(st, _)| *st == 200), "{results:?}");
        assert_eq!(destroyed, 1, "{results:?}");
        assert!(!root.exists(), "{} is left behind", root.display());
        let ((st, v), took) = poll.join().unwrap();
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (404, Some("not_found")),
            "{v}"
        );
        assert!(took < Duration::from_secs(5), "the long poll took {took:?}");
    }
    drop(s);
}

#[test]
fn slow_and_idle_clients_are_cut_off_and_connections_capped() {
    let t = tempfile::tempdir().unwrap();
    let (mut s, via) = serve_on(
        t.path(),
        false,
        &[
            "--client-timeout",
            "1",
            "--idle-connection-timeout",
            "2",
            "--max-connections",
            "6",
        ],
        &[],
    );
    answers(&mut s, &via, "start");
    let (k, _) = sandbox(&via, "warm");
    assert_eq!(
        via.call("DELETE", &format!("/v1/sandboxes/{k}"), None).0,
        200
    );
    let before = fds(&s);
    // A head that never ends: 408 after the client timeout.
    let mut slow = via.connect();
    slow.set_timeout(Duration::from_secs(10));
    slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let start = Instant::now();
    let mut resp = Vec::new();
    let _ = slow.read_to_end(&mut resp);
    let (st, v) = parse_answer(&resp);
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (408, Some("request_timeout")),
        "{v}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    // A body that stalls: the connection is closed.
    let mut stall = via.connect();
    stall.set_timeout(Duration::from_secs(10));
    stall
        .write_all(
            b"PUT /v1/threads/s/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n[",
        )
        .unwrap();
    let start = Instant::now();
    let mut resp = Vec::new();
    let _ = stall.read_to_end(&mut resp);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(
        resp.is_empty() || parse_answer(&resp).0 == 400,
        "{}",
        String::from_utf8_lossy(&resp)
    );
    // An idle connection: closed after the idle timeout.
    let mut idle = via.connect();
    idle.set_timeout(Duration::from_secs(10));
    let start = Instant::now();
    let mut b = [0u8; 1];
    assert_eq!(idle.read(&mut b).unwrap_or(0), 0);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(6),
        "{took:?}"
    );
    // An idle connection after a reply, too.
    let mut kept = via.connect();
    kept.set_timeout(Duration::from_secs(10));
    kept.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    while let Ok(n) = kept.read(&mut buf) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "{:?}",
        start.elapsed()
    );
    // A long poll is not cut off by the client timeout: the request is the server's.
    let _g = crate::MountsUnder(t.path().join("sb"));
    let (key, _root) = sandbox(&via, "poll");
    let start = Instant::now();
    let (st, v) = via.call(
        "GET",
        &format!("/v1/sandboxes/{key}/events?after=1000&wait_ms=3000"),
        None,
    );
    assert_eq!((st, v), (200, json!([])));
    assert!(start.elapsed() >= Duration::from_millis(2900));
    assert_eq!(
        via.call("DELETE", &format!("/v1/sandboxes/{key}"), None).0,
        200
    );

    // The cap: six open (each answered once, so the server surely holds it, and kept
    // alive), the seventh is turned away with 503, then served once one closes. The
    // connections of the calls above may not all be seen closed yet: one of the six
    // turned away meanwhile is tried again.
    let deadline = Instant::now() + Duration::from_secs(10);
    let open: Vec<Conn> = (0..6)
        .map(|_| loop {
            let mut c = via.connect();
            c.set_timeout(Duration::from_secs(10));
            let mut b = [0u8; 512];
            let n = c
                .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                .and_then(|()| c.read(&mut b))
                .unwrap_or(0);
            if b[..n].starts_with(b"HTTP/1.1 200") {
                break c;
            }
            assert!(
                Instant::now() < deadline,
                "not answered: {}",
                String::from_utf8_lossy(&b[..n])
            );
            std::thread::sleep(Duration::from_millis(50));
        })
        .collect();
    let (st, v) = raw(&via, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (503, Some("too_many_connections")),
        "{v}"
    );
    drop(open);
    // Until the server has seen the six close, a new connection may still be turned
    // away, its request cut off (a reset): that is a no, not a failure.
    let healthy = || {
        let mut c = via.connect();
        c.set_timeout(Duration::from_secs(5));
        let mut resp = Vec::new();
        c.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .is_ok()
            && c.read_to_end(&mut resp).is_ok()
            && resp.starts_with(b"HTTP/1.1 200")
    };
    assert!(wait_for(Duration::from_secs(5), healthy));
    fds_back(&s, before, "after slow clients");
    answers(&mut s, &via, "slow clients");
}

#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let t = tempfile::tempdir().unwrap();
    let (s, via) = serve_on(t.path(), true, &[], &[]);
    for (header, status) in [
        (format!("bearer {TOKEN}"), 200),
        (format!("BEARER  {TOKEN}"), 200),
        (format!("Bearer {TOKEN}"), 200),
        (format!("Basic {TOKEN}"), 401),
        ("Bearer".to_string(), 401),
    ] {
        let req = format!(
            "GET /v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: {header}\r\nConnection: close\r\n\r\n"
        );
        let (st, v) = raw(&via, req.as_bytes());
        assert_eq!(st, status, "{header}: {v}");
    }
    drop(s);
}

/// xorshift64*: the storm's bytes, reproducible from the seed it prints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One request of the storm: a real request of some route, mutated or not, or noise.
fn storm_request(r: &mut Rng, auth: &str) -> Vec<u8> {
    let threads = [
        "s1",
        "s2",
        "%2e%2e",
        "a%00b",
        "\u{e9}t\u{e9}",
        "x/y",
        "@s1",
        "s1~1",
    ];
    let th = threads[r.below(threads.len())];
    let (method, path, body): (&str, String, String) = match r.below(10) {
        0 => ("GET", "/v1/health".into(), String::new()),
        1 => ("GET", "/v1/threads".into(), String::new()),
        2 => ("POST", format!("/v1/threads/{th}/writer"), "{}".into()),
        3 => ("GET", format!("/v1/threads/{th}/head"), String::new()),
        4 => (
            "PUT",
            format!("/v1/threads/{th}/messages"),
            r#"[{"role":"user","content":"hi"}]"#.into(),
        ),
        5 => (
            "GET",
            format!("/v1/threads/{th}/checkpoints?limit=5"),
            String::new(),
        ),
        6 => (
            "POST",
            "/v1/sandboxes".into(),
            format!(r#"{{"thread":"{th}"}}"#),
        ),
        7 => ("GET", "/v1/sandboxes".into(), String::new()),
        8 => (
            "GET",
            format!(
                "/v1/sandboxes/{th}/events?after={}&wait_ms={}",
                r.next(),
                r.below(300)
            ),
            String::new(),
        ),
        _ => ("POST", "/v1/runs/nope/finish".into(), String::new()),
    };
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes();
    match r.below(6) {
        0 => {
            // Noise.
            let n = r.below(300);
            req = (0..n).map(|_| r.next() as u8).collect();
        }
        1 | 2 => {
            // A few bytes flipped.
            for _ in 0..1 + r.below(4) {
                let i = r.below(req.len());
                req[i] = r.next() as u8;
            }
        }
        3 => {
            // Bytes inserted.
            let i = r.below(req.len());
            let ins: Vec<u8> = (0..r.below(20)).map(|_| r.next() as u8).collect();
            req.splice(i..i, ins);
        }
        _ => {}
    }
    req
}

#[test]
fn a_storm_of_arbitrary_bytes_and_disconnects_never_ends_the_server() {
    let secs: u64 = std::env::var("CASFS_STORM_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed = std::env::var("CASFS_STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("storm seed {seed} (CASFS_STORM_SEED), {secs} s per transport");
    for tcp in [false, true] {
        let t = tempfile::tempdir().unwrap();
        let _g = crate::MountsUnder(t.path().join("sb"));
        let (mut s, via) = serve_on(
            t.path(),
            tcp,
            &[
                "--max-sandboxes",
                "3",
                "--client-timeout",
                "1",
                "--idle-connection-timeout",
                "1",
            ],
            &[],
        );
        // Warm up what the server opens once (its store's files, one sandbox's kind).
        let (k, _) = sandbox(&via, "warm");
        assert_eq!(
            via.call("DELETE", &format!("/v1/sandboxes/{k}"), None).0,
            200
        );
        let before = fds(&s);
        let mut r = Rng(seed ^ tcp as u64);
        let auth = via.auth();
        let end = Instant::now() + Duration::from_secs(secs);
        let mut n = 0;
        while Instant::now() < end {
            n += 1;
            let req = storm_request(&mut r, &auth);
            let mut c = via.connect();
            c.set_timeout(Duration::from_secs(5));
            // Cut the request at a random byte, or send it whole.
            let cut = if r.below(3) == 0 {
                r.below(req.len() + 1)
            } else {
                req.len()
            };
            let _ = c.write_all(&req[..cut]);
            match r.below(3) {
                0 => {} // walk away at once
                1 => {
                    // Read a little of the answer, then go.
                    let mut b = vec![0u8; r.below(64) + 1];
                    let _ = c.read(&mut b);
                }
                _ => {
                    if cut < req.len() {
                        c.shutdown_write();
                    }
                    let mut resp = Vec::new();
                    let _ = c.read_to_end(&mut resp);
                    let (st, v) = parse_answer(&resp);
                    assert!(
                        st < 500,
                        "seed {seed}, request {n}: {st} {v} for {:?}",
                        String::from_utf8_lossy(&req[..cut])
                    );
                }
            }
            if n % 50 == 0 {
                answers(&mut s, &via, &format!("storm request {n} (seed {seed})"));
            }
        }
        answers(
            &mut s,
            &via,
            &format!("the storm (seed {seed}, {n} requests)"),
        );
        // The sandboxes the storm made go; then every descriptor is given back.
        let (_, list) = via.call("GET", "/v1/sandboxes", None);
        for sb in list.as_array().unwrap() {
            let key = sb["key"].as_str().unwrap();
            let path = format!("/v1/sandboxes/{}", key.replace('%', "%25"));
            assert_eq!(via.call("DELETE", &path, None).0, 200, "{key}");
        }
        fds_back(&s, before, &format!("the storm (seed {seed})"));
        eprintln!(
            "storm over {}: {n} requests",
            if tcp { "tcp" } else { "unix" }
        );
    }
}
