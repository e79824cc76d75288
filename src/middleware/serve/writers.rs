//! The checkpoint store for a writer that keeps its own lease (the TypeScript adapter,
//! shaped like an agent framework's checkpoint store): take, renew and give up a
//! thread's writer lease, read the head, and append a checkpoint of a sandbox under the
//! lease with compare-and-swap on the head. The store checks the fencing token and the
//! head in the same atomic step as the append: a writer whose lease expired or was
//! taken over, or that read a head that has since moved, publishes nothing.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, no_secret, ApiJson, ApiPath};
use super::error::{to_json, ApiError, ApiResult};
use super::identity::Caller;
use super::server::Server;
use crate::cas::Hash;
use crate::checkpoint::{CheckpointId, LeaseStatus, OwnerToken, ThreadId, WriterLease};
use crate::middleware::publish::Publish;

/// The longest lease a client may ask for (as the stores allow).
const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// A lease as the API answers it (to its writer only: it holds the owner secret): the
/// store's record plus when to renew (a third of the TTL after the last renewal, in
/// milliseconds from now on).
pub(super) fn lease_json(who: &Caller, l: &WriterLease) -> Value {
    let mut v = to_json(l);
    v["renew_after_ms"] = json!(l.ttl_ms / 3);
    who.show_thread_field(&mut v, "thread", &l.thread);
    v
}

/// A holder name for a client that gave none: `casfs-client:` and a random tag.
fn client_holder() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let seed = format!(
        "{}-{n}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    );
    format!("casfs-client:{}", Hash::of(seed.as_bytes()).short(8))
}

fn check_ttl_ms(ttl_ms: u64) -> Result<Duration, ApiError> {
    let ttl = Duration::from_millis(ttl_ms);
    if ttl < Duration::from_millis(100) || ttl > MAX_TTL {
        return Err(ApiError::bad(format!(
            "ttl_ms {ttl_ms}: use 100 ms to 24 hours"
        )));
    }
    Ok(ttl)
}

/// What a writer sends to renew, release or append with its lease: the fencing token
/// and the owner secret it was given at acquire. Holder and TTL are fixed at acquire
/// and not sent again.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WriterProof {
    token: u64,
    owner_token: String,
}

impl WriterProof {
    fn lease(self, thread: &ThreadId) -> Result<WriterLease, ApiError> {
        if self.owner_token.is_empty() || self.owner_token.len() > 256 {
            return Err(ApiError::bad(
                "owner_token: the secret the lease's acquire answered with",
            ));
        }
        Ok(WriterLease::presented(
            thread.clone(),
            self.token,
            OwnerToken::from_client(self.owner_token),
        ))
    }
}

/// A holder name goes into the store's records as it is: 1 to 200 printable
/// characters, never a secret's value.
fn check_holder(s: &Server, holder: &str) -> Result<(), ApiError> {
    if holder.is_empty() || holder.len() > 200 || holder.chars().any(char::is_control) {
        return Err(ApiError::bad(format!(
            "holder {holder:?}: use 1 to 200 printable characters"
        )));
    }
    no_secret(s, "the holder name", holder)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Acquire {
    /// Who holds it, as errors name it (default: this server, with a random tag).
    holder: Option<String>,
    /// Default: the server's lease TTL (`casfs serve --lease-ttl`).
    ttl_ms: Option<u64>,
}

pub(super) async fn acquire(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(b): ApiJson<Acquire>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let ttl = match b.ttl_ms {
            Some(ms) => check_ttl_ms(ms)?,
            None => s.mw.publisher().snapshots()?.lease_ttl,
        };
        let holder = match b.holder {
            Some(h) => {
                check_holder(&s, &h)?;
                h
            }
            // Not a name of this server's process: the client outlives a server that
            // crashed, so its lease is taken over only after its TTL.
            None => client_holder(),
        };
        let lease = s.store.checkpoints().acquire_writer(&t, &holder, ttl)?;
        Ok(Json(lease_json(&who, &lease)))
    })
    .await
}

pub(super) async fn renew(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(p): ApiJson<WriterProof>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let renewed = s.store.checkpoints().renew(&p.lease(&t)?)?;
        Ok(Json(lease_json(&who, &renewed)))
    })
    .await
}

