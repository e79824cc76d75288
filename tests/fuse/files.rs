//! A sandbox's files through `casfs serve` (`/v1/sandboxes/{key}/fs/...`, what the
//! TypeScript provider's `fs` uses): every path resolved beneath the workspace's root
//! whatever links the workspace holds or gains meanwhile, and every operation done as
//! the sandbox's owner. Tried as the attack went: a member's agent plants
//! links to places outside (absolute, relative, through `/proc`) and swaps a directory
//! with a link in a loop, while a root client reads and writes the workspace.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::paths::Exchanger;
use crate::serve::{call, start, Served};
use crate::users::{place, TestGroup, TestUser};
use crate::MountsUnder;

/// A raw request to the server as root, with a byte body; the status and body.
fn raw(s: &Served, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    use std::io::{Read, Write};
    let mut c = std::os::unix::net::UnixStream::connect(&s.socket).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).unwrap();
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, out[split + 4..].to_vec())
}

/// Percent-encodes a query value.
fn q(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn read(s: &Served, key: &str, path: &str) -> (u16, Vec<u8>) {
    raw(
        s,
        "GET",
        &format!("/v1/sandboxes/{key}/fs/read?path={}", q(path)),
        b"",
    )
}

fn write(s: &Served, key: &str, path: &str, data: &[u8]) -> u16 {
    raw(
        s,
        "PUT",
        &format!("/v1/sandboxes/{key}/fs/write?path={}", q(path)),
        data,
    )
    .0
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// What is under `dir`: every path with its size and mode (nothing may change there).
fn state_of(dir: &Path) -> Vec<(PathBuf, u64, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let m = std::fs::symlink_metadata(e.path()).unwrap();
        out.push((e.path(), m.size(), m.mode()));
        if m.is_dir() {
            out.extend(state_of(&e.path()));
        }
    }
    out.sort();
    out
}

/// Boundary 6 (provider fs): a sandbox's files as its client reads and writes them
/// through the server never reach outside the workspace, whatever links the workspace
/// holds (absolute, relative `..`, `/proc/self/root`, a link to a root-only file) or
/// gains while it works (a directory swapped with a link to outside in a loop), and a
/// root client included.
#[test]
fn the_provider_fs_never_reaches_outside_the_workspace() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (t, store, sandboxes) = place();
    let group = TestGroup::new();
    let member = TestUser::new(Some(&group));
    let _g = MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &[
            "--socket-group",
            &group.name,
            "--mode",
            crate::mount_mode().as_str(),
        ],
        &[],
    );
    // Outside every workspace: a directory of root's with a root-only canary.
    let outside = t.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
    let canary = outside.join("canary");
    let secret = format!("casfs-files-canary-{}", std::process::id());
    std::fs::write(&canary, &secret).unwrap();
    std::fs::set_permissions(&canary, std::fs::Permissions::from_mode(0o600)).unwrap();
    let before = state_of(&outside);

    // The member's sandbox; the member's agent plants links.
    let (st, v) = member.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "w"})),
    );
    assert_eq!(st, 200, "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = PathBuf::from(v["path"].as_str().unwrap());
    let o = outside.display().to_string();
    member.sh(
        &root,
        &format!(
            "printf 'mine\\n' > own.txt && mkdir d && \
             ln -s '{o}/made-by-write' notes.md && ln -s ../../../../../../.. up && \
             ln -s / abs && ln -s /proc/self/root proc && ln -s '{o}/canary' canary && \
             ln -s '{o}' dl"
        ),
    );
    // Root, as a root-run agent host would, through the member's sandbox.
    assert_ne!(
        write(&s, &key, "notes.md", b"x"),
        200,
        "written through a dangling link"
    );
    assert!(!outside.join("made-by-write").exists());
    for p in [
        "canary".to_string(),
        format!("abs{o}/canary"),
        format!("up{o}/canary"),
        format!("../../../../../../..{o}/canary"),
        format!("{o}/canary"),
        "proc/etc/hostname".to_string(),
        "dl/canary".to_string(),
    ] {
        let (st, body) = read(&s, &key, &p);
        assert!(
            !contains(&body, secret.as_bytes()),
            "read {p}: the canary ({st})"
        );
        assert_ne!(st, 200, "read {p}");
    }
    // What `..` and `/` lead to is the workspace's own root.
    let (st, v) = call(
        &s,
        "GET",
        &format!("/v1/sandboxes/{key}/fs/list?path=up"),
        None,
    );
    assert_eq!(st, 200, "{v}");
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"own.txt") && names.contains(&"notes.md"),
        "{v}"
    );
    assert_eq!(write(&s, &key, &format!("abs{o}/planted"), b"p"), 200);
    assert_eq!(write(&s, &key, "up/escaped.txt", b"e"), 200);
    assert!(root.join(format!("{}/planted", &o[1..])).exists());
    assert!(root.join("escaped.txt").exists());
    // A link to outside leads to the same path inside the workspace (made just above).
    let mk = json!({"path": "dl/newdir"});
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/fs/mkdir"),
        Some(&mk),
    );
    assert_eq!(st, 200, "{v}");
    assert!(root.join(format!("{}/newdir", &o[1..])).is_dir());
    assert!(!outside.join("newdir").exists());
    // A remove or rename acts on the link itself, never on what it leads to.
    let rm = json!({"path": "canary"});
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/fs/remove"),
        Some(&rm),
    );
    assert_eq!((st, v["removed"].as_bool()), (200, Some(true)), "{v}");
    let mv = json!({"from": "dl", "to": "d/moved"});
    let (st, v) = call(
        &s,
        "POST",
        &format!("/v1/sandboxes/{key}/fs/rename"),
        Some(&mv),
    );
    assert_eq!(st, 200, "{v}");
    assert!(std::fs::symlink_metadata(root.join("d/moved"))
        .unwrap()
        .is_symlink());

    // The race: the member swaps a directory with a link to outside, over and over,
    // while root writes and reads inside it.
    member.sh(&root, &format!("mkdir -p x && ln -s '{o}' xl"));
    let swapping = Exchanger::start(&member, &root, &[("x", "xl", &o)]);
    for i in 0..200 {
        let _ = write(&s, &key, &format!("x/f{i}"), b"raced");
        let (_, body) = read(&s, &key, "x/canary");
        assert!(
            !contains(&body, secret.as_bytes()),
            "round {i}: read the canary"
        );
    }
    drop(swapping);
    assert_eq!(
        state_of(&outside),
        before,
        "something changed outside the workspace"
    );
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), secret);
}

