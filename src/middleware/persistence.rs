//! Where a host keeps a thread's conversation, its artifacts and their bytes, and how
//! the middleware learns that a run's persistence is complete. The traits are the
//! host's seam; [`StorePersistence`] keeps all three in the casfs store (column family
//! `host`), so a single store directory carries a thread to another host.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::{MiddlewareError, MiddlewareResult};
use super::secrets::Secrets;
use crate::cas::Database;
use crate::checkpoint::ThreadId;

/// A thread's conversation: messages in order, each any JSON the host uses.
pub trait MessageStore: Send + Sync {
    fn load_thread(&self, thread: &ThreadId) -> MiddlewareResult<Vec<serde_json::Value>>;
    /// Replaces the thread's conversation (a restore on a new host does this).
    fn save_thread(
        &self,
        thread: &ThreadId,
        messages: &[serde_json::Value],
    ) -> MiddlewareResult<()>;
}

/// An artifact a run produced; its bytes are in the blob store under `blob_key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArtifactMeta {
    pub artifact_id: String,
    pub run_id: String,
    pub thread: ThreadId,
    pub blob_key: Option<String>,
    pub name: String,
    pub mime_type: String,
    pub size: u64,
    pub created_at_ms: u64,
}

pub trait ArtifactStore: Send + Sync {
    fn list_for_thread(&self, thread: &ThreadId) -> MiddlewareResult<Vec<ArtifactMeta>>;
    fn put(&self, meta: &ArtifactMeta) -> MiddlewareResult<()>;
}

pub trait BlobStore: Send + Sync {
    fn get(&self, key: &str) -> MiddlewareResult<Option<Vec<u8>>>;
    /// The blob's size, if it exists.
    fn head(&self, key: &str) -> MiddlewareResult<Option<u64>>;
    fn put(&self, key: &str, body: &[u8]) -> MiddlewareResult<()>;
}

/// Tells when everything a run wrote to persistence (its last messages, artifacts) is
/// durable, so a capture sees it.
pub trait RunCompletion: Send + Sync {
    fn wait_for_run_completion(&self, run_id: &str, timeout: Duration) -> MiddlewareResult<()>;
}

/// The persistence layer a run uses: all four parts.
#[derive(Clone)]
pub struct Persistence {
    pub messages: Option<Arc<dyn MessageStore>>,
    pub artifacts: Option<Arc<dyn ArtifactStore>>,
    pub blobs: Option<Arc<dyn BlobStore>>,
    pub completion: Option<Arc<dyn RunCompletion>>,
}

impl Persistence {
    /// Everything on one [`StorePersistence`].
    pub fn on_store(p: Arc<StorePersistence>) -> Persistence {
        Persistence {
            messages: Some(p.clone()),
            artifacts: Some(p.clone()),
            blobs: Some(p.clone()),
            completion: Some(p),
        }
    }

    /// Whether `other` is made of the very same stores.
    pub fn same_as(&self, other: &Persistence) -> bool {
        fn same<T: ?Sized>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
            match (a, b) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
        }
        same(&self.messages, &other.messages)
            && same(&self.artifacts, &other.artifacts)
            && same(&self.blobs, &other.blobs)
            && same(&self.completion, &other.completion)
    }

    /// The parts, or a configuration error naming the first one missing.
    pub(crate) fn parts(&self) -> MiddlewareResult<Parts<'_>> {
        let missing = |what: &str| {
            MiddlewareError::Config(format!(
                "snapshots need persistence stores for messages, artifacts and blobs and a run \
                 completion signal; {what} is missing"
            ))
        };
        Ok(Parts {
            messages: self
                .messages
                .as_deref()
                .ok_or_else(|| missing("messages"))?,
            artifacts: self
                .artifacts
                .as_deref()
                .ok_or_else(|| missing("artifacts"))?,
            blobs: self.blobs.as_deref().ok_or_else(|| missing("blobs"))?,
            completion: self
                .completion
                .as_deref()
                .ok_or_else(|| missing("completion"))?,
        })
    }
}

pub(crate) struct Parts<'a> {
    pub messages: &'a dyn MessageStore,
    pub artifacts: &'a dyn ArtifactStore,
    pub blobs: &'a dyn BlobStore,
    pub completion: &'a dyn RunCompletion,
}

/// Conversations, artifacts and blobs in the casfs store. Writes are synchronous, so
/// a run's persistence is complete when its writes have returned.
///
/// With secrets, nothing it writes holds a secret value: keys, messages, artifact
/// records and blobs have every value replaced by its placeholder on the way in (JSON
/// before it is encoded) and put back on the way out, so the host reads what it wrote.
pub struct StorePersistence {
    db: Arc<Database>,
    secrets: Secrets,
}

/// The column family of [`StorePersistence`]: plain keys, not objects.
pub const HOST_CF: &str = "host";

/// The column families the middleware keeps in a store's database: open the store with
/// them ([`crate::checkpoint::Store::open_with_families`]).
pub const COLUMN_FAMILIES: &[&str] = &[HOST_CF];

