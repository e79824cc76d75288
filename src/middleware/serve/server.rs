//! What one `casfs serve` server holds: the store, the middleware, the runs, the
//! callers' identities, the request memory and the isolation of processes
//! ([`Server`]), with its limits ([`ServeLimits`]), and the reaping of what nobody
//! asked about. Sandboxes are the provider's: what the server keeps of one a client
//! made hangs off the provider's entry of it (`client_sandboxes`) and goes with it; a
//! run holds its sandbox (a handle) while it is live, and never ends it but through
//! the provider.

use crate::sys::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::budget::Budget;
use super::client_sandboxes::ApiSandboxes;
use super::conn::Timeouts;
use super::identity::Identities;
use super::json_bounds::JsonLimits;
use super::run_slot::RunSlot;
use crate::checkpoint::Store;
use crate::middleware::error::MiddlewareError;
use crate::middleware::lifecycle::{Middleware, MiddlewareConfig, Run};
use crate::middleware::persistence::{Persistence, StorePersistence};
use crate::middleware::provider::SandboxProvider;

/// The largest request body of a route that carries no data, by default
/// (`casfs serve --max-body`).
pub const DEFAULT_MAX_BODY: usize = 256 << 10;

/// The largest request body of a route that carries data (`DATA_ROUTES`), by default
/// (`casfs serve --max-data-body`): an artifact travels base64-encoded, so about three
/// quarters of it.
pub const DEFAULT_MAX_DATA_BODY: usize = 32 << 20;

/// The memory for request bodies and the JSON values made of them, held at once by
/// all requests, by default (`casfs serve --max-request-memory`).
pub const DEFAULT_MAX_REQUEST_MEMORY: usize = 512 << 20;

/// What one server takes on at most, and how long it waits for a run's client.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// The largest request body of a route that carries no data (413 beyond).
    pub max_body: usize,
    /// The largest request body of a route that carries data (`DATA_ROUTES`).
    pub max_data_body: usize,
    /// Bounds on a request body's JSON, checked before any value is made (400 beyond).
    pub json: JsonLimits,
    /// Request bodies and the JSON values made of them, held at once by all requests
    /// (beyond: the request waits, then 503 `busy`).
    pub max_request_memory: usize,
    /// The same, held by one peer (a Unix user other than the server's) beside its
    /// first request.
    pub max_request_memory_per_peer: usize,
    /// How long a request waits for memory before 503 `busy`.
    pub request_memory_wait: Duration,
    /// Runs set up and not ended (429 `too_many_runs` beyond).
    pub max_runs: usize,
    /// Of them, one tenant's (administrators are held only to `max_runs`).
    pub max_runs_per_tenant: usize,
    /// A run nobody asked about (no request for it: chunk, events, any hook) for this
    /// long is ended as a disconnect: nothing published, the lease released.
    pub run_idle: Duration,
    /// A sandbox no run has held for this long is destroyed (its uncaptured work
    /// discarded; the next run on its thread starts at the head).
    pub sandbox_idle: Duration,
    /// File events kept per run for the events route; a client that falls further
    /// behind is told which were lost.
    pub max_events: usize,
    /// Client connections open at once (503 `too_many_connections` beyond).
    pub max_connections: usize,
    /// Client connections open at once from one peer (a Unix user other than the
    /// server's, by `SO_PEERCRED`; a TCP client by its address).
    pub max_connections_per_peer: usize,
    /// How long a connection waits on a client that stalls or idles.
    pub timeouts: Timeouts,
}

impl Default for ServeLimits {
    fn default() -> ServeLimits {
        ServeLimits {
            max_body: DEFAULT_MAX_BODY,
            max_data_body: DEFAULT_MAX_DATA_BODY,
            json: JsonLimits::default(),
            max_request_memory: DEFAULT_MAX_REQUEST_MEMORY,
            max_request_memory_per_peer: DEFAULT_MAX_REQUEST_MEMORY / 4,
            request_memory_wait: Duration::from_secs(5),
            max_runs: 64,
            max_runs_per_tenant: 16,
            run_idle: Duration::from_secs(600),
            sandbox_idle: Duration::from_secs(3600),
            max_events: 10_000,
            max_connections: 256,
            max_connections_per_peer: 64,
            timeouts: Timeouts::default(),
        }
    }
}

/// What the server serves.
pub struct Server {
    pub(super) store: Arc<Store>,
    pub(super) persistence: Arc<StorePersistence>,
    pub(super) mw: Arc<Middleware>,
    /// Runs by `Caller::run_key`: a tenant's run ids are its own.
    pub(super) runs: Mutex<HashMap<String, RunSlot>>,
    /// How callers are told apart (the tokens, the administrators' group).
    pub(super) identities: Identities,
    pub(super) limits: Mutex<ServeLimits>,
    /// The sandboxes clients made themselves: their file events, on the provider's
    /// entries, and the lock one is made under.
    pub(super) sandboxes: ApiSandboxes,
    /// Portable stores may keep their clients' clock (for tests): `--allow-client-clocks`.
    pub(super) client_clocks: std::sync::atomic::AtomicBool,
    /// The memory request bodies hold (`body`).
    pub(super) budget: Arc<Budget>,
    /// How sandboxes' processes are isolated (`processes`).
    pub(super) isolation: Mutex<crate::middleware::isolate::Options>,
}

