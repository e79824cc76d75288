//! Issue 48, item 1: every path the server touches inside a tree a less trusted party
//! changes goes through a directory handle with no path following. Tried as a hostile
//! member of the socket's group would: in their own sandbox of a real `casfs serve`
//! (the overlay backend, the FUSE backend, plain directories), a process of theirs
//! exchanges a regular file and a symlink to a root-only file (`renameat2` with
//! `RENAME_EXCHANGE`, in a tight loop) while checkpoints of the sandbox are appended;
//! and while root restores a checkpoint into a directory the member controls, the
//! member swaps a subdirectory for a symlink to a root-owned directory, and a FIFO for a
//! symlink to a root-only file.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

use casfs::cas::file::read_file;
use casfs::cas::{load_tree, EntryContent, TreeId};
use casfs::checkpoint::{CheckpointId, OpenMode, Store};

use crate::common::{casfs, json as cli_json, ok};
use crate::serve::start;
use crate::users::{place, TestGroup, TestUser};

/// How many checkpoints the race appends (the capture race of issue 48 leaked within 2
/// to 23 appends on the overlay backend).
const APPENDS: usize = 100;

/// A program of the member's that exchanges pairs of names of a directory for ever
/// (until killed): `renameat2(RENAME_EXCHANGE)`, the second of a pair made again as a
/// symlink to its target whenever it is gone (a restore removes it); `ready` is printed
/// after the first round.
const EXCHANGER: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
a = sys.argv[2:]
names = [(a[i].encode(), a[i + 1].encode(), a[i + 2]) for i in range(0, len(a), 3)]
first = True
while True:
    for x, y, target in names:
        if libc.renameat2(-100, x, -100, y, 2) != 0 and target:
            try:
                os.symlink(target, y)
            except OSError:
                pass
    if first:
        print("ready", flush=True)
        first = False
"#;

/// The member's exchanging process, killed when dropped (also when a test fails).
pub(crate) struct Exchanger(Child);

impl Exchanger {
    /// Starts exchanging each pair of `pairs` (two names, and the target of a symlink
    /// to make as the second where it is missing, or "") in `dir`, as `user`; returns
    /// once the first exchanges are done.
    pub(crate) fn start(user: &TestUser, dir: &Path, pairs: &[(&str, &str, &str)]) -> Exchanger {
        let mut args = vec![
            format!("--reuid={}", user.name),
            format!("--regid={}", user.gid),
            "--init-groups".into(),
            "--".into(),
            "python3".into(),
            "-c".into(),
            EXCHANGER.into(),
            dir.display().to_string(),
        ];
        for (a, b, target) in pairs {
            args.push(a.to_string());
            args.push(b.to_string());
            args.push(target.to_string());
        }
        let mut child = Command::new("setpriv")
            .args(&args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the exchanger");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the exchanger did not start");
        Exchanger(child)
    }
}

