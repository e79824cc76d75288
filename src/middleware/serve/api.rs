//! What every route of `casfs serve` shares: the bearer-token check, extractors whose
//! rejections are JSON errors (the answer itself is `super::error`'s), and running
//! blocking store work off the async workers.

use std::sync::Arc;

use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::identity::{Caller, TokenHolder};
use super::peer::Peer;
use super::server::Server;
use crate::checkpoint::{CheckpointError, CheckpointId, ThreadId};

/// The token layer (when the server has tokens): a request without a valid token is
/// refused; one with a token is marked with whose it is ([`TokenHolder`]), which names
/// the caller on TCP (on the Unix socket the peer's credentials name the caller).
pub(super) async fn auth(State(s): State<Arc<Server>>, mut req: Request, next: Next) -> Response {
    let holder = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_credentials)
        .and_then(|t| s.identities.holder(t));
    if let Some(h) = holder {
        req.extensions_mut().insert(TokenHolder(h));
        next.run(req).await
    } else {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required",
        )
        .into_response()
    }
}

/// The credentials of an `Authorization: Bearer ...` value: the scheme's name is
/// case-insensitive and followed by one or more spaces (RFC 9110, 11.4).
fn bearer_credentials(v: &str) -> Option<&str> {
    let (scheme, rest) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim_start_matches(' '))
}

/// The request body as JSON, read within the route's limits and the server's memory
/// for requests (`serve::body`); a body that is not (bad JSON, wrong type, missing
/// field, no JSON content type, too large, too deep) is an [`ApiError`] like every
/// other.
pub(super) struct ApiJson<T>(pub T);

impl<T: serde::de::DeserializeOwned> FromRequest<Arc<Server>> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, s: &Arc<Server>) -> Result<Self, ApiError> {
        super::body::read_json(req, s).await.map(ApiJson)
    }
}

/// An extractor of request parts whose rejection is a 400 [`ApiError`], like every other
/// error: `$name(T)` wraps `axum::extract::$inner<T>`.
macro_rules! api_extractor {
    ($(#[$doc:meta])* $name:ident, $inner:ident, $rejection:ty) => {
        $(#[$doc])*
        pub(super) struct $name<T>(pub T);

        impl<T, S> FromRequestParts<S> for $name<T>
        where
            axum::extract::$inner<T>: FromRequestParts<S, Rejection = $rejection>,
            S: Send + Sync,
        {
            type Rejection = ApiError;

            async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
                axum::extract::$inner::<T>::from_request_parts(parts, state)
                    .await
                    .map(|x| $name(x.0))
                    .map_err(|r| ApiError::bad(r.body_text()))
            }
        }
    };
}

api_extractor!(
    /// A path parameter; one that does not decode is a 400.
    ApiPath,
    Path,
    PathRejection
);
api_extractor!(
    /// The query string; one that does not parse is a 400.
    ApiQuery,
    Query,
    QueryRejection
);

/// Who the caller is: on the Unix socket, the peer the kernel names; on TCP, the
/// token's holder the token layer found.
impl FromRequestParts<Arc<Server>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &Arc<Server>) -> Result<Caller, ApiError> {
        let peer = parts.extensions.get::<ConnectInfo<Peer>>().map(|c| &c.0);
        match peer {
            // The Unix socket: the kernel's word.
            Some(p) if p.is_unix() => s.identities.of_peer(p),
            // TCP: the token's (the token layer refused a request without one).
            Some(_) => match parts.extensions.get::<TokenHolder>() {
                Some(TokenHolder(p)) => Ok(Caller {
                    principal: p.clone(),
                    owner: None,
                }),
                None => Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "a valid bearer token is required",
                )),
            },
            // A router called in-process, with no connection: the server's own user.
            None => Ok(Caller::admin()),
        }
    }
}

pub(super) async fn no_route(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

pub(super) async fn no_method(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} is not served on {}", req.method(), req.uri().path()),
    )
}

/// Runs blocking store and mount work off the async workers.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
}

impl Server {
    /// The thread a route names for `who`: a valid thread id, in the caller's space (a
    /// tenant's own), that holds no secret's value. Every route resolves its thread
    /// here, so no name holding a secret reaches a record, a head, a lease or a fencing
    /// key, and no tenant names another's thread.
    pub(super) fn thread_id(&self, who: &Caller, name: &str) -> Result<ThreadId, ApiError> {
        let t = who.thread(name)?;
        no_secret(self, "the thread", name)?;
        Ok(t)
    }

    /// The checkpoint reference `r` (an id, a prefix, `@thread`, `~N`) names for `who`.
    /// For a tenant: `@thread` is its own thread, a prefix is looked for among its own
    /// checkpoints, and the base must be its own before any step back is taken; a
    /// checkpoint that is not its own is "not found", with the same answer as one that
    /// does not exist (nothing tells a tenant what others' ids are or how long their
    /// histories run).
    pub(super) fn resolve(&self, who: &Caller, r: &str) -> Result<CheckpointId, ApiError> {
        no_secret(self, "the checkpoint reference", r)?;
        let cps = self.store.checkpoints();
        if who.is_admin() {
            return Ok(crate::checkpoint::refs::resolve(cps, r)?);
        }
        let not_found = || {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no checkpoint {r:?}"),
            )
        };
        let (base, up) = match r.rsplit_once('~') {
            Some((b, n)) => (
                b,
                n.parse::<usize>().map_err(|_| {
                    ApiError::bad(format!(
                        "checkpoint reference {r:?}: '~' must be followed by a number"
                    ))
                })?,
            ),
            None => (r, 0),
        };
        let owned = |id: &CheckpointId| -> Result<bool, ApiError> {
            match cps.get(id) {
                Ok(cp) => Ok(who.owns(&cp.body.thread_id)),
                Err(CheckpointError::NotFound(_)) => Ok(false),
                Err(e) => Err(e.into()),
            }
        };
        let mut id = match base.strip_prefix('@') {
            Some(name) => {
                let t = self.thread_id(who, name)?;
                cps.head(&t)?.ok_or_else(not_found)?
            }
            None => match cps.resolve_prefix(base) {
                Ok(id) => id,
                Err(CheckpointError::NotFound(_)) => return Err(not_found()),
                Err(CheckpointError::Ambiguous { candidates, .. }) => {
                    let mut mine = Vec::new();
                    for c in candidates {
                        if owned(&c)? {
                            mine.push(c);
                        }
                    }
                    match mine.as_slice() {
                        [] => return Err(not_found()),
                        [one] => *one,
                        _ => {
                            return Err(ApiError::bad(format!(
                                "checkpoint reference {r:?} is ambiguous: give more hex digits"
                            )))
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            },
        };
        if !owned(&id)? {
            return Err(not_found());
        }
        for _ in 0..up {
            id = match cps.get(&id)?.body.parent_id {
                Some(p) if owned(&p)? => p,
                _ => return Err(not_found()),
            };
        }
        Ok(id)
    }
}

/// Refuses a name that is stored as it is (a thread, run id, holder, artifact field)
/// when it holds the value of one of the server's secrets.
pub(super) fn no_secret(s: &Server, what: &str, value: &str) -> Result<(), ApiError> {
    match s.mw.secrets.found_in(value.as_bytes()) {
        Some(secret) => Err(ApiError::bad(format!(
            "{what} holds the value of secret {secret}; names are stored as they are, so this \
             is refused"
        ))),
        None => Ok(()),
    }
}
