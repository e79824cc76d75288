//! The remote store itself: [`RemoteObjectStore`], what it holds (the local store, the
//! remote, the indexes read, the counters) and its core: opening, keys, the runtime,
//! listing and reading indexes, and fetching and verifying objects (one at a time, or
//! by pack with coalesced ranged GETs). The upload side (`upload`), garbage collection
//! (`gc`) and the [`ObjectStore`] implementation (the parent) build on it.

use super::packed::PackedAtPut;
use crate::sys::Locked;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as RemotePath;
use object_store::ObjectStore as Remote;
use rayon::prelude::*;

use crate::cas::error::{CasError, CasResult};
use crate::cas::hash::{Hash, ObjectId};
use crate::cas::object::decode_stored;
use crate::cas::pack::{coalesce, read_whole, Location, PackIndex};
use crate::cas::remote_index::{Counters, Indexes, RemoteRequests};
use crate::cas::rocks_store::RocksObjectStore;
use crate::cas::store::ObjectStore;

/// The column family that marked objects known to be in the remote store (before
/// packs); kept so that stores which have it open, no longer read or written.
pub const REMOTE_CF: &str = "remote";

/// Objects to read, by the pack that holds them: (object, offset, length).
pub(super) type ByPack = HashMap<Hash, Vec<(Hash, u64, u64)>>;

/// Parallel requests to the remote store (object reads, index reads).
pub(super) const PARALLEL: usize = 32;
/// Packs uploaded at once (each is held in memory while it goes).
pub(super) const PARALLEL_PACKS: usize = 4;
/// The default pack size (`CASFS_PACK_SIZE` overrides it), as restic's.
pub(super) const PACK_SIZE: usize = 16 << 20;
/// Neighbouring objects of a pack at most this far apart share one ranged GET...
pub(super) const MAX_GAP: u64 = 256 << 10;
/// ...of at most this many bytes.
pub(super) const MAX_SPAN: u64 = 8 << 20;

/// Counters of what crossed the network.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RemoteStats {
    pub uploaded_objects: u64,
    pub uploaded_bytes: u64,
    pub uploaded_packs: u64,
    /// Objects looked up in the remote's indexes (not known locally to be remote).
    pub checked_objects: u64,
    pub fetched_objects: u64,
    pub fetched_bytes: u64,
    pub requests: RemoteRequests,
}

impl RemoteStats {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &RemoteStats) -> RemoteStats {
        RemoteStats {
            uploaded_objects: self.uploaded_objects - before.uploaded_objects,
            uploaded_bytes: self.uploaded_bytes - before.uploaded_bytes,
            uploaded_packs: self.uploaded_packs - before.uploaded_packs,
            checked_objects: self.checked_objects - before.checked_objects,
            fetched_objects: self.fetched_objects - before.fetched_objects,
            fetched_bytes: self.fetched_bytes - before.fetched_bytes,
            requests: self.requests.since(&before.requests),
        }
    }
}

/// Objects put and not uploaded yet, in the order they were put (a pack then holds a
/// directory's files near each other, and a metadata pack its trees).
#[derive(Default)]
pub(super) struct Pending {
    pub(super) order: Vec<Hash>,
    pub(super) set: HashSet<Hash>,
    /// Those of them put as metadata (trees, chunk lists): packed apart.
    pub(super) metadata: HashSet<Hash>,
    /// Packs of file contents filled as they were put: see [`PACKED_AT_PUT`](super::packed::PACKED_AT_PUT).
    pub(super) packed: PackedAtPut,
}

