//! `casfs serve`: the checkpoint store, sandboxes and run lifecycle over HTTP + JSON,
//! on a Unix socket (owner only, or a group's: [`SocketAccess`]; each caller's
//! sandboxes are theirs, [`Peer`]) or on loopback TCP with a bearer token, so an agent
//! host in another language can use casfs. `docs/openapi.json` describes every route of
//! [`ROUTES`]; a test keeps the two equal.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::checkpoint::maintenance::MaintainOp;
use crate::mount::control::NamespaceInfo;

mod api;
mod body;
mod budget;
mod caps;
mod client_sandboxes;
mod conn;
mod error;
mod event_ring;
mod files;
mod identity;
mod json_bounds;
mod peer;
mod processes;
mod run_slot;
mod runs;
mod sandboxes;
mod server;
mod stores;
mod stream;
mod threads;
mod writers;

use runs::{abort, chunk, disconnect, events, finish, run_error, start_run};
use threads::{
    artifacts, checkpoint, health, messages, post_artifact, put_messages, thread_log, threads,
};

use api::{blocking, ApiJson};
pub use body::DATA_ROUTES;
pub use conn::Timeouts;
pub use error::ApiError;
use error::{to_json, ApiResult};
pub use identity::{tenant_of_uid, Caller, Identities, Principal, MIN_TOKEN_LEN};
pub use json_bounds::{JsonLimits, MAX_DEPTH as MAX_JSON_DEPTH};
pub use peer::{group_id, Peer, SocketAccess};
pub use server::{
    ServeLimits, Server, DEFAULT_MAX_BODY, DEFAULT_MAX_DATA_BODY, DEFAULT_MAX_REQUEST_MEMORY,
};

/// Every route the server answers, as `METHOD path`; `docs/openapi.json` has the same.
pub const ROUTES: &[&str] = &[
    "GET /v1/health",
    "GET /v1/threads",
    "GET /v1/threads/{thread}/checkpoints",
    "POST /v1/threads/{thread}/checkpoints",
    "GET /v1/threads/{thread}/head",
    "POST /v1/threads/{thread}/writer",
    "POST /v1/threads/{thread}/writer/renew",
    "POST /v1/threads/{thread}/writer/release",
    "GET /v1/checkpoints/{id}",
    "GET /v1/threads/{thread}/messages",
    "PUT /v1/threads/{thread}/messages",
    "GET /v1/threads/{thread}/artifacts",
    "POST /v1/threads/{thread}/artifacts",
    "POST /v1/runs",
    "POST /v1/runs/{run}/chunk",
    "POST /v1/runs/{run}/finish",
    "POST /v1/runs/{run}/abort",
    "POST /v1/runs/{run}/error",
    "POST /v1/runs/{run}/disconnect",
    "GET /v1/runs/{run}/events",
    "GET /v1/sandboxes",
    "POST /v1/sandboxes",
    "DELETE /v1/sandboxes/{key}",
    "GET /v1/sandboxes/{key}/events",
    "GET /v1/sandboxes/{key}/fs/read",
    "PUT /v1/sandboxes/{key}/fs/write",
    "GET /v1/sandboxes/{key}/fs/list",
    "GET /v1/sandboxes/{key}/fs/stat",
    "POST /v1/sandboxes/{key}/fs/mkdir",
    "POST /v1/sandboxes/{key}/fs/remove",
    "POST /v1/sandboxes/{key}/fs/rename",
    "POST /v1/sandboxes/{key}/exec",
    "POST /v1/sandboxes/{key}/processes",
    "GET /v1/sandboxes/{key}/processes/{id}",
    "POST /v1/sandboxes/{key}/processes/{id}/stdin",
    "POST /v1/sandboxes/{key}/processes/{id}/kill",
    "POST /v1/sandboxes/{key}/ports",
    "POST /v1/maintenance",
    "POST /v1/threads/{thread}/fork",
    "PUT /v1/stores/{store}",
    "POST /v1/stores/{store}/writers",
    "POST /v1/stores/{store}/writers/renew",
    "POST /v1/stores/{store}/writers/release",
    "POST /v1/stores/{store}/checkpoints",
    "GET /v1/stores/{store}/checkpoints/{id}",
    "POST /v1/stores/{store}/heads/delete",
    "GET /v1/stores/{store}/threads/{thread}/head",
    "GET /v1/stores/{store}/threads/{thread}/checkpoints",
    "GET /v1/stores/{store}/threads/{thread}/messages",
    "PUT /v1/stores/{store}/threads/{thread}/messages",
    "GET /v1/stores/{store}/blob-references",
    "POST /v1/stores/{store}/forks",
    "GET /v1/stores/{store}/instances/{key}",
    "PUT /v1/stores/{store}/instances/{key}",
    "DELETE /v1/stores/{store}/instances/{key}",
];

