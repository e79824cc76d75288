//! Sandboxes a client manages itself (the TypeScript sandbox provider): create or
//! resume the casfs-mounted workspace of a thread, showing the thread's head; destroy
//! it; and read its file events, numbered without gaps, waiting for new ones if asked.
//! Such a sandbox is the same one a run on the thread gets (one per sandbox key).
//!
//! Its events are recorded from its creation, or, when the client asks for
//! `"events": false`, from the first events request: watching an overlay sandbox walks
//! its whole tree (inotify watches every directory), which a client that watches later,
//! or never, need not wait for when it restores.

use crate::sys::Locked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath, ApiQuery};
use super::client_sandboxes::ApiSandbox;
use super::error::{ApiError, ApiResult};
use super::event_ring::EventRing;
use super::identity::Caller;
use super::server::Server;
use crate::checkpoint::ThreadId;
use crate::middleware::events::Watcher;
use crate::middleware::{EnsureOutcome, FileEvents, RunContext, SandboxHandle};
use crate::mount::control::NamespaceInfo;

/// The longest an events request waits for a first new event.
const MAX_WAIT: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Create {
    thread: String,
    tenant: Option<String>,
    /// Record file events from now (the default), or, when false, from the first
    /// events request.
    events: Option<bool>,
    /// Where its processes may go: a narrowing of the server's `--sandbox-allow` (the
    /// whole list when absent).
    network: Option<NetworkRequest>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NetworkRequest {
    allow: Vec<String>,
}

fn outcome_name(o: EnsureOutcome) -> &'static str {
    match o {
        EnsureOutcome::Resumed => "resumed",
        EnsureOutcome::NativeRestored => "native_restored",
        EnsureOutcome::Created => "created",
    }
}

pub(super) async fn create(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiJson(b): ApiJson<Create>,
) -> ApiResult {
    blocking(move || {
        let t = s.thread_id(&who, &b.thread)?;
        if let Some(tenant) = &b.tenant {
            crate::middleware::check_tenant(tenant).map_err(ApiError::bad)?;
            if let Some(secret) = s.mw.secrets.found_in(tenant.as_bytes()) {
                return Err(ApiError::bad(format!(
                    "the tenant holds the value of secret {secret}; it names a directory, so \
                     this is refused"
                )));
            }
        }
        let network = match &b.network {
            None => None,
            Some(n) => Some(s.network_within(&n.allow)?),
        };
        let head = s.mw.publisher().head_checkpoint(&t)?;
        let mut ctx = RunContext::new(t.clone(), "sandbox-api");
        ctx.tenant = b.tenant;
        // The caller's workspace (a member of the socket's group who is not root), or
        // the stand-in's (see `workspace_owner`).
        ctx.owner = s.workspace_owner(&who);
        // A DELETE of the key meanwhile waits until this is made and shown.
        let _making = s.sandboxes.making(&s.mw.provider().key(&ctx));
        let (h, outcome) = s.mw.provider().ensure(&ctx, &s.mw.secrets)?;
        let shown = match &head {
            Some(cp) => s.mw.publisher().show_files(&h, outcome, cp),
            None => Ok(false),
        };
        let restored = match shown {
            Ok(r) => r,
            Err(e) => {
                // A sandbox this call made that cannot show the head is not left behind.
                if outcome != EnsureOutcome::Resumed {
                    if let Err(c) = s.mw.provider().destroy(&h.key, &s.mw.secrets) {
                        tracing::warn!(sandbox = %h.key, "destroying after a failed restore: {c}");
                    }
                }
                return Err(e.into());
            }
        };
        let eager = b.events.unwrap_or(true);
        let api = s.register(&h, &t, eager)?;
        // A resumed sandbox keeps what it asked for unless this asks again (it takes
        // effect at its next isolation's start).
        if network.is_some() {
            if let Some(a) = &api {
                *a.network.locked() = network;
            }
        }
        let recording = api.is_some_and(|a| a.watcher.locked().is_some());
        Ok(Json(json!({
            "key": h.key,
            "path": h.root,
            "thread": who.show(&t),
            "outcome": outcome_name(outcome),
            "restored": restored,
            "base": h.expected_head().map(|c| c.to_hex()),
            "kind": if h.mount().is_some() { "mount" } else { "dir" },
            "mode": h.mount().map(|m| m.mode()),
            "namespace": h.mount().and_then(|m| NamespaceInfo::of_mount(m.mode(), &h.root)),
            "events": if recording { "recording" } else { "from_first_read" },
        })))
    })
    .await
}

impl Server {
    /// Keeps the file events of API sandbox `h`, on the provider's entry of it:
    /// recorded from now when `eager`, else from the first events request (a sandbox
    /// already recording goes on). None: the sandbox went meanwhile (its events are not
    /// found).
    fn register(
        &self,
        h: &SandboxHandle,
        thread: &ThreadId,
        eager: bool,
    ) -> Result<Option<Arc<ApiSandbox>>, ApiError> {
        let cap = self.limits().max_events;
        let diff = self
            .mw
            .config()
            .file_events
            .as_ref()
            .is_some_and(|f| f.diff);
        // Resumed: its events go on. An earlier sandbox of the key (evicted, reaped)
        // took its own with it. (Made under the provider's lock: nothing slow.)
        let api = self.sandboxes.attach(h, || {
            let events = Arc::new(Mutex::new(EventRing::new(cap)));
            let notify = Arc::new(tokio::sync::Notify::new());
            let (sink, wake) = (events.clone(), notify.clone());
            let cfg = FileEvents {
                on_event: Arc::new(move |e| {
                    sink.locked().push(e);
                    wake.notify_waiters();
                }),
                diff,
            };
            ApiSandbox {
                thread: thread.clone(),
                events,
                notify,
                gone: Arc::new(AtomicBool::new(false)),
                handle: h.downgrade(),
                cfg,
                watcher: Arc::new(Mutex::new(None)),
                network: Mutex::new(None),
            }
        });
        if let (Some(a), true) = (&api, eager) {
            start_watcher(&a.watcher, h, &a.cfg)?;
        }
        Ok(api)
    }

