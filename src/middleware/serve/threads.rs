//! Threads and their records over HTTP: health, the threads a caller sees, a thread's
//! checkpoints, one checkpoint, and a thread's messages and artifacts.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath, ApiQuery};
use super::error::{to_json, ApiError, ApiResult};
use super::identity::Caller;
use super::server::Server;
use crate::middleware::persistence::ArtifactMeta;

pub(super) async fn health() -> Json<Value> {
    Json(json!({"ok": true, "version": env!("CARGO_PKG_VERSION")}))
}

pub(super) async fn threads(State(s): State<Arc<Server>>, who: Caller) -> ApiResult {
    blocking(move || {
        let t = s.store.checkpoints().threads()?;
        Ok(Json(Value::Array(
            t.into_iter()
                .filter(|(t, _)| who.owns(t))
                .map(|(t, h)| json!({"thread": who.show(&t), "head": h.to_hex()}))
                .collect(),
        )))
    })
    .await
}

#[derive(Deserialize)]
pub(super) struct LogQuery {
    limit: Option<usize>,
}

pub(super) async fn thread_log(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiQuery(q): ApiQuery<LogQuery>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let log = s
            .store
            .checkpoints()
            .log(&t, q.limit.unwrap_or(100).min(10_000))?;
        // The thread's history walks parents: where it reaches a thread that is not the
        // caller's (an administrator forked it from there), the caller's part ends.
        Ok(Json(Value::Array(
            log.iter()
                .take_while(|c| who.owns(&c.body.thread_id))
                .map(|c| who.show_checkpoint(c))
                .collect(),
        )))
    })
    .await
}

pub(super) async fn checkpoint(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        // The references the command line takes: an id, a prefix, `@thread`, `~N`.
        let id = s.resolve(&who, &id)?;
        Ok(Json(who.show_checkpoint(&s.store.checkpoints().get(&id)?)))
    })
    .await
}

pub(super) async fn messages(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let m = crate::middleware::MessageStore::load_thread(&*s.persistence, &t)?;
        Ok(Json(Value::Array(m)))
    })
    .await
}

pub(super) async fn put_messages(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(body): ApiJson<Vec<Value>>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        crate::middleware::MessageStore::save_thread(&*s.persistence, &t, &body)?;
        Ok(Json(json!({"ok": true, "messages": body.len()})))
    })
    .await
}

pub(super) async fn artifacts(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let list = crate::middleware::ArtifactStore::list_for_thread(&*s.persistence, &t)?;
        Ok(Json(Value::Array(
            list.iter().map(|a| show_artifact(&who, a)).collect(),
        )))
    })
    .await
}

/// An artifact's record as its caller sees it (its thread as they name it).
pub(super) fn show_artifact(who: &Caller, a: &ArtifactMeta) -> Value {
    let mut v = to_json(a);
    who.show_thread_field(&mut v, "thread", &a.thread);
    v
}

#[derive(Deserialize)]
pub(super) struct NewArtifact {
    artifact_id: String,
    run_id: String,
    name: String,
    mime_type: String,
    /// The bytes, base64 (standard alphabet).
    content_base64: String,
}

pub(super) async fn post_artifact(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(thread): ApiPath<String>,
    ApiJson(a): ApiJson<NewArtifact>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &thread)?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(a.content_base64.as_bytes())
            .map_err(|e| ApiError::bad(format!("content_base64: {e}")))?;
        if a.artifact_id.is_empty() || a.artifact_id.contains('\0') {
            return Err(ApiError::bad("artifact_id: 1 or more characters, no NUL"));
        }
        // The thread's length first: a tenant's thread holds a '/', as an artifact id
        // may, and two (thread, id) pairs must never share a key.
        let key = format!("artifacts/{}:{t}/{}", t.as_str().len(), a.artifact_id);
        crate::middleware::BlobStore::put(&*s.persistence, &key, &bytes)?;
        let meta = ArtifactMeta {
            artifact_id: a.artifact_id,
            run_id: a.run_id,
            thread: t,
            blob_key: Some(key),
            name: a.name,
            mime_type: a.mime_type,
            size: bytes.len() as u64,
            created_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        crate::middleware::ArtifactStore::put(&*s.persistence, &meta)?;
        Ok(Json(show_artifact(&who, &meta)))
    })
    .await
}