impl Drop for Exchanger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A root-only (0600) file outside every workspace, with bytes found nowhere else.
fn canary(dir: &Path) -> (PathBuf, Vec<u8>) {
    let p = dir.join("canary");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let bytes = format!("casfs-canary-{}-{nanos}\n", std::process::id()).into_bytes();
    std::fs::write(&p, &bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    (p, bytes)
}

/// Whether anything of the tree `root` (every file's content, every symlink's target,
/// every name and xattr, all the way down) holds `secret`: the path where it does.
fn leak_in(store: &Store, root: TreeId, secret: &[u8], at: &str) -> Option<String> {
    let tree = load_tree(store.objects(), &root).unwrap();
    for e in tree.entries() {
        let p = format!("{at}/{}", String::from_utf8_lossy(&e.name));
        let mut bytes = e.name.clone();
        for (k, v) in &e.xattrs {
            bytes.extend_from_slice(k);
            bytes.extend_from_slice(v);
        }
        match &e.content {
            EntryContent::File(_) => {
                bytes.extend(read_file(store.objects(), &e.file_ref().unwrap()).unwrap())
            }
            EntryContent::Symlink(t) => bytes.extend_from_slice(t),
            EntryContent::Dir(t) => {
                if let Some(l) = leak_in(store, *t, secret, &p) {
                    return Some(l);
                }
            }
            _ => {}
        }
        if contains(&bytes, secret) {
            return Some(p);
        }
    }
    None
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The capture race, on a sandbox of `casfs serve` started with `extra`; with
/// `swap_dirs`, a directory is exchanged with a symlink to a root-only directory too
/// (on a mount, each such exchange has the upper's watch look into a new directory: a
/// tight loop of them slows every checkpoint, so the mounts race on files only).
fn capture_race(extra: &[&str], swap_dirs: bool) {
    let (t, store, sandboxes) = place();
    let (canary_path, secret) = canary(t.path());
    // A root-only directory holding a file whose xattr is the canary's bytes too.
    let hidden = t.path().join("hidden");
    std::fs::create_dir(&hidden).unwrap();
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(hidden.join("m"), b"").unwrap();
    crate::common::set_xattr(&hidden.join("m"), "user.canary", &secret);
    let group = TestGroup::new();
    let member = TestUser::new(Some(&group));
    let _g = crate::MountsUnder(sandboxes.clone());
    let mut args = vec!["--socket-group", group.name.as_str(), "--lease-ttl", "3600"];
    args.extend_from_slice(extra);
    let s = start(&store, &sandboxes, &args, &[]);

    // The member's own sandbox, with a file and a link to the root-only file.
    let (st, v) = member.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "race"})),
    );
    assert_eq!(st, 200, "{v}");
    let key = v["key"].as_str().unwrap().to_string();
    let root = PathBuf::from(v["path"].as_str().unwrap());
    member.sh(
        &root,
        &format!(
            "printf 'an ordinary file\\n' > f && ln -s '{}' l && mkdir d && \
             printf 'another\\n' > d/g && ln -s '{}' d/m && ln -s '{}' e",
            canary_path.display(),
            canary_path.display(),
            hidden.display()
        ),
    );
    let (st, lease) = member.http(
        &s.socket,
        "POST",
        "/v1/threads/race/writer",
        Some(&json!({})),
    );
    assert_eq!(st, 200, "{lease}");
    let writer = json!({"token": lease["token"], "owner_token": lease["owner_token"]});

    // The exchange runs for as long as the checkpoints are appended.
    let mut pairs = vec![("f", "l", ""), ("d/g", "d/m", "")];
    if swap_dirs {
        pairs.push(("d", "e", ""));
    }
    let ex = Exchanger::start(&member, &root, &pairs);
    let mut head = Value::Null;
    let mut appended: Vec<(String, String)> = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..APPENDS {
        let (st, v) = member.http(
            &s.socket,
            "POST",
            "/v1/threads/race/checkpoints",
            Some(&json!({"sandbox": key, "expected_head": head, "writer": writer})),
        );
        if st == 200 {
            let cp = &v["checkpoint"];
            head = cp["id"].clone();
            appended.push((
                cp["id"].as_str().unwrap().to_string(),
                cp["root"].as_str().unwrap_or_default().to_string(),
            ));
        } else {
            // A capture that gave up on an entry that kept changing: nothing published.
            refused.push(format!("{st} {v}"));
        }
    }
    drop(ex);
    assert!(
        appended.len() >= APPENDS / 2,
        "{} of {APPENDS} appends refused: {:?}",
        refused.len(),
        &refused[..refused.len().min(3)]
    );

    // The server is alive; then stopped, so that the store is read back whole.
    let (st, _) = member.http(&s.socket, "GET", "/v1/threads/race/head", None);
    assert_eq!(st, 200);
    drop(s);
    drop(_g);
    // No checkpoint holds the root-only file's bytes: every file, link and xattr of
    // every tree is read back through the store.
    let st = Store::open(
        &store,
        OpenMode::MustExist,
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    for (id, _) in &appended {
        let cp = st
            .checkpoints()
            .get(&CheckpointId(casfs::cas::Hash::from_hex(id).unwrap()))
            .unwrap();
        if let Some(p) = leak_in(&st, cp.body.root, &secret, "") {
            panic!("checkpoint {id} holds the root-only file's bytes at {p}");
        }
    }
    // The canary is untouched.
    let m = std::fs::metadata(&canary_path).unwrap();
    assert_eq!((m.mode() & 0o7777, m.uid()), (0o600, 0));
    assert_eq!(std::fs::read(&canary_path).unwrap(), secret);
}

/// Boundary 1 (paths): a member exchanging a file of their sandbox with a symlink to a
/// root-only file while checkpoints are appended never gets that file's bytes into a
/// checkpoint; on this run's mount backend (overlay or FUSE).
#[test]
fn a_capture_racing_a_link_swap_never_stores_a_root_only_file() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    capture_race(&["--mode", crate::mount_mode().as_str()], false);
}

