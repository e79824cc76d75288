//! Garbage collection of the remote store's packs, safe beside uploads from other
//! hosts. The protocol (docs/checkpoints.md, "Packs and their collection"):
//!
//! 1. An upload writes its packs, then the index naming them, and only then lets the
//!    checkpoint that needs them be appended. An upload leaves out an object only when
//!    an index names it in a pack **not marked for deletion**.
//! 2. A collection lists the indexes (and reads the new ones), lists the packs, and
//!    takes the set of live objects from every checkpoint record (the caller marks it
//!    while holding the gc lease, so two collections never overlap). Then per pack:
//!    - a pack with no live object, or with more than `max_unused` of its bytes dead,
//!      that is older than the grace period is **marked** (its live objects, if any, are
//!      first copied into a new pack): it stays readable, but from now on no upload
//!      leaves an object out because of it;
//!    - a pack marked at least a grace period ago is **deleted**, after every object of
//!      it that is live now (an upload that read the indexes before the mark may have
//!      left one out and appended since) has been copied into a new pack;
//!    - a pack no index names (an upload that died between its packs and its index)
//!      is deleted once it is older than the grace period.
//! 3. The collection writes one index of what stays (marks included) and then deletes
//!    the indexes it read, then the packs it deleted. Indexes written meanwhile by
//!    uploads are not touched, nor are their packs (younger than the grace period).
//!
//! So nothing a checkpoint needs is deleted provided no upload takes longer than the
//! grace period from reading the indexes to appending its checkpoint (default one hour:
//! an upload reads them at the start of its sync, which is the last step before the
//! append).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as RemotePath;

use super::store::{is_not_found, RemoteObjectStore, MAX_GAP, MAX_SPAN, PARALLEL};
use crate::cas::error::CasResult;
use crate::cas::hash::Hash;
use crate::cas::pack::{coalesce, Location, PackEntry, PackIndex, PackWriter};
use crate::cas::remote_index::{Counters, RemoteRequests};
use crate::sys::Locked;

/// How a collection decides.
#[derive(Debug, Clone, Copy)]
pub struct RemoteGcOptions {
    /// Packs younger than this are never marked or deleted, and a mark waits this
    /// long before its pack goes.
    pub grace: Duration,
    /// A pack with more than this fraction of its bytes dead is rewritten.
    pub max_unused: f64,
    pub dry_run: bool,
}

impl Default for RemoteGcOptions {
    fn default() -> RemoteGcOptions {
        RemoteGcOptions {
            grace: Duration::from_secs(3600),
            max_unused: 0.1,
            dry_run: false,
        }
    }
}

/// What a collection found and did (or, dry, would do).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct RemoteGcReport {
    pub dry_run: bool,
    pub indexes_read: usize,
    pub packs: usize,
    pub packs_kept: usize,
    /// Marked for deletion in this run.
    pub packs_marked: usize,
    /// Marked before, still in their grace period.
    pub packs_waiting: usize,
    pub packs_deleted: usize,
    /// Packs no index names, deleted.
    pub orphan_packs_deleted: usize,
    /// Live objects copied out of packs that are marked or deleted.
    pub objects_copied: u64,
    pub packs_written: usize,
    pub bytes_deleted: u64,
    /// Dead bytes left in kept packs (below the rewrite threshold, or too young).
    pub bytes_unused: u64,
    pub requests: RemoteRequests,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One pack as the indexes and the listing describe it.
struct PackState {
    objects: Vec<(Hash, u64, u64)>,
    marked: Option<u64>,
}

