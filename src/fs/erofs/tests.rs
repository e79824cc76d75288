//! Images mounted by the kernel and read back against their trees, and the writer's own checks.

use super::*;
use crate::cas::file::{store_bytes, StoreStats};
use crate::cas::{store_tree, Database, RocksObjectStore, Tree};
use std::sync::Arc;

/// A store in a temporary directory, if this runs as root (mounting an image needs
/// it); None, and the test skipped, otherwise.
fn store_if_root() -> Option<(tempfile::TempDir, RocksObjectStore)> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting an image needs root");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(Database::open(&dir.path().join("db"), &[]).unwrap());
    Some((dir, RocksObjectStore::new(db)))
}

#[test]
fn data_names_round_trip_and_refuse_anything_else() {
    let f = FileRef {
        id: crate::cas::FileId(crate::cas::Hash::of(b"x")),
        size: 12345,
    };
    let p = data_path(&f);
    assert_eq!(parse_data_name(&p.as_bytes()[1..]), Some(f));
    for bad in [
        &b"abc-1"[..],
        b"",
        b"-",
        &p.as_bytes()[1..65],
        format!("{}-", &p[1..65]).as_bytes(),
        format!("{}-1x", &p[1..65]).as_bytes(),
        format!("{}--1", &p[1..65]).as_bytes(),
    ] {
        assert_eq!(
            parse_data_name(bad),
            None,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn devices_encode_as_the_kernel_does() {
    assert_eq!(encode_dev(libc::makedev(1, 3)), Some(0x103));
    assert_eq!(encode_dev(libc::makedev(8, 0x12345)), Some(0x12300845));
    assert_eq!(encode_dev(libc::makedev(4096, 0)), None);
}

#[test]
fn entries_split_into_blocks_that_fit() {
    let e: Vec<_> = (0..1000)
        .map(|i| (format!("name-{i:05}").into_bytes(), 0usize, 1u8))
        .collect();
    let (blocks, tail) = split_blocks(&e);
    assert_eq!(blocks.iter().sum::<usize>(), 1000);
    assert!(blocks.len() > 1);
    for &b in &blocks[..blocks.len() - 1] {
        assert!(b * (DIRENT_SIZE + 10) <= BLOCK && (b + 1) * (DIRENT_SIZE + 10) > BLOCK);
    }
    assert_eq!(tail, blocks.last().unwrap() * (DIRENT_SIZE + 10));
}

/// A tree with what a workspace holds (and what the format finds hard: a directory
/// of many blocks, names sorting before `.`, long symlinks, xattrs, devices,
/// negative times), written as an image, mounted by the kernel and read back.
#[test]
fn the_kernel_reads_back_the_tree() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Some((dir, store)) = store_if_root() else {
        return;
    };
    let mut st = StoreStats::default();
    let e = |name: &[u8], content, mode, size, xattrs: Vec<(Vec<u8>, Vec<u8>)>| TreeEntry {
        name: name.to_vec(),
        content,
        mode,
        mtime_ns: 1_700_000_000_123_456_789,
        size,
        xattrs,
    };
    let mut big = Vec::new();
    for i in 0..1500 {
        let f = store_bytes(&store, format!("f{i}").as_bytes(), &mut st).unwrap();
        big.push(e(
            format!("entry-with-a-longish-name-{i:05}").as_bytes(),
            EntryContent::File(f.id),
            0o644,
            f.size,
            vec![],
        ));
    }
    let (big_id, _) = store_tree(&store, &Tree::from_entries(big).unwrap()).unwrap();
    let hello = store_bytes(&store, b"hello\n", &mut st).unwrap();
    let empty = store_bytes(&store, b"", &mut st).unwrap();
    let (sub_id, _) = store_tree(&store, &Tree::default()).unwrap();
    let long_target = vec![b'x'; 4000];
    let mut old = e(
        b"old",
        EntryContent::File(hello.id),
        0o600,
        hello.size,
        vec![],
    );
    old.mtime_ns = -1_500_000_000;
    let root_entries = vec![
        e(b"!first", EntryContent::File(empty.id), 0o644, 0, vec![]),
        e(b"-dash", EntryContent::Dir(sub_id), 0o700, 0, vec![]),
        e(b"big", EntryContent::Dir(big_id), 0o755, 0, vec![]),
        e(
            b"hello",
            EntryContent::File(hello.id),
            0o4755,
            hello.size,
            vec![
                (b"security.x".to_vec(), b"s".to_vec()),
                (b"user.note".to_vec(), b"v".repeat(300)),
            ],
        ),
        e(b"fifo", EntryContent::Fifo, 0o640, 0, vec![]),
        e(
            b"null",
            EntryContent::CharDevice {
                rdev: libc::makedev(1, 3),
            },
            0o666,
            0,
            vec![],
        ),
        e(
            b"sda",
            EntryContent::BlockDevice {
                rdev: libc::makedev(8, 0x12345),
            },
            0o660,
            0,
            vec![],
        ),
        e(
            b"link",
            EntryContent::Symlink(b"hello".to_vec()),
            0o777,
            5,
            vec![],
        ),
        e(
            b"long",
            EntryContent::Symlink(long_target.clone()),
            0o777,
            4000,
            vec![],
        ),
        old,
    ];
    let (root, _) = store_tree(&store, &Tree::from_entries(root_entries).unwrap()).unwrap();
    let image = dir.path().join("tree.erofs");
    let stats = write_image(&store, &root, &image, 0, 0).unwrap();
    assert_eq!(stats.inodes, 1 + 10 + 1500);
    let mnt = dir.path().join("mnt");
    let _guard = Mounted::new(&image, &mnt);

    let names = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names(&mnt),
        ["!first", "-dash", "big", "fifo", "hello", "link", "long", "null", "old", "sda"]
    );
    assert_eq!(names(&mnt.join("big")).len(), 1500);
    assert!(names(&mnt.join("-dash")).is_empty());
    let m = std::fs::metadata(mnt.join("big/entry-with-a-longish-name-01234")).unwrap();
    assert_eq!((m.size(), m.mode()), (5, 0o100644));
    let redirect = xattr(
        &mnt.join("big/entry-with-a-longish-name-01234"),
        "trusted.overlay.redirect",
    );
    let f = store_bytes(&store, b"f1234", &mut st).unwrap();
    assert_eq!(redirect.unwrap(), data_path(&f).into_bytes());
    let m = std::fs::metadata(mnt.join("hello")).unwrap();
    assert_eq!((m.size(), m.mode() & 0o7777), (6, 0o4755));
    assert_eq!((m.mtime(), m.mtime_nsec()), (1_700_000_000, 123_456_789));
    assert_eq!(
        xattr(&mnt.join("hello"), "user.note").unwrap(),
        b"v".repeat(300)
    );
    assert_eq!(xattr(&mnt.join("hello"), "security.x").unwrap(), b"s");
    assert!(xattr(&mnt.join("hello"), "trusted.overlay.metacopy").is_some());
    let m = std::fs::metadata(mnt.join("old")).unwrap();
    assert_eq!((m.mtime(), m.mtime_nsec()), (-2, 500_000_000));
    let m = std::fs::metadata(mnt.join("!first")).unwrap();
    assert_eq!(m.size(), 0);
    assert!(xattr(&mnt.join("!first"), "trusted.overlay.redirect").is_none());
    assert_eq!(
        std::fs::read_link(mnt.join("link")).unwrap(),
        Path::new("hello")
    );
    assert_eq!(
        std::fs::read_link(mnt.join("long"))
            .unwrap()
            .as_os_str()
            .len(),
        long_target.len()
    );
    let m = std::fs::symlink_metadata(mnt.join("null")).unwrap();
    assert!(m.file_type().is_char_device());
    assert_eq!(m.rdev(), libc::makedev(1, 3));
    let m = std::fs::symlink_metadata(mnt.join("sda")).unwrap();
    assert!(m.file_type().is_block_device());
    assert_eq!(m.rdev(), libc::makedev(8, 0x12345));
    assert!(std::fs::symlink_metadata(mnt.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    let m = std::fs::metadata(mnt.join("-dash")).unwrap();
    assert_eq!((m.mode(), m.nlink()), (0o40700, 2));
    assert_eq!(std::fs::metadata(&mnt).unwrap().nlink(), 4);
    assert!(std::fs::metadata(mnt.join("big/nope")).is_err());
}

/// An image mounted at a new directory; detached when dropped.
struct Mounted(std::ffi::CString);

impl Mounted {
    fn new(image: &Path, mnt: &Path) -> Mounted {
        std::fs::create_dir(mnt).unwrap();
        mount_image(image, mnt).expect("mount the image");
        Mounted(std::ffi::CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Names and sizes at the format's edges: 255-byte names, bytes that are not UTF-8,
/// newlines and backslashes; directories whose entries fill a block exactly, or
/// leave a tail of just under and just over the inline limit; an xattr of 60,000
/// bytes (its inode cannot hold a tail inline). Every name is found by lookup and
/// by listing, every size and xattr reads back.
#[test]
fn names_and_sizes_at_the_edges_read_back() {
    use std::collections::BTreeSet;
    use std::os::unix::ffi::OsStrExt;
    let Some((dir, store)) = store_if_root() else {
        return;
    };
    let mut st = StoreStats::default();
    let f = store_bytes(&store, b"content", &mut st).unwrap();
    let file = |name: Vec<u8>, xattrs| TreeEntry {
        name,
        content: EntryContent::File(f.id),
        mode: 0o644,
        mtime_ns: 0,
        size: f.size,
        xattrs,
    };
    // Entry sizes: 12 bytes of dirent + the name. `.` and `..` take 12 + 1 and
    // 12 + 2. Names of n bytes for a block of exactly 4096: 4096 - 27 = 4069 left.
    let exact: Vec<Vec<u8>> = {
        let mut v = Vec::new();
        let mut left = 4069usize;
        let mut i = 0;
        while left > 0 {
            // 112 bytes while what stays can still hold an entry (13 bytes).
            let len = if left >= 112 + 13 { 100 } else { left - 12 };
            let mut name = format!("x{i:04}-").into_bytes();
            name.resize(len, b'e');
            left -= 12 + len;
            v.push(name);
            i += 1;
        }
        v
    };
    let tail_names = |total: usize| {
        // Entries of 12 + 50 bytes after `.` and `..` (27 bytes) up to `total`.
        let mut v = Vec::new();
        let mut used = 27;
        let mut i = 0;
        while used + 62 <= total {
            let mut name = format!("t{i:04}-").into_bytes();
            name.resize(50, b't');
            v.push(name);
            used += 62;
            i += 1;
        }
        v
    };
    let mut odd: Vec<Vec<u8>> = vec![
        vec![b'n'; 255],
        b"new\nline".to_vec(),
        b"back\\slash".to_vec(),
        vec![0xff, 0xfe, b'x'],
        b"-".to_vec(),
        b"\x01low".to_vec(),
        b"sp ace".to_vec(),
    ];
    odd.sort();
    let mut dirs = Vec::new();
    for (name, names) in [
        (&b"exact"[..], exact.clone()),
        (b"tail-2040", tail_names(2040)),
        (b"tail-2110", tail_names(2110)),
        (b"odd", odd.clone()),
    ] {
        let t =
            Tree::from_entries(names.iter().map(|n| file(n.clone(), vec![])).collect()).unwrap();
        let (id, _) = store_tree(&store, &t).unwrap();
        dirs.push((name.to_vec(), id, names));
    }
    let mut root = vec![file(
        b"big-xattr".to_vec(),
        vec![(b"user.big".to_vec(), vec![b'v'; 60_000])],
    )];
    for (name, id, _) in &dirs {
        root.push(TreeEntry {
            name: name.clone(),
            content: EntryContent::Dir(*id),
            mode: 0o755,
            mtime_ns: 0,
            size: 0,
            // A large xattr on one directory only: it keeps that one's tail out of
            // the inode, which the tail-* directories must not be.
            xattrs: if name == b"odd" {
                vec![(b"user.d".to_vec(), vec![b'd'; 3000])]
            } else {
                vec![]
            },
        });
    }
    let (root, _) = store_tree(&store, &Tree::from_entries(root).unwrap()).unwrap();
    let image = dir.path().join("edges.erofs");
    write_image(&store, &root, &image, 0, 0).unwrap();
    let mnt = dir.path().join("mnt");
    let _guard = Mounted::new(&image, &mnt);
    for (name, _, names) in &dirs {
        let d = mnt.join(std::ffi::OsStr::from_bytes(name));
        let listed: BTreeSet<Vec<u8>> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().as_bytes().to_vec())
            .collect();
        let want: BTreeSet<Vec<u8>> = names.iter().cloned().collect();
        assert_eq!(listed, want, "{}", String::from_utf8_lossy(name));
        for n in names {
            let m = std::fs::metadata(d.join(std::ffi::OsStr::from_bytes(n))).unwrap();
            assert_eq!(m.len(), 7, "{:?}", String::from_utf8_lossy(n));
        }
        if name == b"odd" {
            assert_eq!(xattr(&d, "user.d").unwrap(), vec![b'd'; 3000]);
        }
    }
    assert_eq!(
        xattr(&mnt.join("big-xattr"), "user.big").unwrap(),
        vec![b'v'; 60_000]
    );
    assert!(xattr(&mnt.join("big-xattr"), "trusted.overlay.redirect").is_some());
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let p = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 65536];
    // SAFETY: NUL-terminated strings and a buffer of the given length.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (r >= 0).then(|| buf[..r as usize].to_vec())
}