impl Server {
    /// The HTTP routes, with the bearer-token check when a token is set.
    pub fn router(self: &Arc<Self>) -> Router {
        let r = Router::new()
            .route("/v1/health", get(health))
            .route("/v1/threads", get(threads))
            .route(
                "/v1/threads/{thread}/checkpoints",
                get(thread_log).post(writers::append),
            )
            .route("/v1/threads/{thread}/head", get(writers::head))
            .route("/v1/threads/{thread}/writer", post(writers::acquire))
            .route("/v1/threads/{thread}/writer/renew", post(writers::renew))
            .route(
                "/v1/threads/{thread}/writer/release",
                post(writers::release),
            )
            .route("/v1/checkpoints/{id}", get(checkpoint))
            .route(
                "/v1/threads/{thread}/messages",
                get(messages).put(put_messages),
            )
            .route(
                "/v1/threads/{thread}/artifacts",
                get(artifacts).post(post_artifact),
            )
            .route("/v1/runs", post(start_run))
            .route("/v1/runs/{run}/chunk", post(chunk))
            .route("/v1/runs/{run}/finish", post(finish))
            .route("/v1/runs/{run}/abort", post(abort))
            .route("/v1/runs/{run}/error", post(run_error))
            .route("/v1/runs/{run}/disconnect", post(disconnect))
            .route("/v1/runs/{run}/events", get(events))
            .route("/v1/sandboxes", get(list_sandboxes).post(sandboxes::create))
            .route("/v1/sandboxes/{key}", delete(sandboxes::destroy))
            .route("/v1/sandboxes/{key}/events", get(sandboxes::events))
            .route("/v1/sandboxes/{key}/fs/read", get(files::read))
            .route("/v1/sandboxes/{key}/fs/write", put(files::write))
            .route("/v1/sandboxes/{key}/fs/list", get(files::list))
            .route("/v1/sandboxes/{key}/fs/stat", get(files::stat))
            .route("/v1/sandboxes/{key}/fs/mkdir", post(files::mkdir))
            .route("/v1/sandboxes/{key}/fs/remove", post(files::remove))
            .route("/v1/sandboxes/{key}/fs/rename", post(files::rename))
            .route("/v1/sandboxes/{key}/exec", post(processes::exec))
            .route("/v1/sandboxes/{key}/processes", post(processes::spawn))
            .route("/v1/sandboxes/{key}/processes/{id}", get(processes::output))
            .route(
                "/v1/sandboxes/{key}/processes/{id}/stdin",
                post(processes::stdin),
            )
            .route(
                "/v1/sandboxes/{key}/processes/{id}/kill",
                post(processes::kill),
            )
            .route("/v1/sandboxes/{key}/ports", post(processes::port))
            .route("/v1/maintenance", post(maintain))
            .route("/v1/threads/{thread}/fork", post(writers::fork))
            .route("/v1/stores/{store}", put(stores::open))
            .route("/v1/stores/{store}/writers", post(stores::acquire))
            .route("/v1/stores/{store}/writers/renew", post(stores::renew))
            .route("/v1/stores/{store}/writers/release", post(stores::release))
            .route("/v1/stores/{store}/checkpoints", post(stores::append))
            .route("/v1/stores/{store}/checkpoints/{id}", get(stores::get))
            .route("/v1/stores/{store}/heads/delete", post(stores::delete_head))
            .route(
                "/v1/stores/{store}/threads/{thread}/head",
                get(stores::head),
            )
            .route(
                "/v1/stores/{store}/threads/{thread}/checkpoints",
                get(stores::list),
            )
            .route(
                "/v1/stores/{store}/threads/{thread}/messages",
                get(stores::messages).put(stores::put_messages),
            )
            .route(
                "/v1/stores/{store}/blob-references",
                get(stores::blob_references),
            )
            .route("/v1/stores/{store}/forks", post(stores::fork))
            .route(
                "/v1/stores/{store}/instances/{key}",
                get(stores::instance)
                    .put(stores::put_instance)
                    .delete(stores::delete_instance),
            )
            .fallback(api::no_route)
            .method_not_allowed_fallback(api::no_method)
            .layer(axum::middleware::from_fn(body::hold))
            .layer(axum::middleware::from_fn(body::busy))
            .with_state(self.clone());
        if self.identities.tokens() {
            r.layer(axum::middleware::from_fn_with_state(
                self.clone(),
                api::auth,
            ))
        } else {
            r
        }
    }
}

async fn list_sandboxes(State(s): State<Arc<Server>>, who: Caller) -> ApiResult {
    blocking(move || {
        let mut list: Vec<Value> =
            s.mw.provider()
                .live()
                .iter()
                .filter(|h| who.owns(&h.thread))
                .map(|h| {
                    let mut v = json!({
                        "key": h.key,
                        "path": h.root,
                        "kind": if h.mount().is_some() { "mount" } else { "dir" },
                        "base": h.expected_head().map(|c| c.to_hex()),
                    });
                    v["thread"] = json!(who.show(&h.thread));
                    if let Some(m) = h.mount() {
                        let (_, st) = m.status();
                        v["mode"] = json!(m.mode());
                        v["namespace"] = json!(NamespaceInfo::of_mount(m.mode(), &h.root));
                        v["dirty_files"] = json!(st.dirty_files);
                        v["dirty_bytes"] = json!(st.dirty_bytes);
                    }
                    v
                })
                .collect();
        list.sort_by(|a, b| a["key"].as_str().cmp(&b["key"].as_str()));
        Ok(Json(Value::Array(list)))
    })
    .await
}

