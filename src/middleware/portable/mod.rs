//! Portable checkpoint stores: an agent framework's own checkpoint records, kept durable
//! in casfs's store. TanStack AI's sandbox layer (`SandboxCheckpointStore`) publishes
//! *portable* snapshots: a manifest of workspace files by blob key, the conversation
//! and the artifacts, on threads whose heads move by compare-and-swap under a writer
//! lease (an owner secret and a fence). A framework host that wants those records
//! where its casfs checkpoints are uses one of these stores instead of an in-memory
//! one.
//!
//! Each store has a name and its own key space: its threads, heads, writer leases,
//! fences, blob reference counts, the transcripts a fork writes, and the framework's
//! sandbox instance records. Every operation is one transaction ([`PortableKv`]):
//! checked and applied at once, so two hosts' writers see one order. The rules are the
//! framework's contract: check order included (an id is checked before the writer, the
//! writer before a duplicate id, the duplicate before the head), since a caller tells
//! the cases apart by the error's kind.
//!
//! Lease time: a store keeps the server's clock, unless it was made with
//! [`Clock::Client`], where every lease operation states the time it happens at (a
//! test's injected clock). Such a store is only its own: its leases, heads and records
//! share nothing with any other store, and a server makes one only when its operator
//! allowed it (`casfs serve --allow-client-clocks`).

mod stores;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use crate::checkpoint::portable_kv::{KvTx, PortableKv};

use crate::cas::CasError;
use crate::checkpoint::{CheckpointError, OwnerToken, Store};

/// What a portable store refuses, by the framework's kinds of refusal.
#[derive(Debug, thiserror::Error)]
pub enum PortableError {
    #[error("{0}")]
    InvalidId(String),
    #[error("{0}")]
    InvalidEntry(String),
    #[error("{0}")]
    StaleHead(String),
    #[error("{0}")]
    ParentMismatch(String),
    #[error("{0}")]
    DuplicateId(String),
    #[error("{0}")]
    NotHead(String),
    #[error("{0}")]
    WriterConflict(String),
    #[error("{0}")]
    WriterLost(String),
    #[error("{0}")]
    ForkSourceNotFound(String),
    #[error("{0}")]
    ForkSourceThreadMismatch(String),
    #[error("{0}")]
    ForkDestinationNotEmpty(String),
    /// A request that is not well formed (options, the stated time, a store name).
    #[error("{0}")]
    Invalid(String),
    /// No such store.
    #[error("{0}")]
    NoStore(String),
    /// The store exists with other options.
    #[error("{0}")]
    StoreExists(String),
    #[error(transparent)]
    Store(#[from] CheckpointError),
}

impl From<CasError> for PortableError {
    fn from(e: CasError) -> PortableError {
        PortableError::Store(CheckpointError::Cas(e))
    }
}

impl PortableError {
    /// The error's kind in `casfs serve`'s answers (the framework's code, in lower case
    /// without its `SANDBOX_SNAPSHOT_` prefix).
    pub fn kind(&self) -> &'static str {
        use PortableError as P;
        match self {
            P::InvalidId(_) => "invalid_id",
            P::InvalidEntry(_) => "invalid_entry",
            P::StaleHead(_) => "stale_head",
            P::ParentMismatch(_) => "parent_mismatch",
            P::DuplicateId(_) => "duplicate_id",
            P::NotHead(_) => "not_head",
            P::WriterConflict(_) => "writer_conflict",
            P::WriterLost(_) => "writer_lost",
            P::ForkSourceNotFound(_) => "fork_source_not_found",
            P::ForkSourceThreadMismatch(_) => "fork_source_thread_mismatch",
            P::ForkDestinationNotEmpty(_) => "fork_destination_not_empty",
            P::Invalid(_) => "invalid",
            P::NoStore(_) => "no_store",
            P::StoreExists(_) => "store_exists",
            P::Store(_) => "internal",
        }
    }
}

pub type PortableResult<T> = Result<T, PortableError>;

/// Whose clock decides when a store's leases expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    /// The server's: a request stating a time is refused.
    Server,
    /// The clients': every lease operation states `now` (a test's injected clock).
    Client,
}

/// A store's settings, fixed when it is made.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StoreOptions {
    pub lease_duration_ms: f64,
    pub renew_after_ms: f64,
    pub clock: Clock,
}

impl Default for StoreOptions {
    /// The framework's defaults: leases of 120 s, renewed after 45 s.
    fn default() -> StoreOptions {
        StoreOptions {
            lease_duration_ms: 120_000.0,
            renew_after_ms: 45_000.0,
            clock: Clock::Server,
        }
    }
}