pub struct RemoteObjectStore {
    pub(super) local: Arc<RocksObjectStore>,
    pub(super) remote: Arc<dyn Remote>,
    pub(super) prefix: RemotePath,
    /// A URL naming the remote without credentials, for messages.
    pub(super) name: String,
    pub(super) rt: tokio::runtime::Runtime,
    pub(super) pending: Mutex<Pending>,
    /// One upload at a time.
    pub(super) uploading: Mutex<()>,
    pub(super) indexes: Indexes,
    /// When the indexes were last listed; one listing at a time.
    pub(super) listed: Mutex<Option<Instant>>,
    pub(super) pack_size: std::sync::atomic::AtomicUsize,
    pub(super) requests: Counters,
    pub(super) uploaded_objects: AtomicU64,
    pub(super) uploaded_bytes: AtomicU64,
    pub(super) uploaded_packs: AtomicU64,
    pub(super) checked_objects: AtomicU64,
    pub(super) fetched_objects: AtomicU64,
    pub(super) fetched_bytes: AtomicU64,
}

/// Removes anything secret from a URL before it is shown: user info and query.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.to_string()
        }
        Err(_) => "<unparsable URL>".into(),
    }
}

pub(super) fn is_not_found(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. })
}

impl RemoteObjectStore {
    /// Opens the remote store at `url` (`s3://bucket/prefix`, `gs://...`,
    /// `az://...`, `file:///dir`, `memory://`) over the local store `local`; indexes
    /// read are kept in `index_dir` (none kept without one).
    pub fn open(
        local: Arc<RocksObjectStore>,
        url: &str,
        index_dir: Option<PathBuf>,
    ) -> CasResult<RemoteObjectStore> {
        let name = redact_url(url);
        let bad = |detail: String| CasError::Invalid(format!("object store {name}: {detail}"));
        let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(bad(
                "credentials do not belong in the URL; give them in the environment \
                 (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)"
                    .into(),
            ));
        }
        let (remote, prefix): (Arc<dyn Remote>, RemotePath) = if parsed.scheme() == "s3" {
            let s3 = object_store::aws::AmazonS3Builder::from_env()
                .with_url(url)
                .build()
                .map_err(|e| bad(e.to_string()))?;
            let prefix = RemotePath::from(parsed.path().trim_matches('/'));
            (Arc::new(s3), prefix)
        } else {
            let (store, prefix) = object_store::parse_url_opts(&parsed, std::env::vars())
                .map_err(|e| bad(e.to_string()))?;
            (Arc::from(store), prefix)
        };
        let pack_size = match std::env::var("CASFS_PACK_SIZE") {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (64 << 10..=1 << 30).contains(n))
                .ok_or_else(|| {
                    bad(format!(
                        "CASFS_PACK_SIZE={v:?}: want a size in bytes from 65536 to 1073741824"
                    ))
                })?,
            Err(_) => PACK_SIZE,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("casfs-remote")
            .enable_all()
            .build()
            .map_err(|e| bad(format!("starting its runtime: {e}")))?;
        Ok(RemoteObjectStore {
            local,
            remote,
            prefix,
            name,
            rt,
            pending: Mutex::new(Pending::default()),
            uploading: Mutex::new(()),
            indexes: Indexes::new(index_dir),
            listed: Mutex::new(None),
            pack_size: std::sync::atomic::AtomicUsize::new(pack_size),
            requests: Counters::default(),
            uploaded_objects: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
            uploaded_packs: AtomicU64::new(0),
            checked_objects: AtomicU64::new(0),
            fetched_objects: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
        })
    }

    /// Sets the size packs are filled to from now on (64 KiB to 1 GiB).
    pub fn set_pack_size(&self, bytes: usize) -> CasResult<()> {
        if !(64 << 10..=1 << 30).contains(&bytes) {
            return Err(CasError::Invalid(format!(
                "pack size {bytes}: want 65536 to 1073741824 bytes"
            )));
        }
        self.pack_size.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn pack_size(&self) -> usize {
        self.pack_size.load(Ordering::Relaxed)
    }

    pub fn local(&self) -> &Arc<RocksObjectStore> {
        &self.local
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            uploaded_objects: self.uploaded_objects.load(Ordering::Relaxed),
            uploaded_bytes: self.uploaded_bytes.load(Ordering::Relaxed),
            uploaded_packs: self.uploaded_packs.load(Ordering::Relaxed),
            checked_objects: self.checked_objects.load(Ordering::Relaxed),
            fetched_objects: self.fetched_objects.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            requests: self.requests.snapshot(),
        }
    }

    /// Where the remote object `rel` (`packs/<hex>`, `index/<hex>`) is.
    pub fn key_of(&self, rel: &str) -> RemotePath {
        rel.split('/')
            .fold(self.prefix.clone(), |p, part| p.child(part))
    }

    /// The key of an object stored on its own (the layout before packs).
    pub(super) fn key(&self, id: &Hash) -> RemotePath {
        let hex = id.to_hex();
        self.prefix.child(&hex[..2]).child(hex.as_str())
    }

    pub(super) fn pack_key(&self, id: &Hash) -> RemotePath {
        self.prefix.child("packs").child(id.to_hex().as_str())
    }

    pub(super) fn index_key(&self, id: &Hash) -> RemotePath {
        self.prefix.child("index").child(id.to_hex().as_str())
    }

    pub(super) fn err(&self, what: &str, id: Option<&Hash>, e: impl std::fmt::Display) -> CasError {
        CasError::Invalid(match id {
            Some(id) => format!("object store {}: {what} {id}: {e}", self.name),
            None => format!("object store {}: {what}: {e}", self.name),
        })
    }

    /// Runs `fut` on this store's runtime from any thread (also one inside another
    /// runtime, where blocking on a runtime of its own is not allowed).
    pub(super) fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        self.rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().expect("the remote store's runtime is running")
    }

    /// Lists the remote's indexes and reads the ones not read before (from the copy
    /// kept under the store, else with a GET, verified against its name); forgets
    /// those gc replaced. One listing at a time.
    pub(super) fn list_indexes(&self) -> CasResult<()> {
        let mut listed = self.listed.locked();
        // An index listed and then deleted before its GET was replaced by another host's
        // gc, which writes the merged index before deleting what it merges: listing
        // again finds it.
        for attempt in 1.. {
            if self.list_indexes_once()? {
                break;
            }
            if attempt == 5 {
                return Err(self.err(
                    "reading pack indexes",
                    None,
                    "indexes vanished between listing and reading, 5 times in a row",
                ));
            }
        }
        *listed = Some(Instant::now());
        Ok(())
    }

    /// One listing and read of the indexes; `false` if an index listed was gone.
    pub(super) fn list_indexes_once(&self) -> CasResult<bool> {
        let names = self.list_names("index")?;
        self.indexes
            .retain(&names.iter().map(|(h, _)| *h).collect());
        let known: HashSet<Hash> = self.indexes.names().into_iter().collect();
        let mut want = Vec::new();
        for (name, _) in names {
            if known.contains(&name) {
                continue;
            }
            match self.indexes.kept(&name) {
                Some(b) => self.load_index(name, &b)?,
                None => want.push((name, self.index_key(&name))),
            }
        }
        Counters::add(&self.requests.get, want.len() as u64);
        let remote = self.remote.clone();
        type Got = Result<Vec<(Hash, Option<bytes::Bytes>)>, (Hash, String)>;
        let got: Got = self.run(async move {
            stream::iter(want.into_iter().map(|(name, key)| {
                let remote = remote.clone();
                async move {
                    let r = match remote.get(&key).await {
                        Ok(r) => r,
                        Err(e) if is_not_found(&e) => return Ok((name, None)),
                        Err(e) => return Err((name, e.to_string())),
                    };
                    let b = r.bytes().await.map_err(|e| (name, e.to_string()))?;
                    Ok((name, Some(b)))
                }
            }))
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await
        });
        let mut complete = true;
        for (name, bytes) in got.map_err(|(n, e)| self.err("reading pack index", Some(&n), e))? {
            let Some(bytes) = bytes else {
                complete = false;
                continue;
            };
            if Hash::of(&bytes) != name {
                return Err(CasError::Corrupt {
                    id: name,
                    detail: format!(
                        "pack index index/{name} of {} does not hash to its name",
                        self.name
                    ),
                });
            }
            self.load_index(name, &bytes)?;
            self.indexes.keep(&name, &bytes);
        }
        Ok(complete)
    }

    pub(super) fn load_index(&self, name: Hash, bytes: &[u8]) -> CasResult<()> {
        let idx = PackIndex::decode(&format!("index/{name} of {}", self.name), bytes)?;
        self.indexes.insert(name, Arc::new(idx));
        Ok(())
    }

    /// The objects under `<prefix>/<dir>/` whose names are hashes, with their sizes and
    /// times. One LIST request a thousand.
    pub(super) fn list_names(&self, dir: &str) -> CasResult<Vec<(Hash, object_store::ObjectMeta)>> {
        let remote = self.remote.clone();
        let at = self.prefix.child(dir);
        let metas: Result<Vec<object_store::ObjectMeta>, object_store::Error> =
            self.run(async move { remote.list(Some(&at)).try_collect().await });
        let metas = metas.map_err(|e| self.err(&format!("listing {dir}/"), None, e))?;
        Counters::add(&self.requests.list, 1 + metas.len() as u64 / 1000);
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let h = Hash::from_hex(m.location.filename()?)?;
                Some((h, m))
            })
            .collect())
    }

    /// Uploads packs (name, bytes) in parallel.
    /// Decodes and verifies what was read for `id` (out of pack `from`, or its own
    /// key) and counts it as fetched. A damaged object is an integrity error naming
    /// where it was read.
    pub(super) fn verify(
        &self,
        id: &Hash,
        stored: &[u8],
        from: Option<&Location>,
    ) -> CasResult<Vec<u8>> {
        let data = decode_stored(id, stored).map_err(|e| match (e, from) {
            (CasError::Corrupt { id, detail }, Some(l)) => CasError::Corrupt {
                id,
                detail: format!(
                    "as read from pack packs/{} at offset {} ({} bytes) of {}: {detail}",
                    l.pack, l.offset, l.len, self.name
                ),
            },
            (e, _) => e,
        })?;
        self.fetched_objects.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        Ok(data)
    }

    /// [`Self::verify`], then keeps the object locally.
    pub(super) fn accept(
        &self,
        id: &Hash,
        stored: &[u8],
        from: Option<&Location>,
    ) -> CasResult<Vec<u8>> {
        let data = self.verify(id, stored, from)?;
        // Keeping it is an optimisation (a read-only open cannot).
        if let Err(e) = self.local.put_stored(id, stored) {
            tracing::debug!("not caching object {id}: {e}");
        }
        Ok(data)
    }

    /// The bytes `start..end` of pack `pack` (`Ok(None)`: the pack is gone).
    pub(super) fn read_range(
        &self,
        pack: &Hash,
        start: u64,
        end: u64,
    ) -> CasResult<Option<bytes::Bytes>> {
        let (remote, key) = (self.remote.clone(), self.pack_key(pack));
        let got = self.run(async move { remote.get_range(&key, start..end).await });
        Counters::add(&self.requests.ranged_get, 1);
        match got {
            Ok(b) if b.len() as u64 == end - start => Ok(Some(b)),
            Ok(b) => Err(CasError::Corrupt {
                id: *pack,
                detail: format!(
                    "pack packs/{pack} of {} gave {} bytes for the range {start}..{end}",
                    self.name,
                    b.len()
                ),
            }),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(self.err("reading pack", Some(pack), e)),
        }
    }

    /// Where `id` is in a pack, listing the indexes again if none names it (an
    /// object another host uploaded since the last listing).
    pub(super) fn locate(&self, id: &Hash) -> CasResult<Option<Location>> {
        if let Some(l) = self.indexes.find(id) {
            return Ok(Some(l));
        }
        self.list_indexes()?;
        Ok(self.indexes.find(id))
    }

    /// Fetches one object from the remote store, verifies it and keeps it locally.
    pub(super) fn fetch(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        for attempt in 0..2 {
            let Some(l) = self.locate(&id.0)? else { break };
            match self.read_range(&l.pack, l.offset, l.offset + l.len)? {
                Some(b) => return self.accept(&id.0, &b, Some(&l)),
                // The pack went (gc rewrote it): its objects are named by a newer index.
                None if attempt == 0 => self.list_indexes()?,
                None => break,
            }
        }
        let key = self.key(&id.0);
        let remote = self.remote.clone();
        let got = self.run(async move {
            match remote.get(&key).await {
                Ok(r) => r.bytes().await.map(Some),
                Err(e) if is_not_found(&e) => Ok(None),
                Err(e) => Err(e),
            }
        });
        Counters::add(&self.requests.get, 1);
        match got {
            Ok(Some(b)) => self.accept(&id.0, &b, None),
            Ok(None) => Err(CasError::NotFound { what, id: id.0 }),
            Err(e) => Err(self.err("fetching", Some(&id.0), e)),
        }
    }

    /// Reads objects of packs with coalesced ranged GETs, many at a time, and hands
    /// each object's stored bytes to `keep` (which verifies them). Best effort (a read
    /// reports what failed).
    pub(super) fn fetch_ranges(
        &self,
        by_pack: ByPack,
        keep: impl Fn(&Hash, &[u8], &Location) + Sync,
    ) {
        let mut work = Vec::new();
        for (pack, objs) in by_pack {
            let (gap, span) = read_whole(&objs).unwrap_or((MAX_GAP, MAX_SPAN));
            for span in coalesce(objs, gap, span) {
                work.push((pack, self.pack_key(&pack), span));
            }
        }
        Counters::add(&self.requests.ranged_get, work.len() as u64);
        // Each range is decoded, verified and kept as soon as it arrives, its objects
        // on every core, while the other ranges are still coming.
        let (tx, rx) = std::sync::mpsc::channel::<(Hash, crate::cas::pack::Span, bytes::Bytes)>();
        let remote = self.remote.clone();
        self.rt.spawn(async move {
            stream::iter(work.into_iter().map(|(pack, key, span)| {
                let remote = remote.clone();
                async move {
                    let b = remote.get_range(&key, span.start..span.end).await.ok()?;
                    Some((pack, span, b))
                }
            }))
            .buffer_unordered(PARALLEL)
            .for_each(|got| {
                if let Some(got) = got {
                    let _ = tx.send(got);
                }
                async {}
            })
            .await;
        });
        for (pack, span, b) in rx {
            span.objects.par_iter().for_each(|(id, off, len)| {
                let (from, to) = (
                    (off - span.start) as usize,
                    (off - span.start + len) as usize,
                );
                let Some(stored) = b.get(from..to) else {
                    return;
                };
                let l = Location {
                    pack,
                    offset: *off,
                    len: *len,
                    pending_since_ms: None,
                };
                keep(id, stored, &l);
            });
        }
    }

    /// Of `ids`, those not stored locally, by the pack that holds them (listing the
    /// indexes again if one is named by none), and those no index names (stored on
    /// their own keys, the layout before packs).
    pub(super) fn plan(&self, ids: &[ObjectId]) -> (ByPack, Vec<Hash>) {
        let want: Vec<Hash> = ids
            .iter()
            .filter(|id| !self.local.contains(id).unwrap_or(true))
            .map(|id| id.0)
            .collect();
        if want.iter().any(|id| self.indexes.find(id).is_none()) {
            let _ = self.list_indexes();
        }
        let mut by_pack = ByPack::new();
        let mut loose = Vec::new();
        for id in want {
            match self.indexes.find(&id) {
                Some(l) => by_pack
                    .entry(l.pack)
                    .or_default()
                    .push((id, l.offset, l.len)),
                None => loose.push(id),
            }
        }
        (by_pack, loose)
    }
}
