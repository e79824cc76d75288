//! The content-addressed store: hashes and typed ids, object encoding with zstd and
//! verification, fixed-size chunking of large files, canonical trees, and the
//! [`ObjectStore`] trait with its RocksDB implementation.
//!
//! This layer knows nothing of checkpoints, threads or FUSE.

mod encoding;
mod error;
pub mod file;
mod hash;
pub mod object;
pub mod rocks;
mod store;
pub mod tree;

pub use error::{CasError, CasResult};
pub use file::{FileRef, StoreStats, CHUNK_SIZE};
pub use hash::{decode_hex, ChunkId, FileId, Hash, ObjectId, ParseIdError, TreeId, HASH_LEN};
pub use rocks::Database;
pub use store::{ObjectStore, PutOutcome, RocksObjectStore};
pub use tree::{EntryContent, Tree, TreeEntry};

/// Reads and decodes a tree object.
pub fn load_tree(store: &dyn ObjectStore, id: &TreeId) -> CasResult<Tree> {
    let bytes = store.get(&ObjectId(id.0), "tree")?;
    Tree::decode(&bytes).map_err(|detail| CasError::Decode {
        what: "tree",
        id: id.0,
        detail,
    })
}

/// Encodes and stores a tree object.
pub fn store_tree(store: &dyn ObjectStore, tree: &Tree) -> CasResult<(TreeId, PutOutcome)> {
    let p = store.put(&tree.encode())?;
    Ok((TreeId(p.id.0), p))
}
