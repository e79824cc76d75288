//! Real Unix users and groups for the tests that need a second user (useradd,
//! groupadd), removed when dropped, also when a test fails; commands and HTTP requests
//! run as them (setpriv, curl over the server's socket).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use serde_json::Value;

/// useradd and groupadd lock /etc/passwd and /etc/group: one at a time.
static ACCOUNTS: Mutex<()> = Mutex::new(());

pub(crate) fn admin(cmd: &str, args: &[&str]) {
    let _one = ACCOUNTS.lock().unwrap_or_else(|p| p.into_inner());
    // Another process (a second test binary) may hold the lock files a moment.
    let mut tries = 0;
    loop {
        let out = Command::new(cmd).args(args).output().expect("run useradd");
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        tries += 1;
        if tries < 50 && err.contains("lock") {
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        panic!("{cmd} {args:?}: {err}");
    }
}

/// A name no other test (or earlier run) uses.
pub(crate) fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A system group, removed when dropped.
pub(crate) struct TestGroup {
    pub name: String,
}

impl TestGroup {
    pub fn new() -> TestGroup {
        let name = unique("casfsg");
        admin("groupadd", &[&name]);
        TestGroup { name }
    }

    pub fn gid(&self) -> u32 {
        let out = Command::new("getent")
            .args(["group", &self.name])
            .output()
            .unwrap();
        let line = String::from_utf8(out.stdout).unwrap();
        line.split(':').nth(2).unwrap().trim().parse().unwrap()
    }
}

impl Drop for TestGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}

/// An ordinary user (no home, no login shell, its own group), in `group` if given;
/// removed when dropped.
pub(crate) struct TestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl TestUser {
    pub fn new(group: Option<&TestGroup>) -> TestUser {
        let name = unique("casfsu");
        let mut args = vec!["-M", "-U", "-s", "/usr/sbin/nologin"];
        if let Some(g) = group {
            args.extend(["-G", g.name.as_str()]);
        }
        args.push(&name);
        admin("useradd", &args);
        let id = |flag: &str| -> u32 {
            let out = Command::new("id").args([flag, &name]).output().unwrap();
            String::from_utf8(out.stdout)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let (uid, gid) = (id("-u"), id("-g"));
        assert_ne!(uid, 0);
        TestUser { name, uid, gid }
    }

    /// `program args...` run as this user, with its groups.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        Command::new("setpriv")
            .arg(format!("--reuid={}", self.name))
            .arg(format!("--regid={}", self.gid))
            .arg("--init-groups")
            .arg("--")
            .arg(program)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .output()
            .expect("run setpriv")
    }

    /// A shell command run as this user in `dir`, which must succeed.
    pub fn sh(&self, dir: &Path, script: &str) {
        let out = self.run(
            "sh",
            &["-c", &format!("cd '{}' && {script}", dir.display())],
        );
        assert!(
            out.status.success(),
            "as {}: {script}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// One request to the server over `socket`, made by this user's own process (so the
    /// server sees this user at the other end): the status and the JSON answer.
    pub fn http(
        &self,
        socket: &Path,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let url = format!("http://localhost{path}");
        let sock = socket.display().to_string();
        let data = body.map(|b| b.to_string());
        let mut args = vec![
            "-sS",
            "--unix-socket",
            &sock,
            "-X",
            method,
            "-w",
            "\n%{http_code}",
        ];
        if let Some(d) = &data {
            args.extend(["-H", "Content-Type: application/json", "--data", d]);
        }
        args.push(&url);
        let out = self.run("curl", &args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "as {}: {method} {path}: curl: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let (body, code) = text.rsplit_once('\n').unwrap();
        let v = serde_json::from_str(body).unwrap_or(Value::String(body.into()));
        (code.parse().unwrap(), v)
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _one = ACCOUNTS.lock().unwrap_or_else(|p| p.into_inner());
        let _ = Command::new("userdel").arg(&self.name).output();
        // Its own group, if userdel left it.
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}

pub(crate) fn owner_of(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.uid(), m.gid())
}

/// A temporary directory others may pass through (the socket and the sandboxes sit in
/// it), with the server's store and sandboxes directory.
pub(crate) fn place() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let store = t.path().join("store");
    let sandboxes = t.path().join("sb");
    (t, store, sandboxes)
}
