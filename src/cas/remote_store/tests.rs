//! The remote store against a local directory (`file://`): packing order, uploads and reads.

use super::upload::tree_order;
use super::*;
use crate::cas::file::ChunkList;
use crate::cas::hash::{ChunkId, FileId, TreeId};
use crate::cas::rocks_store::RocksObjectStore;
use crate::cas::tree::{EntryContent, Tree, TreeEntry};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

fn entry(name: &str, content: EntryContent) -> TreeEntry {
    let size = u64::from(matches!(content, EntryContent::File(_)));
    TreeEntry {
        name: name.into(),
        content,
        mode: 0o644,
        mtime_ns: 0,
        size,
        xattrs: Vec::new(),
    }
}

fn open_at(dir: &std::path::Path, remote: &std::path::Path) -> RemoteObjectStore {
    let db = Arc::new(crate::cas::kv::Database::open(&dir.join("db"), &[]).unwrap());
    let local = Arc::new(RocksObjectStore::new(db));
    let url = format!("file://{}", remote.display());
    RemoteObjectStore::open(local, &url, None).unwrap()
}

/// A pack that cannot be uploaded fails the sync naming it, no index names what did
/// not arrive, and the next sync uploads everything.
#[test]
fn a_failed_pack_upload_is_named_and_indexes_nothing() {
    let t = tempfile::tempdir().unwrap();
    let remote = t.path().join("remote");
    std::fs::create_dir_all(&remote).unwrap();
    // Where the packs go stands a file: every pack upload fails.
    std::fs::write(remote.join("packs"), b"not a directory").unwrap();
    let a = open_at(&t.path().join("a"), &remote);
    a.set_pack_size(64 << 10).unwrap();
    let data: Vec<Vec<u8>> = (0..40u8)
        .map(|i| {
            (0..20_000u32)
                .map(|j| (j.wrapping_mul(i as u32 + 7) >> 3) as u8)
                .collect()
        })
        .collect();
    let ids: Vec<ObjectId> = data.iter().map(|d| a.put(d).unwrap().id).collect();
    let err = a.sync().unwrap_err().to_string();
    assert!(err.contains("uploading pack"), "{err}");
    assert!(
        !remote.join("index").exists()
            || std::fs::read_dir(remote.join("index")).unwrap().count() == 0
    );
    assert_eq!(a.stats().uploaded_packs, 0);
    // Repaired: the next sync uploads every object, and a fresh host reads them.
    std::fs::remove_file(remote.join("packs")).unwrap();
    a.sync().unwrap();
    assert_eq!(a.stats().uploaded_objects, 40);
    let b = open_at(&t.path().join("b"), &remote);
    for (id, d) in ids.iter().zip(&data) {
        assert_eq!(&b.get(id, "blob").unwrap(), d);
    }
}

#[test]
fn packs_follow_a_walk_of_the_trees() {
    let h = |s: &str| Hash::of(s.as_bytes());
    let (a1, a2, b1, top, c1, c2, loose) = (
        h("a1"),
        h("a2"),
        h("b1"),
        h("top"),
        h("c1"),
        h("c2"),
        h("loose"),
    );
    // A large file: a chunk list of two chunks.
    let list = ChunkList {
        chunks: vec![
            (ChunkId(c1), crate::cas::file::CHUNK_SIZE as u32),
            (ChunkId(c2), 1),
        ],
    }
    .encode();
    let big = Hash::of(&list);
    let dir_a = Tree::from_entries(vec![
        entry("2", EntryContent::File(FileId(a2))),
        entry("1", EntryContent::File(FileId(a1))),
    ])
    .unwrap()
    .encode();
    let dir_b = Tree::from_entries(vec![entry("1", EntryContent::File(FileId(b1)))])
        .unwrap()
        .encode();
    let (ta, tb) = (Hash::of(&dir_a), Hash::of(&dir_b));
    let root = Tree::from_entries(vec![
        entry("a", EntryContent::Dir(TreeId(ta))),
        entry("b", EntryContent::Dir(TreeId(tb))),
        entry("big", EntryContent::File(FileId(big))),
        entry("top", EntryContent::File(FileId(top))),
    ])
    .unwrap()
    .encode();
    let tr = Hash::of(&root);
    let content: HashMap<Hash, Vec<u8>> =
        [(ta, dir_a), (tb, dir_b), (tr, root), (big, list)].into();
    let metadata: HashSet<Hash> = content.keys().copied().collect();
    // As two capture threads put them: interleaved, the root last; b1 was put
    // before (not pending); one object no tree names.
    let put = [c2, a2, top, loose, c1, a1, ta, big, tb, tr];
    let got = tree_order(&put, &metadata, |id| content.get(id).cloned());
    assert_eq!(got, vec![tr, ta, a1, a2, tb, big, c1, c2, top, loose]);
    // No trees among them: the order they were put.
    assert_eq!(
        tree_order(&put[..4], &metadata, |_| None),
        put[..4].to_vec()
    );
}
