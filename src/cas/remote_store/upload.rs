//! The upload side of the remote store: what `sync` sends (packs in the order a walk of
//! the trees meets their objects, uploaded as they fill, then one index), and what a
//! put keeps for it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use object_store::PutPayload;
use rayon::prelude::*;

use super::packed::PACK_SLACK;
use super::store::{RemoteObjectStore, PARALLEL_PACKS};
use crate::cas::error::CasResult;
use crate::cas::hash::{Hash, ObjectId};
use crate::cas::pack::{PackEntry, PackIndex, PackWriter};
use crate::cas::remote_index::Counters;
use crate::cas::store::{ObjectStore, PutOutcome};
use crate::sys::Locked;

/// Objects an upload reads back from the local store at a time, on every core (at most
/// 64 MiB: a chunk is at most 1 MiB).
const READ_BATCH: usize = 64;

/// Packs on their way to the remote store, at most [`PARALLEL_PACKS`] at a time, while
/// the caller fills the next ones.
struct PackUploads<'s> {
    store: &'s RemoteObjectStore,
    /// Each pack under way: its hash, its size and where its upload's outcome comes.
    flying: std::collections::VecDeque<(Hash, u64, UploadDone)>,
}

type UploadDone = std::sync::mpsc::Receiver<Result<(), String>>;

impl<'s> PackUploads<'s> {
    fn new(store: &'s RemoteObjectStore) -> Self {
        PackUploads {
            store,
            flying: Default::default(),
        }
    }

