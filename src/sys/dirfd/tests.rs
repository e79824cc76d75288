//! The handles against symlink tricks: `..`, absolute links, links to
//! `/proc/self/root`, magic links, and entries that are not what they were.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;

use super::root::Root;
use super::*;

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn code(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// A root with `in/file`, a secret next to the root, and links of every kind.
fn tree() -> (tempfile::TempDir, std::path::PathBuf) {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("secret"), b"outside").unwrap();
    let r = t.path().join("root");
    std::fs::create_dir_all(r.join("in/sub")).unwrap();
    std::fs::create_dir_all(r.join("etc")).unwrap();
    std::fs::write(r.join("in/file"), b"inside").unwrap();
    std::fs::write(r.join("etc/passwd"), b"the root's own").unwrap();
    symlink("../secret", r.join("up")).unwrap();
    symlink("../../../secret", r.join("in/upup")).unwrap();
    symlink(t.path().join("secret"), r.join("abs")).unwrap();
    symlink("/etc/passwd", r.join("etcpw")).unwrap();
    symlink("/proc/self/root/etc/passwd", r.join("procroot")).unwrap();
    symlink("/proc/self/fd/0", r.join("magic")).unwrap();
    symlink("in", r.join("indir")).unwrap();
    symlink("nowhere/x", r.join("dangling")).unwrap();
    (t, r)
}

#[test]
fn beneath_a_handle_no_link_is_followed_and_nothing_outside_is_reached() {
    let (_t, r) = tree();
    let d = open_dir_path(&r).unwrap();
    let d = d.as_fd();
    // Plain paths work.
    assert!(open_beneath(d, b"in/file", OFlags::RDONLY).is_ok());
    assert!(open_dir_beneath(d, b"in/sub").is_ok());
    assert!(open_dir_beneath(d, b"").is_ok());
    // Any link on the way, or at the end, is refused.
    for p in [
        "up",
        "abs",
        "etcpw",
        "procroot",
        "magic",
        "indir/file",
        "in/upup",
    ] {
        let e = open_beneath(d, p.as_bytes(), OFlags::RDONLY).unwrap_err();
        assert_eq!(code(&e), libc::ELOOP, "{p}: {e}");
    }
    // Out of the handle by `..` or an absolute path: refused.
    for p in ["../secret", "in/../../secret", "/etc/passwd"] {
        let e = open_beneath(d, p.as_bytes(), OFlags::RDONLY).unwrap_err();
        assert_eq!(code(&e), libc::EXDEV, "{p}: {e}");
    }
    // A single name is a single name.
    for n in ["..", ".", "in/file", ""] {
        assert!(open_dir_at(d, &c(n)).is_err(), "{n:?}");
        assert!(Entry::open(d, &c(n)).is_err(), "{n:?}");
    }
    let e = open_dir_at(d, &c("indir")).unwrap_err();
    assert!(matches!(code(&e), libc::ELOOP | libc::ENOTDIR), "{e}");
}

#[test]
fn magic_links_are_refused_beneath_a_handle_and_inside_a_root() {
    let p = open_dir_path(Path::new("/proc/self")).unwrap();
    for rel in ["root/etc/passwd", "cwd/.", "root"] {
        let e = open_beneath(p.as_fd(), rel.as_bytes(), OFlags::RDONLY).unwrap_err();
        assert_eq!(code(&e), libc::ELOOP, "{rel}: {e}");
    }
    // As a last name, a magic link is opened as itself, never followed.
    let e = Entry::open_beneath(p.as_fd(), b"exe").unwrap();
    assert!(e.meta.is_symlink());
    assert!(e.open_read().is_err());
    let root = Root::open(Path::new("/proc/self")).unwrap();
    for rel in ["root/etc/passwd", "cwd/x", "fd/0", "exe"] {
        let e = root.entry(rel.as_bytes()).unwrap_err();
        assert_eq!(code(&e), libc::ELOOP, "{rel}: {e}");
    }
}

