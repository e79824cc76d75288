//! What a host knows of the remote store's pack indexes ([`super::pack`]): the indexes
//! it has read, decoded and kept (in memory, and as files under the store so that a
//! restart reads none again), and the request counters every remote operation reports.

use crate::sys::ReadWriteLocked;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::hash::Hash;
use super::pack::{Location, PackIndex};

/// Requests made to the remote store, by kind.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RemoteRequests {
    pub put: u64,
    pub get: u64,
    /// GETs of a byte range (objects out of a pack).
    pub ranged_get: u64,
    pub list: u64,
    pub head: u64,
    pub delete: u64,
}

impl RemoteRequests {
    pub fn total(&self) -> u64 {
        self.put + self.get + self.ranged_get + self.list + self.head + self.delete
    }

    /// What was made between `before` and `self`.
    pub fn since(&self, before: &RemoteRequests) -> RemoteRequests {
        RemoteRequests {
            put: self.put - before.put,
            get: self.get - before.get,
            ranged_get: self.ranged_get - before.ranged_get,
            list: self.list - before.list,
            head: self.head - before.head,
            delete: self.delete - before.delete,
        }
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub put: AtomicU64,
    pub get: AtomicU64,
    pub ranged_get: AtomicU64,
    pub list: AtomicU64,
    pub head: AtomicU64,
    pub delete: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> RemoteRequests {
        RemoteRequests {
            put: self.put.load(Ordering::Relaxed),
            get: self.get.load(Ordering::Relaxed),
            ranged_get: self.ranged_get.load(Ordering::Relaxed),
            list: self.list.load(Ordering::Relaxed),
            head: self.head.load(Ordering::Relaxed),
            delete: self.delete.load(Ordering::Relaxed),
        }
    }
}

/// The indexes this host has loaded, by name (the hash of their bytes).
pub(super) struct Indexes {
    loaded: RwLock<Loaded>,
    /// Where decoded indexes are kept between runs (`None`: not kept).
    dir: Option<PathBuf>,
}

#[derive(Default)]
struct Loaded {
    by_name: BTreeMap<Hash, Arc<PackIndex>>,
    /// Packs some index marks for deletion, with the earliest mark: a mark counts
    /// whatever other index names the pack without one.
    marked: HashMap<Hash, u64>,
}

impl Loaded {
    fn remark(&mut self) {
        self.marked.clear();
        for idx in self.by_name.values() {
            for p in idx.packs() {
                if let Some(t) = p.pending_since_ms {
                    let m = self.marked.entry(p.id).or_insert(t);
                    *m = (*m).min(t);
                }
            }
        }
    }
}

impl Indexes {
    pub fn new(dir: Option<PathBuf>) -> Indexes {
        Indexes {
            loaded: RwLock::new(Loaded::default()),
            dir,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Loaded> {
        self.loaded.read_locked()
    }

    /// Where `id` is: a location in a pack no index marks for deletion if there is
    /// one, else one in a marked pack (still readable until gc deletes it).
    pub fn find(&self, id: &Hash) -> Option<Location> {
        let l = self.read();
        let mut marked = None;
        for idx in l.by_name.values() {
            if let Some(mut loc) = idx.find(id) {
                loc.pending_since_ms = l.marked.get(&loc.pack).copied();
                if loc.pending_since_ms.is_none() {
                    return Some(loc);
                }
                marked = Some(loc);
            }
        }
        marked
    }

    /// Whether `id` is in a pack not marked for deletion: only then may an upload
    /// leave it out (an object only in a marked pack is uploaded again).
    pub fn has_live(&self, id: &Hash) -> bool {
        self.find(id).is_some_and(|l| l.pending_since_ms.is_none())
    }

    pub fn names(&self) -> Vec<Hash> {
        self.read().by_name.keys().copied().collect()
    }

    pub fn all(&self) -> Vec<(Hash, Arc<PackIndex>)> {
        self.read()
            .by_name
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    pub fn insert(&self, name: Hash, idx: Arc<PackIndex>) {
        let mut l = self.loaded.write_locked();
        l.by_name.insert(name, idx);
        l.remark();
    }

    /// Forgets the indexes not in `listed` (gc replaced them) and their kept files.
    pub fn retain(&self, listed: &std::collections::HashSet<Hash>) {
        let mut l = self.loaded.write_locked();
        let gone: Vec<Hash> = l
            .by_name
            .keys()
            .filter(|k| !listed.contains(k))
            .copied()
            .collect();
        for g in &gone {
            l.by_name.remove(g);
            if let Some(d) = &self.dir {
                let _ = std::fs::remove_file(d.join(g.to_hex()));
            }
        }
        if !gone.is_empty() {
            l.remark();
        }
    }

    /// The kept bytes of index `name`, if this host kept it and they are intact.
    pub fn kept(&self, name: &Hash) -> Option<Vec<u8>> {
        let b = std::fs::read(self.dir.as_ref()?.join(name.to_hex())).ok()?;
        (Hash::of(&b) == *name).then_some(b)
    }

    /// Keeps the bytes of index `name` for the next run (best effort: a read-only
    /// store keeps nothing).
    pub fn keep(&self, name: &Hash, bytes: &[u8]) {
        let Some(d) = &self.dir else { return };
        let tmp = d.join(format!("{}.tmp", name.to_hex()));
        let ok = std::fs::create_dir_all(d).is_ok()
            && std::fs::write(&tmp, bytes).is_ok()
            && std::fs::rename(&tmp, d.join(name.to_hex())).is_ok();
        if !ok {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}