impl StoreOptions {
    fn check(&self) -> PortableResult<()> {
        let d = self.lease_duration_ms;
        let r = self.renew_after_ms;
        if !(d.is_finite() && d > 0.0 && d <= 86_400_000.0) {
            return Err(PortableError::Invalid(format!(
                "lease_duration_ms {d}: more than 0, at most 24 hours"
            )));
        }
        if !(r.is_finite() && r > 0.0 && r < d) {
            return Err(PortableError::Invalid(format!(
                "renew_after_ms {r}: more than 0 and less than lease_duration_ms ({d})"
            )));
        }
        Ok(())
    }
}

/// A writer as it presents itself: the thread, its owner secret and its fence.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Writer {
    pub thread_id: String,
    pub owner_token: String,
    pub fence: u64,
}

/// A lease as its acquirer is told it.
#[derive(Debug, Clone, Serialize)]
pub struct Grant {
    pub thread_id: String,
    pub owner_token: String,
    pub fence: u64,
    pub expires_at: f64,
    pub renew_after_ms: f64,
}

/// A thread's lease as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseRow {
    fence: u64,
    owner_digest: String,
    expires_at: f64,
}

/// What a fork copies and where to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkInput {
    pub source_thread_id: String,
    pub source_checkpoint_id: String,
    pub destination_thread_id: String,
    pub destination_checkpoint_id: String,
    pub created_at: Value,
    pub writer: Writer,
}

// Key space: a tag byte, then the store name and the other parts, each with its length
// (4 bytes, big-endian) first, so that a prefix of parts is a prefix of keys.
const META: u8 = b'N';
const RECORD: u8 = b'C';
const BY_THREAD: u8 = b'T';
const HEAD: u8 = b'H';
const LEASE: u8 = b'W';
const FENCE: u8 = b'F';
const REFS: u8 = b'R';
const MESSAGES: u8 = b'M';
const INSTANCE: u8 = b'I';

fn key(tag: u8, parts: &[&str]) -> Vec<u8> {
    let mut k = vec![tag];
    for p in parts {
        k.extend_from_slice(&(p.len() as u32).to_be_bytes());
        k.extend_from_slice(p.as_bytes());
    }
    k
}

/// The parts of a key made by [`key`] (after its tag).
fn parts(k: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = &k[1.min(k.len())..];
    while rest.len() >= 4 {
        let n = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let Some(p) = rest.get(4..4 + n) else { break };
        out.push(String::from_utf8_lossy(p).into_owned());
        rest = &rest[4 + n..];
    }
    out
}

/// The longest id, thread id or key a store takes (in bytes).
pub const MAX_ID: usize = 1024;

fn valid_id(v: &str, label: &str) -> PortableResult<()> {
    if v.is_empty() {
        return Err(PortableError::InvalidId(format!(
            "{label} must be a non-empty well-formed Unicode string"
        )));
    }
    if v.len() > MAX_ID {
        return Err(PortableError::InvalidId(format!(
            "{label} is over {MAX_ID} bytes"
        )));
    }
    Ok(())
}

/// A store name: 1 to 200 of letters, digits and `._:@+-`; or a tenant's store,
/// `tenant/name` (`casfs serve` puts every store a tenant names in its space).
pub fn check_store_name(name: &str) -> PortableResult<()> {
    let (tenant, local) = match name.split_once('/') {
        Some((t, n)) => (Some(t), n),
        None => (None, name),
    };
    if let Some(t) = tenant {
        crate::checkpoint::check_tenant_name(t)
            .map_err(|e| PortableError::Invalid(e.to_string()))?;
    }
    let ok = !local.is_empty()
        && local.len() <= 200
        && local
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:@+-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(PortableError::Invalid(format!(
            "store name {local:?}: use 1 to 200 of letters, digits and ._:@+-"
        )))
    }
}

fn str_field<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get(field).and_then(Value::as_str)
}

fn is_normal_path(p: &str) -> bool {
    let drive = p.len() >= 2
        && p.as_bytes()[0].is_ascii_alphabetic()
        && p.as_bytes()[1] == b':'
        && (p.len() == 2 || p.as_bytes()[2] == b'/' || p.as_bytes()[2] == b'\\');
    !p.is_empty()
        && !p.contains('\0')
        && !p.starts_with('/')
        && !p.contains('\\')
        && !drive
        && p.split('/').all(|s| !s.is_empty() && s != "." && s != "..")
}

