//! The [`ObjectStore`] trait: content-addressed objects, verified on every read. Its
//! implementations: [`super::RocksObjectStore`] (the embedded default) and
//! [`super::remote_store::RemoteObjectStore`] (an S3-compatible bucket behind a local
//! cache).

use super::gc::Fence;
use super::{CasResult, ObjectId};

/// What a `put` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOutcome {
    pub id: ObjectId,
    /// False when the store already held the object (deduplicated).
    pub new: bool,
    /// Bytes written to the store (after compression); 0 when not new.
    pub stored_len: u64,
}

/// A content-addressed object store. Keys are blake3 hashes of the objects' bytes;
/// every read is verified against its key.
pub trait ObjectStore: Send + Sync {
    /// Stores `data` under its hash, unless already present.
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome>;

    /// Stores a tree or a chunk list: the same as `put`, with the hint that it is
    /// metadata, which a restore reads before any content (a remote store packs it
    /// apart from file contents, as restic keeps tree packs apart from data packs).
    fn put_metadata(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.put(data)
    }

    /// Reads and verifies an object. `what` names its type for the not-found error.
    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>>;

    /// Whether the object is present (not verified).
    fn contains(&self, id: &ObjectId) -> CasResult<bool>;

    /// Makes every object stored so far durable. Until it returns, objects written since
    /// the last sync may be lost in a crash, so nothing may refer to them before.
    fn sync(&self) -> CasResult<()>;

    /// The fence between writers and garbage collection, for stores that collect.
    fn fence(&self) -> Option<&Fence> {
        None
    }

    /// A hint that these objects will be read soon: a remote store fetches the ones it
    /// lacks locally, many at a time. Best effort: a failure shows at the read.
    fn prefetch(&self, _ids: &[ObjectId]) {}
}

/// What a sweep found and did.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct SweepReport {
    pub objects_total: u64,
    pub objects_kept: u64,
    /// Unreachable objects deleted (or, in a dry run, that would be).
    pub objects_freed: u64,
    /// Their stored (compressed) bytes.
    pub bytes_freed: u64,
    /// Objects put while the collection ran, kept although unmarked.
    pub kept_new: u64,
}
