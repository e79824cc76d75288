//! `casfs serve` driven over its Unix socket (and loopback TCP with a token) by a
//! plain HTTP/1.1 client, the way an agent host in another language would: every route
//! of openapi.json is called at least once.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::common::casfs_bin;
use crate::{wait_for, MountGuard};

/// The server process, stopped (SIGTERM, then SIGKILL) when dropped; whatever it left
/// mounted in its store (a server killed before it destroyed its sandboxes leaves
/// their disks and overlays) is detached then.
pub(crate) struct Served {
    pub child: Child,
    pub socket: PathBuf,
    store: PathBuf,
    /// The last 64 KiB the server logged: its stderr is read away as it comes, so
    /// that a full pipe never stops it (a member's workload may make it warn a lot).
    #[allow(dead_code)]
    pub log: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Served {
    /// Stops the server with SIGTERM as a service manager does; whether it ended by
    /// itself within ten seconds, and what it left mounted in its store.
    pub fn stop(mut self) -> (bool, Vec<PathBuf>) {
        let ended = self.terminate();
        (ended, crate::mounts_under(&self.store_path()))
    }

    fn terminate(&mut self) -> bool {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return true;
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let ended = wait_for(Duration::from_secs(10), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        if !ended {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        ended
    }

    fn store_path(&self) -> PathBuf {
        std::fs::canonicalize(&self.store).unwrap_or_else(|_| self.store.clone())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.terminate();
        drop(crate::MountsUnder(self.store_path()));
    }
}

pub(crate) fn start(
    store: &Path,
    sandboxes: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Served {
    let socket = store.parent().unwrap().join("serve.sock");
    // A server killed earlier leaves its socket behind.
    let _ = std::fs::remove_file(&socket);
    let mut cmd = Command::new(casfs_bin());
    cmd.arg("--store")
        .arg(store)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--sandboxes")
        .arg(sandboxes)
        .args(extra)
        .env_remove("CASFS_STORE")
        .env_remove("CASFS_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (mut err, kept) = (child.stderr.take().unwrap(), log.clone());
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = err.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut k = kept.lock().unwrap_or_else(|p| p.into_inner());
            k.extend_from_slice(&buf[..n]);
            let over = k.len().saturating_sub(64 << 10);
            k.drain(..over);
        }
    });
    let s = Served {
        child,
        socket,
        store: store.to_path_buf(),
        log,
    };
    assert!(
        wait_for(Duration::from_secs(20), || s.socket.exists()
            || !extra.is_empty() && extra.contains(&"--listen")),
        "the server did not start"
    );
    s
}

/// One HTTP/1.1 request; returns the status and the JSON body.
pub(crate) fn http(
    stream: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&Value>,
    token: Option<&str>,
) -> (u16, Value) {
    let mut stream = stream;
    let body = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body).unwrap();
    let mut resp = Vec::new();
    stream.read_to_end(&mut resp).unwrap();
    let text = String::from_utf8_lossy(&resp).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    // Bodies are small: the server answers with Content-Length (or chunked).
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut r = rest;
        while let Some((len, tail)) = r.split_once("\r\n") {
            let n = usize::from_str_radix(len.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            r = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    let v = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&body).unwrap_or(Value::String(body))
    };
    (status, v)
}

pub(crate) fn call(s: &Served, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    http(
        UnixStream::connect(&s.socket).unwrap(),
        method,
        path,
        body,
        None,
    )
}

/// A call that must fail with `status` and error kind `kind`; returns the message.
pub(crate) fn refused(
    s: &Served,
    method: &str,
    path: &str,
    body: Option<&Value>,
    status: u16,
    kind: &str,
) -> String {
    let (st, v) = call(s, method, path, body);
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (status, Some(kind)),
        "{method} {path}: {v}"
    );
    v["error"]["message"].as_str().unwrap().to_string()
}