impl StorePersistence {
    /// Persistence in `db`, which must have been opened with [`COLUMN_FAMILIES`].
    pub fn new(db: Arc<Database>) -> MiddlewareResult<StorePersistence> {
        if !db.has_column(HOST_CF) {
            return Err(MiddlewareError::Config(format!(
                "the store's database was opened without the {HOST_CF:?} column family; \
                 open it with middleware::COLUMN_FAMILIES"
            )));
        }
        Ok(StorePersistence {
            db,
            secrets: Secrets::default(),
        })
    }

    /// Keeps the values of `secrets` out of everything it stores.
    pub fn with_secrets(mut self, secrets: Secrets) -> StorePersistence {
        self.secrets = secrets;
        self
    }

    fn key(&self, kind: u8, parts: &[&str]) -> Vec<u8> {
        let mut k = vec![kind];
        for p in parts {
            k.extend_from_slice(self.secrets.scrub_str(p).as_bytes());
            k.push(0);
        }
        k
    }

    fn get(&self, key: &[u8]) -> MiddlewareResult<Option<Vec<u8>>> {
        self.db
            .column(HOST_CF)
            .get(key)
            .map_err(|e| MiddlewareError::Persistence(e.to_string()))
    }

    /// A synced write: a run's persistence is complete when its writes have returned.
    fn put(&self, key: &[u8], value: &[u8]) -> MiddlewareResult<()> {
        self.db
            .column(HOST_CF)
            .put(key, value, true)
            .map_err(|e| MiddlewareError::Persistence(e.to_string()))
    }

    fn scan(&self, prefix: &[u8]) -> MiddlewareResult<Vec<Vec<u8>>> {
        Ok(self
            .db
            .column(HOST_CF)
            .prefixed(prefix)
            .map_err(|e| MiddlewareError::Persistence(e.to_string()))?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> MiddlewareResult<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| MiddlewareError::Persistence(format!("stored {what} unreadable: {e}")))
}

impl MessageStore for StorePersistence {
    fn load_thread(&self, thread: &ThreadId) -> MiddlewareResult<Vec<serde_json::Value>> {
        match self.get(&self.key(b'm', &[thread.as_str()]))? {
            Some(b) => {
                let stored: Vec<serde_json::Value> = decode("conversation", &b)?;
                Ok(stored.iter().map(|m| self.secrets.fill_json(m)).collect())
            }
            None => Ok(Vec::new()),
        }
    }

    fn save_thread(
        &self,
        thread: &ThreadId,
        messages: &[serde_json::Value],
    ) -> MiddlewareResult<()> {
        let scrubbed: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| self.secrets.scrub_json(m))
            .collect();
        let bytes = serde_json::to_vec(&scrubbed).expect("JSON values serialize");
        self.put(&self.key(b'm', &[thread.as_str()]), &bytes)
    }
}

impl ArtifactStore for StorePersistence {
    fn list_for_thread(&self, thread: &ThreadId) -> MiddlewareResult<Vec<ArtifactMeta>> {
        let mut v: Vec<ArtifactMeta> = self
            .scan(&self.key(b'a', &[thread.as_str()]))?
            .iter()
            .map(|b| {
                let stored: serde_json::Value = decode("artifact", b)?;
                serde_json::from_value(self.secrets.fill_json(&stored)).map_err(|e| {
                    MiddlewareError::Persistence(format!("stored artifact unreadable: {e}"))
                })
            })
            .collect::<MiddlewareResult<_>>()?;
        v.sort_by(|a, b| (a.created_at_ms, &a.artifact_id).cmp(&(b.created_at_ms, &b.artifact_id)));
        Ok(v)
    }

    fn put(&self, meta: &ArtifactMeta) -> MiddlewareResult<()> {
        let v = serde_json::to_value(meta).expect("artifact serializes");
        let bytes = serde_json::to_vec(&self.secrets.scrub_json(&v)).expect("JSON serializes");
        StorePersistence::put(
            self,
            &self.key(b'a', &[meta.thread.as_str(), &meta.artifact_id]),
            &bytes,
        )
    }
}

impl BlobStore for StorePersistence {
    fn get(&self, key: &str) -> MiddlewareResult<Option<Vec<u8>>> {
        Ok(StorePersistence::get(self, &self.key(b'b', &[key]))?
            .map(|b| self.secrets.fill(&b).unwrap_or(b)))
    }

    fn head(&self, key: &str) -> MiddlewareResult<Option<u64>> {
        Ok(BlobStore::get(self, key)?.map(|b| b.len() as u64))
    }

    fn put(&self, key: &str, body: &[u8]) -> MiddlewareResult<()> {
        let stored = self.secrets.scrub(body).map(|(b, _)| b);
        StorePersistence::put(
            self,
            &self.key(b'b', &[key]),
            stored.as_deref().unwrap_or(body),
        )
    }
}

impl RunCompletion for StorePersistence {
    fn wait_for_run_completion(&self, _run: &str, _timeout: Duration) -> MiddlewareResult<()> {
        // Every write above is synced before it returns.
        Ok(())
    }
}
