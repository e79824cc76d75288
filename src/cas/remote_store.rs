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
mod upload;

use crate::sys::Locked;
use packed::PackedAtPut;

pub use gc::{RemoteGcOptions, RemoteGcReport};

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as RemotePath;
use object_store::{ObjectStore as Remote, PutPayload};
use rayon::prelude::*;

use super::error::{CasError, CasResult};
use super::fence::Fence;
use super::hash::{Hash, ObjectId};
use super::object::decode_stored;
use super::pack::{coalesce, read_whole, Location, PackEntry, PackIndex, PackWriter};
use super::remote_index::{Counters, Indexes, RemoteRequests};
use super::rocks_store::RocksObjectStore;
use super::store::{ObjectStore, PutOutcome, Staged};

/// The column family that marked objects known to be in the remote store (before
/// packs); kept so that stores which have it open, no longer read or written.
pub const REMOTE_CF: &str = "remote";

/// Objects to read, by the pack that holds them: (object, offset, length).
type ByPack = HashMap<Hash, Vec<(Hash, u64, u64)>>;

/// Parallel requests to the remote store (object reads, index reads).
const PARALLEL: usize = 32;
/// Packs uploaded at once (each is held in memory while it goes).
const PARALLEL_PACKS: usize = 4;
/// The default pack size (`CASFS_PACK_SIZE` overrides it), as restic's.
const PACK_SIZE: usize = 16 << 20;
/// Neighbouring objects of a pack at most this far apart share one ranged GET...
const MAX_GAP: u64 = 256 << 10;
/// ...of at most this many bytes.
const MAX_SPAN: u64 = 8 << 20;

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
struct Pending {
    order: Vec<Hash>,
    set: HashSet<Hash>,
    /// Those of them put as metadata (trees, chunk lists): packed apart.
    metadata: HashSet<Hash>,
    /// Packs of file contents filled as they were put: see [`PACKED_AT_PUT`].
    packed: PackedAtPut,
}

pub struct RemoteObjectStore {
    local: Arc<RocksObjectStore>,
    remote: Arc<dyn Remote>,
    prefix: RemotePath,
    /// A URL naming the remote without credentials, for messages.
    name: String,
    rt: tokio::runtime::Runtime,
    pending: Mutex<Pending>,
    /// One upload at a time.
    uploading: Mutex<()>,
    indexes: Indexes,
    /// When the indexes were last listed; one listing at a time.
    listed: Mutex<Option<Instant>>,
    pack_size: std::sync::atomic::AtomicUsize,
    requests: Counters,
    uploaded_objects: AtomicU64,
    uploaded_bytes: AtomicU64,
    uploaded_packs: AtomicU64,
    checked_objects: AtomicU64,
    fetched_objects: AtomicU64,
    fetched_bytes: AtomicU64,
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

fn is_not_found(e: &object_store::Error) -> bool {
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

    fn pack_size(&self) -> usize {
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
    fn key(&self, id: &Hash) -> RemotePath {
        let hex = id.to_hex();
        self.prefix.child(&hex[..2]).child(hex.as_str())
    }

    fn pack_key(&self, id: &Hash) -> RemotePath {
        self.prefix.child("packs").child(id.to_hex().as_str())
    }

    fn index_key(&self, id: &Hash) -> RemotePath {
        self.prefix.child("index").child(id.to_hex().as_str())
    }

    fn err(&self, what: &str, id: Option<&Hash>, e: impl std::fmt::Display) -> CasError {
        CasError::Invalid(match id {
            Some(id) => format!("object store {}: {what} {id}: {e}", self.name),
            None => format!("object store {}: {what}: {e}", self.name),
        })
    }

    /// Runs `fut` on this store's runtime from any thread (also one inside another
    /// runtime, where blocking on a runtime of its own is not allowed).
    fn run<T: Send + 'static>(
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
    fn list_indexes(&self) -> CasResult<()> {
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
    fn list_indexes_once(&self) -> CasResult<bool> {
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

    fn load_index(&self, name: Hash, bytes: &[u8]) -> CasResult<()> {
        let idx = PackIndex::decode(&format!("index/{name} of {}", self.name), bytes)?;
        self.indexes.insert(name, Arc::new(idx));
        Ok(())
    }

    /// The objects under `<prefix>/<dir>/` whose names are hashes, with their sizes and
    /// times. One LIST request a thousand.
    fn list_names(&self, dir: &str) -> CasResult<Vec<(Hash, object_store::ObjectMeta)>> {
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
    fn verify(&self, id: &Hash, stored: &[u8], from: Option<&Location>) -> CasResult<Vec<u8>> {
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
    fn accept(&self, id: &Hash, stored: &[u8], from: Option<&Location>) -> CasResult<Vec<u8>> {
        let data = self.verify(id, stored, from)?;
        // Keeping it is an optimisation (a read-only open cannot).
        if let Err(e) = self.local.put_stored(id, stored) {
            tracing::debug!("not caching object {id}: {e}");
        }
        Ok(data)
    }

    /// The bytes `start..end` of pack `pack` (`Ok(None)`: the pack is gone).
    fn read_range(&self, pack: &Hash, start: u64, end: u64) -> CasResult<Option<bytes::Bytes>> {
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
    fn locate(&self, id: &Hash) -> CasResult<Option<Location>> {
        if let Some(l) = self.indexes.find(id) {
            return Ok(Some(l));
        }
        self.list_indexes()?;
        Ok(self.indexes.find(id))
    }

    /// Fetches one object from the remote store, verifies it and keeps it locally.
    fn fetch(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
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
    fn fetch_ranges(&self, by_pack: ByPack, keep: impl Fn(&Hash, &[u8], &Location) + Sync) {
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
        let (tx, rx) = std::sync::mpsc::channel::<(Hash, super::pack::Span, bytes::Bytes)>();
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
    fn plan(&self, ids: &[ObjectId]) -> (ByPack, Vec<Hash>) {
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