async fn maintain(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiJson(op): ApiJson<MaintainOp>,
) -> ApiResult {
    // Retention and collection act on every tenant's history.
    who.require_admin("maintenance")?;
    blocking(move || {
        let live: std::collections::HashSet<[u8; 8]> =
            s.mw.provider()
                .live()
                .iter()
                .filter_map(|h| h.mount().map(|m| m.key()))
                .collect();
        Ok(Json(to_json(&op.run(&s.store, &live)?)))
    })
    .await
}

/// Aborts a task when dropped (the server's reaper, when serving ends).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where `casfs serve` listens.
pub enum Listen {
    /// A Unix socket, with its permissions.
    Unix(PathBuf, SocketAccess),
    /// Loopback only; requires a token.
    Tcp(std::net::SocketAddr),
}

/// Serves until `shutdown` completes.
pub async fn serve(
    server: Arc<Server>,
    listen: Listen,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Handlers learn who connected (`Peer`): `conn` puts it in each request.
    let app = server.router();
    // The reaper: abandoned runs and idle sandboxes, checked every second at most.
    let l = server.limits();
    let tick = (l.run_idle.min(l.sandbox_idle) / 4)
        .clamp(Duration::from_millis(50), Duration::from_secs(1));
    let reaping = server.clone();
    let reaper = tokio::spawn(async move {
        loop {
            tokio::time::sleep(tick).await;
            let s = reaping.clone();
            let _ = tokio::task::spawn_blocking(move || s.reap()).await;
        }
    });
    let _stop_reaper = AbortOnDrop(reaper);
    let caps = conn::Caps {
        max: l.max_connections.max(1),
        per_peer: l.max_connections_per_peer.max(1),
        timeouts: l.timeouts,
    };
    match listen {
        Listen::Unix(path, access) => {
            let sock = access.bind(&path)?;
            sock.set_nonblocking(true)?;
            let sock = tokio::net::UnixListener::from_std(sock)?;
            conn::run(conn::Socket::Unix(sock), app, caps, shutdown).await;
            let _ = std::fs::remove_file(&path);
            Ok(())
        }
        Listen::Tcp(addr) => {
            if !addr.ip().is_loopback() || !server.identities.tokens() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{addr}: TCP is served on loopback only, and only with a token"),
                ));
            }
            let sock = tokio::net::TcpListener::bind(addr).await?;
            conn::run(conn::Socket::Tcp(sock), app, caps, shutdown).await;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{DATA_ROUTES, ROUTES};

    #[test]
    fn data_routes_are_served_routes() {
        for r in DATA_ROUTES {
            assert!(ROUTES.contains(r), "{r} is not a route");
        }
    }
    use serde_json::Value;

    fn spec() -> Value {
        let text = include_str!("../../../docs/openapi.json");
        serde_json::from_str(text).expect("openapi.json is JSON")
    }

    /// Every `$ref` in `v` names something that exists in the document.
    fn refs_resolve(doc: &Value, v: &Value, at: &str) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    let ptr = r
                        .strip_prefix('#')
                        .unwrap_or_else(|| panic!("{at}: external $ref {r}"));
                    assert!(
                        doc.pointer(ptr).is_some(),
                        "{at}: $ref {r} resolves to nothing"
                    );
                }
                for (k, x) in m {
                    refs_resolve(doc, x, &format!("{at}/{k}"));
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    refs_resolve(doc, x, &format!("{at}/{i}"));
                }
            }
            _ => {}
        }
    }

    #[test]
    fn openapi_describes_exactly_the_served_routes() {
        let doc = spec();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
        let methods = ["get", "put", "post", "delete", "patch"];
        let mut described = Vec::new();
        let mut ids = std::collections::BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (m, op) in item.as_object().unwrap() {
                assert!(methods.contains(&m.as_str()), "{path}: unknown method {m}");
                described.push(format!("{} {path}", m.to_uppercase()));
                let id = op["operationId"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{m} {path}: no operationId"));
                assert!(ids.insert(id.to_string()), "operationId {id} twice");
                let responses = op["responses"].as_object().unwrap();
                assert!(responses.contains_key("200"), "{m} {path}: no 200 response");
                // Path parameters named in the path are declared, and only those.
                let in_path: Vec<&str> = path
                    .split('/')
                    .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                    .collect();
                let declared: Vec<&str> = op["parameters"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter(|p| p["in"] == "path")
                            .map(|p| p["name"].as_str().unwrap())
                            .collect()
                    })
                    .unwrap_or_default();
                assert_eq!(in_path, declared, "{m} {path}: path parameters");
            }
        }
        described.sort();
        let mut served: Vec<String> = ROUTES.iter().map(|s| s.to_string()).collect();
        served.sort();
        assert_eq!(described, served);
        refs_resolve(&doc, &doc, "#");
    }
}
