//! A sandbox's files for its client (the TypeScript provider's `fs`): read, write,
//! list, stat and lstat, make a directory, remove, rename, under
//! `/v1/sandboxes/{key}/fs/...`. Every path is resolved beneath the workspace's root
//! as a container runtime resolves a path inside a rootfs (`sys::dirfd::Root`:
//! `openat2` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`): a link in the workspace
//! is followed inside it, an absolute one from its root, `..` stops at the root, and
//! nothing outside it is ever read or written, whatever links the workspace holds or
//! gains meanwhile. Each operation runs as the sandbox's owner
//! ([`crate::fs::Owner::run_as`]): it is held to their permissions and what it makes
//! is theirs, as if the client had done it in the workspace itself.
//!
//! Paths are relative to the workspace's root (a leading `/` names the root too). Only
//! the caller's own sandbox is served; another's is not found.

use std::io;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath, ApiQuery};
use super::error::{ApiError, ApiResult};
use super::identity::Caller;
use super::server::Server;
use crate::middleware::SandboxHandle;
use crate::sys::dirfd::root::Root;
use crate::sys::dirfd::Meta;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathQuery {
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StatQuery {
    path: String,
    /// Follow a last link (inside the root): `stat`; by default `lstat`.
    #[serde(default)]
    follow: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathBody {
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RenameBody {
    from: String,
    to: String,
}

impl Server {
    /// The caller's live sandbox `key`, looked at (not held: a DELETE meanwhile is not
    /// refused for it); another's is not found, as one that does not exist.
    pub(super) fn sandbox_for(&self, who: &Caller, key: &str) -> Result<SandboxHandle, ApiError> {
        let h = self
            .mw
            .provider()
            .look(key)
            .filter(|h| who.owns(&h.thread))
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("no live sandbox {key:?}"),
                )
            })?;
        self.mw.provider().touch(key);
        Ok(h)
    }
}

/// `op` on the root of the caller's sandbox `key`, as its owner, off the async
/// workers; an error names `path` inside the workspace (never a path of the host).
async fn in_sandbox<T: Send + 'static>(
    s: Arc<Server>,
    who: Caller,
    key: String,
    path: String,
    op: impl FnOnce(&Root) -> io::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    blocking(move || {
        let h = s.sandbox_for(&who, &key)?;
        let root = Root::open(&h.root).map_err(|e| fs_error(&key, "/", e))?;
        h.owner
            .run_as(|| op(&root))
            .map_err(|e| fs_error(&key, &path, e))
    })
    .await
}

/// An error of the file system as the API answers it, naming the path inside the
/// workspace.
fn fs_error(key: &str, path: &str, e: io::Error) -> ApiError {
    let (status, kind) = match (e.kind(), e.raw_os_error()) {
        (io::ErrorKind::NotFound, _) => (StatusCode::NOT_FOUND, "not_found"),
        (io::ErrorKind::PermissionDenied, _) => (StatusCode::FORBIDDEN, "forbidden"),
        (io::ErrorKind::InvalidInput, _) => (StatusCode::BAD_REQUEST, "invalid"),
        (
            _,
            Some(
                libc::ELOOP
                | libc::ENOTDIR
                | libc::EISDIR
                | libc::ENOTEMPTY
                | libc::EEXIST
                | libc::EXDEV
                | libc::EINVAL
                | libc::ENAMETOOLONG,
            ),
        ) => (StatusCode::BAD_REQUEST, "invalid"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "sandbox"),
    };
    ApiError::new(status, kind, format!("{path:?} in sandbox {key:?}: {e}"))
}

fn kind_of(m: &Meta) -> &'static str {
    match m.mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "dir",
        libc::S_IFLNK => "symlink",
        _ => "other",
    }
}

fn stat_json(m: &Meta) -> Value {
    json!({
        "type": kind_of(m),
        "mode": m.mode,
        "size": m.size,
        "mtime_ms": m.mtime_ns.div_euclid(1_000_000),
    })
}

