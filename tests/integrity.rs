//! Damaged or hostile stored data: corrupt objects are integrity errors that name the
//! hash and write nothing wrong; trees with names that would escape the destination are
//! refused before anything is written.

mod common;

use std::fs;
use std::time::Duration;

use casfs::cas::kv::OBJECTS_CF;
use casfs::cas::{load_tree, Hash, TreeId};
use casfs::checkpoint::{NewCheckpoint, OpenMode, Store, ThreadId};
use common::*;

fn open(dir: &std::path::Path) -> Store {
    Store::open(dir, OpenMode::MustExist, Duration::from_secs(5)).unwrap()
}

#[test]
fn a_flipped_byte_is_an_integrity_error_naming_the_hash() {
    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    let work = t.path().join("work");
    fs::create_dir(&work).unwrap();
    fs::write(work.join("good.txt"), b"fine").unwrap();
    fs::write(work.join("victim.txt"), pattern(20_000, 9)).unwrap();
    ok(
        &store_dir,
        &["capture", work.to_str().unwrap(), "-t", "main"],
    );

    // Find the victim's object and flip a byte in its stored value.
    let victim = {
        let store = open(&store_dir);
        let head = store
            .checkpoints()
            .head(&ThreadId::new("main").unwrap())
            .unwrap()
            .unwrap();
        let root = store.checkpoints().get(&head).unwrap().body.root;
        let tree = load_tree(store.objects(), &root).unwrap();
        let id = tree.get(b"victim.txt").unwrap().file_ref().unwrap().id;
        let db = store.database();
        let col = db.column(OBJECTS_CF);
        let mut raw = col.get(id.0.as_bytes()).unwrap().unwrap();
        let n = raw.len() / 2;
        raw[n] ^= 0x40;
        col.put(id.0.as_bytes(), &raw, true).unwrap();
        id
    };

    let out = casfs(&store_dir, &["cat", "@main", "victim.txt"]);
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "no bytes of a corrupt file are printed"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("integrity error"), "{err}");
    assert!(err.contains(&victim.to_hex()), "{err}");
    assert_eq!(ok(&store_dir, &["cat", "@main", "good.txt"]), "fine");

    let dest = t.path().join("dest");
    let err = fails(
        &store_dir,
        &["restore", dest.to_str().unwrap(), "-t", "main"],
    );
    assert!(err.contains(&victim.to_hex()), "{err}");
    assert!(
        !dest.join("victim.txt").exists(),
        "nothing wrong is written"
    );
    for e in fs::read_dir(&dest).unwrap() {
        let name = e.unwrap().file_name();
        assert!(
            !name.to_string_lossy().starts_with(".casfs-restore"),
            "temporary file left behind"
        );
    }
}

/// Encodes by hand, bypassing the validating encoder, a tree of one empty file.
fn raw_tree(name: &[u8], content: &Hash) -> Vec<u8> {
    let mut v = vec![1u8, 1, name.len() as u8];
    v.extend_from_slice(name);
    v.push(1); // kind: file
    v.extend_from_slice(&[0xa4, 0x03]); // mode 0o644
    v.push(0); // mtime 0
    v.push(0); // size 0
    v.extend_from_slice(content.as_bytes());
    v.push(0); // no xattrs
    v
}

#[test]
fn hostile_names_in_a_stored_tree_are_refused_before_writing() {
    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    ok(&store_dir, &["init"]);
    let dest = t.path().join("dest");
    fs::create_dir(&dest).unwrap();
    fs::write(dest.join("keep"), b"untouched").unwrap();
    let empty = Hash::of(b"");

    let cases: Vec<(&[u8], &str)> = vec![
        (b"..", "\"..\" is not allowed"),
        (b".", "\".\" is not allowed"),
        (b"a/b", "contains '/'"),
        (b"/etc", "contains '/'"),
        (b"a\0b", "contains NUL"),
    ];
    for (i, (name, msg)) in cases.into_iter().enumerate() {
        let thread = format!("evil{i}");
        {
            let store = open(&store_dir);
            store.objects().put(b"").unwrap();
            let bytes = raw_tree(name, &empty);
            let root = TreeId(store.objects().put(&bytes).unwrap().id.0);
            let th = ThreadId::new(&thread).unwrap();
            let lease = store
                .checkpoints()
                .acquire_writer(&th, "test", Duration::from_secs(10))
                .unwrap();
            store
                .checkpoints()
                .append(NewCheckpoint::new(th, root, "evil"), None, &lease)
                .unwrap();
            store.checkpoints().release(&lease).unwrap();
        }
        let err = fails(
            &store_dir,
            &["restore", dest.to_str().unwrap(), "-t", &thread, "--force"],
        );
        assert!(
            err.contains(msg),
            "{:?}: {err}",
            String::from_utf8_lossy(name)
        );
        assert_eq!(fs::read(dest.join("keep")).unwrap(), b"untouched");
        assert_eq!(fs::read_dir(&dest).unwrap().count(), 1);
    }
}