impl RemoteObjectStore {
    /// Collects the remote's packs (see the module's protocol); `live` holds every
    /// object a checkpoint needs.
    pub fn collect(&self, live: &HashSet<Hash>, o: &RemoteGcOptions) -> CasResult<RemoteGcReport> {
        let before = self.requests.snapshot();
        let _one = self.uploading.locked();
        self.list_indexes()?;
        let old = self.indexes.all();
        let listed: HashMap<Hash, object_store::ObjectMeta> =
            self.list_names("packs")?.into_iter().collect();
        let now = now_ms();
        let grace = o.grace.as_millis() as u64;
        let older = |p: &Hash| {
            listed.get(p).is_some_and(|m| {
                now.saturating_sub(m.last_modified.timestamp_millis().max(0) as u64) >= grace
            })
        };
        // Every pack the indexes name, with its objects and its mark.
        let mut packs: HashMap<Hash, PackState> = HashMap::new();
        for (_, idx) in &old {
            for info in idx.packs() {
                let p = packs.entry(info.id).or_insert(PackState {
                    objects: Vec::new(),
                    marked: None,
                });
                p.marked = p.marked.max(info.pending_since_ms);
            }
        }
        let mut seen: HashSet<(Hash, Hash)> = HashSet::new();
        for (_, idx) in &old {
            for (h, l) in idx.iter() {
                if seen.insert((l.pack, h)) {
                    if let Some(p) = packs.get_mut(&l.pack) {
                        p.objects.push((h, l.offset, l.len));
                    }
                }
            }
        }
        // A pack the listing lacks is gone (a collection deleted it, then failed
        // before its index went): its entries go.
        packs.retain(|id, _| listed.contains_key(id));
        let mut rep = RemoteGcReport {
            dry_run: o.dry_run,
            indexes_read: old.len(),
            packs: packs.len(),
            ..RemoteGcReport::default()
        };
        let bytes_of = |objs: &[(Hash, u64, u64)]| objs.iter().map(|o| o.2).sum::<u64>();
        let mut ids: Vec<Hash> = packs.keys().copied().collect();
        ids.sort();
        // First the packs not marked before: kept, or marked now.
        let mut keep: Vec<(Hash, Option<u64>)> = Vec::new();
        let mut copy: Vec<(Hash, Location)> = Vec::new();
        let mut copied: HashSet<Hash> = HashSet::new();
        let mut doomed: Vec<Hash> = Vec::new();
        for id in &ids {
            let p = &packs[id];
            if p.marked.is_some() {
                continue;
            }
            let total = bytes_of(&p.objects);
            let alive: Vec<&(Hash, u64, u64)> = p
                .objects
                .iter()
                .filter(|(h, _, _)| live.contains(h))
                .collect();
            let dead = total - alive.iter().map(|o| o.2).sum::<u64>();
            let wasteful = total > 0 && dead as f64 > o.max_unused * total as f64;
            if wasteful && older(id) {
                for (h, off, len) in alive {
                    if copied.insert(*h) {
                        copy.push((*h, loc(*id, *off, *len)));
                    }
                }
                keep.push((*id, Some(now)));
                rep.packs_marked += 1;
            } else {
                rep.bytes_unused += dead;
                keep.push((*id, None));
            }
        }
        // Then the packs marked before: waiting, or deleted (their live objects that no
        // unmarked pack holds are copied first).
        let unmarked: HashSet<Hash> = keep
            .iter()
            .filter(|(_, m)| m.is_none())
            .map(|(id, _)| *id)
            .collect();
        let held: HashSet<Hash> = unmarked
            .iter()
            .flat_map(|id| packs[id].objects.iter().map(|o| o.0))
            .collect();
        for id in &ids {
            let p = &packs[id];
            let Some(t) = p.marked else { continue };
            if now.saturating_sub(t) < grace {
                keep.push((*id, Some(t)));
                rep.packs_waiting += 1;
                continue;
            }
            for (h, off, len) in &p.objects {
                if live.contains(h) && !held.contains(h) && copied.insert(*h) {
                    copy.push((*h, loc(*id, *off, *len)));
                }
            }
            doomed.push(*id);
            rep.bytes_deleted += listed[id].size;
        }
        rep.packs_deleted = doomed.len();
        rep.packs_kept = keep.iter().filter(|(_, m)| m.is_none()).count();
        // Packs no index names, old enough that no upload is still writing its index.
        let orphans: Vec<Hash> = listed
            .keys()
            .filter(|id| !packs.contains_key(id) && older(id))
            .copied()
            .collect();
        rep.orphan_packs_deleted = orphans.len();
        rep.bytes_deleted += orphans.iter().map(|id| listed[id].size).sum::<u64>();
        rep.objects_copied = copy.len() as u64;
        let changed = rep.packs_marked + rep.packs_deleted > 0 || !copy.is_empty();
        if o.dry_run {
            rep.requests = self.requests.snapshot().since(&before);
            return Ok(rep);
        }
        // Copy what must survive into new packs (every object verified on the way).
        let mut index_packs: Vec<(Hash, Option<u64>, Vec<PackEntry>)> = Vec::new();
        if !copy.is_empty() {
            let stored = self.read_exact(&copy)?;
            let mut w = PackWriter::default();
            let mut ready = Vec::new();
            for (h, b) in &stored {
                w.push(*h, b);
                if w.size() >= self.pack_size() {
                    let (pid, bytes, entries) = std::mem::take(&mut w).finish();
                    index_packs.push((pid, None, entries));
                    ready.push((pid, bytes));
                }
            }
            if !w.is_empty() {
                let (pid, bytes, entries) = w.finish();
                index_packs.push((pid, None, entries));
                ready.push((pid, bytes));
            }
            rep.packs_written = ready.len();
            self.put_packs(ready)?;
        }
        if changed || old.len() > 1 {
            for (id, mark) in &keep {
                let entries = packs[id]
                    .objects
                    .iter()
                    .map(|&(h, offset, len)| PackEntry { id: h, offset, len })
                    .collect();
                index_packs.push((*id, *mark, entries));
            }
            let name = self.put_index(PackIndex::build(&index_packs)?)?;
            // The indexes read are covered by the new one: they go, then the packs.
            let gone: Vec<RemotePath> = old
                .iter()
                .filter(|(n, _)| *n != name)
                .map(|(n, _)| self.index_key(n))
                .collect();
            self.delete_all(gone)?;
            let dead: Vec<RemotePath> = doomed
                .iter()
                .chain(&orphans)
                .map(|id| self.pack_key(id))
                .collect();
            self.delete_all(dead)?;
            self.list_indexes()?;
        } else if !orphans.is_empty() {
            self.delete_all(orphans.iter().map(|id| self.pack_key(id)).collect())?;
        }
        rep.requests = self.requests.snapshot().since(&before);
        Ok(rep)
    }