fn is_blob_key(k: &str, prefix: &str) -> bool {
    k.strip_prefix(prefix).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn safe_size(v: Option<&Value>) -> bool {
    v.and_then(Value::as_u64).is_some_and(|n| n < (1u64 << 53))
}

/// The framework's rules for a checkpoint's file entries.
fn check_entries(cp: &Value) -> PortableResult<()> {
    let bad = |m: String| Err(PortableError::InvalidEntry(m));
    let Some(files) = cp.get("files").and_then(Value::as_array) else {
        return bad("Checkpoint files must be an array".into());
    };
    let mut kinds: BTreeMap<&str, bool> = BTreeMap::new(); // path -> is a file
    for e in files {
        let Some(obj) = e.as_object() else {
            return bad("Checkpoint entry must be an object".into());
        };
        let Some(path) = obj
            .get("path")
            .and_then(Value::as_str)
            .filter(|p| is_normal_path(p))
        else {
            return bad(
                "Checkpoint entry path must be a normalized workspace-relative path".into(),
            );
        };
        if kinds.contains_key(path) {
            return bad(format!("Checkpoint contains duplicate entry path '{path}'"));
        }
        for (i, _) in path.match_indices('/') {
            let ancestor = &path[..i];
            if kinds.get(ancestor) == Some(&true) {
                return bad(format!(
                    "Checkpoint entry '{path}' is beneath file '{ancestor}'"
                ));
            }
        }
        let kind = obj.get("kind").and_then(Value::as_str);
        if kind == Some("file") {
            let under = format!("{path}/");
            if kinds
                .range(under.as_str()..)
                .next()
                .is_some_and(|(k, _)| k.starts_with(&under))
            {
                return bad(format!(
                    "Checkpoint file '{path}' is an ancestor of another entry"
                ));
            }
        }
        match kind {
            Some("file") => {
                let key_ok = obj
                    .get("blobKey")
                    .and_then(Value::as_str)
                    .is_some_and(|k| is_blob_key(k, "sandbox-files/sha256/"));
                if !key_ok {
                    return bad("File entries require a non-empty blobKey".into());
                }
                if !safe_size(obj.get("size")) {
                    return bad("File entry size must be a non-negative safe integer".into());
                }
            }
            Some("dir") => {
                if obj.contains_key("blobKey") || obj.contains_key("size") {
                    return bad("Directory entries cannot contain file fields".into());
                }
            }
            _ => return bad("Checkpoint entry kind must be file or dir".into()),
        }
        kinds.insert(path, kind == Some("file"));
    }
    Ok(())
}

/// The framework's rules for a checkpoint's artifacts.
fn check_artifacts(cp: &Value) -> PortableResult<()> {
    let Some(arts) = cp.get("artifacts").and_then(Value::as_array) else {
        return Err(PortableError::InvalidEntry(
            "Checkpoint artifacts must be an array".into(),
        ));
    };
    for a in arts {
        let text = |f: &str| str_field(a, f).is_some_and(|s| !s.is_empty());
        let ok = a.is_object()
            && text("artifactId")
            && text("name")
            && text("mimeType")
            && str_field(a, "blobKey").is_some_and(|k| is_blob_key(k, "sandbox-artifacts/sha256/"))
            && safe_size(a.get("size"))
            && a.get("createdAt").is_some_and(Value::is_number);
        if !ok {
            return Err(PortableError::InvalidEntry(
                "Checkpoint artifact has invalid fields".into(),
            ));
        }
    }
    Ok(())
}

/// The distinct blob keys a checkpoint refers to (files and artifacts).
fn blob_keys(cp: &Value) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for list in ["files", "artifacts"] {
        for e in cp.get(list).and_then(Value::as_array).into_iter().flatten() {
            if list == "artifacts" || str_field(e, "kind") == Some("file") {
                if let Some(k) = str_field(e, "blobKey") {
                    keys.insert(k.to_string());
                }
            }
        }
    }
    keys
}

/// The portable stores of one casfs store.
#[derive(Clone)]
pub struct PortableStores {
    kv: Arc<dyn PortableKv>,
}

/// The reads and writes of one transaction of one store.
struct Tx<'a> {
    kv: &'a mut dyn KvTx,
    name: &'a str,
}

