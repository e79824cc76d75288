//! An [`ObjectStore`] on S3-compatible object storage (or GCS, Azure, a local
//! directory: anything the `object_store` crate reaches), with the store's own RocksDB
//! as a read-through cache.
//!
//! - `put` stores locally and remembers the object; `sync` (which every capture runs
//!   before it appends) uploads what the remote lacks: existence checks and uploads run
//!   in parallel, and objects known to be remote (a marker in the `remote` column family)
//!   are not checked again. So a checkpoint uploads only what changed.
//! - `get` reads locally; a miss fetches the object, verifies it against its hash, keeps
//!   it locally and returns it. A restore on another host therefore mounts at once and
//!   fetches chunks as they are read.
//! - Remote keys are `<prefix>/<first two hex digits>/<hex>`; the value is the stored
//!   encoding (header byte, raw or zstd), the same bytes as locally.
//!
//! Credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, ...), never from the URL.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as RemotePath;
use object_store::{ObjectStore as Remote, PutPayload};

use super::gc::Fence;
use super::kv::Database;
use super::object::decode_stored;
use super::rocks_store::RocksObjectStore;
use super::store::{ObjectStore, PutOutcome};
use super::{CasError, CasResult, Hash, ObjectId};

/// The column family marking objects known to be in the remote store.
pub const REMOTE_CF: &str = "remote";

/// An object checked (and uploaded: its stored length) or found present.
type Uploaded = (Hash, Option<u64>);

/// Parallel requests to the remote store.
const PARALLEL: usize = 32;

/// Counters of what crossed the network.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RemoteStats {
    pub uploaded_objects: u64,
    pub uploaded_bytes: u64,
    /// Existence checks made (objects not known to be remote).
    pub checked_objects: u64,
    pub fetched_objects: u64,
    pub fetched_bytes: u64,
}

