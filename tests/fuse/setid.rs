//! Set-id files and device nodes in a workspace are data, never in effect: every mount
//! casfs makes of workspace content (the FUSE workspace, the overlay and each of its
//! lowers, a read-only view) is nosuid and nodev, while the bits themselves are kept
//! exactly. Tried as a hostile user would: a set-uid copy of `id` planted in someone
//! else's workspace, run by an ordinary user.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::common::{casfs_env, ok};
use crate::serve::start;
use crate::users::{place, TestGroup, TestUser};
use crate::{mounts_under, MountGuard};

/// The per-mount options of the mount at `mp` (/proc/self/mountinfo's sixth field).
fn mount_options(mp: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    // The last mount at the path is the one seen there.
    let line = info
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(4) == Some(mp.to_str().unwrap()))
        .unwrap_or_else(|| panic!("{} is no mount point:\n{info}", mp.display()));
    line.split(' ')
        .nth(5)
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect()
}

/// Asserts that the mount at `mp` is nosuid and nodev.
fn assert_inert(mp: &Path) {
    let o = mount_options(mp);
    assert!(
        o.iter().any(|x| x == "nosuid") && o.iter().any(|x| x == "nodev"),
        "{} is mounted {}",
        mp.display(),
        o.join(",")
    );
}

/// `casfs mount` of thread `thread` at `mp` (this run's backend), with `extra` and
/// `env`; the mount must succeed.
fn mount(store: &Path, mp: &Path, thread: &str, extra: &[&str], env: &[(&str, &str)]) {
    std::fs::create_dir_all(mp).unwrap();
    let mut args = vec!["mount", mp.to_str().unwrap(), "-t", thread];
    args.extend_from_slice(extra);
    let out = casfs_env(store, &args, env);
    assert!(
        out.status.success(),
        "casfs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Boundary 2 (set-id): every mount casfs makes of workspace content is nosuid and
/// nodev, on this run's backend: the FUSE workspace, or the overlay with each of its
/// lowers (an EROFS image and the objects' view, or the tree's view), and a read-only
/// view.
#[test]
fn every_mount_of_workspace_content_is_nosuid_and_nodev() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a\n").unwrap();
    // A store per writable mount (a mount's daemon holds its store), each with the
    // mount's lowers under it: every mount under `t` is one this test made.
    let mut lowers = vec![""];
    if crate::overlay() {
        // The overlay's lower as the tree's view too (the default is an image).
        lowers.push("view");
    }
    let mut guards = Vec::new();
    for (i, lower) in lowers.iter().enumerate() {
        let store = t.path().join(format!("store{i}"));
        ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
        let mp = t.path().join(format!("mnt{i}"));
        guards.push(MountGuard::new(&mp));
        let env: Vec<(&str, &str)> = if lower.is_empty() {
            vec![]
        } else {
            vec![("CASFS_OVERLAY_LOWER", lower)]
        };
        mount(&store, &mp, "w", &[], &env);
        assert!(crate::is_mounted(&mp));
    }
    let view = t.path().join("view");
    guards.push(MountGuard::new(&view));
    mount(&t.path().join("store0"), &view, "w", &["--read-only"], &[]);
    let all = mounts_under(t.path());
    // FUSE: the workspace and the view; overlay: two overlays, the first over an image
    // and the objects' view (as root: a rootless overlay has no image), the second
    // over the tree's view, and the read-only view.
    let want = match (crate::overlay(), crate::root()) {
        (false, _) => 2,
        (true, true) => 6,
        (true, false) => 5,
    };
    assert_eq!(all.len(), want, "{all:?}");
    for mp in &all {
        assert_inert(mp);
    }
    // The bits themselves stay data: a set-uid file is kept and shown as such.
    let f = t.path().join("mnt0").join("a.txt");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o4755)).unwrap();
    assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o7777, 0o4755);
}

/// Builds the test's own copy of `id` in `dir`, mode 4755.
fn setuid_id(dir: &Path) -> PathBuf {
    let p = dir.join("id");
    std::fs::copy("/usr/bin/id", &p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o4755)).unwrap();
    p
}

