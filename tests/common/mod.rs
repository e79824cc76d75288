//! Helpers shared by the integration tests: running the CLI, building trees on disk
//! and comparing two trees entry by entry (content, kind, mode, mtime, target, xattrs).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cmd`, panicking with `what` and its standard error unless it succeeds.
pub fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The casfs binary under test: this build's, or `CASFS_TEST_BIN` (to run the tests
/// against another build, say the one before a fix).
pub fn casfs_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var("CASFS_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_casfs").into())
    })
}

/// Runs `casfs --store STORE args...`.
pub fn casfs(store: &Path, args: &[&str]) -> Output {
    casfs_env(store, args, &[])
}

/// [`casfs`] with `env` set.
pub fn casfs_env(store: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(casfs_bin())
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("CASFS_STORE")
        .envs(env.iter().copied())
        .output()
        .expect("run casfs")
}

/// Runs casfs and expects success; returns stdout.
pub fn ok(store: &Path, args: &[&str]) -> String {
    let out = casfs(store, args);
    assert!(
        out.status.success(),
        "casfs {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Runs casfs and expects failure; returns stderr.
pub fn fails(store: &Path, args: &[&str]) -> String {
    let out = casfs(store, args);
    assert!(
        !out.status.success(),
        "casfs {args:?} should have failed; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).expect("utf-8 output")
}

pub fn json(store: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&ok(store, &a)).expect("valid JSON")
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'a' + (x % 26) as u8
        })
        .collect()
}

pub fn set_mtime(path: &Path, secs: i64, nsec: i64) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let t = libc::timespec {
        tv_sec: secs,
        tv_nsec: nsec,
    };
    let times = [t, t];
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(rc, 0, "utimensat {}", path.display());
}

pub fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    let rc = unsafe {
        libc::setxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(rc, 0, "setxattr {}", path.display());
}

/// The extended attributes of `path` (a symlink's own), through casfs's directory
/// handles: its parent opened, the entry read by name in it.
pub fn xattrs(path: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    use casfs::sys::dirfd;
    use std::os::fd::AsFd;
    let dir = dirfd::open_dir_path(path.parent().unwrap()).unwrap();
    let name = CString::new(path.file_name().unwrap().as_bytes()).unwrap();
    let m = dirfd::lstat_at(dir.as_fd(), &name).unwrap().unwrap();
    casfs::sys::xattr::list_at(dir.as_fd(), &name, &m).unwrap()
}

pub fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o640) }, 0);
}

/// A small tree with every kind of entry the store keeps: files around the chunk size,
/// empty files, symlinks (relative, absolute, dangling), empty directories, a fifo,
/// unusual modes, xattrs and nanosecond mtimes.
pub fn build_sample_tree(root: &Path) {
    fs::create_dir_all(root.join("src/deep/er/still")).unwrap();
    fs::create_dir_all(root.join("empty/nested-empty")).unwrap();
    fs::write(root.join("README.md"), b"# sample\n").unwrap();
    fs::write(root.join("empty-file"), b"").unwrap();
    fs::write(root.join("src/main.rs"), pattern(5000, 1)).unwrap();
    fs::write(root.join("src/deep/er/still/data.bin"), pattern(3 << 20, 2)).unwrap();
    fs::write(root.join("src/exactly-1MiB"), pattern(1 << 20, 3)).unwrap();
    fs::write(root.join("src/1MiB-plus-1"), pattern((1 << 20) + 1, 4)).unwrap();
    fs::write(root.join("name with spaces & ünïcödé"), b"x").unwrap();
    std::os::unix::fs::symlink("src/main.rs", root.join("link-rel")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", root.join("link-abs")).unwrap();
    std::os::unix::fs::symlink("does/not/exist", root.join("link-dangling")).unwrap();
    mkfifo(&root.join("pipe"));
    fs::write(root.join("script.sh"), b"#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(root.join("script.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(root.join("secret"), b"s").unwrap();
    fs::set_permissions(root.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o2750)).unwrap();
    set_xattr(
        &root.join("README.md"),
        "user.casfs.test",
        b"value\0with nul",
    );
    set_xattr(&root.join("src"), "user.dir-attr", b"d");
    set_mtime(&root.join("README.md"), 1_600_000_000, 123_456_789);
    set_mtime(&root.join("link-rel"), 1_500_000_000, 1);
    set_mtime(&root.join("src/deep"), 1_400_000_000, 999_999_999);
}

#[derive(Debug, PartialEq, Eq)]
pub struct Node {
    kind: char,
    mode: u32,
    mtime: (i64, i64),
    content: Option<Vec<u8>>,
    target: Option<PathBuf>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Node {
    /// A regular file's content.
    pub fn content(&self) -> Option<&[u8]> {
        self.content.as_deref()
    }
}

/// Everything about a tree that a restore promises to reproduce, by relative path.
/// (The root directory's own mode and mtime are not part of a checkpoint.)
pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Node>) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        let m = fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            'd'
        } else if ft.is_symlink() {
            'l'
        } else if ft.is_fifo() {
            'p'
        } else {
            'f'
        };
        let node = Node {
            kind,
            mode: if kind == 'l' { 0 } else { m.mode() & 0o7777 },
            mtime: (m.mtime(), m.mtime_nsec()),
            content: (kind == 'f').then(|| fs::read(&p).unwrap()),
            target: (kind == 'l').then(|| fs::read_link(&p).unwrap()),
            xattrs: if kind == 'l' { vec![] } else { xattrs(&p) },
        };
        out.insert(p.strip_prefix(root).unwrap().to_path_buf(), node);
        if kind == 'd' {
            walk(root, &p, out);
        }
    }
}

/// Asserts two trees are the same, naming the first difference.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let (sa, sb) = (snapshot(a), snapshot(b));
    let ka: Vec<_> = sa.keys().collect();
    let kb: Vec<_> = sb.keys().collect();
    assert_eq!(
        ka,
        kb,
        "different paths in {} and {}",
        a.display(),
        b.display()
    );
    for (k, na) in &sa {
        assert_eq!(na, &sb[k], "{} differs", k.display());
    }
}