/// `GET /v1/sandboxes/{key}/fs/read?path=`: the content of the regular file `path`
/// leads to (links followed inside the workspace), at most `--max-data-body` bytes.
pub(super) async fn read(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, ApiError> {
    let limit = s.limits().max_data_body as u64;
    let p = q.path.clone();
    let bytes = in_sandbox(s, who, key, q.path, move |r| r.read(p.as_bytes(), limit)).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

/// `PUT /v1/sandboxes/{key}/fs/write?path=`: the body (any bytes) becomes the whole
/// content of the file `path` (made, with the directories above it, where missing).
pub(super) async fn write(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    req: Request,
) -> ApiResult {
    let data = super::body::read_bytes(req, &s).await?;
    let n = data.len();
    let p = q.path.clone();
    in_sandbox(s, who, key, q.path, move |r| {
        let parent = match p.trim_end_matches('/').rsplit_once('/') {
            Some((dir, _)) => dir.to_string(),
            None => String::new(),
        };
        r.mkdir_all(parent.as_bytes(), 0o777)?;
        r.write(p.as_bytes(), &data, 0o666)
    })
    .await?;
    Ok(Json(json!({"ok": true, "size": n})))
}

/// `GET /v1/sandboxes/{key}/fs/list?path=`: the entries of the directory `path` leads
/// to, by name, each with its type (links not followed).
pub(super) async fn list(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult {
    let p = q.path.clone();
    let entries = in_sandbox(s, who, key, q.path, move |r| r.list(p.as_bytes())).await?;
    Ok(Json(Value::Array(
        entries
            .iter()
            .map(|(name, m)| json!({"name": String::from_utf8_lossy(name), "type": kind_of(m)}))
            .collect(),
    )))
}

/// `GET /v1/sandboxes/{key}/fs/stat?path=&follow=`: what `path` names (`lstat`), or
/// with `follow` what it leads to (`stat`, inside the workspace); 404 when nothing.
pub(super) async fn stat(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<StatQuery>,
) -> ApiResult {
    let (p, follow) = (q.path.clone(), q.follow);
    let m = in_sandbox(s, who, key, q.path, move |r| {
        if follow {
            r.stat(p.as_bytes())
        } else {
            r.lstat(p.as_bytes())
        }
    })
    .await?;
    Ok(Json(stat_json(&m)))
}

/// `POST /v1/sandboxes/{key}/fs/mkdir {path}`: the directory `path` and every missing
/// one above it.
pub(super) async fn mkdir(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(b): ApiJson<PathBody>,
) -> ApiResult {
    let p = b.path.clone();
    in_sandbox(s, who, key, b.path, move |r| {
        r.mkdir_all(p.as_bytes(), 0o777)
    })
    .await?;
    Ok(Json(json!({"ok": true})))
}

/// `POST /v1/sandboxes/{key}/fs/remove {path}`: the entry `path` names (a link itself,
/// not what it leads to) and, for a directory, everything in it; nothing there is no
/// error (`removed` false).
pub(super) async fn remove(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(b): ApiJson<PathBody>,
) -> ApiResult {
    let p = b.path.clone();
    let removed = in_sandbox(s, who, key, b.path, move |r| {
        match r.remove_all(p.as_bytes()) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    })
    .await?;
    Ok(Json(json!({"ok": true, "removed": removed})))
}

/// `POST /v1/sandboxes/{key}/fs/rename {from, to}`: the entry `from` names moves to
/// `to` (links themselves, not what they lead to).
pub(super) async fn rename(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(b): ApiJson<RenameBody>,
) -> ApiResult {
    let (from, to) = (b.from.clone(), b.to.clone());
    let shown = format!("{} -> {}", b.from, b.to);
    in_sandbox(s, who, key, shown, move |r| {
        r.rename(from.as_bytes(), to.as_bytes())
    })
    .await?;
    Ok(Json(json!({"ok": true})))
}