#[test]
fn an_entry_is_what_was_opened_and_only_a_regular_file_is_read() {
    let (t, r) = tree();
    let d = open_dir_path(&r).unwrap();
    let d = d.as_fd();
    rustix::fs::mkfifoat(d, "fifo", Mode::from_raw_mode(0o600)).unwrap();
    // A symlink is opened as itself: its own metadata, its own target, never read.
    let l = Entry::open(d, &c("abs")).unwrap();
    assert!(l.meta.is_symlink());
    assert_eq!(
        l.readlink().unwrap(),
        t.path().join("secret").as_os_str().as_bytes()
    );
    assert!(l.open_read().is_err());
    // A FIFO is never opened for reading (this would block).
    let f = Entry::open(d, &c("fifo")).unwrap();
    assert_eq!(f.meta.kind(), libc::S_IFIFO);
    assert!(f.open_read().is_err());
    // A file is read from the very inode opened, even once another is renamed over it.
    let e = Entry::open_beneath(d, b"in/file").unwrap();
    std::fs::write(r.join("other"), b"replacement").unwrap();
    std::fs::rename(r.join("other"), r.join("in/file")).unwrap();
    let mut s = String::new();
    e.open_read().unwrap().read_to_string(&mut s).unwrap();
    assert_eq!(s, "inside");
    // chmod, chown and times act on the entry opened, and a symlink's target is left.
    f.chmod(0o640).unwrap();
    f.set_mtime(1_000_000_123).unwrap();
    let m = lstat_at(d, &c("fifo")).unwrap().unwrap();
    assert_eq!((m.perm(), m.mtime_ns), (0o640, 1_000_000_123));
    let before = std::fs::metadata(t.path().join("secret")).unwrap();
    l.chmod(0o777).unwrap();
    l.set_mtime(5_000_000_000).unwrap();
    if rustix::process::geteuid().is_root() {
        l.chown(1, 1).unwrap();
        assert_eq!(lstat_at(d, &c("abs")).unwrap().unwrap().uid, 1);
    }
    let after = std::fs::metadata(t.path().join("secret")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (before.mode(), before.mtime(), before.uid()),
        (after.mode(), after.mtime(), after.uid())
    );
    assert_eq!(
        lstat_at(d, &c("abs")).unwrap().unwrap().mtime_ns,
        5_000_000_000
    );
}

#[test]
fn xattrs_by_name_are_the_entrys_own_and_checked_to_be_of_it() {
    let (_t, r) = tree();
    let d = open_dir_path(&r).unwrap();
    let d = d.as_fd();
    let file = c("file2");
    std::fs::write(r.join("file2"), b"x").unwrap();
    let fd = rustix::fs::openat(d, &file, OFlags::RDONLY, Mode::empty()).unwrap();
    if crate::sys::xattr::fset(fd.as_raw_fd(), b"user.k", b"v").is_err() {
        // No user xattrs on this filesystem.
        return;
    }
    let m = lstat_at(d, &file).unwrap().unwrap();
    let want = vec![(b"user.k".to_vec(), b"v".to_vec())];
    assert_eq!(crate::sys::xattr::list_at(d, &file, &m).unwrap(), want);
    assert_eq!(crate::sys::xattr::list_proc(d, &file).unwrap(), want);
    // A symlink's own (none), never its target's.
    let l = lstat_at(d, &c("indir")).unwrap().unwrap();
    assert!(crate::sys::xattr::list_at(d, &c("indir"), &l)
        .unwrap()
        .is_empty());
    // Another entry under the name since: refused, not taken for it.
    let other = lstat_at(d, &c("etc")).unwrap().unwrap();
    let e = crate::sys::xattr::list_at(d, &file, &other).unwrap_err();
    assert!(vanished(&e), "{e}");
}

