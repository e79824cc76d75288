//! Request bodies of `casfs serve`, read within bounds: each route's size limit (most
//! routes carry no data and take `--max-body`; the few that do take
//! `--max-data-body`: [`DATA_ROUTES`]), the JSON's depth and element count checked as
//! the bytes arrive ([`super::json_bounds`]), and the memory they take charged to the
//! server's budget ([`super::budget`]) from before the first byte is read until the
//! request is answered ([`hold`]). Every refusal is the API's JSON error: 413
//! `too_large` naming the route's limit, 400 `invalid` naming the JSON limit, 503
//! `busy` when the budget has no room within `--request-memory-wait`.

use crate::sys::Locked;
use std::sync::{Arc, Mutex};

use axum::extract::{FromRequestParts, Request};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use super::budget::{Charge, Refused, Share};
use super::error::ApiError;
use super::json_bounds::{JsonBounds, TooMuch};
use super::peer::Peer;
use super::server::{ServeLimits, Server};

/// The routes whose bodies carry data, as `METHOD path` (the rest take `--max-body`):
/// an artifact (base64), a conversation (the thread's messages, the client append's
/// `conversation`), a portable checkpoint record, a portable transcript, a file written
/// into a sandbox.
pub const DATA_ROUTES: &[&str] = &[
    "PUT /v1/sandboxes/{key}/fs/write",
    "POST /v1/threads/{thread}/artifacts",
    "PUT /v1/threads/{thread}/messages",
    "POST /v1/threads/{thread}/checkpoints",
    "POST /v1/stores/{store}/checkpoints",
    "PUT /v1/stores/{store}/threads/{thread}/messages",
];

/// The route template of `path` among [`DATA_ROUTES`], if it is one.
fn data_route(method: &Method, path: &str) -> Option<&'static str> {
    DATA_ROUTES.iter().copied().find(|r| {
        let (m, template) = r.split_once(' ').expect("METHOD path");
        m == method.as_str()
            && template.split('/').count() == path.split('/').count()
            && template
                .split('/')
                .zip(path.split('/'))
                .all(|(t, p)| t == p || (t.starts_with('{') && !p.is_empty()))
    })
}

/// The largest body of the request's route, and the setting that says so.
fn limit_of(method: &Method, path: &str, l: &ServeLimits) -> (usize, &'static str, String) {
    match data_route(method, path) {
        Some(route) => (l.max_data_body, "--max-data-body", route.to_string()),
        None => (l.max_body, "--max-body", format!("{method} {path}")),
    }
}

/// Bytes, in a binary unit when round.
fn shown(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// Whether the body is declared JSON (`application/json`, or `application/*+json`),
/// as axum's `Json` takes it.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(v) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = v
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let Some((kind, sub)) = essence.split_once('/') else {
        return false;
    };
    kind == "application" && (sub == "json" || sub.ends_with("+json"))
}

fn too_large(what: &str, limit: usize, flag: &str) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!(
            "the body of {what} is over its limit of {} (casfs serve {flag} {limit})",
            shown(limit)
        ),
    )
}

fn refused(r: Refused) -> ApiError {
    match r {
        Refused::Busy {
            wanted,
            share,
            peer,
        } => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            format!(
                "the server's memory for requests ({} at once, casfs serve \
                 --max-request-memory{}) had no room for {} more within {:?} \
                 (--request-memory-wait); try again later",
                shown(share.total),
                if peer {
                    format!(
                        "; {} for one peer beside its first request, \
                         --max-request-memory-per-peer",
                        shown(share.per_peer)
                    )
                } else {
                    String::new()
                },
                shown(wanted),
                share.wait
            ),
        ),
        Refused::NeverFits { wanted, total } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!(
                "the body and the JSON values made of it would take about {}, more than \
                 all the server's memory for requests ({}, casfs serve \
                 --max-request-memory)",
                shown(wanted),
                shown(total)
            ),
        ),
    }
}

fn json_refused(t: TooMuch) -> ApiError {
    ApiError::bad(match t {
        TooMuch::Depth(max) => format!(
            "the JSON body nests arrays and objects deeper than {max} levels (casfs serve \
             --max-json-depth)"
        ),
        TooMuch::Elements(max) => format!(
            "the JSON body holds over {max} elements, array items and object members \
             together (casfs serve --max-json-elements)"
        ),
    })
}

/// The charges of a request being answered, given back when the answer is made
/// ([`hold`] keeps them until then).
#[derive(Clone, Default)]
pub(super) struct Held(Arc<Mutex<Vec<Charge>>>);

/// Keeps what a request's body was charged until its handler has answered: the values
/// made of the body live as long as the handler.
pub(super) async fn hold(mut req: Request, next: Next) -> Response {
    let held = Held::default();
    req.extensions_mut().insert(held.clone());
    let answer = next.run(req).await;
    drop(held);
    answer
}