pub(super) async fn release(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(p): ApiJson<WriterProof>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        s.store.checkpoints().release(&p.lease(&t)?)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn head(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let h = s.store.checkpoints().head(&t)?;
        Ok(Json(
            json!({"thread": who.show(&t), "head": h.map(|h| h.to_hex())}),
        ))
    })
    .await
}

/// A full checkpoint id (64 hex digits): a compare-and-swap takes no prefix.
fn full_id(what: &str, s: &str) -> Result<CheckpointId, ApiError> {
    if s.len() != 64 {
        return Err(ApiError::bad(format!(
            "{what} {s:?}: a full checkpoint id (64 hex digits)"
        )));
    }
    Hash::from_hex(s)
        .map(CheckpointId)
        .ok_or_else(|| ApiError::bad(format!("{what} {s:?}: not hex")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Append {
    /// The sandbox whose workspace is captured (a key from `POST /v1/sandboxes`).
    sandbox: String,
    /// The head the writer read (null: the thread has none yet). Required: a writer
    /// that forgot it must not be taken to mean "an empty thread".
    #[serde(default, deserialize_with = "present")]
    expected_head: Option<Option<String>>,
    /// The writer's fencing token and owner secret.
    writer: WriterProof,
    reason: Option<String>,
    source_run_id: Option<String>,
    /// The conversation to store with it; absent: the thread's messages on the server.
    conversation: Option<Vec<Value>>,
}

/// A field that may be null but must be there: absent stays `None`, null is `Some(None)`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

pub(super) async fn append(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(b): ApiJson<Append>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let lease = b.writer.lease(&t)?;
        let expected = b
            .expected_head
            .ok_or_else(|| {
                ApiError::bad("expected_head is required (null for a thread with no checkpoint)")
            })?
            .map(|h| full_id("expected_head", &h))
            .transpose()?;
        let handle = s.sandbox_of(&who, &b.sandbox, &t)?;
        let reason = b.reason.unwrap_or_else(|| "client append".into());
        no_secret(&s, "reason", &reason)?;
        if let Some(r) = &b.source_run_id {
            no_secret(&s, "source_run_id", r)?;
        }
        let out = s.mw.publisher().publish(Publish {
            thread: &t,
            handle: &handle,
            reason,
            source_run_id: b.source_run_id,
            completion_of: None,
            conversation: b.conversation,
            expected_head: Some(expected),
            // The store checks the token and its expiry in the append itself.
            lease: &|| LeaseStatus::Held(lease.clone()),
        })?;
        let id = out.checkpoint.ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the append published nothing",
            )
        })?;
        let cp = s.store.checkpoints().get(&id)?;
        Ok(Json(json!({
            "checkpoint": who.show_checkpoint(&cp),
            "changed_files": out.changed_files,
            "skipped": out.skipped,
            "secret_files": out.secret_files,
        })))
    })
    .await
}

impl Server {
    /// Live sandbox `key`, checked to be a workspace of `thread`.
    pub(super) fn sandbox_of(
        &self,
        who: &Caller,
        key: &str,
        thread: &ThreadId,
    ) -> Result<crate::middleware::SandboxHandle, ApiError> {
        // Another tenant's sandbox is not found, as one that does not exist.
        let h = self
            .mw
            .provider()
            .get(key)
            .filter(|h| who.owns(&h.thread))
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("no live sandbox {key:?}"),
                )
            })?;
        self.mw.provider().touch(key);
        if &h.thread != thread {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "wrong_thread",
                format!(
                    "sandbox {key:?} is a workspace of thread {:?}, not of {:?}",
                    who.show(&h.thread),
                    who.show(thread)
                ),
            ));
        }
        Ok(h)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Fork {
    /// The checkpoint the new thread starts from (any reference: id, prefix, `@thread`).
    from: String,
}

/// Starts thread `thread` at checkpoint `from`: its first checkpoint has `from`'s
/// content, `from` its parent. The thread must not exist.
pub(super) async fn fork(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(b): ApiJson<Fork>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        // From a checkpoint the caller may see: a tenant forks only its own.
        let from = s.resolve(&who, &b.from)?;
        let cp = s.store.checkpoints().fork(&t, &from)?;
        Ok(Json(who.show_checkpoint(&cp)))
    })
    .await
}
