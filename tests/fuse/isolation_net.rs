//! Sandboxes' networks: a root sandbox runs as the stand-in user and reaches the host's
//! network only when asked; the allow-list is the only way out; a port inside is
//! reached through its channel with its token only. Run through `casfs serve` by real
//! members of the socket's group, on the pass's backend.

use std::net::TcpListener;
use std::time::Duration;

use serde_json::json;

use crate::isolation::{bwrap_missing, exec, members, py, sandbox};
use crate::serve::{call, start};
use crate::users::{place, TestUser};
use crate::MountsUnder;

/// A sandbox the server's own user (root) made runs as the stand-in user, never root,
/// and the host's network is there only when asked for.
#[test]
fn a_root_sandbox_runs_as_the_stand_in_and_host_network_is_opt_in() {
    if crate::needs_root("it runs a root server") || bwrap_missing() {
        return;
    }
    let (_t, store, sandboxes) = place();
    let _g = MountsUnder(sandboxes.clone());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let s = start(
        &store,
        &sandboxes,
        &[
            "--mode",
            crate::mount_mode().as_str(),
            "--sandbox-network",
            "host",
        ],
        &[],
    );
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "root"})),
    );
    assert_eq!(st, 200, "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = std::path::PathBuf::from(v["path"].as_str().unwrap());
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/exec"),
        Some(
            &json!({"command": format!("id -u; python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 3); print(\"connected\")'")}),
        ),
    );
    assert_eq!(st, 200, "{v}");
    let out = v["stdout"].as_str().unwrap();
    assert!(out.starts_with("65534\n"), "{v}");
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/exec"),
        Some(&json!({"command": "id -G"})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["stdout"], "65534\n",
        "the stand-in holds a group of the host's"
    );
    assert!(
        out.contains("connected"),
        "the host's network was asked for: {v}"
    );
    // The sandbox is the stand-in's: its processes write its workspace, and what they
    // make is the stand-in's on the host.
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/exec"),
        Some(&json!({"command": "mkdir -p d && echo made > d/f && cat d/f && stat -c %u ."})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["stdout"], "made\n65534\n", "{v}");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(root.join("d/f")).unwrap().uid(), 65534);
    // On the host's network its ports are the host's: no channel (which would let its
    // owner reach the host's loopback services through the server).
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/ports"),
        Some(&json!({ "port": port })),
    );
    assert_eq!(st, 400, "{v}");
}

/// A host service for the network tests: answers every request with `body`, counting
/// the connections it took.
fn http_service(body: &'static str) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = seen.clone();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut head = Vec::new();
            let mut b = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match c.read(&mut b) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&b[..n]),
                }
            }
            let _ = write!(
                c,
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, seen)
}

/// Item 4 (network policy): a sandbox without the host's network reaches exactly the
/// destinations of the server's allow-list, through the proxy casfs runs in its
/// namespace (plain HTTP and CONNECT), and nothing else: not another port of the host,
/// not a name on the list that leads to the host's loopback, not any address directly.
/// A server without a list gives its sandboxes no proxy at all.
#[test]
fn the_allow_list_is_the_only_way_out() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let (allowed, allowed_seen) = http_service("allowed\n");
    let (denied, denied_seen) = http_service("denied\n");
    let m = members(&[
        "--sandbox-allow",
        &format!("127.0.0.1:{allowed}"),
        "--sandbox-allow",
        &format!("localhost:{denied}"),
    ]);
    let (key, root) = sandbox(&m.a, &m.s, "net");
    let script = r#"
import http.client, os, socket, sys
A, D = int(sys.argv[1]), int(sys.argv[2])
print("proxy", os.environ.get("HTTPS_PROXY"))
def get(host, port):
    c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
    c.request("GET", "http://%s:%d/" % (host, port))
    r = c.getresponse()
    return "%d %s" % (r.status, r.read().decode().strip())
def tunnel(host, port):
    c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
    c.set_tunnel(host, port)
    try:
        c.request("GET", "/")
        r = c.getresponse()
        return "%d %s" % (r.status, r.read().decode().strip())
    except OSError as e:
        return "refused"
def direct(host, port):
    try:
        socket.create_connection((host, port), 3)
        return "connected"
    except OSError as e:
        return "failed"