/// The server is busy while it answers a request: sandboxes are booted ahead while it
/// is not ([`crate::middleware::isolate::Busy`]).
pub(super) async fn busy(req: Request, next: Next) -> Response {
    let _busy = crate::middleware::isolate::Busy::new();
    next.run(req).await
}

/// The request's body, read within the route's limits and the budget, as JSON of `T`.
pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request,
    s: &Arc<Server>,
) -> Result<T, ApiError> {
    if !json_content_type(req.headers()) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Expected request with `Content-Type: application/json`",
        ));
    }
    let (bytes, charge) = read(req, s, true).await?;
    let v = parse(&bytes);
    // Served without `hold`: given back once the values are made.
    drop(charge);
    v
}

/// The request's body as bytes (any content type), read within the route's limits and
/// the budget.
pub(super) async fn read_bytes(req: Request, s: &Arc<Server>) -> Result<Vec<u8>, ApiError> {
    let (bytes, charge) = read(req, s, false).await?;
    drop(charge);
    Ok(bytes)
}

/// The body, charged to the budget (the charge kept by [`hold`], or given to the
/// caller when there is none), its JSON bounds checked when `json`.
async fn read(
    req: Request,
    s: &Arc<Server>,
    json: bool,
) -> Result<(Vec<u8>, Option<Charge>), ApiError> {
    let l = s.limits();
    let (limit, flag, what) = limit_of(req.method(), req.uri().path(), &l);
    // Framing is checked before hyper reads the head (`conn`): one length at most.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(&what, limit, flag));
    }
    let (mut parts, body) = req.into_parts();
    let peer = Peer::from_request_parts(&mut parts, s)
        .await
        .unwrap_or_default();
    let share = Share {
        total: l.max_request_memory,
        per_peer: l.max_request_memory_per_peer,
        wait: l.request_memory_wait,
    };
    let mut charge = s.budget.open(peer.owner().map(|o| o.uid));
    // A declared length is charged whole before a byte is read: all or nothing, so
    // that waiting requests never each hold part of what they need.
    let declared = declared.map(|n| n as usize);
    if let Some(n) = declared {
        charge.grow(n, share).await.map_err(refused)?;
    }
    let mut bounds = JsonBounds::new(l.json);
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad(format!("the request body could not be read: {e}")))?;
        if bytes.len() + chunk.len() > limit {
            return Err(too_large(&what, limit, flag));
        }
        if declared.is_none() {
            charge.grow(chunk.len(), share).await.map_err(refused)?;
        }
        if json {
            bounds.feed(&chunk).map_err(json_refused)?;
        }
        bytes.extend_from_slice(&chunk);
    }
    if json {
        // The values about to be made of it.
        let tree = usize::try_from(bounds.tree_bytes()).unwrap_or(usize::MAX);
        charge.grow(tree, share).await.map_err(refused)?;
    }
    match parts.extensions.get::<Held>() {
        Some(h) => {
            h.0.locked().push(charge);
            Ok((bytes, None))
        }
        None => Ok((bytes, Some(charge))),
    }
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    axum::Json::<T>::from_bytes(bytes)
        .map(|j| j.0)
        .map_err(|r| ApiError::bad(r.body_text()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_routes_match_their_paths_only() {
        let l = ServeLimits::default();
        let put = Method::PUT;
        let post = Method::POST;
        for (m, path, flag) in [
            (&put, "/v1/threads/t%2Fx/messages", "--max-data-body"),
            (&post, "/v1/threads/t/artifacts", "--max-data-body"),
            (&post, "/v1/threads/t/checkpoints", "--max-data-body"),
            (&post, "/v1/stores/s/checkpoints", "--max-data-body"),
            (&put, "/v1/stores/s/threads/t/messages", "--max-data-body"),
            (&post, "/v1/threads/t/messages", "--max-body"),
            (&put, "/v1/stores/s/instances/k", "--max-body"),
            (&post, "/v1/runs", "--max-body"),
            (&put, "/v1/threads//messages", "--max-body"),
            (&put, "/v1/threads/t/messages/x", "--max-body"),
        ] {
            assert_eq!(limit_of(m, path, &l).1, flag, "{m} {path}");
        }
    }

    #[test]
    fn json_is_what_axum_takes_as_json() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            json_content_type(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/vnd.api+json"));
        assert!(!with("text/json"));
        assert!(!with("application/jsonx"));
        assert!(!json_content_type(&HeaderMap::new()));
        assert_eq!(shown(32 << 20), "32 MiB");
        assert_eq!(shown(256 << 10), "256 KiB");
        assert_eq!(shown(1000), "1000 bytes");
    }
}