pub struct RemoteObjectStore {
    local: Arc<RocksObjectStore>,
    remote: Arc<dyn Remote>,
    prefix: RemotePath,
    /// A URL naming the remote without credentials, for messages.
    name: String,
    rt: tokio::runtime::Runtime,
    pending: Mutex<HashSet<Hash>>,
    uploaded_objects: AtomicU64,
    uploaded_bytes: AtomicU64,
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

impl RemoteObjectStore {
    /// Opens the remote store at `url` (`s3://bucket/prefix`, `gs://...`,
    /// `az://...`, `file:///dir`, `memory://`) over the local store `local`.
    pub fn open(local: Arc<RocksObjectStore>, url: &str) -> CasResult<RemoteObjectStore> {
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
            pending: Mutex::new(HashSet::new()),
            uploaded_objects: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
            checked_objects: AtomicU64::new(0),
            fetched_objects: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
        })
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
            checked_objects: self.checked_objects.load(Ordering::Relaxed),
            fetched_objects: self.fetched_objects.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
        }
    }

    fn db(&self) -> &Database {
        self.local.database()
    }

    fn key(&self, id: &Hash) -> RemotePath {
        let hex = id.to_hex();
        self.prefix.child(&hex[..2]).child(hex.as_str())
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

    fn known_remote(&self, id: &Hash) -> CasResult<bool> {
        let cf = self.db().cf(REMOTE_CF);
        Ok(self
            .db()
            .raw()
            .get_pinned_cf(cf, id.as_bytes())
            .map_err(|e| self.db().err(e))?
            .is_some())
    }

    fn mark_remote(&self, ids: &[Hash]) -> CasResult<()> {
        let cf = self.db().cf(REMOTE_CF);
        let mut b = rocksdb::WriteBatch::default();
        for id in ids {
            b.put_cf(cf, id.as_bytes(), []);
        }
        self.db().raw().write(b).map_err(|e| self.db().err(e))
    }

    /// Uploads every object put since the last sync that the remote lacks.
    fn upload_pending(&self) -> CasResult<()> {
        let ids: Vec<Hash> = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let mut unknown = Vec::new();
        for id in &ids {
            if !self.known_remote(id)? {
                unknown.push(*id);
            }
        }
        self.checked_objects
            .fetch_add(unknown.len() as u64, Ordering::Relaxed);
        let (remote, local) = (self.remote.clone(), self.local.clone());
        let work: Vec<(Hash, RemotePath)> = unknown.iter().map(|id| (*id, self.key(id))).collect();
        // Each object's stored bytes are read only when the remote lacks it, and only
        // PARALLEL at a time are in memory.
        let results: Result<Vec<Uploaded>, (Hash, String)> = self.run(async move {
            stream::iter(work.into_iter().map(|(id, key)| {
                let (remote, local) = (remote.clone(), local.clone());
                async move {
                    match remote.head(&key).await {
                        Ok(_) => return Ok((id, None)),
                        Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err((id, format!("checking: {e}"))),
                    }
                    let stored = match local.get_stored(&id) {
                        Ok(Some(s)) => s,
                        Ok(None) => return Err((id, "not in the local store".into())),
                        Err(e) => return Err((id, e.to_string())),
                    };
                    let len = stored.len() as u64;
                    remote
                        .put(&key, PutPayload::from(stored))
                        .await
                        .map_err(|e| (id, format!("uploading: {e}")))?;
                    Ok((id, Some(len)))
                }
            }))
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await
        });
        let done = results.map_err(|(id, e)| self.err("object", Some(&id), e))?;
        for (_, up) in &done {
            if let Some(len) = up {
                self.uploaded_objects.fetch_add(1, Ordering::Relaxed);
                self.uploaded_bytes.fetch_add(*len, Ordering::Relaxed);
            }
        }
        self.mark_remote(&ids)?;
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for id in &ids {
            p.remove(id);
        }
        Ok(())
    }

    /// Fetches one object from the remote store, verifies it and keeps it locally.
    fn fetch(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        let key = self.key(&id.0);
        let remote = self.remote.clone();
        let got = self.run(async move {
            match remote.get(&key).await {
                Ok(r) => r.bytes().await.map(Some),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        });
        let stored = match got {
            Ok(Some(b)) => b,
            Ok(None) => return Err(CasError::NotFound { what, id: id.0 }),
            Err(e) => return Err(self.err("fetching", Some(&id.0), e)),
        };
        // Verified before anything is kept or returned.
        let data = decode_stored(&id.0, &stored)?;
        // Keeping it is an optimisation (a read-only open cannot).
        if let Err(e) = self
            .local
            .put_stored(&id.0, &stored)
            .and_then(|()| self.mark_remote(&[id.0]))
        {
            tracing::debug!("not caching object {}: {e}", id.0);
        }
        self.fetched_objects.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        Ok(data)
    }
}

impl ObjectStore for RemoteObjectStore {
    fn put(&self, data: &[u8]) -> CasResult<PutOutcome> {
        let out = self.local.put(data)?;
        if out.new || !self.known_remote(&out.id.0)? {
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(out.id.0);
        }
        Ok(out)
    }

    fn get(&self, id: &ObjectId, what: &'static str) -> CasResult<Vec<u8>> {
        match self.local.get(id, what) {
            Err(CasError::NotFound { .. }) => self.fetch(id, what),
            other => other,
        }
    }

    fn contains(&self, id: &ObjectId) -> CasResult<bool> {
        if self.local.contains(id)? {
            return Ok(true);
        }
        let key = self.key(&id.0);
        let remote = self.remote.clone();
        match self.run(async move { remote.head(&key).await }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.err("checking", Some(&id.0), e)),
        }
    }

    fn sync(&self) -> CasResult<()> {
        self.local.sync()?;
        self.upload_pending()
    }

    fn fence(&self) -> Option<&Fence> {
        self.local.fence()
    }

    fn prefetch(&self, ids: &[ObjectId]) {
        let mut want = Vec::new();
        for id in ids {
            if !self.local.contains(id).unwrap_or(true) {
                want.push((id.0, self.key(&id.0)));
            }
        }
        if want.is_empty() {
            return;
        }
        let remote = self.remote.clone();
        let got: Vec<(Hash, bytes::Bytes)> = self.run(async move {
            stream::iter(want.into_iter().map(|(id, key)| {
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
        let mut marked = Vec::with_capacity(got.len());
        for (id, stored) in got {
            // Kept only when it is what it claims to be (a read reports the rest).
            if decode_stored(&id, &stored).is_ok() && self.local.put_stored(&id, &stored).is_ok() {
                self.fetched_objects.fetch_add(1, Ordering::Relaxed);
                self.fetched_bytes
                    .fetch_add(stored.len() as u64, Ordering::Relaxed);
                marked.push(id);
            }
        }
        let _ = self.mark_remote(&marked);
    }
}
