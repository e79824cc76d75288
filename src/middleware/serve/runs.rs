//! Runs over HTTP (`/v1/runs`): a run id reserved atomically, the middleware's hooks
//! behind start, chunk, finish, abort, error and disconnect, and each run's file events
//! read from its ring (`super::event_ring`).

use crate::sys::Locked;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath, ApiQuery};
use super::error::{ApiError, ApiResult};
use super::event_ring::EventRing;
use super::identity::Caller;
use super::run_slot::{LiveRun, RunSlot};
use super::server::Server;
use crate::middleware::context::RunContext;
use crate::middleware::error::MiddlewareError;
use crate::middleware::events::FileEvents;
use crate::middleware::lifecycle::{AbortInfo, Chunk, Run};

impl Server {
    /// The id of a live run whose sandbox is `key`, if there is one.
    pub(super) fn run_holding(&self, key: &str) -> Option<String> {
        let runs = self.runs.locked();
        runs.values().find_map(|r| match r {
            RunSlot::Live(l) if l.run.sandbox().is_some_and(|h| h.key == key) => {
                Some(l.run.context().run_id.clone())
            }
            _ => None,
        })
    }

    fn run(&self, who: &Caller, id: &str) -> Result<Arc<Run>, ApiError> {
        self.live(who, id, |l| l.run.clone())
    }

    /// `f` of the caller's live run `id` (which counts as a request for it); 404 if
    /// there is none, 409 while it is still starting.
    fn live<T>(
        &self,
        who: &Caller,
        id: &str,
        f: impl FnOnce(&LiveRun) -> T,
    ) -> Result<T, ApiError> {
        let key = who.run_key(id);
        match self.runs.locked().get(&key) {
            Some(RunSlot::Live(l)) => {
                *l.seen.locked() = Instant::now();
                Ok(f(l))
            }
            Some(RunSlot::Starting) => Err(ApiError::new(
                StatusCode::CONFLICT,
                "run_starting",
                format!("run {id:?} is still being set up"),
            )),
            None => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no run {id:?}"),
            )),
        }
    }

    /// Runs a terminal hook of run `id`; the run is forgotten whatever the hook says.
    /// The run is taken out first: a second terminal call finds no run (404).
    fn end_run<T>(
        &self,
        who: &Caller,
        id: &str,
        hook: impl FnOnce(&Run) -> Result<T, MiddlewareError>,
    ) -> Result<T, ApiError> {
        let r = self.run(who, id)?;
        let key = who.run_key(id);
        let taken = {
            let mut runs = self.runs.locked();
            match runs.get(&key) {
                Some(RunSlot::Live(l)) if Arc::ptr_eq(&l.run, &r) => runs.remove(&key).is_some(),
                _ => false,
            }
        };
        if !taken {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no run {id:?} (it ended)"),
            ));
        }
        Ok(hook(&r)?)
    }
}

#[derive(Deserialize)]
pub(super) struct StartRun {
    thread: String,
    run_id: String,
    tenant: Option<String>,
}

pub(super) async fn start_run(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiJson(b): ApiJson<StartRun>,
) -> ApiResult {
    blocking(move || {
        let thread = s.thread_id(&who, &b.thread)?;
        // Taken atomically (setup checks the id itself: 1 to 200 bytes, no secret): of
        // two starts with one id, one gets it, the other 409. A tenant's run ids are
        // its own.
        let reserved = Reservation::take(&s, &who, &b.run_id)?;
        let mut ctx = RunContext::new(thread, b.run_id.clone());
        ctx.tenant = b.tenant;
        ctx.owner = s.workspace_owner(&who);
        // A DELETE of the sandbox meanwhile waits for the run to hold it.
        let _making = s.sandboxes.making(&s.mw.provider().key(&ctx));
        let events = Arc::new(Mutex::new(EventRing::new(s.limits().max_events)));
        let sink = events.clone();
        let on_event = FileEvents {
            on_event: Arc::new(move |e| sink.locked().push(e)),
            diff: s.mw_config().file_events.as_ref().is_some_and(|f| f.diff),
        };
        let run =
            s.mw.setup_with_events(ctx, Some(&s.persistence()), Some(on_event))?;
        let h = run.sandbox();
        let lease = run.lease();
        let answer = json!({
            "run_id": b.run_id,
            "thread": who.show(&run.context().thread),
            "sandbox": h.as_ref().map(|h| json!({"key": h.key, "path": h.root})),
            "lease_token": lease.map(|l| l.token),
        });
        reserved.fill(LiveRun {
            run: Arc::new(run),
            events,
            seen: Mutex::new(Instant::now()),
        });
        Ok(Json(answer))
    })
    .await
}