    /// The destinations `asked` names, each within the server's allow-list.
    fn network_within(
        &self,
        asked: &[String],
    ) -> Result<Vec<crate::middleware::isolate::proxy::Allowed>, ApiError> {
        if asked.len() > 256 {
            return Err(ApiError::bad("network.allow: at most 256 destinations"));
        }
        let server = self.isolation().allow;
        let mut out = Vec::with_capacity(asked.len());
        for a in asked {
            let d: crate::middleware::isolate::proxy::Allowed = a
                .parse()
                .map_err(|e: String| ApiError::bad(format!("network.allow: {e}")))?;
            if !server.iter().any(|s| s.covers(&d)) {
                return Err(ApiError::bad(format!(
                    "network.allow: {a:?} is not within the server's allow-list (--sandbox-allow)"
                )));
            }
            out.push(d);
        }
        Ok(out)
    }
}

/// Starts the watcher of sandbox `h` unless it runs already.
fn start_watcher(
    slot: &Mutex<Option<Watcher>>,
    h: &SandboxHandle,
    cfg: &FileEvents,
) -> Result<(), ApiError> {
    let mut w = slot.locked();
    if w.is_none() {
        *w = Some(Watcher::start(h, cfg).map_err(|detail| {
            ApiError::from(crate::middleware::MiddlewareError::Sandbox {
                key: h.key.clone(),
                detail,
            })
        })?);
    }
    Ok(())
}

pub(super) async fn destroy(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        // One being made (or taken by a run) is waited for.
        let _making = s.sandboxes.making(&key);
        // Another tenant's sandbox is not found, as one that does not exist (nothing to
        // destroy: not an error).
        if !s.owns_sandbox(&who, &key) {
            return Ok(Json(json!({"ok": true, "destroyed": false})));
        }
        // Refused while a run holds it: the run's finish would find it gone.
        let destroyed =
            s.mw.provider()
                .destroy_unheld(&key, &s.mw.secrets)
                .map_err(|e| match e {
                    crate::middleware::MiddlewareError::SandboxBusy { .. } => {
                        let run = s.run_holding(&key);
                        ApiError::new(
                            axum::http::StatusCode::CONFLICT,
                            "sandbox_busy",
                            match run {
                                Some(r) => format!(
                                    "sandbox {key:?} is held by run {r:?}: end the run (finish, \
                                 abort, error) first; the sandbox is kept"
                                ),
                                None => e.to_string(),
                            },
                        )
                    }
                    e => e.into(),
                })?;
        // With it went what the API kept of it: its watcher stopped, and requests
        // waiting for its events were answered.
        Ok(Json(json!({"ok": true, "destroyed": destroyed})))
    })
    .await
}

impl Server {
    /// Whether live sandbox `key` is the caller's (one that is not live is no one's).
    fn owns_sandbox(&self, who: &Caller, key: &str) -> bool {
        self.mw
            .provider()
            .look(key)
            .is_some_and(|h| who.owns(&h.thread))
    }
}

fn no_sandbox(key: &str) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        "not_found",
        format!("no sandbox {key:?} made through POST /v1/sandboxes (or it was destroyed)"),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    after: Option<u64>,
    /// Wait up to this long (at most 30 s) for an event after `after`.
    wait_ms: Option<u64>,
}

pub(super) async fn events(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> ApiResult {
    // Its parts only (see `ApiSandboxes::with`): its `gone` is set and its waiters
    // woken when the sandbox ends.
    let (events, notify, gone, watch) = s
        .sandboxes
        .with(&key, |sb| {
            who.owns(&sb.thread).then(|| {
                let watch = (sb.watcher.clone(), sb.handle.clone(), sb.cfg.clone());
                (sb.events.clone(), sb.notify.clone(), sb.gone.clone(), watch)
            })
        })
        .flatten()
        .ok_or_else(|| no_sandbox(&key))?;
    s.mw.provider().touch(&key);
    // Made with `"events": false`: its events are recorded from this request on.
    if watch.0.locked().is_none() {
        let k = key.clone();
        blocking(move || {
            let (slot, weak, cfg) = watch;
            let h = weak.upgrade().ok_or_else(|| no_sandbox(&k))?;
            start_watcher(&slot, &h, &cfg)
        })
        .await?;
    }
    let after = q.after.unwrap_or(0);
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0)).min(MAX_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Registered before looking, so an event pushed in between wakes it.
        let woken = notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let list = events.locked().after(after);
        if !list.is_empty() || tokio::time::Instant::now() >= deadline {
            return Ok(Json(Value::Array(list)));
        }
        // Destroyed while waiting: no event can come (those it had were answered).
        if gone.load(Ordering::SeqCst) {
            return Err(no_sandbox(&key));
        }
        if tokio::time::timeout_at(deadline, woken).await.is_err() {
            let list = events.locked().after(after);
            return Ok(Json(Value::Array(list)));
        }
    }
}
