//! Every fuzz target's check (src/fuzzing.rs) over every saved input: the seeds in
//! `fuzz/seeds/<target>/` and every crash the fuzzers ever found, kept in
//! `fuzz/regressions/<target>/`. Also over samples built here from real encoders,
//! which `CASFS_WRITE_FUZZ_SEEDS=1 cargo test --test fuzz_regressions` saves as seeds.

use std::fs;
use std::path::Path;

use casfs::cas::file::ChunkList;
use casfs::cas::object::encode_stored;
use casfs::cas::{ChunkId, EntryContent, FileId, Hash, Tree, TreeEntry, TreeId, CHUNK_SIZE};
use casfs::checkpoint::maintenance::MaintainOp;
use casfs::checkpoint::sync::dircache::DirCache;
use casfs::checkpoint::{Checkpoint, CheckpointId, NewCheckpoint, ThreadId};
use casfs::fs::dirty::{Kind, MountMeta, NodeRecord};
use casfs::fuzzing::TARGETS;
use casfs::mount::control::Request;
use casfs::sys::dirfd::Fingerprint;

fn sample_tree() -> Tree {
    let h = |s: &str| Hash::of(s.as_bytes());
    Tree::from_sorted_entries(vec![
        TreeEntry {
            name: b"a.txt".to_vec(),
            content: EntryContent::File(FileId(h("a"))),
            mode: 0o644,
            mtime_ns: 1_700_000_000_123_456_789,
            size: 5,
            xattrs: vec![(b"user.k".to_vec(), b"v".to_vec())],
        },
        TreeEntry {
            name: b"dir".to_vec(),
            content: EntryContent::Dir(TreeId(h("d"))),
            mode: 0o755,
            mtime_ns: -5,
            size: 0,
            xattrs: vec![],
        },
        TreeEntry {
            name: b"link".to_vec(),
            content: EntryContent::Symlink(b"a.txt".to_vec()),
            mode: 0o777,
            mtime_ns: 0,
            size: 5,
            xattrs: vec![],
        },
        TreeEntry {
            name: b"pipe".to_vec(),
            content: EntryContent::Fifo,
            mode: 0o600,
            mtime_ns: 1,
            size: 0,
            xattrs: vec![],
        },
    ])
    .unwrap()
}

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let tree = sample_tree();
    let list = ChunkList {
        chunks: vec![
            (ChunkId(Hash::of(b"c1")), CHUNK_SIZE as u32),
            (ChunkId(Hash::of(b"c2")), 17),
        ],
    };
    let mut new = NewCheckpoint::new(ThreadId::new("t").unwrap(), tree.id(), "sample");
    new.source_run_id = Some("run-1".into());
    let cp = Checkpoint::from_new(
        new,
        Some(CheckpointId(Hash::of(b"parent"))),
        std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000),
    );
    let record = NodeRecord {
        kind: Kind::File,
        mode: 0o644,
        uid: 0,
        gid: 0,
        rdev: 0,
        atime_ns: 1,
        mtime_ns: 2,
        ctime_ns: 3,
        size: 10,
        nlink: 1,
        xattrs: vec![],
        tree: None,
        clean: Some(FileId(Hash::of(b"x"))),
        upper: true,
        target: None,
    };
    let meta = MountMeta {
        base: tree.id(),
        tag: serde_json::value::to_raw_value(
            &serde_json::json!({"thread": "t", "base": null, "expected_head": null}),
        )
        .unwrap(),
    };
    let fp = Fingerprint {
        dev: 1,
        ino: 2,
        size: 5,
        mode: 0o100644,
        mtime_ns: 10,
        ctime_ns: 11,
    };
    let dircache = DirCache {
        tree_id: tree.id(),
        fingerprints: vec![Some(fp), None, None, None],
        tree: tree.clone(),
    };
    let requests = [
        Request::Status,
        Request::Checkpoint {
            reason: Some("r".into()),
        },
        Request::Restore {
            checkpoint: cp.id,
            thread: Some("t2".into()),
            force: true,
        },
        Request::Maintain(MaintainOp::Prune {
            keep_last: Some(3),
            keep_within_ms: Some(60_000),
            thread: None,
            dry_run: true,
            gc: true,
        }),
        Request::Maintain(MaintainOp::Fsck { repair: false }),
        Request::Maintain(MaintainOp::Gc {
            dry_run: false,
            grace_secs: Some(60),
            max_unused: Some(0.25),
        }),
    ];
    let mut out = vec![
        ("tree", tree.encode()),
        ("chunk_list", list.encode()),
        ("stored_object", encode_stored(b"a small object")),
        (
            "stored_object",
            encode_stored(&b"compressible ".repeat(500)),
        ),
        ("checkpoint_record", cp.encode()),
        ("dirty_set", serde_json::to_vec(&record).unwrap()),
        ("dirty_set", serde_json::to_vec(&meta).unwrap()),
        ("dirty_set", vec![1, 0, 0, 0, 0, 0, 0, 0, 7]),
        ("dircache", dircache.encode()),
        ("pack_index", pack_index_body()),
    ];
    for r in &requests {
        out.push(("control_request", serde_json::to_vec(r).unwrap()));
    }
    out
}

/// The zstd-framed body of a small pack index (the fuzz check frames its input).
fn pack_index_body() -> Vec<u8> {
    use casfs::cas::pack::{PackEntry, PackIndex};
    let e = |n: u8, offset, len| PackEntry {
        id: Hash::of(&[n]),
        offset,
        len,
    };
    let idx = PackIndex::build(&[
        (Hash::of(b"p1"), None, vec![e(1, 0, 10), e(2, 10, 5)]),
        (Hash::of(b"p2"), Some(1_700_000_000_000), vec![e(3, 0, 7)]),
    ])
    .unwrap();
    zstd::decode_all(&idx.encode()[9..]).unwrap()
}

#[test]
fn every_saved_fuzz_input_and_sample_passes_its_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let write = std::env::var_os("CASFS_WRITE_FUZZ_SEEDS").is_some();
    let samples = samples();
    for (i, (target, bytes)) in samples.iter().enumerate() {
        let (_, check) = TARGETS.iter().find(|(n, _)| n == target).unwrap();
        check(bytes);
        if write {
            let dir = root.join("seeds").join(target);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join(format!("sample-{i}")), bytes).unwrap();
        }
    }
    // Samples that decode must decode (the checks only look further when they do).
    assert!(Tree::decode(&samples[0].1).is_ok());
    assert!(ChunkList::decode(&samples[1].1).is_ok());
    let mut ran = 0;
    for (name, check) in TARGETS {
        for kind in ["seeds", "regressions"] {
            let Ok(rd) = fs::read_dir(root.join(kind).join(name)) else {
                continue;
            };
            for e in rd.flatten() {
                let bytes = fs::read(e.path()).unwrap();
                check(&bytes);
                ran += 1;
            }
        }
    }
    assert!(ran >= samples.len(), "saved inputs missing: {ran}");
}