/// Boundary 1 (paths): the same race on a plain-directory sandbox (`casfs serve
/// --plain`), a directory exchanged with a symlink to a root-only directory too (whose
/// file's xattr holds the canary's bytes).
#[test]
fn a_plain_capture_racing_a_link_swap_never_stores_a_root_only_file() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    capture_race(&["--plain"], true);
}

/// What of a directory can change: its entries' names, kinds, modes, owners, sizes and
/// modification times.
fn state_of(dir: &Path) -> Vec<(String, u32, u32, u64, i64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let m = std::fs::symlink_metadata(&d).unwrap();
        out.push((
            d.display().to_string(),
            m.mode(),
            m.uid(),
            m.size(),
            m.mtime(),
        ));
        if m.is_dir() {
            for e in std::fs::read_dir(&d).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    out.sort();
    out
}

/// Boundary 1 (paths): while root restores a checkpoint into a directory a member
/// controls, the member swaps a subdirectory for a symlink to a root-owned directory,
/// and a FIFO of it for a symlink to a root-only file, in a loop: nothing outside the
/// directory is ever written, chowned or chmodded.
#[test]
fn a_restore_racing_link_swaps_never_changes_anything_outside_its_directory() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let store = t.path().join("store");
    let member = TestUser::new(None);
    // Root's: a directory with a file, and a root-only file.
    let theirs = t.path().join("root-dir");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("p"), b"root's own\n").unwrap();
    std::fs::write(theirs.join("f.txt"), b"root's own\n").unwrap();
    std::fs::set_permissions(theirs.join("p"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let (canary_path, secret) = canary(t.path());
    let before = (state_of(&theirs), state_of(&canary_path));

    // The checkpoint: a subdirectory with files, and one with a FIFO, that the member
    // may write in.
    let src = t.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    for i in 0..40 {
        std::fs::write(src.join(format!("sub/f{i}.txt")), format!("{i}\n")).unwrap();
    }
    std::fs::create_dir_all(src.join("keep")).unwrap();
    std::fs::write(src.join("keep/a.txt"), b"a\n").unwrap();
    crate::common::mkfifo(&src.join("keep/p"));
    std::fs::set_permissions(src.join("keep/p"), std::fs::Permissions::from_mode(0o666)).unwrap();
    std::fs::set_permissions(src.join("keep"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(src.join("sub"), std::fs::Permissions::from_mode(0o777)).unwrap();
    ok(&store, &["init"]);
    let cp = cli_json(&store, &["capture", src.to_str().unwrap(), "-t", "r"]);
    let id = cp["checkpoint"]["id"].as_str().unwrap().to_string();

    // The member's directory, with their subdirectories and the links they swap in: the
    // one subdirectory for a link to root's directory, a FIFO in the other for a link to
    // the root-only file.
    let ws = t.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::os::unix::fs::chown(&ws, Some(member.uid), Some(member.gid)).unwrap();
    member.sh(
        &ws,
        &format!(
            "mkdir -m 777 sub keep && ln -s '{}' evil && ln -s '{}' keep/q && \
             mkfifo -m 666 keep/p",
            theirs.display(),
            canary_path.display()
        ),
    );
    let (th, ca) = (
        theirs.display().to_string(),
        canary_path.display().to_string(),
    );
    // Each swap in a process of its own, each as fast as it goes.
    let ex = Exchanger::start(&member, &ws, &[("sub", "evil", &th)]);
    let ex2 = Exchanger::start(&member, &ws, &[("keep/p", "keep/q", &ca)]);
    let mut restored = 0;
    for _ in 0..60 {
        let out = casfs(
            &store,
            &["restore", ws.to_str().unwrap(), "--at", &id, "--force"],
        );
        if out.status.success() {
            restored += 1;
        }
    }
    drop((ex, ex2));
    assert!(restored > 0, "no restore went through");
    let after = (state_of(&theirs), state_of(&canary_path));
    assert_eq!(
        before, after,
        "the restore changed something outside its directory"
    );
    assert_eq!(std::fs::read(&canary_path).unwrap(), secret);
    assert_eq!(
        std::fs::read_dir(&theirs).unwrap().count(),
        2,
        "the restore wrote into root's directory"
    );
}
