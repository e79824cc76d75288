//! Portable checkpoint stores over HTTP (`/v1/stores/{store}/...`): an agent
//! framework's checkpoint store, transcript store and sandbox instance store, durable
//! in casfs's store (`middleware::portable`). The TypeScript package's
//! `CasfsCheckpointStore` and `CasfsInstanceStore` are their clients.
//!
//! Every record, transcript and instance record is stored scrubbed of the server's
//! secrets (placeholders) and answered with the values back, as the messages and
//! artifacts routes do; an id, thread id or key holding a secret's value is refused
//! (it is part of a key, stored as it is).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath};
use super::error::{ApiError, ApiResult};
use super::identity::Caller;
use super::server::Server;
use crate::middleware::portable::{ForkInput, PortableError, PortableStores, StoreOptions, Writer};

impl From<PortableError> for ApiError {
    fn from(e: PortableError) -> ApiError {
        use PortableError as P;
        let status = match &e {
            P::InvalidId(_) | P::InvalidEntry(_) | P::Invalid(_) => StatusCode::BAD_REQUEST,
            P::NoStore(_) | P::ForkSourceNotFound(_) => StatusCode::NOT_FOUND,
            P::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::CONFLICT,
        };
        ApiError::new(status, e.kind(), e.to_string())
    }
}

impl Server {
    /// Refuses an id that holds one of the server's secrets (ids are parts of keys,
    /// stored as they are), or text that looks like one of casfs's placeholders (an id
    /// is not escaped, and answers fill placeholders).
    fn portable_id(&self, what: &str, v: &str) -> Result<(), ApiError> {
        if v.contains("{{casfs-") {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_id",
                format!(
                    "{what} holds `{{{{casfs-`, which casfs's placeholders begin with; ids are \
                     stored as they are, so this is refused"
                ),
            ));
        }
        match self.mw.secrets.found_in(v.as_bytes()) {
            Some(secret) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_id",
                format!(
                    "{what} holds the value of secret {secret}; ids are stored as they are, so \
                     this is refused"
                ),
            )),
            None => Ok(()),
        }
    }

    fn scrub(&self, v: &Value) -> Value {
        self.mw.secrets.scrub_json(v)
    }

    fn fill(&self, v: &Value) -> Value {
        self.mw.secrets.fill_json(v)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct Open {
    lease_duration_ms: Option<f64>,
    renew_after_ms: Option<f64>,
    clock: Option<crate::middleware::portable::Clock>,
}

/// Runs `f` off the async runtime on the caller's store named `store` (a tenant's
/// stores are its own: `f` is given the name resolved for the caller), with the
/// server and the portable stores.
async fn on_store(
    s: Arc<Server>,
    who: Caller,
    store: String,
    f: impl FnOnce(&Server, PortableStores, String) -> ApiResult + Send + 'static,
) -> ApiResult {
    blocking(move || {
        let store = who.store(&store);
        f(&s, PortableStores::of(&s.store), store)
    })
    .await
}

pub(super) async fn open(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<Open>,
) -> ApiResult {
    let named = store.clone();
    on_store(s, who, store, move |s, stores, store| {
        let options =
            if b.lease_duration_ms.is_none() && b.renew_after_ms.is_none() && b.clock.is_none() {
                None
            } else {
                let d = StoreOptions::default();
                Some(StoreOptions {
                    lease_duration_ms: b.lease_duration_ms.unwrap_or(d.lease_duration_ms),
                    renew_after_ms: b.renew_after_ms.unwrap_or(d.renew_after_ms),
                    clock: b.clock.unwrap_or(d.clock),
                })
            };
        let allow = s.allow_client_clocks();
        let o = stores.open(&store, options, allow)?;
        Ok(Json(json!({"store": named, "options": o})))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Acquire {
    thread_id: String,
    now: Option<f64>,
}

pub(super) async fn acquire(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<Acquire>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        s.portable_id("the thread id", &b.thread_id)?;
        let g = stores.acquire(&store, &b.thread_id, b.now)?;
        Ok(Json(serde_json::to_value(g).expect("JSON")))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WriterOp {
    writer: Writer,
    now: Option<f64>,
}

pub(super) async fn renew(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<WriterOp>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        let expires_at = stores.renew(&store, &b.writer, b.now)?;
        Ok(Json(json!({"expires_at": expires_at})))
    })
    .await
}

pub(super) async fn release(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<WriterOp>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        if b.now.is_some() {
            return Err(ApiError::bad("a release states no `now`"));
        }
        stores.release(&store, &b.writer)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn get(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, id)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        let cp = stores.get(&store, &id)?;
        Ok(Json(json!({"checkpoint": cp.map(|c| s.fill(&c))})))
    })
    .await
}

pub(super) async fn list(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, thread)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        let l = stores.list(&store, &thread)?;
        Ok(Json(Value::Array(l.iter().map(|c| s.fill(c)).collect())))
    })
    .await
}

