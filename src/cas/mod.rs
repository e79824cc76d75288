//! The content-addressed store: hashes and typed ids, object encoding with zstd and
//! verification, fixed-size chunking of large files, canonical trees, and the
//! [`ObjectStore`] trait with its RocksDB implementation.
//!
//! This layer knows nothing of checkpoints, threads or FUSE.

mod encoding;
mod error;
pub mod fence;
pub mod file;
pub mod gc;
mod hash;
pub mod kv;
pub mod object;
pub mod pack;
pub mod remote_index;
pub mod remote_store;
mod rocks_store;
mod store;
pub mod tree;
pub mod tree_io;

pub use error::{CasError, CasResult};
pub use fence::{Fence, WriteSession};
pub use file::{FileRef, StoreStats, CHUNK_SIZE};
pub use gc::{Marker, Problem};
pub use hash::{decode_hex, ChunkId, FileId, Hash, ObjectId, ParseIdError, TreeId, HASH_LEN};
pub use kv::{set_default_block_cache, Batch, Column, Database};
pub use rocks_store::RocksObjectStore;
pub use store::{write_session, ObjectStore, PutOutcome, Staged, StagedReader, SweepReport};
pub use tree::{EntryContent, Paired, Tree, TreeEntry, TreeFacts, MAX_TREE_DEPTH};
pub use tree_io::{
    file_at, join_path, load_tree, paths_between, store_tree, store_tree_over, walk_pairs, Below,
    PairVisitor,
};