#[test]
fn a_symlinked_parent_in_the_destination_is_never_followed() {
    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    let work = t.path().join("work");
    fs::create_dir_all(work.join("sub/inner")).unwrap();
    fs::write(work.join("sub/inner/file"), b"data").unwrap();
    ok(
        &store_dir,
        &["capture", work.to_str().unwrap(), "-t", "main"],
    );

    let dest = t.path().join("dest");
    let outside = t.path().join("outside");
    fs::create_dir_all(outside.join("inner")).unwrap();
    fs::create_dir(&dest).unwrap();
    std::os::unix::fs::symlink(&outside, dest.join("sub")).unwrap();
    ok(
        &store_dir,
        &["restore", dest.to_str().unwrap(), "-t", "main", "--force"],
    );
    assert!(!fs::symlink_metadata(dest.join("sub")).unwrap().is_symlink());
    assert_eq!(fs::read(dest.join("sub/inner/file")).unwrap(), b"data");
    assert!(
        !outside.join("inner/file").exists(),
        "wrote through a symlink"
    );
    assert!(
        outside.join("inner").is_dir(),
        "removed outside the destination"
    );
}

/// A tree naming a file, or a large file's chunk, that the store does not have: the
/// restore names the missing object and changes nothing in the destination.
#[test]
fn a_missing_file_or_chunk_stops_the_restore_before_anything_changes() {
    use casfs::cas::file::ChunkList;
    use casfs::cas::{store_tree, ChunkId, EntryContent, FileId, Tree, TreeEntry, CHUNK_SIZE};

    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    ok(&store_dir, &["init"]);
    let dest = t.path().join("dest");
    fs::create_dir(&dest).unwrap();
    fs::write(dest.join("keep"), b"untouched").unwrap();
    let missing = Hash::of(b"never stored");
    let present = Hash::of(&[7u8; CHUNK_SIZE]);
    let file = |name: &str, id: Hash, size: u64| TreeEntry {
        name: name.as_bytes().to_vec(),
        content: EntryContent::File(FileId(id)),
        mode: 0o644,
        mtime_ns: 0,
        size,
        xattrs: Vec::new(),
    };
    for (thread, what) in [("no-file", "file"), ("no-chunk", "chunk")] {
        {
            let store = open(&store_dir);
            let o = store.objects();
            o.put(b"here").unwrap();
            let mut entries = vec![file("a-small", Hash::of(b"here"), 4)];
            if what == "file" {
                entries.push(file("b-gone", missing, 10));
            } else {
                // Two chunks: one stored, one not; the list itself is stored.
                o.put(&[7u8; CHUNK_SIZE]).unwrap();
                let list = ChunkList {
                    chunks: vec![
                        (ChunkId(present), CHUNK_SIZE as u32),
                        (ChunkId(missing), 10),
                    ],
                };
                let id = o.put_metadata(&list.encode()).unwrap().id.0;
                entries.push(file("b-large", id, CHUNK_SIZE as u64 + 10));
            }
            let (root, _) = store_tree(o, &Tree::from_entries(entries).unwrap()).unwrap();
            let th = ThreadId::new(thread).unwrap();
            let lease = store
                .checkpoints()
                .acquire_writer(&th, "test", Duration::from_secs(10))
                .unwrap();
            store
                .checkpoints()
                .append(NewCheckpoint::new(th, root, "gap"), None, &lease)
                .unwrap();
            store.checkpoints().release(&lease).unwrap();
        }
        let err = fails(
            &store_dir,
            &["restore", dest.to_str().unwrap(), "-t", thread, "--force"],
        );
        assert!(err.contains(&missing.to_string()[..12]), "{what}: {err}");
        assert!(err.contains(what), "{what}: {err}");
        assert_eq!(fs::read(dest.join("keep")).unwrap(), b"untouched");
        assert_eq!(
            fs::read_dir(&dest).unwrap().count(),
            1,
            "{what}: nothing written"
        );
    }
}