print("get-allowed", get("127.0.0.1", A))
print("tunnel-allowed", tunnel("127.0.0.1", A))
print("get-denied", get("127.0.0.1", D).split()[0])
print("tunnel-denied", tunnel("127.0.0.1", D))
print("name-inward", get("localhost", D).split()[0])
print("direct", direct("127.0.0.1", A))
print("outside", direct("192.0.2.1", 80))
"#;
    std::fs::write(root.join("net.py"), script).unwrap();
    let (code, out, err) = exec(
        &m.a,
        &m.s,
        &key,
        &format!("python3 /workspace/net.py {allowed} {denied}"),
    );
    assert_eq!(code, 0, "{out} {err}");
    assert_eq!(
        out,
        "proxy http://127.0.0.1:3128\n\
         get-allowed 200 allowed\n\
         tunnel-allowed 200 allowed\n\
         get-denied 403\n\
         tunnel-denied refused\n\
         name-inward 502\n\
         direct failed\n\
         outside failed\n",
        "{err}"
    );
    assert_eq!(
        allowed_seen.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the allowed service saw the two requests the proxy let through"
    );
    assert_eq!(
        denied_seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing reached the service not on the list"
    );
    // A sandbox may narrow the server's list, never widen it.
    let (st, v) = m.a.http(
        &m.s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({ "thread": "wider", "network": { "allow": ["example.com"] } })),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not within the server's allow-list"),
        "{v}"
    );
    let (st, v) = m.a.http(
        &m.s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({ "thread": "narrow", "network": { "allow": [] } })),
    );
    assert_eq!(st, 200, "{v}");
    let narrow = v["key"].as_str().unwrap().to_string();
    let (code, out, _) = exec(
        &m.a,
        &m.s,
        &narrow,
        &format!(
            "echo \"proxy=${{HTTPS_PROXY:-none}}\"; {}",
            py("import socket; socket.create_connection((\"127.0.0.1\", 3128), 3)")
        ),
    );
    assert_ne!(code, 0, "{out}");
    assert!(out.starts_with("proxy=none\n"), "{out}");
    assert_eq!(
        allowed_seen.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "a sandbox that asked for no network reached nothing"
    );
    drop(m);

    // Without a list: no proxy, no way out.
    let m = members(&[]);
    let (key, _) = sandbox(&m.a, &m.s, "closed");
    let (code, out, _) = exec(
        &m.a,
        &m.s,
        &key,
        &format!(
            "echo \"proxy=${{HTTPS_PROXY:-none}}\"; {}",
            py("import socket; socket.create_connection((\"127.0.0.1\", 3128), 3)")
        ),
    );
    assert_ne!(code, 0, "{out}");
    assert!(out.starts_with("proxy=none\n"), "{out}");
}