#[test]
fn removal_never_follows_a_link_out() {
    let (t, r) = tree();
    std::fs::create_dir(t.path().join("keep")).unwrap();
    std::fs::write(t.path().join("keep/f"), b"x").unwrap();
    symlink(t.path().join("keep"), r.join("in/sub/link")).unwrap();
    let d = open_dir_path(&r).unwrap();
    remove_entry(d.as_fd(), &c("in")).unwrap();
    assert!(!r.join("in").exists());
    assert!(t.path().join("keep/f").exists());
    remove_entry(d.as_fd(), &c("in")).unwrap();
}

#[test]
fn inside_a_root_links_resolve_inside_it() {
    let (t, r) = tree();
    let root = Root::open(&r).unwrap();
    let read = |p: &str| root.read(p.as_bytes(), 1 << 20);
    assert_eq!(read("in/file").unwrap(), b"inside");
    assert_eq!(read("/in/file").unwrap(), b"inside");
    assert_eq!(read("indir/file").unwrap(), b"inside");
    // `..` stops at the root; an absolute link or path starts at it.
    assert_eq!(read("../../etc/passwd").unwrap(), b"the root's own");
    assert_eq!(read("etcpw").unwrap(), b"the root's own");
    assert_eq!(read("in/../../../etc/passwd").unwrap(), b"the root's own");
    for p in ["up", "in/upup", "abs", "procroot", "dangling"] {
        let e = read(p).unwrap_err();
        assert_eq!(code(&e), libc::ENOENT, "{p}: {e}");
    }
    let e = read("magic").unwrap_err();
    assert_eq!(code(&e), libc::ENOENT, "{e}");
    // Writes through a link land inside the root; the secret is never touched.
    root.write(b"etcpw", b"written", 0o644).unwrap();
    assert_eq!(std::fs::read(r.join("etc/passwd")).unwrap(), b"written");
    let e = root.write(b"up", b"no", 0o644).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    root.write(b"../new", b"made", 0o600).unwrap();
    assert_eq!(std::fs::read(r.join("new")).unwrap(), b"made");
    assert_eq!(std::fs::read(t.path().join("secret")).unwrap(), b"outside");
    assert!(!t.path().join("new").exists());
    // A FIFO is neither read nor written.
    rustix::fs::mkfifoat(root.fd(), "fifo", Mode::from_raw_mode(0o600)).unwrap();
    assert!(read("fifo").is_err());
    assert!(root.write(b"fifo", b"x", 0o600).is_err());
    // Directories, renames, removal, listing: of the entries named, links not followed.
    root.mkdir_all(b"/a/b/c", 0o755).unwrap();
    assert!(r.join("a/b/c").is_dir());
    root.mkdir_all(b"indir/deeper", 0o755).unwrap();
    assert!(r.join("in/deeper").is_dir());
    root.rename(b"abs", b"/a/moved").unwrap();
    assert!(std::fs::symlink_metadata(r.join("a/moved"))
        .unwrap()
        .is_symlink());
    assert!(root.lstat(b"a/moved").unwrap().is_symlink());
    assert!(root.stat(b"a/moved").is_err());
    assert!(root.stat(b"indir").unwrap().is_dir());
    assert_eq!(root.readlink(b"up").unwrap(), b"../secret");
    root.remove(b"up").unwrap();
    root.remove_all(b"indir").unwrap();
    assert!(r.join("in/file").exists());
    root.remove_all(b"in").unwrap();
    assert!(!r.join("in").exists());
    let names: Vec<Vec<u8>> = root.list(b"/").unwrap().into_iter().map(|e| e.0).collect();
    assert!(names.contains(&b"a".to_vec()) && names.contains(&b"etcpw".to_vec()));
    assert!(root.mkdir(b"..", 0o755).is_err());
    assert!(root.remove(b"").is_err());
    assert!(root.read(b"new", 2).is_err(), "over the limit");
    assert_eq!(std::fs::read(t.path().join("secret")).unwrap(), b"outside");
}
