//! An [`ObjectStore`] on S3-compatible object storage (or GCS, Azure, a local
//! directory: anything the `object_store` crate reaches), with the store's own RocksDB
//! as a read-through cache. Objects travel in packs ([`super::pack`]).
//!
//! - `put` stores locally and remembers the object; `sync` (which every capture runs
//!   before it appends) uploads what the remote lacks: it lists the remote's indexes
//!   (reading only those it has not read before), leaves out every object an index
//!   names in a pack not marked for deletion, appends the rest, in the order of a walk
//!   of the trees among them (`tree_order`), into packs of `CASFS_PACK_SIZE` bytes
//!   (16 MiB; trees and chunk lists in packs of their own, so that a restore's walk of
//!   the trees reads few packs), uploads each pack as it fills, and then one index
//!   naming them all. So the first upload of a tree costs one request per pack plus
//!   two, and a checkpoint after a few changes three or four.
//! - `get` reads locally; a miss fetches the one object with a ranged GET of its pack,
//!   verifies it against its hash, keeps it locally and returns it. `prefetch` (a
//!   mount's read-first) groups the objects it lacks by pack and reads neighbours with
//!   one ranged GET, many at a time. `stage` (a plain restore's) reads the same way
//!   into memory only: the restore writes the objects into files at once, and they
//!   skip the local store (a second decode and check, its memtable, log and files).
//!   An object no index names is read
//!   from its own key, `<prefix>/<first two hex digits>/<hex>` (the layout before
//!   packs), so stores written before keep working.
//! - Every object read is verified; a damaged one is an integrity error naming the
//!   object, the pack and the offset, and nothing of it is kept.
//! - Garbage collection of packs: [`RemoteObjectStore::collect`] (`gc` below).
//!
//! Credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, ...), never from the URL.

mod gc;
mod packed;
mod store;
mod upload;

pub use gc::{RemoteGcOptions, RemoteGcReport};
pub use store::{redact_url, RemoteObjectStore, RemoteStats, REMOTE_CF};

use crate::sys::Locked;
use std::sync::Mutex;

use futures::stream::{self, StreamExt};
use object_store::path::Path as RemotePath;

use super::error::{CasError, CasResult};
use super::fence::Fence;
use super::hash::{Hash, ObjectId};
use super::remote_index::Counters;
use super::store::{ObjectStore, PutOutcome, Staged};
use store::{is_not_found, PARALLEL};

impl ObjectStore for RemoteObjectStore {
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.put_pending(data, false)
    }

    fn put_metadata(&self, data: &[u8]) -> CasResult<PutOutcome> {
        self.put_pending(data, true)
    }

    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        match self.local.get(id, what) {
            Err(CasError::NotFound { .. }) => self.fetch(id, what),
            other => other,
        }
    }

    /// This host's: facts are noted where trees are stored, not shipped (a tree
    /// another host stored is not known here).
    fn tree_facts(&self, id: &crate::cas::hash::TreeId) -> Option<crate::cas::tree::TreeFacts> {
        self.local.tree_facts(id)
    }

    fn note_tree_facts(&self, id: &crate::cas::hash::TreeId, facts: crate::cas::tree::TreeFacts) {
        self.local.note_tree_facts(id, facts)
    }

    fn contains(&self, id: &ObjectId) -> CasResult<bool> {
        if self.local.contains(id)? || self.locate(&id.0)?.is_some() {
            return Ok(true);
        }
        let key = self.key(&id.0);
        let remote = self.remote.clone();
        let r = self.run(async move { remote.head(&key).await });
        Counters::add(&self.requests.head, 1);
        match r {
            Ok(_) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(self.err("checking", Some(&id.0), e)),
        }
    }

    fn sync(&self) -> CasResult<()> {
        // The local flush and the upload run side by side: the upload reads objects
        // from the memtable or from the tables the flush writes, alike, and a
        // checkpoint that names them is appended only after both.
        let (local, remote) = std::thread::scope(|s| {
            let local = s.spawn(|| self.local.sync());
            let remote = self.upload_pending();
            (local.join(), remote)
        });
        local.unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        remote
    }

    fn fence(&self) -> Option<&Fence> {
        self.local.fence()
    }

    fn prefetch(&self, ids: &[ObjectId]) {
        // What is local is read ahead locally (and the plan's presence checks then
        // read memory).
        self.local.prefetch(ids);
        let (by_pack, loose) = self.plan(ids);
        if !by_pack.is_empty() {
            self.fetch_ranges(by_pack, |id, stored, l| {
                let _ = self.accept(id, stored, Some(l));
            });
        }
        if loose.is_empty() {
            return;
        }
        let loose: Vec<(Hash, RemotePath)> =
            loose.into_iter().map(|id| (id, self.key(&id))).collect();
        // Objects stored before packs, one GET each.
        Counters::add(&self.requests.get, loose.len() as u64);
        let remote = self.remote.clone();
        let got: Vec<(Hash, bytes::Bytes)> = self.run(async move {
            stream::iter(loose.into_iter().map(|(id, key)| {
                let remote = remote.clone();
                async move {
                    let r = remote.get(&key).await.ok()?;
                    r.bytes().await.ok().map(|b| (id, b))
                }
            }))
            .buffer_unordered(PARALLEL)
            .filter_map(|x| async move { x })
            .collect()
            .await
        });
        for (id, stored) in got {
            // Kept only when it is what it claims to be (a read reports the rest).
            let _ = self.accept(&id, &stored, None);
        }
    }

    /// Only what is local: fetching is left to the listing that needs it.
    fn read_ahead(&self, ids: Vec<ObjectId>) {
        self.local.read_ahead(ids);
    }

    fn stage(&self, ids: &[ObjectId]) -> Staged {
        // Objects on their own keys (the layout before packs) are left to `get`.
        let (by_pack, _) = self.plan(ids);
        let staged = Mutex::new(Staged::default());
        if !by_pack.is_empty() {
            self.fetch_ranges(by_pack, |id, stored, l| {
                if let Ok(data) = self.verify(id, stored, Some(l)) {
                    staged.locked().insert(*id, data);
                }
            });
        }
        staged.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests;