/// `path -u` run by `user`: the effective uid it reports.
fn euid_running(user: &TestUser, path: &Path) -> u32 {
    let out = user.run(path.to_str().unwrap(), &["-u"]);
    assert!(
        out.status.success(),
        "as {}: {}: {}",
        user.name,
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Boundary 2 (set-id): a set-uid-root copy of `id` restored from a checkpoint into
/// root's workspace, whose root an agent made 0755, run by an ordinary user: the bits
/// are kept (mode 4755, owner root), and the user's effective uid stays theirs.
#[test]
fn a_set_uid_file_restored_into_root_s_workspace_gives_no_one_root() {
    if crate::needs_root("it makes a user with useradd and plants a set-uid-root file") {
        return;
    }
    let user = TestUser::new(None);
    let (t, store, _) = place();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    setuid_id(&src);
    ok(&store, &["capture", src.to_str().unwrap(), "-t", "w"]);
    let mp = t.path().join("mnt");
    let _g = MountGuard::new(&mp);
    mount(&store, &mp, "w", &["--allow-other"], &[]);
    std::fs::set_permissions(&mp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let id = mp.join("id");
    let m = std::fs::metadata(&id).unwrap();
    assert_eq!(
        (m.mode() & 0o7777, m.uid()),
        (0o4755, 0),
        "restored exactly"
    );
    assert_eq!(euid_running(&user, &id), user.uid);
    assert_inert(&mp);
}

/// Boundary 2 (set-id): in a workspace that is another ordinary user B's (a sandbox B
/// made through `casfs serve --socket-group`), a set-uid copy of `id` owned by B, run
/// by user A through a bind mount A can reach: the bits are kept (mode 4755, owner B),
/// and A does not get B's effective uid.
#[test]
fn a_set_uid_file_in_another_user_s_workspace_gives_no_one_their_uid() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (t, store, sandboxes) = place();
    let group = TestGroup::new();
    let a = TestUser::new(None);
    let b = TestUser::new(Some(&group));
    let mode = crate::mount_mode().as_str();
    let _g1 = crate::MountsUnder(sandboxes.clone());
    let s = start(
        &store,
        &sandboxes,
        &["--socket-group", &group.name, "--mode", mode],
        &[],
    );
    let (st, v) = b.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "b"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["path"].as_str().unwrap());
    // B (or an agent of B's, or whoever appended to B's thread) leaves a set-uid file
    // there, and the root open to others.
    b.sh(&root, "cp /usr/bin/id id && chmod 4755 id && chmod 0755 .");
    // A reaches the workspace through a bind mount of it in a directory A can pass.
    let seen = t.path().join("seen");
    std::fs::create_dir(&seen).unwrap();
    let _g2 = MountGuard::new(&seen);
    bind(&root, &seen);
    let id = seen.join("id");
    let m = std::fs::metadata(&id).unwrap();
    assert_eq!(
        (m.mode() & 0o7777, m.uid()),
        (0o4755, b.uid),
        "kept exactly"
    );
    assert_eq!(euid_running(&a, &id), a.uid);
    assert_inert(&root);
    assert_inert(&seen);
    // The server stops promptly although the workspace is still held (by the bind
    // mount), and leaves nothing mounted in its store (no disk, no overlay).
    let (ended, left) = s.stop();
    assert!(
        ended && left.is_empty(),
        "ended: {ended}, left mounted: {left:?}"
    );
}

/// Boundary 2 (set-id): a plain sandbox (`casfs serve --plain`: no mount, so no
/// nosuid) of an ordinary user: what a restore writes into it is theirs before any
/// set-id bit is set on it, so no set-uid-root file ever stands there, and the bits are
/// kept exactly (mode 4755, owner the user).
#[test]
fn a_plain_restore_never_leaves_a_set_uid_root_file() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let b = TestUser::new(Some(&group));
    let s = start(
        &store,
        &sandboxes,
        &["--socket-group", &group.name, "--plain"],
        &[],
    );
    let (st, v) = b.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "p"})),
    );
    assert_eq!(st, 200, "{v}");
    let (key, root) = (
        v["key"].as_str().unwrap().to_string(),
        PathBuf::from(v["path"].as_str().unwrap()),
    );
    b.sh(
        &root,
        "cp /usr/bin/id id && chmod 4755 id && mkdir -p d && cp -p id d/id2 && chmod 4755 d/id2",
    );
    let (st, w) = b.http(&s.socket, "POST", "/v1/threads/p/writer", Some(&json!({})));
    assert_eq!(st, 200, "{w}");
    let proof = json!({"token": w["token"], "owner_token": w["owner_token"]});
    let body = json!({"sandbox": key, "expected_head": null, "writer": proof});
    let (st, v) = b.http(&s.socket, "POST", "/v1/threads/p/checkpoints", Some(&body));
    assert_eq!(st, 200, "{v}");
    let (st, v) = b.http(&s.socket, "DELETE", &format!("/v1/sandboxes/{key}"), None);
    assert_eq!(st, 200, "{v}");
    // Made again: restored from the head, as root writes it.
    let (st, v) = b.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "p"})),
    );
    assert_eq!(st, 200, "{v}");
    let root = PathBuf::from(v["path"].as_str().unwrap());
    for p in ["id", "d/id2"] {
        let m = std::fs::symlink_metadata(root.join(p)).unwrap();
        assert_eq!((m.mode() & 0o7777, m.uid()), (0o4755, b.uid), "{p}");
    }
    let m = std::fs::symlink_metadata(root.join("d")).unwrap();
    assert_eq!(m.uid(), b.uid, "d");
    drop(s);
}

/// Bind-mounts `src` at `dst` (the new mount keeps the source mount's flags).
fn bind(src: &Path, dst: &Path) {
    let c = |p: &Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let (s, d) = (c(src), c(dst));
    // SAFETY: NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    assert_eq!(
        r,
        0,
        "bind {}: {}",
        src.display(),
        std::io::Error::last_os_error()
    );
}
