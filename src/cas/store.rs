//! The [`ObjectStore`] trait: content-addressed objects, verified on every read. It
//! knows none of its implementations (they depend on it): the embedded RocksDB default
//! in `rocks_store` and the S3-compatible bucket behind a local cache in
//! `remote_store`.

use std::collections::HashMap;

use super::error::CasResult;
use super::fence::{Fence, WriteSession};
use super::hash::{Hash, ObjectId, TreeId};
use super::tree::TreeFacts;

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

    /// What is known of tree `id` and the trees below it, if it was noted
    /// ([`crate::cas::tree_io::store_tree`] notes it for the trees it stores).
    fn tree_facts(&self, _id: &TreeId) -> Option<TreeFacts> {
        None
    }

    /// Notes `facts` of tree `id`. They follow from the tree's content, so they hold
    /// for ever (whatever becomes of the tree object). Best effort: a store may keep
    /// nothing.
    fn note_tree_facts(&self, _id: &TreeId, _facts: TreeFacts) {}

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

    /// Like [`ObjectStore::prefetch`] but returns at once: the reads go on in the
    /// background, for objects likely wanted a little later (a listing's
    /// subdirectories' subdirectories). Best effort, and nothing of the store is kept
    /// alive by it.
    fn read_ahead(&self, _ids: Vec<ObjectId>) {}

    /// Reads those of `ids` that are not stored locally into memory, verified, many at
    /// a time, without keeping them in the local store: for work that writes them
    /// elsewhere at once (a plain restore writes them into files, which are then the
    /// local copy). Read them through [`StagedReader`]. A store whose objects are all
    /// local stages nothing. Best effort: an object that could not be staged is read
    /// (and its failure reported) by `get`.
    fn stage(&self, _ids: &[ObjectId]) -> Staged {
        Staged::default()
    }
}

/// Objects [`ObjectStore::stage`] read ahead: decoded and verified against their ids.
#[derive(Default)]
pub struct Staged {
    objects: HashMap<Hash, Vec<u8>>,
}

impl Staged {
    /// Keeps `data`, which the caller verified to be the object `id`.
    pub(super) fn insert(&mut self, id: Hash, data: Vec<u8>) {
        self.objects.insert(id, data);
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}

/// Reads staged objects from memory and everything else from the store; writes go to
/// the store.
pub struct StagedReader<'a> {
    staged: &'a Staged,
    store: &'a dyn ObjectStore,
}

impl<'a> StagedReader<'a> {
    pub fn new(staged: &'a Staged, store: &'a dyn ObjectStore) -> Self {
        StagedReader { staged, store }
    }
}

impl ObjectStore for StagedReader<'_> {
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.store.put(data)
    }

    fn put_metadata(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.store.put_metadata(data)
    }

    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        match self.staged.objects.get(&id.0) {
            Some(data) => Ok(data.clone()),
            None => self.store.get(id, what),
        }
    }

    fn tree_facts(&self, id: &TreeId) -> Option<TreeFacts> {
        self.store.tree_facts(id)
    }

    fn note_tree_facts(&self, id: &TreeId, facts: TreeFacts) {
        self.store.note_tree_facts(id, facts)
    }

    fn contains(&self, id: &ObjectId) -> CasResult<bool> {
        Ok(self.staged.objects.contains_key(&id.0) || self.store.contains(id)?)
    }

    fn sync(&self) -> CasResult<()> {
        self.store.sync()
    }

    fn fence(&self) -> Option<&Fence> {
        self.store.fence()
    }

    fn prefetch(&self, ids: &[ObjectId]) {
        self.store.prefetch(ids)
    }

    fn read_ahead(&self, ids: Vec<ObjectId>) {
        self.store.read_ahead(ids)
    }

    fn stage(&self, ids: &[ObjectId]) -> Staged {
        self.store.stage(ids)
    }
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

/// Holds a write session on `store`'s fence, if it has one.
pub fn write_session(store: &dyn ObjectStore) -> WriteSession<'_> {
    match store.fence() {
        Some(f) => f.session(),
        None => WriteSession::none(),
    }
}