pub(super) async fn head(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, thread)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        let h = stores.head(&store, &thread)?;
        Ok(Json(json!({"head": h})))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Append {
    checkpoint: Value,
    /// Required (null: the thread has no head yet).
    #[serde(default, deserialize_with = "present")]
    expected_head_id: Option<Option<String>>,
    writer: Writer,
    now: Option<f64>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

pub(super) async fn append(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<Append>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        let expected = b.expected_head_id.ok_or_else(|| {
            ApiError::bad("expected_head_id is required (null for a thread with no head)")
        })?;
        for (what, field) in [("the checkpoint id", "id"), ("the thread id", "threadId")] {
            if let Some(v) = b.checkpoint.get(field).and_then(Value::as_str) {
                s.portable_id(what, v)?;
            }
        }
        let cp = s.scrub(&b.checkpoint);
        let head = stores.append(&store, &cp, expected.as_deref(), &b.writer, b.now)?;
        Ok(Json(json!({"head_id": head})))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DeleteHead {
    thread_id: String,
    checkpoint_id: String,
    writer: Writer,
    now: Option<f64>,
}

pub(super) async fn delete_head(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<DeleteHead>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        stores.delete_head(&store, &b.thread_id, &b.checkpoint_id, &b.writer, b.now)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn blob_references(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        let refs = stores.blob_references(&store)?;
        Ok(Json(Value::Array(
            refs.into_iter()
                .map(|(key, references)| json!({"key": key, "references": references}))
                .collect(),
        )))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Fork {
    #[serde(flatten)]
    fork: ForkInput,
    now: Option<f64>,
}

pub(super) async fn fork(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(store): ApiPath<String>,
    ApiJson(b): ApiJson<Fork>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        s.portable_id("the destination thread id", &b.fork.destination_thread_id)?;
        s.portable_id(
            "the destination checkpoint id",
            &b.fork.destination_checkpoint_id,
        )?;
        // The new record is stored as the rest are: what the client gives of it
        // (`created_at`: any JSON) scrubbed, so an answer filling it never expands a
        // placeholder the client wrote.
        let mut fork = b.fork;
        fork.created_at = s.scrub(&fork.created_at);
        let cp = stores.fork(&store, &fork, b.now)?;
        Ok(Json(json!({"checkpoint": s.fill(&cp)})))
    })
    .await
}

pub(super) async fn messages(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, thread)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        let m = stores.messages(&store, &thread)?;
        Ok(Json(json!({"messages": m.map(|m| s.fill(&m))})))
    })
    .await
}

pub(super) async fn put_messages(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, thread)): ApiPath<(String, String)>,
    ApiJson(messages): ApiJson<Vec<Value>>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        s.portable_id("the thread id", &thread)?;
        let m = s.scrub(&Value::Array(messages));
        stores.save_messages(&store, &thread, &m)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn instance(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, key)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        let r = stores.instance(&store, &key)?;
        Ok(Json(json!({"record": r.map(|r| s.fill(&r))})))
    })
    .await
}

pub(super) async fn put_instance(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, key)): ApiPath<(String, String)>,
    ApiJson(record): ApiJson<Value>,
) -> ApiResult {
    on_store(s, who, store, move |s, stores, store| {
        s.portable_id("the instance key", &key)?;
        let r = s.scrub(&record);
        stores.put_instance(&store, &key, &r)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn delete_instance(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((store, key)): ApiPath<(String, String)>,
) -> ApiResult {
    on_store(s, who, store, move |_, stores, store| {
        stores.delete_instance(&store, &key)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}