impl Server {
    /// A server over `store` whose sandboxes come from `provider`. `config` is the
    /// middleware's; its snapshot persistence, if any, must be `persistence`'s (the
    /// server's messages and artifacts routes write through it), and its file events
    /// are replaced by per-run buffers the events route reads.
    pub fn new(
        store: Arc<Store>,
        persistence: Arc<StorePersistence>,
        provider: Arc<dyn SandboxProvider>,
        config: MiddlewareConfig,
        identities: Identities,
    ) -> Result<Arc<Server>, MiddlewareError> {
        let sandboxes = ApiSandboxes::new(provider.clone());
        let mw = Arc::new(Middleware::new(store.clone(), provider, config)?);
        Ok(Arc::new(Server {
            store,
            persistence,
            mw,
            runs: Mutex::new(HashMap::new()),
            identities,
            limits: Mutex::new(ServeLimits::default()),
            sandboxes,
            client_clocks: std::sync::atomic::AtomicBool::new(false),
            budget: Arc::default(),
            isolation: Mutex::default(),
        }))
    }

    /// Sets the server's limits (the body limit for routers made from now on).
    pub fn set_limits(&self, l: ServeLimits) {
        *self.limits.locked() = l;
    }

    /// Lets clients make portable stores whose leases keep the clients' clock
    /// (`casfs serve --allow-client-clocks`; for test suites that inject a clock).
    pub fn set_allow_client_clocks(&self, allow: bool) {
        self.client_clocks
            .store(allow, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn allow_client_clocks(&self) -> bool {
        self.client_clocks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn limits(&self) -> ServeLimits {
        *self.limits.locked()
    }

    /// Ends runs nobody asked about for the run idle timeout (as a disconnect: nothing
    /// published, the lease released) and destroys sandboxes no run has held for the
    /// sandbox idle timeout. `serve` calls it every second at most.
    pub fn reap(&self) {
        let l = self.limits();
        let stale: Vec<(String, Arc<Run>)> = {
            let mut runs = self.runs.locked();
            let ids: Vec<String> = runs
                .iter()
                .filter_map(|(id, r)| match r {
                    RunSlot::Live(l2) if l2.seen.locked().elapsed() >= l.run_idle => {
                        Some(id.clone())
                    }
                    _ => None,
                })
                .collect();
            ids.into_iter()
                .filter_map(|id| match runs.remove(&id) {
                    Some(RunSlot::Live(l2)) => Some((id, l2.run)),
                    _ => None,
                })
                .collect()
        };
        for (id, run) in stale {
            tracing::info!(run = %id, "no request for the run in {:?}: ended as a disconnect", l.run_idle);
            if let Err(e) = run.on_disconnect() {
                tracing::warn!(run = %id, "ending an abandoned run: {e}");
            }
        }
        // Sandboxes clients made are theirs to destroy (or the cap's, when idle): the
        // server cannot see a client working in one. (What the API kept of those reaped
        // or evicted went with them.)
        let api = self.sandboxes.keys();
        let spare = |k: &str| api.contains(k);
        match self.mw.reap_idle_sandboxes(l.sandbox_idle, &spare) {
            Ok(0) => {}
            Ok(n) => tracing::info!("destroyed {n} sandbox(es) idle for {:?}", l.sandbox_idle),
            Err(e) => tracing::warn!("destroying idle sandboxes: {e}"),
        }
        give_back_freed_memory();
    }

    /// Ends the server's runs (as a disconnect: nothing published, leases released) and
    /// destroys every sandbox: nothing a run left uncaptured outlives the server, and
    /// what the API kept of each goes with it (its waiters are woken).
    pub fn close(&self) -> Result<(), MiddlewareError> {
        let runs: Vec<RunSlot> = self.runs.locked().drain().map(|(_, r)| r).collect();
        for r in runs {
            if let RunSlot::Live(l) = r {
                if let Err(e) = l.run.on_disconnect() {
                    tracing::warn!(run = %l.run.context().run_id, "closing the run: {e}");
                }
            }
        }
        self.mw.destroy_all_sandboxes()
    }

    /// The persistence layer runs write through (the server's store).
    pub fn persistence(&self) -> Persistence {
        match &self.mw_config().snapshots {
            Some(s) => s.persistence.clone(),
            None => Persistence::on_store(self.persistence.clone()),
        }
    }

    pub(super) fn mw_config(&self) -> &MiddlewareConfig {
        self.mw.config()
    }
}

/// Returns the allocator's free memory to the kernel, every 10 seconds at most. Every
/// sandbox brings its own serving threads, and glibc gives each thread's arena memory
/// back only when asked: without this, a server's resident memory kept the high-water
/// mark of every arena (`cargo bench --bench soak`).
fn give_back_freed_memory() {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = LAST.locked();
    if last.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
        return;
    }
    *last = Some(Instant::now());
    crate::memory::give_back();
}