/// A run id reserved for a start in progress; given back if the start fails (or
/// panics) before [`Reservation::fill`].
pub(super) struct Reservation<'a> {
    server: &'a Server,
    /// The run's key among the server's runs ([`Caller::run_key`]).
    id: String,
    filled: bool,
}

impl<'a> Reservation<'a> {
    fn take(server: &'a Server, who: &Caller, run_id: &str) -> Result<Reservation<'a>, ApiError> {
        let l = server.limits();
        let id = who.run_key(run_id);
        let mut runs = server.runs.locked();
        if runs.contains_key(&id) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "run_exists",
                format!("run {run_id:?} is already going"),
            ));
        }
        if runs.len() >= l.max_runs {
            return Err(MiddlewareError::AtCapacity {
                what: "runs",
                limit: l.max_runs,
            }
            .into());
        }
        // A tenant's runs are counted apart: one tenant's load never takes every slot.
        if let Some(t) = who.tenant() {
            let prefix = format!("{t}/");
            let mine = runs.keys().filter(|k| k.starts_with(&prefix)).count();
            if mine >= l.max_runs_per_tenant {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too_many_runs",
                    format!(
                        "tenant {t} has {mine} runs going, its most \
                         (--max-runs-per-tenant {}): end one first",
                        l.max_runs_per_tenant
                    ),
                ));
            }
        }
        runs.insert(id.clone(), RunSlot::Starting);
        Ok(Reservation {
            server,
            id,
            filled: false,
        })
    }

    fn fill(mut self, run: LiveRun) {
        self.server
            .runs
            .locked()
            .insert(self.id.clone(), RunSlot::Live(run));
        self.filled = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.filled {
            self.server.runs.locked().remove(&self.id);
        }
    }
}

#[derive(Deserialize)]
pub(super) struct ChunkBody {
    /// `run_finished` or anything else (ignored).
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    interrupt: bool,
}

pub(super) async fn chunk(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
    ApiJson(b): ApiJson<ChunkBody>,
) -> ApiResult {
    blocking(move || {
        let r = s.run(&who, &run)?;
        let c = if b.kind == "run_finished" {
            Chunk::RunFinished {
                interrupt: b.interrupt,
            }
        } else {
            Chunk::Other
        };
        r.on_chunk(&c)?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn finish(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        let out = s.end_run(&who, &run, Run::on_finish)?;
        Ok(Json(json!({
            "checkpoint": out.checkpoint.map(|c| c.to_hex()),
            "changed_files": out.changed_files,
            "skipped": out.skipped,
            "secret_files": out.secret_files,
        })))
    })
    .await
}

#[derive(Deserialize)]
pub(super) struct AbortBody {
    cancelled: bool,
}

pub(super) async fn abort(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
    ApiJson(b): ApiJson<AbortBody>,
) -> ApiResult {
    blocking(move || {
        s.end_run(&who, &run, |r| {
            r.on_abort(AbortInfo {
                cancelled: b.cancelled,
            })
        })?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

#[derive(Deserialize)]
pub(super) struct ErrorBody {
    message: String,
}

pub(super) async fn run_error(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
    ApiJson(b): ApiJson<ErrorBody>,
) -> ApiResult {
    blocking(move || {
        s.end_run(&who, &run, |r| r.on_error(&b.message))?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

pub(super) async fn disconnect(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
) -> ApiResult {
    blocking(move || {
        s.run(&who, &run)?.on_disconnect()?;
        Ok(Json(json!({"ok": true})))
    })
    .await
}

#[derive(Deserialize)]
pub(super) struct EventsQuery {
    after: Option<u64>,
}

pub(super) async fn events(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(run): ApiPath<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> ApiResult {
    let ev = s.live(&who, &run, |l| l.events.clone())?;
    let list = ev.locked().after(q.after.unwrap_or(0));
    Ok(Json(Value::Array(list)))
}
