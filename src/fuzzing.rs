//! The checks the fuzz targets in `fuzz/` run on arbitrary bytes, one per decoder of
//! stored or received data; the regression test runs them over every input in
//! `fuzz/regressions/` and `fuzz/seeds/`. Each must return (an error is fine) and never
//! panic, hang or allocate without bound; where a decoder accepts its input, encoding
//! what it decoded must give the same bytes back (the formats are canonical) or at
//! least decode again to the same value.

use crate::cas::file::ChunkList;
use crate::cas::object::{decode_stored, encode_stored};
use crate::cas::{Hash, Tree};
use crate::checkpoint::sync::dircache::DirCache;
use crate::checkpoint::{Checkpoint, CheckpointId, LeaseRecord, WriterLease};
use crate::fs::dirty::{decode_override, MountMeta, NodeRecord};
use crate::mount::control::Request;

/// A check of arbitrary bytes.
pub type Check = fn(&[u8]);

/// The targets by name, as `fuzz/fuzz_targets/<name>.rs` call them.
pub const TARGETS: &[(&str, Check)] = &[
    ("tree", tree),
    ("chunk_list", chunk_list),
    ("stored_object", stored_object),
    ("checkpoint_record", checkpoint_record),
    ("control_request", control_request),
    ("dirty_set", dirty_set),
    ("dircache", dircache),
    ("pack_index", pack_index),
];

/// A tree object: canonical, so a decoded tree encodes to the input exactly.
pub fn tree(data: &[u8]) {
    if let Ok(t) = Tree::decode(data) {
        assert_eq!(
            t.encode(),
            data,
            "a decoded tree must re-encode to its bytes"
        );
    }
}

/// A large file's chunk list: canonical too.
pub fn chunk_list(data: &[u8]) {
    if let Ok(l) = ChunkList::decode(data) {
        assert_eq!(
            l.encode(),
            data,
            "a decoded chunk list must re-encode to its bytes"
        );
    }
}

/// A stored value (header byte, raw or zstd): checked against the hash of what it
/// claims to hold; and any content stored and read back is itself.
pub fn stored_object(data: &[u8]) {
    if let Some((_, rest)) = data.split_first() {
        // Whatever the bytes claim, the check against a key decides.
        let _ = decode_stored(&Hash::of(rest), data);
        let _ = decode_stored(&Hash::of(data), data);
    }
    let stored = encode_stored(data);
    assert_eq!(
        decode_stored(&Hash::of(data), &stored).expect("own encoding"),
        data
    );
}

/// A checkpoint record under the id its bytes hash to (so only the body is in
/// question).
pub fn checkpoint_record(data: &[u8]) {
    let id = CheckpointId(Hash::of(data));
    if let Ok(cp) = Checkpoint::decode(&id, data) {
        let again = cp.encode();
        let back = Checkpoint::decode(&CheckpointId(Hash::of(&again)), &again)
            .expect("a decoded record's encoding decodes");
        assert_eq!(back.body, cp.body);
    }
    let _ = serde_json::from_slice::<LeaseRecord>(data);
    let _ = serde_json::from_slice::<WriterLease>(data);
}

/// A line on a mount's control socket.
pub fn control_request(data: &[u8]) {
    if let Ok(line) = std::str::from_utf8(data) {
        if let Ok(req) = serde_json::from_str::<Request>(line) {
            let text = serde_json::to_string(&req).expect("a request serializes");
            serde_json::from_str::<Request>(&text).expect("and parses again");
        }
    }
}

/// A mount's dirty-set values: node records, mount records, entry overrides.
pub fn dirty_set(data: &[u8]) {
    let _ = serde_json::from_slice::<NodeRecord>(data);
    let _ = serde_json::from_slice::<MountMeta>(data);
    let _ = decode_override(data);
}

/// A directory-cache entry: canonical when it decodes.
pub fn dircache(data: &[u8]) {
    if let Some(d) = DirCache::decode(data) {
        assert_eq!(
            d.encode(),
            data,
            "a decoded cache entry must re-encode to its bytes"
        );
    }
}

/// A pack index (`cas::pack`): the input as a whole file and, so that the fuzzer gets
/// past the zstd frame, as the body of one. What decodes finds each of its entries,
/// and re-encodes to an index that decodes to the same entries.
pub fn pack_index(data: &[u8]) {
    let _ = crate::cas::pack::PackIndex::decode("fuzz", data);
    let mut file = b"casfsidx\x01".to_vec();
    file.extend_from_slice(&zstd::bulk::compress(data, 1).expect("zstd compresses memory"));
    if let Ok(idx) = crate::cas::pack::PackIndex::decode("fuzz", &file) {
        let entries: Vec<_> = idx.iter().collect();
        for (h, l) in &entries {
            assert_eq!(idx.find(h).as_ref(), Some(l), "every entry is found");
        }
        let again = crate::cas::pack::PackIndex::decode("fuzz", &idx.encode())
            .expect("a decoded index re-encodes to one that decodes");
        assert_eq!(again.iter().collect::<Vec<_>>(), entries);
        assert_eq!(again.packs(), idx.packs());
    }
}
