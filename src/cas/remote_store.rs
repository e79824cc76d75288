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

/// Objects an upload reads back from the local store at a time, on every core (at most
/// 64 MiB: a chunk is at most 1 MiB).
const READ_BATCH: usize = 64;
/// File contents new to the local store are packed as they are put, up to this many
/// bytes per sync; an upload then sends those packs as they are instead of reading the
/// objects back (beyond it, they are read back).
const PACKED_AT_PUT: usize = 256 << 20;
/// A pack ends with the object that takes it to the pack size or past it (a chunk is at
/// most 1 MiB): room enough that it is never copied to grow.
const PACK_SLACK: usize = 2 << 20;

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

/// Objects to read, by the pack that holds them: (object, offset, length).
type ByPack = HashMap<Hash, Vec<(Hash, u64, u64)>>;

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

/// `ids` (objects put, in that order) in the order a walk of the trees among them meets
/// them: each directory's entries in name order, a subdirectory's whole subtree in its
/// place, a large file's chunks after its chunk list; what no walk meets keeps its
/// place after. A capture puts objects as its threads hash them, interleaving
/// directories; packed in walk order, the files of neighbouring entries lie together
/// and a restore reads them with few ranged GETs and nothing between. `read` gives a
/// metadata object's content (trees and chunk lists are in `metadata`).
fn tree_order(
    ids: &[Hash],
    metadata: &HashSet<Hash>,
    read: impl Fn(&Hash) -> Option<Vec<u8>>,
) -> Vec<Hash> {
    use super::file::ChunkList;
    use super::tree::{EntryContent, Tree};
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
    fn put_packs(&self, packs: Vec<(Hash, Vec<u8>)>) -> CasResult<()> {
        let mut uploads = PackUploads::new(self);
        for (id, bytes) in packs {
            uploads.start(id, bytes)?;
        }
        uploads.finish()
    }

    /// Uploads index `idx` (after the packs it names) and makes it known here.
    fn put_index(&self, idx: PackIndex) -> CasResult<Hash> {
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
    fn upload_pending(&self) -> CasResult<()> {
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
    fn put_pending(&self, data: &[u8], metadata: bool) -> CasResult<PutOutcome> {
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
mod tests {
    use super::*;
    use crate::cas::file::ChunkList;
    use crate::cas::hash::{ChunkId, FileId, TreeId};
    use crate::cas::tree::{EntryContent, Tree, TreeEntry};

    fn entry(name: &str, content: EntryContent) -> TreeEntry {
        let size = u64::from(matches!(content, EntryContent::File(_)));
        TreeEntry {
            name: name.into(),
            content,
            mode: 0o644,
            mtime_ns: 0,
            size,
            xattrs: Vec::new(),
        }
    }

    fn open_at(dir: &std::path::Path, remote: &std::path::Path) -> RemoteObjectStore {
        let db = Arc::new(crate::cas::kv::Database::open(&dir.join("db"), &[]).unwrap());
        let local = Arc::new(RocksObjectStore::new(db));
        let url = format!("file://{}", remote.display());
        RemoteObjectStore::open(local, &url, None).unwrap()
    }

    /// A pack that cannot be uploaded fails the sync naming it, no index names what did
    /// not arrive, and the next sync uploads everything.
    #[test]
    fn a_failed_pack_upload_is_named_and_indexes_nothing() {
        let t = tempfile::tempdir().unwrap();
        let remote = t.path().join("remote");
        std::fs::create_dir_all(&remote).unwrap();
        // Where the packs go stands a file: every pack upload fails.
        std::fs::write(remote.join("packs"), b"not a directory").unwrap();
        let a = open_at(&t.path().join("a"), &remote);
        a.set_pack_size(64 << 10).unwrap();
        let data: Vec<Vec<u8>> = (0..40u8)
            .map(|i| {
                (0..20_000u32)
                    .map(|j| (j.wrapping_mul(i as u32 + 7) >> 3) as u8)
                    .collect()
            })
            .collect();
        let ids: Vec<ObjectId> = data.iter().map(|d| a.put(d).unwrap().id).collect();
        let err = a.sync().unwrap_err().to_string();
        assert!(err.contains("uploading pack"), "{err}");
        assert!(
            !remote.join("index").exists()
                || std::fs::read_dir(remote.join("index")).unwrap().count() == 0
        );
        assert_eq!(a.stats().uploaded_packs, 0);
        // Repaired: the next sync uploads every object, and a fresh host reads them.
        std::fs::remove_file(remote.join("packs")).unwrap();
        a.sync().unwrap();
        assert_eq!(a.stats().uploaded_objects, 40);
        let b = open_at(&t.path().join("b"), &remote);
        for (id, d) in ids.iter().zip(&data) {
            assert_eq!(&b.get(id, "blob").unwrap(), d);
        }
    }

    #[test]
    fn packs_follow_a_walk_of_the_trees() {
        let h = |s: &str| Hash::of(s.as_bytes());
        let (a1, a2, b1, top, c1, c2, loose) = (
            h("a1"),
            h("a2"),
            h("b1"),
            h("top"),
            h("c1"),
            h("c2"),
            h("loose"),
        );
        // A large file: a chunk list of two chunks.
        let list = ChunkList {
            chunks: vec![
                (ChunkId(c1), crate::cas::file::CHUNK_SIZE as u32),
                (ChunkId(c2), 1),
            ],
        }
        .encode();
        let big = Hash::of(&list);
        let dir_a = Tree::from_entries(vec![
            entry("2", EntryContent::File(FileId(a2))),
            entry("1", EntryContent::File(FileId(a1))),
        ])
        .unwrap()
        .encode();
        let dir_b = Tree::from_entries(vec![entry("1", EntryContent::File(FileId(b1)))])
            .unwrap()
            .encode();
        let (ta, tb) = (Hash::of(&dir_a), Hash::of(&dir_b));
        let root = Tree::from_entries(vec![
            entry("a", EntryContent::Dir(TreeId(ta))),
            entry("b", EntryContent::Dir(TreeId(tb))),
            entry("big", EntryContent::File(FileId(big))),
            entry("top", EntryContent::File(FileId(top))),
        ])
        .unwrap()
        .encode();
        let tr = Hash::of(&root);
        let content: HashMap<Hash, Vec<u8>> =
            [(ta, dir_a), (tb, dir_b), (tr, root), (big, list)].into();
        let metadata: HashSet<Hash> = content.keys().copied().collect();
        // As two capture threads put them: interleaved, the root last; b1 was put
        // before (not pending); one object no tree names.
        let put = [c2, a2, top, loose, c1, a1, ta, big, tb, tr];
        let got = tree_order(&put, &metadata, |id| content.get(id).cloned());
        assert_eq!(got, vec![tr, ta, a1, a2, tb, big, c1, c2, top, loose]);
        // No trees among them: the order they were put.
        assert_eq!(
            tree_order(&put[..4], &metadata, |_| None),
            put[..4].to_vec()
        );
    }
}