#[test]
fn the_http_api_drives_runs_over_the_unix_socket() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sandboxes = t.path().join("sb");
    let _g1 = MountGuard::new(&sandboxes.join("t").join("workspace"));
    let secret = "sk-test-9f8e7d6c5b4a";
    let s = start(
        &store,
        &sandboxes,
        &["--secret", "API_KEY", "--diffs"],
        &[("API_KEY", secret)],
    );

    let (st, v) = call(&s, "GET", "/v1/health", None);
    assert_eq!((st, v["ok"].clone()), (200, json!(true)));
    // Bad input is a 400 that names it; an unknown run is a 404.
    let bad = json!({"thread": "a b", "run_id": "x"});
    let m = refused(&s, "POST", "/v1/runs", Some(&bad), 400, "invalid");
    assert!(m.contains("\"a b\""), "{m}");
    refused(&s, "POST", "/v1/runs/nope/finish", None, 404, "not_found");

    // A run: start, work in the sandbox, persist a message and an artifact, finish.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "t", "run_id": "r1"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    assert!(v["lease_token"].as_u64().is_some());
    std::fs::write(
        root.join("app.py"),
        format!("KEY = '{secret}'\nprint('hi')\n"),
    )
    .unwrap();
    let (st, _) = call(
        &s,
        "PUT",
        "/v1/threads/t/messages",
        Some(&json!([{"role": "user", "content": "write app.py"}])),
    );
    assert_eq!(st, 200);
    let content = base64::engine::general_purpose::STANDARD.encode(b"the report");
    let (st, v) = call(
        &s,
        "POST",
        "/v1/threads/t/artifacts",
        Some(
            &json!({"artifact_id": "a1", "run_id": "r1", "name": "report.txt", "mime_type": "text/plain", "content_base64": content}),
        ),
    );
    assert_eq!((st, v["size"].as_u64()), (200, Some(10)), "{v}");
    // Events are delivered by the run's dispatcher thread, asynchronously: wait for the
    // create and the modify of app.py.
    let mut v = Value::Null;
    assert!(crate::wait_for(Duration::from_secs(10), || {
        let (st, got) = call(&s, "GET", "/v1/runs/r1/events", None);
        v = got;
        st == 200 && v.as_array().is_some_and(|a| a.len() >= 2)
    }));
    let ev = v.as_array().unwrap();
    assert_eq!(ev[0]["kind"], "create");
    assert_eq!(ev[0]["path"], "app.py");
    assert!(
        ev[1]["diff"].as_str().unwrap().contains("+print('hi')"),
        "{v}"
    );
    let (st, v) = call(&s, "GET", "/v1/runs/r1/events?after=1", None);
    assert_eq!((st, v.as_array().unwrap().len()), (200, 1));
    // A second run on the thread is refused while r1 holds it; the same run id too.
    let r2 = json!({"thread": "t", "run_id": "r2"});
    refused(&s, "POST", "/v1/runs", Some(&r2), 409, "lease_held");
    let again = json!({"thread": "t", "run_id": "r1"});
    refused(&s, "POST", "/v1/runs", Some(&again), 409, "run_exists");
    let (st, v) = call(&s, "POST", "/v1/runs/r1/finish", None);
    assert_eq!(st, 200, "{v}");
    let id = v["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(v["secret_files"], 1);

    let (st, v) = call(&s, "GET", "/v1/threads", None);
    assert_eq!((st, v[0]["head"].as_str()), (200, Some(id.as_str())), "{v}");
    let (st, v) = call(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v[0]["key"].as_str(), v[0]["kind"].as_str()),
        (Some("t"), Some("mount"))
    );
    assert_eq!(v[0]["base"].as_str(), Some(id.as_str()));
    // app.py stays dirty: the workspace keeps the real value its checkpoint does not.
    assert_eq!(v[0]["dirty_files"], 1, "{v}");
    let (st, v) = call(&s, "GET", "/v1/threads/t/checkpoints?limit=5", None);
    assert_eq!((st, v.as_array().unwrap().len()), (200, 1));
    let (st, v) = call(&s, "GET", &format!("/v1/checkpoints/{}", &id[..12]), None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["id"], json!(id));
    assert_eq!(v["source_run_id"], "r1");
    assert_eq!(v["artifacts"][0]["name"], "report.txt");
    assert_eq!(v["secret_files"][0]["path"], "app.py");
    let (st, v) = call(&s, "GET", "/v1/threads/t/messages", None);
    assert_eq!((st, v[0]["content"].as_str()), (200, Some("write app.py")));
    let (st, v) = call(&s, "GET", "/v1/threads/t/artifacts", None);
    assert_eq!((st, v[0]["artifact_id"].as_str()), (200, Some("a1")));

    // Paused, disconnected, aborted and failed runs publish nothing.
    for (run, how) in [
        ("p", "chunk"),
        ("d", "disconnect"),
        ("a", "abort"),
        ("e", "error"),
    ] {
        let (st, v) = call(
            &s,
            "POST",
            "/v1/runs",
            Some(&json!({"thread": "t", "run_id": run})),
        );
        assert_eq!(st, 200, "{run}: {v}");
        std::fs::write(root.join(format!("{run}.txt")), run).unwrap();
        let (st, v) = match how {
            "chunk" => call(
                &s,
                "POST",
                "/v1/runs/p/chunk",
                Some(&json!({"type": "run_finished", "interrupt": true})),
            ),
            "disconnect" => call(&s, "POST", "/v1/runs/d/disconnect", None),
            "abort" => call(
                &s,
                "POST",
                "/v1/runs/a/abort",
                Some(&json!({"cancelled": false})),
            ),
            _ => call(
                &s,
                "POST",
                "/v1/runs/e/error",
                Some(&json!({"message": "model failed"})),
            ),
        };
        assert_eq!(st, 200, "{run}: {v}");
        if matches!(how, "chunk" | "disconnect") {
            let (st, v) = call(&s, "POST", &format!("/v1/runs/{run}/finish"), None);
            assert_eq!(
                (st, v["checkpoint"].clone()),
                (200, Value::Null),
                "{run}: {v}"
            );
        }
        let (_, v) = call(&s, "GET", "/v1/threads", None);
        assert_eq!(v[0]["head"].as_str(), Some(id.as_str()), "{run} published");
    }
    // Maintenance runs in the server's process (it holds the store), beside the live
    // sandbox: fsck sees it and finds nothing wrong; prune + gc keep what it needs.
    let fsck = json!({"what": "fsck", "repair": false});
    let (st, v) = call(&s, "POST", "/v1/maintenance", Some(&fsck));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["errors"].clone(), v["mounts"].clone()),
        (json!([]), json!(1)),
        "{v}"
    );
    let prune = json!({"what": "prune", "keep_last": 1, "gc": true});
    let (st, v) = call(&s, "POST", "/v1/maintenance", Some(&prune));
    assert_eq!(st, 200, "{v}");
    assert!(v["gc"]["reachable"].as_u64().unwrap() > 0, "{v}");
    let (st, v) = call(&s, "GET", &format!("/v1/checkpoints/{id}"), None);
    assert_eq!(st, 200, "the head is kept: {v}");
    assert_eq!(std::fs::read(root.join("p.txt")).unwrap(), b"p");
    let no_rule = json!({"what": "prune"});
    refused(
        &s,
        "POST",
        "/v1/maintenance",
        Some(&no_rule),
        400,
        "invalid",
    );
    drop(s);
    assert!(
        !casfs::fs::is_fuse_mount(&root),
        "a stopped server leaves no sandbox mounted"
    );

    // Nothing the server stored holds the secret.
    let st = casfs::checkpoint::Store::open_read_only(&store).unwrap();
    let db = st.database();
    for cf in [casfs::cas::kv::OBJECTS_CF, "checkpoints"] {
        for item in db.column(cf).entries() {
            let (k, v) = item.unwrap();
            let data = if cf == "checkpoints" {
                v.to_vec()
            } else {
                casfs::cas::object::decode_stored(&casfs::cas::Hash::from_slice(&k).unwrap(), &v)
                    .unwrap()
            };
            assert!(!data.windows(secret.len()).any(|w| w == secret.as_bytes()));
        }
    }
}

#[test]
fn loopback_tcp_needs_the_token() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let token = "tok-0123456789abcdef0123";
    // Refused without a token, and on a non-loopback address.
    let out = Command::new(casfs_bin())
        .arg("--store")
        .arg(&store)
        .args(["serve", "--listen", &addr])
        .env_remove("CASFS_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("token"));
    let _s = start(
        &store,
        &t.path().join("sb"),
        &["--listen", &addr],
        &[("CASFS_TOKEN", token)],
    );
    let connect = || {
        let mut c = None;
        wait_for(Duration::from_secs(20), || {
            c = std::net::TcpStream::connect(&addr).ok();
            c.is_some()
        });
        c.expect("the server listens")
    };
    assert_eq!(http(connect(), "GET", "/v1/health", None, None).0, 401);
    assert_eq!(
        http(
            connect(),
            "GET",
            "/v1/health",
            None,
            Some("wrong-token-0000000000")
        )
        .0,
        401
    );
    let (st, v) = http(connect(), "GET", "/v1/health", None, Some(token));
    assert_eq!((st, v["ok"].clone()), (200, json!(true)));
}