impl Tx<'_> {
    fn get_json<T: serde::de::DeserializeOwned>(&mut self, k: &[u8]) -> PortableResult<Option<T>> {
        match self.kv.get(k)? {
            None => Ok(None),
            Some(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
                PortableError::Store(CheckpointError::Corrupt {
                    id: format!("portable store {:?} record {:?}", self.name, parts(k)),
                    detail: e.to_string(),
                })
            }),
        }
    }

    fn put_json<T: Serialize>(&mut self, k: &[u8], v: &T) {
        self.kv
            .put(k, &serde_json::to_vec(v).expect("JSON serializes"));
    }

    fn options(&mut self) -> PortableResult<StoreOptions> {
        self.get_json(&key(META, &[self.name]))?.ok_or_else(|| {
            PortableError::NoStore(format!(
                "no portable store {:?} (make it first: PUT /v1/stores/{})",
                self.name, self.name
            ))
        })
    }

    /// The time of this operation, by the store's clock.
    fn now(&mut self, stated: Option<f64>) -> PortableResult<f64> {
        match (self.options()?.clock, stated) {
            (Clock::Server, None) => {
                Ok(crate::checkpoint::millis(std::time::SystemTime::now()) as f64)
            }
            (Clock::Server, Some(_)) => Err(PortableError::Invalid(format!(
                "store {:?} keeps the server's time: a request may not state `now`",
                self.name
            ))),
            (Clock::Client, Some(t)) if t.is_finite() => Ok(t),
            (Clock::Client, _) => Err(PortableError::Invalid(format!(
                "store {:?} keeps its clients' time: every lease operation states a finite `now`",
                self.name
            ))),
        }
    }

    fn head(&mut self, thread: &str) -> PortableResult<Option<String>> {
        Ok(self
            .kv
            .get(&key(HEAD, &[self.name, thread]))?
            .map(|b| String::from_utf8_lossy(&b).into_owned()))
    }

    fn record(&mut self, id: &str) -> PortableResult<Option<Value>> {
        self.get_json(&key(RECORD, &[self.name, id]))
    }

    fn lease(&mut self, thread: &str) -> PortableResult<Option<LeaseRow>> {
        self.get_json(&key(LEASE, &[self.name, thread]))
    }

    /// `writer` holds `thread`'s live lease at `now`.
    fn check_writer(&mut self, writer: &Writer, thread: &str, now: f64) -> PortableResult<()> {
        let current = self.lease(thread)?;
        let digest = OwnerToken::from_client(writer.owner_token.clone()).digest();
        match current {
            Some(l)
                if l.owner_digest == digest && l.fence == writer.fence && l.expires_at > now =>
            {
                Ok(())
            }
            _ => Err(PortableError::WriterLost(format!(
                "Checkpoint writer lease for thread '{thread}' is no longer current"
            ))),
        }
    }

    fn add_refs(&mut self, keys: &BTreeSet<String>, delta: i64) -> PortableResult<()> {
        for k in keys {
            let rk = key(REFS, &[self.name, k]);
            let n: i64 = self.get_json(&rk)?.unwrap_or(0) + delta;
            if n > 0 {
                self.put_json(&rk, &n);
            } else {
                self.kv.delete(&rk);
            }
        }
        Ok(())
    }

    /// Stores `cp` as the thread's new head, counting its blob keys.
    fn publish(&mut self, cp: &Value) -> PortableResult<()> {
        let id = str_field(cp, "id").expect("checked");
        let thread = str_field(cp, "threadId").expect("checked");
        self.put_json(&key(RECORD, &[self.name, id]), cp);
        self.kv.put(&key(BY_THREAD, &[self.name, thread, id]), b"");
        self.kv.put(&key(HEAD, &[self.name, thread]), id.as_bytes());
        self.add_refs(&blob_keys(cp), 1)
    }
}

fn created_at_finite(v: Option<&Value>, what: &str) -> PortableResult<()> {
    match v.and_then(Value::as_f64) {
        Some(x) if x.is_finite() => Ok(()),
        _ => Err(PortableError::InvalidEntry(format!(
            "{what} createdAt must be a finite number"
        ))),
    }
}

fn order_key(cp: &Value) -> (f64, Vec<u8>) {
    (
        cp.get("createdAt").and_then(Value::as_f64).unwrap_or(0.0),
        str_field(cp, "id").unwrap_or("").as_bytes().to_vec(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_one_thread_never_prefix_another_s() {
        let a = key(BY_THREAD, &["s", "t", "x"]);
        let b = key(BY_THREAD, &["s", "tt"]);
        assert!(!a.starts_with(&b));
        assert!(a.starts_with(&key(BY_THREAD, &["s", "t"])));
        assert_eq!(parts(&a), vec!["s", "t", "x"]);
    }

    #[test]
    fn entries_follow_the_framework_s_rules() {
        let key = |n: u8| format!("sandbox-files/sha256/{}", format!("{n:02x}").repeat(32));
        let cp = |files: Value| json!({"files": files, "artifacts": []});
        let f = |p: &str| json!({"path": p, "kind": "file", "blobKey": key(1), "size": 1});
        let d = |p: &str| json!({"path": p, "kind": "dir"});
        assert!(check_entries(&cp(json!([f("a"), d("b"), f("b/c")]))).is_ok());
        for bad in [
            json!([f("/a")]),
            json!([f("a/../b")]),
            json!([f("a\\b")]),
            json!([f("C:/x")]),
            json!([f("a"), f("a")]),
            json!([f("a"), f("a/b")]),
            json!([d("a/b"), f("a")]),
            json!([{"path": "a", "kind": "file", "blobKey": "nope", "size": 1}]),
            json!([{"path": "a", "kind": "file", "blobKey": key(2), "size": -1}]),
            json!([{"path": "a", "kind": "dir", "size": 0}]),
            json!([{"path": "a", "kind": "link"}]),
        ] {
            assert!(check_entries(&cp(bad.clone())).is_err(), "{bad}");
        }
    }
}