/// Boundary 6 (provider fs): the server does a client's file operations as the
/// sandbox's owner: what it makes is theirs, and it is held to their permissions (a
/// root-only file root left in the workspace is not read for them).
#[test]
fn the_provider_fs_acts_as_the_sandboxes_owner() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let member = TestUser::new(Some(&group));
    let _g = MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &[
            "--socket-group",
            &group.name,
            "--mode",
            crate::mount_mode().as_str(),
        ],
        &[],
    );
    let (st, v) = member.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "w"})),
    );
    assert_eq!(st, 200, "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = PathBuf::from(v["path"].as_str().unwrap());
    // The member's own request (curl as the member): a file and directories theirs.
    let put = member.run(
        "curl",
        &[
            "-sS",
            "--unix-socket",
            &s.socket.display().to_string(),
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            "hello",
            &format!("http://localhost/v1/sandboxes/{key}/fs/write?path=a/b/c.txt"),
        ],
    );
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    for p in ["a", "a/b", "a/b/c.txt"] {
        let m = std::fs::metadata(root.join(p)).unwrap();
        assert_eq!((m.uid(), m.gid()), (member.uid, member.gid), "{p}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join("a/b/c.txt")).unwrap(),
        "hello"
    );
    // A file root left there, root's only: not read, not removed for the member.
    std::fs::write(root.join("root-only"), "root's").unwrap();
    std::fs::set_permissions(
        root.join("root-only"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let (st, v) = member.http(
        &s.socket,
        "GET",
        &format!("/v1/sandboxes/{key}/fs/stat?path=root-only"),
        None,
    );
    assert_eq!((st, v["type"].as_str()), (200, Some("file")), "{v}");
    let out = member.run(
        "curl",
        &[
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--unix-socket",
            &s.socket.display().to_string(),
            &format!("http://localhost/v1/sandboxes/{key}/fs/read?path=root-only"),
        ],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "403");
    // Another member's request for this sandbox: not found.
    let other = TestUser::new(Some(&group));
    let (st, v): (u16, Value) = other.http(
        &s.socket,
        "GET",
        &format!("/v1/sandboxes/{key}/fs/list?path="),
        None,
    );
    assert_eq!(st, 404, "{v}");
}