    /// Starts uploading pack `id`, first waiting for the oldest upload if
    /// [`PARALLEL_PACKS`] are under way.
    fn start(&mut self, id: Hash, bytes: Vec<u8>) -> CasResult<()> {
        while self.flying.len() >= PARALLEL_PACKS {
            self.wait_one()?;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let (remote, key, len) = (
            self.store.remote.clone(),
            self.store.pack_key(&id),
            bytes.len(),
        );
        self.store.rt.spawn(async move {
            let r = remote.put(&key, PutPayload::from(bytes)).await;
            let _ = tx.send(r.map(|_| ()).map_err(|e| e.to_string()));
        });
        Counters::add(&self.store.requests.put, 1);
        self.flying.push_back((id, len as u64, rx));
        Ok(())
    }

    fn wait_one(&mut self) -> CasResult<()> {
        let Some((id, len, rx)) = self.flying.pop_front() else {
            return Ok(());
        };
        let s = self.store;
        match rx.recv() {
            Ok(Ok(())) => {
                s.uploaded_packs.fetch_add(1, Ordering::Relaxed);
                s.uploaded_bytes.fetch_add(len, Ordering::Relaxed);
                Ok(())
            }
            Ok(Err(e)) => Err(s.err("uploading pack", Some(&id), e)),
            Err(_) => Err(s.err("uploading pack", Some(&id), "the upload stopped")),
        }
    }

    /// Waits for every upload; the first failure is the error.
    fn finish(mut self) -> CasResult<()> {
        let mut first = Ok(());
        while !self.flying.is_empty() {
            let r = self.wait_one();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// `ids` (objects put, in that order) in the order a walk of the trees among them meets
/// them: each directory's entries in name order, a subdirectory's whole subtree in its
/// place, a large file's chunks after its chunk list; what no walk meets keeps its
/// place after. A capture puts objects as its threads hash them, interleaving
/// directories; packed in walk order, the files of neighbouring entries lie together
/// and a restore reads them with few ranged GETs and nothing between. `read` gives a
/// metadata object's content (trees and chunk lists are in `metadata`).
pub(super) fn tree_order(
    ids: &[Hash],
    metadata: &HashSet<Hash>,
    read: impl Fn(&Hash) -> Option<Vec<u8>>,
) -> Vec<Hash> {
    use crate::cas::file::ChunkList;
    use crate::cas::tree::{EntryContent, Tree};
    let pending: HashSet<Hash> = ids.iter().copied().collect();
    // What each pending tree or chunk list refers to, in order.
    let mut children: HashMap<Hash, Vec<Hash>> = HashMap::new();
    let mut trees = Vec::new();
    for id in ids.iter().filter(|id| metadata.contains(id)) {
        let Some(bytes) = read(id) else { continue };
        if let Ok(tree) = Tree::decode(&bytes) {
            let kids = tree
                .entries()
                .iter()
                .filter_map(|e| match &e.content {
                    EntryContent::File(f) => Some(f.0),
                    EntryContent::Dir(t) => Some(t.0),
                    _ => None,
                })
                .collect();
            children.insert(*id, kids);
            trees.push(*id);
        } else if let Ok(list) = ChunkList::decode(&bytes) {
            children.insert(*id, list.chunks.iter().map(|c| c.0 .0).collect());
        }
    }
    if trees.is_empty() {
        return ids.to_vec();
    }
    let referenced: HashSet<Hash> = children.values().flatten().copied().collect();
    let mut out = Vec::with_capacity(ids.len());
    let mut done = HashSet::with_capacity(ids.len());
    // Roots first to last put (a capture puts its root tree last), each walked depth
    // first.
    for root in trees.iter().filter(|t| !referenced.contains(t)) {
        let mut stack = vec![*root];
        while let Some(id) = stack.pop() {
            if !done.insert(id) {
                continue;
            }
            if pending.contains(&id) {
                out.push(id);
            }
            if let Some(kids) = children.get(&id) {
                stack.extend(kids.iter().rev().filter(|k| !done.contains(k)));
            }
        }
    }
    out.extend(ids.iter().filter(|id| !done.contains(id)).copied());
    out
}

impl RemoteObjectStore {
    pub(super) fn put_packs(&self, packs: Vec<(Hash, Vec<u8>)>) -> CasResult<()> {
        let mut uploads = PackUploads::new(self);
        for (id, bytes) in packs {
            uploads.start(id, bytes)?;
        }
        uploads.finish()
    }

    /// Uploads index `idx` (after the packs it names) and makes it known here.
    pub(super) fn put_index(&self, idx: PackIndex) -> CasResult<Hash> {
        let bytes = idx.encode();
        let name = Hash::of(&bytes);
        let (remote, key) = (self.remote.clone(), self.index_key(&name));
        let payload = PutPayload::from(bytes.clone());
        let r = self.run(async move { remote.put(&key, payload).await });
        Counters::add(&self.requests.put, 1);
        r.map_err(|e| self.err("uploading pack index", Some(&name), e))?;
        self.indexes.keep(&name, &bytes);
        self.indexes.insert(name, Arc::new(idx));
        Ok(name)
    }

    /// Uploads every object put since the last sync that the remote lacks: packs
    /// first, then the index naming them (so an index never names a pack that is not
    /// there, and `sync`, which returns after both, comes before any checkpoint that
    /// needs them).
    pub(super) fn upload_pending(&self) -> CasResult<()> {
        let _one = self.uploading.locked();
        let (ids, metadata, packed) = {
            let mut p = self.pending.locked();
            (
                p.order.clone(),
                p.metadata.clone(),
                std::mem::take(&mut p.packed).into_packs(self.pack_size()),
            )
        };
        if ids.is_empty() {
            return Ok(());
        }
        let ids = tree_order(&ids, &metadata, |id| {
            self.local.get(&ObjectId(*id), "tree").ok()
        });
        // What the remote has is read now, at the start of the sync: an object is left
        // out only if an index names it in a pack no gc has marked (a host's own memory
        // of having uploaded it is no proof: gc may have deleted it since).
        self.list_indexes()?;
        self.checked_objects
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let mut packs: Vec<(Hash, Option<u64>, Vec<PackEntry>)> = Vec::new();
        // Packs go up while the next ones fill.
        let mut uploads = PackUploads::new(self);
        // Two packs fill at once: file contents, and metadata (trees, chunk lists),
        // so that a fresh host's restore reads every tree from a few packs.
        let room = self.pack_size() + PACK_SLACK;
        let mut writers = [
            PackWriter::with_capacity(room),
            PackWriter::with_capacity(room),
        ];
        let mut objects = 0u64;
        let mut seen = HashSet::new();
        // The packs filled as objects were put go as they are, unless the remote has
        // one of their objects already: those are read back and packed below.
        for w in packed {
            let entries = w.entries();
            if entries
                .iter()
                .all(|e| !self.indexes.has_live(&e.id) && !seen.contains(&e.id))
            {
                seen.extend(entries.iter().map(|e| e.id));
                objects += entries.len() as u64;
                let (pid, bytes, entries) = w.finish();
                packs.push((pid, None, entries));
                uploads.start(pid, bytes)?;
            }
        }
        for batch in ids.chunks(READ_BATCH) {
            let todo: Vec<Hash> = batch
                .iter()
                .copied()
                .filter(|id| !self.indexes.has_live(id) && seen.insert(*id))
                .collect();
            // Read back from the local store on every core, packed in order.
            let stored: Vec<Vec<u8>> = todo
                .par_iter()
                .map(|id| {
                    self.local
                        .get_stored(id)?
                        .ok_or_else(|| self.err("object", Some(id), "not in the local store"))
                })
                .collect::<CasResult<_>>()?;
            for (id, stored) in todo.into_iter().zip(stored) {
                let w = &mut writers[usize::from(metadata.contains(&id))];
                w.push(id, &stored);
                objects += 1;
                if w.size() >= self.pack_size() {
                    let (pid, bytes, entries) =
                        std::mem::replace(w, PackWriter::with_capacity(room)).finish();
                    packs.push((pid, None, entries));
                    uploads.start(pid, bytes)?;
                }
            }
        }
        for w in writers.into_iter().filter(|w| !w.is_empty()) {
            let (pid, bytes, entries) = w.finish();
            packs.push((pid, None, entries));
            uploads.start(pid, bytes)?;
        }
        uploads.finish()?;
        if !packs.is_empty() {
            self.put_index(PackIndex::build(&packs)?)?;
            self.uploaded_objects.fetch_add(objects, Ordering::Relaxed);
        }
        let mut p = self.pending.locked();
        let done: HashSet<Hash> = ids.into_iter().collect();
        p.order.retain(|h| !done.contains(h));
        p.set.retain(|h| !done.contains(h));
        p.metadata.retain(|h| !done.contains(h));
        Ok(())
    }

    /// Stores locally and remembers the object for the next sync: every object put is
    /// looked up then, new here or not.
    pub(super) fn put_pending(&self, data: &[u8], metadata: bool) -> CasResult<PutOutcome> {
        let out = self.local.put_keeping(data, |id, stored| {
            // Metadata packs are filled at upload, in the order a restore reads them.
            if !metadata {
                let mut p = self.pending.locked();
                p.packed.push(*id, stored, self.pack_size());
            }
        })?;
        let mut p = self.pending.locked();
        if p.set.insert(out.id.0) {
            p.order.push(out.id.0);
        }
        if metadata {
            p.metadata.insert(out.id.0);
        }
        Ok(out)
    }
}
