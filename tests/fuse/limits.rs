//! What one member may make `casfs serve` hold, tried over its Unix socket against the
//! real server: a member's idle connections, which never turn another member or root
//! away.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::serve::{call, start};
use crate::users::{place, TestGroup, TestUser};

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