    fn delete_all(&self, keys: Vec<RemotePath>) -> CasResult<()> {
        let n = keys.len() as u64;
        let remote = self.remote.clone();
        let r: Result<Vec<()>, String> = self.run(async move {
            stream::iter(keys.into_iter().map(|k| {
                let remote = remote.clone();
                async move {
                    match remote.delete(&k).await {
                        Ok(()) => Ok(()),
                        Err(e) if is_not_found(&e) => Ok(()),
                        Err(e) => Err(format!("{k}: {e}")),
                    }
                }
            }))
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await
        });
        Counters::add(&self.requests.delete, n);
        r.map(|_| ()).map_err(|e| self.err("deleting", None, e))
    }

    /// The stored bytes of these objects out of their packs, each verified: any that
    /// cannot be read or does not verify is an error (the collection then deletes
    /// nothing).
    fn read_exact(&self, objs: &[(Hash, Location)]) -> CasResult<Vec<(Hash, Vec<u8>)>> {
        let mut by_pack: HashMap<Hash, Vec<(Hash, u64, u64)>> = HashMap::new();
        for (h, l) in objs {
            by_pack
                .entry(l.pack)
                .or_default()
                .push((*h, l.offset, l.len));
        }
        let mut out = Vec::with_capacity(objs.len());
        for (pack, list) in by_pack {
            for span in coalesce(list, MAX_GAP, MAX_SPAN) {
                let b = self
                    .read_range(&pack, span.start, span.end)?
                    .ok_or_else(|| self.err("reading pack", Some(&pack), "it is gone"))?;
                for (h, off, len) in span.objects {
                    let from = (off - span.start) as usize;
                    let stored = &b[from..from + len as usize];
                    let l = loc(pack, off, len);
                    self.accept(&h, stored, Some(&l))?;
                    out.push((h, stored.to_vec()));
                }
            }
        }
        Ok(out)
    }
}

fn loc(pack: Hash, offset: u64, len: u64) -> Location {
    Location {
        pack,
        offset,
        len,
        pending_since_ms: None,
    }
}