/// Ports: a server a sandbox's process runs on its own loopback is reached from the host
/// through the channel the server opens, with the channel's token only; another member
/// gets no channel to it; a port nothing listens on answers 502; the channel ends with
/// the sandbox.
#[test]
fn a_port_inside_is_reached_through_its_channel_with_its_token_only() {
    if crate::needs_root("it makes users with useradd") || bwrap_missing() {
        return;
    }
    let m = members(&[]);
    let (s, a) = (&m.s, &m.a);
    let b = TestUser::new(Some(&m.group));
    let (key, _) = sandbox(a, s, "web");
    let (code, _, err) = exec(a, s, &key, "echo served-inside > /workspace/page.txt");
    assert_eq!(code, 0, "{err}");
    let (st, v) = a.http(
        &s.socket,
        "POST",
        &format!("/v1/sandboxes/{key}/processes"),
        Some(&json!({
            "command": "exec python3 -m http.server 8000 --bind 127.0.0.1 --protocol HTTP/1.1 --directory /workspace"
        })),
    );
    assert_eq!(st, 200, "{v}");
    let (code, out, err) = exec(
        a,
        s,
        &key,
        &py("import socket, time\nfor _ in range(200):\n  try:\n    socket.create_connection((\"127.0.0.1\", 8000)).close(); print(\"up\"); break\n  except OSError: time.sleep(0.05)"),
    );
    assert_eq!((code, out.as_str()), (0, "up\n"), "{err}");
    let channel = |who: &TestUser, port: u16| {
        who.http(
            &s.socket,
            "POST",
            &format!("/v1/sandboxes/{key}/ports"),
            Some(&json!({ "port": port })),
        )
    };
    let (st, v) = channel(a, 8000);
    assert_eq!(st, 200, "{v}");
    let url = v["url"].as_str().unwrap().to_string();
    let addr = url.strip_prefix("http://").unwrap().to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{url}");
    let (header, token) = (
        v["header"].as_str().unwrap().to_string(),
        v["token"].as_str().unwrap().to_string(),
    );
    assert_eq!(token.len(), 64);
    let get = |extra: &str| -> String {
        raw(
            &addr,
            &format!("GET /page.txt HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n"),
        )
    };
    let page = get(&format!("{header}: {token}\r\n"));
    assert!(
        page.starts_with("HTTP/1.1 200") && page.ends_with("served-inside\n"),
        "{page}"
    );
    // One request per connection: a second one behind it (without the token) on a
    // connection kept alive is never answered; the server inside closes after the
    // first.
    let got = raw(
        &addr,
        &format!(
            "GET /page.txt HTTP/1.1\r\nHost: x\r\n{header}: {token}\r\nConnection: keep-alive\r\n\r\n\
             GET /page.txt HTTP/1.1\r\nHost: x\r\n\r\n"
        ),
    );
    assert_eq!(
        got.matches("HTTP/1.1 200").count(),
        1,
        "a request without the token was answered: {got}"
    );
    // Nor behind an upgrade the server inside does not take (it answers 200, not 101).
    let got = raw(
        &addr,
        &format!(
            "GET /page.txt HTTP/1.1\r\nHost: x\r\n{header}: {token}\r\nConnection: keep-alive, Upgrade\r\nUpgrade: h2c\r\n\r\n\
             GET /page.txt HTTP/1.1\r\nHost: x\r\n\r\n"
        ),
    );
    assert_eq!(
        got.matches("HTTP/1.1 200").count(),
        1,
        "a request behind a refused upgrade was answered: {got}"
    );
    // Without the token, with another, or with it twice: refused before the sandbox.
    for extra in [
        String::new(),
        format!("{header}: {}\r\n", "0".repeat(64)),
        format!("{header}: {token}\r\n{header}: {token}\r\n"),
    ] {
        let got = get(&extra);
        assert!(got.starts_with("HTTP/1.1 403"), "{extra:?}: {got}");
    }
    // Any user of the host may connect to the channel: one who opens more connections
    // than the sandbox may have (and than may wait for their head) and sends nothing
    // keeps no one out; the token's holder is answered while they are all still open
    // (each has 5 s to send its head; the oldest are evicted by newer ones).
    let opened = std::time::Instant::now();
    let idle: Vec<std::net::TcpStream> = (0..300)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let page = get(&format!("{header}: {token}\r\n"));
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "too slow to tell: the idle connections may have timed out"
    );
    assert!(
        page.starts_with("HTTP/1.1 200") && page.ends_with("served-inside\n"),
        "{page}"
    );
    drop(idle);
    // The same port again: the same channel.
    let (st, v) = channel(a, 8000);
    assert_eq!((st, v["url"].as_str()), (200, Some(url.as_str())), "{v}");
    // Another member: no such sandbox.
    let (st, v) = channel(&b, 8000);
    assert_eq!(st, 404, "{v}");
    // Nothing listens on 8001 inside.
    let (st, v) = channel(a, 8001);
    assert_eq!(st, 200, "{v}");
    let other = v["url"]
        .as_str()
        .unwrap()
        .strip_prefix("http://")
        .unwrap()
        .to_string();
    let got = raw(
        &other,
        &format!(
            "GET / HTTP/1.1\r\nHost: x\r\n{header}: {}\r\n\r\n",
            v["token"].as_str().unwrap()
        ),
    );
    assert!(got.starts_with("HTTP/1.1 502"), "{got}");
    // Ended with the sandbox.
    let (st, v) = a.http(&s.socket, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(st, 200, "{v}");
    assert!(
        crate::wait_for(Duration::from_secs(10), || std::net::TcpStream::connect(
            &addr
        )
        .is_err()),
        "the channel outlived its sandbox"
    );
}

/// `request` sent as it is to `addr` over TCP; everything answered until it closes.
fn raw(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(request.as_bytes()).unwrap();
    let mut got = String::new();
    let _ = c.read_to_string(&mut got);
    got
}
