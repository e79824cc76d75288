//! A sandbox's processes for its client, under `/v1/sandboxes/{key}/...`: `exec` (run
//! to the end: output and exit code), `processes` (start one in the background), and
//! for each process its output from a cursor (waiting for more while it runs), stdin
//! writes and kill of its whole group; and channels to the ports its servers listen on
//! inside (`ports`, [`crate::middleware::isolate::ports`]). They run isolated
//! ([`crate::middleware::isolate`]): in the sandbox's own namespaces, limits and filter,
//! as its owner (never root), the workspace at `/workspace`. Only the caller's own
//! sandbox is served; another's is not found.

use crate::sys::Locked;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{blocking, ApiJson, ApiPath, ApiQuery};
use super::error::{ApiError, ApiResult};
use super::identity::Caller;
use super::server::Server;
use crate::middleware::isolate::{Jail, Process, Stream};

/// What to start.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Start {
    /// A shell command (run by `/bin/sh -c`).
    #[serde(default)]
    command: Option<String>,
    /// A program and its arguments, run as they are (instead of `command`).
    #[serde(default)]
    argv: Option<Vec<String>>,
    /// Inside the sandbox; relative to `/workspace` (the default).
    #[serde(default)]
    cwd: Option<String>,
    /// Over the sandbox's base environment.
    #[serde(default)]
    env: std::collections::BTreeMap<String, String>,
    /// Keep stdin open for writes (`processes` only; `exec`'s reads end of file).
    #[serde(default)]
    stdin: bool,
    /// `exec` only: kill the process after this long (its result says so).
    #[serde(default)]
    timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OutputQuery {
    /// The cursor to read from (0: the start; each answer's `next` for the rest).
    #[serde(default)]
    after: u64,
    /// How long to wait for output when there is none yet (at most 30 s).
    #[serde(default)]
    wait_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StdinBody {
    #[serde(default)]
    data: String,
    /// Close stdin after the data.
    #[serde(default)]
    end: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KillBody {
    /// A signal's number or name (`SIGTERM`, `TERM`, ...); SIGTERM by default.
    #[serde(default)]
    signal: Option<Value>,
}

/// The environment every process starts with, under the request's.
const BASE_ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/workspace"),
    ("TMPDIR", "/tmp"),
    ("LANG", "C.UTF-8"),
    ("USER", "sandbox"),
    ("LOGNAME", "sandbox"),
    ("SHELL", "/bin/sh"),
];

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid", msg.into())
}

fn not_found(key: &str, what: String) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("{what} in sandbox {key:?}"),
    )
}

impl Start {
    fn argv(&self) -> Result<Vec<String>, ApiError> {
        match (&self.command, &self.argv) {
            (Some(c), None) => Ok(vec!["/bin/sh".into(), "-c".into(), c.clone()]),
            (None, Some(a)) if !a.is_empty() => Ok(a.clone()),
            _ => Err(invalid("give one of `command` (a shell command) or `argv`")),
        }
    }

    fn cwd(&self) -> String {
        match self.cwd.as_deref() {
            None | Some("") => "/workspace".into(),
            Some(c) if c.starts_with('/') => c.into(),
            Some(c) => format!("/workspace/{c}"),
        }
    }

    /// The request's variables, refused (before anything starts) unless each is one.
    fn checked_env(&self) -> Result<(), ApiError> {
        match self
            .env
            .iter()
            .find(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
        {
            Some((k, _)) => Err(invalid(format!("an environment variable {k:?}"))),
            None => Ok(()),
        }
    }

    /// The process's environment: the base, the proxy's when the sandbox has one, then
    /// the request's (checked).
    fn env(&self, proxied: bool) -> Vec<(String, String)> {
        let mut env: std::collections::BTreeMap<String, String> = BASE_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if proxied {
            let url = format!(
                "http://127.0.0.1:{}",
                crate::middleware::isolate::proxy::PORT
            );
            for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
                env.insert(k.into(), url.clone());
            }
            for k in ["NO_PROXY", "no_proxy"] {
                env.insert(k.into(), "localhost,127.0.0.1,::1".into());
            }
        }
        env.extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.into_iter().collect()
    }
}

impl Server {
    /// Sets how sandboxes' processes are isolated (for sandboxes started from now on).
    pub fn set_isolation(&self, o: crate::middleware::isolate::Options) {
        *self.isolation.locked() = o;
    }

    /// Whose a sandbox made for `who` is: a member's own; one that no member of the host
    /// owns (the server's own user's, a token's) is the stand-in's when the server is
    /// root and runs processes, so that its isolated processes (never root) can write
    /// its workspace. A server of another user keeps its own (it can give none away).
    pub(super) fn workspace_owner(&self, who: &Caller) -> Option<crate::fs::Owner> {
        let root = rustix::process::geteuid().is_root();
        who.owner.or_else(|| {
            (root && self.mw.provider().jails().is_some()).then(|| self.isolation().stand_in)
        })
    }

    pub(super) fn isolation(&self) -> crate::middleware::isolate::Options {
        self.isolation.locked().clone()
    }

    /// The caller's sandbox `key`'s isolation, started with its first process.
    async fn jail(self: &Arc<Self>, who: &Caller, key: &str) -> Result<Arc<Jail>, ApiError> {
        let h = self.sandbox_for(who, key)?;
        let jails = self
            .mw
            .provider()
            .jails()
            .cloned()
            .ok_or_else(|| invalid("this server's sandboxes run no processes"))?;
        let mut opts = self.isolation();
        // What the sandbox asked for, when it narrowed the server's list.
        if let Some(n) = self.sandboxes.network(key) {
            opts.allow = n;
        }
        let key = key.to_string();
        let s = self.clone();
        blocking(move || {
            let instance = h.instance();
            let jail = jails
                .get_or_start(&key, instance, || {
                    Jail::start(&key, instance, &h.root, h.owner, &opts)
                })
                .map_err(|e| {
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "sandbox",
                        format!("isolating sandbox {key:?}: {e}"),
                    )
                })?;
            // Destroyed meanwhile: its destroy may have ended the isolation before
            // this one was made, so this one ends here. (`h` is still held: no later
            // sandbox can have its instance meanwhile.)
            let same =
                s.mw.provider()
                    .look(&key)
                    .is_some_and(|now| now.instance() == instance);
            // Its processes are all in the jail's pid namespace: a checkpoint looks
            // there alone for files they keep open for writing.
            if let crate::middleware::SandboxWorkspace::Mount(m) = &h.workspace {
                m.writers_in(Some(jail.pid_ns));
            }
            drop(h);
            if !same {
                jails.end_instance(&key, instance);
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("no live sandbox {key:?}"),
                ));
            }
            Ok(jail)
        })
        .await
    }

    fn process(&self, who: &Caller, key: &str, id: u64) -> Result<Arc<Process>, ApiError> {
        self.sandbox_for(who, key)?;
        self.mw
            .provider()
            .jails()
            .and_then(|j| j.get(key))
            .and_then(|j| j.get(id))
            .ok_or_else(|| not_found(key, format!("no process {id}")))
    }
}

async fn start(
    s: &Arc<Server>,
    who: &Caller,
    key: &str,
    req: &Start,
    stdin: bool,
) -> Result<(Arc<Jail>, Arc<Process>), ApiError> {
    let argv = req.argv()?;
    req.checked_env()?;
    let jail = s.jail(who, key).await?;
    let env = req.env(jail.proxied());
    let p = jail
        .spawn(argv, req.cwd(), env, stdin)
        .await
        .map_err(|e| match e.kind() {
            // The init could not start it: no such program or directory, ...
            std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidInput => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid", e.to_string())
            }
            std::io::ErrorKind::QuotaExceeded => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_processes",
                e.to_string(),
            ),
            _ => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "sandbox", e.to_string()),
        })?;
    Ok((jail, p))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Kills an exec's process group unless it has ended (its request was dropped: the
/// client went away).
struct KillOnDrop {
    jail: Arc<Jail>,
    id: u64,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let ended = self
            .jail
            .get(self.id)
            .is_none_or(|p| p.exit_code().is_some());
        if !ended {
            let _ = self.jail.kill(self.id, libc::SIGKILL);
        }
    }
}

/// `POST /v1/sandboxes/{key}/exec`: runs a command to its end.
pub(super) async fn exec(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(req): ApiJson<Start>,
) -> ApiResult {
    if req.stdin {
        return Err(invalid(
            "exec's stdin is empty: start a process for one to write",
        ));
    }
    let (jail, p) = start(&s, &who, &key, &req, false).await?;
    // A client that goes away before the end takes its process with it.
    let _kill = KillOnDrop {
        jail: jail.clone(),
        id: p.id,
    };
    let timed_out = match req.timeout_ms {
        Some(ms) => tokio::time::timeout(Duration::from_millis(ms), p.wait())
            .await
            .is_err(),
        None => false,
    };
    let code = if timed_out {
        let _ = jail.kill(p.id, libc::SIGKILL);
        // A process that left the group (setsid) may hold the output open: what came
        // in by then is the answer.
        match tokio::time::timeout(Duration::from_secs(2), p.wait()).await {
            Ok(c) => c,
            Err(_) => p.exit_code().unwrap_or(128 + libc::SIGKILL),
        }
    } else {
        p.wait().await
    };
    let (out, err) = p.collected();
    jail.forget(p.id);
    Ok(Json(json!({
        "stdout": text(&out),
        "stderr": text(&err),
        "exit_code": code,
        "timed_out": timed_out,
    })))
}

/// `POST /v1/sandboxes/{key}/processes`: starts a process in the background.
pub(super) async fn spawn(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(req): ApiJson<Start>,
) -> ApiResult {
    if req.timeout_ms.is_some() {
        return Err(invalid(
            "timeout_ms is exec's; kill a background process instead",
        ));
    }
    let (_, p) = start(&s, &who, &key, &req, req.stdin).await?;
    let pid = p.output(0, Duration::ZERO).await.pid;
    Ok(Json(json!({"id": p.id, "pid": pid})))
}

/// `GET /v1/sandboxes/{key}/processes/{id}`: output from a cursor, and the exit code
/// once the process has ended.
pub(super) async fn output(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((key, id)): ApiPath<(String, u64)>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> ApiResult {
    let p = s.process(&who, &key, id)?;
    let wait = Duration::from_millis(q.wait_ms.min(30_000));
    let o = p.output(q.after, wait).await;
    let b64 = base64::engine::general_purpose::STANDARD;
    let chunks: Vec<Value> = o
        .chunks
        .iter()
        .map(|(stream, d)| {
            json!({
                "stream": match stream { Stream::Stdout => "stdout", Stream::Stderr => "stderr" },
                "data_base64": b64.encode(d),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "pid": o.pid,
        "chunks": chunks,
        "next": o.next,
        "dropped_bytes": o.dropped_bytes,
        "exit_code": o.exit_code,
        "error": o.error,
    })))
}

/// `POST /v1/sandboxes/{key}/processes/{id}/stdin`.
pub(super) async fn stdin(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((key, id)): ApiPath<(String, u64)>,
    ApiJson(body): ApiJson<StdinBody>,
) -> ApiResult {
    let p = s.process(&who, &key, id)?;
    p.write_stdin(body.data.as_bytes(), body.end)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::CONFLICT,
                "stdin_closed",
                format!("process {id} in sandbox {key:?}: {e}"),
            )
        })?;
    Ok(Json(json!({"ok": true})))
}

/// A signal by number or name.
fn signal_of(v: Option<&Value>) -> Result<i32, ApiError> {
    let names: &[(&str, i32)] = &[
        ("HUP", libc::SIGHUP),
        ("INT", libc::SIGINT),
        ("QUIT", libc::SIGQUIT),
        ("KILL", libc::SIGKILL),
        ("USR1", libc::SIGUSR1),
        ("USR2", libc::SIGUSR2),
        ("TERM", libc::SIGTERM),
        ("CONT", libc::SIGCONT),
        ("STOP", libc::SIGSTOP),
    ];
    match v {
        None => Ok(libc::SIGTERM),
        Some(Value::Number(n)) => n
            .as_i64()
            .filter(|n| (1..=64).contains(n))
            .map(|n| n as i32)
            .ok_or_else(|| invalid(format!("signal {n}"))),
        Some(Value::String(name)) => {
            let bare = name.strip_prefix("SIG").unwrap_or(name);
            names
                .iter()
                .find(|(n, _)| *n == bare)
                .map(|(_, s)| *s)
                .ok_or_else(|| invalid(format!("signal {name:?}")))
        }
        Some(other) => Err(invalid(format!("signal {other}"))),
    }
}

/// `POST /v1/sandboxes/{key}/processes/{id}/kill`: a signal to the process and
/// everything it started in its group.
pub(super) async fn kill(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath((key, id)): ApiPath<(String, u64)>,
    ApiJson(body): ApiJson<KillBody>,
) -> ApiResult {
    let sig = signal_of(body.signal.as_ref())?;
    s.process(&who, &key, id)?;
    let jail =
        s.mw.provider()
            .jails()
            .and_then(|j| j.get(&key))
            .ok_or_else(|| not_found(&key, format!("no process {id}")))?;
    jail.kill(id, sig)
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "sandbox", e.to_string()))?;
    Ok(Json(json!({"ok": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PortBody {
    /// The port a process of the sandbox listens on, at 127.0.0.1 or ::1 in its network.
    port: u16,
}

/// `POST /v1/sandboxes/{key}/ports`: a channel to a port inside the sandbox (the same
/// one again for the same port): a URL on the host's loopback and the token each
/// request carries (one request per connection, an upgrade's kept).
pub(super) async fn port(
    State(s): State<Arc<Server>>,
    who: Caller,
    ApiPath(key): ApiPath<String>,
    ApiJson(body): ApiJson<PortBody>,
) -> ApiResult {
    if body.port == 0 {
        return Err(invalid("port 0"));
    }
    let jail = s.jail(&who, &key).await?;
    let (addr, token) = jail
        .channel(body.port, std::net::Ipv4Addr::LOCALHOST.into())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::QuotaExceeded => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_ports",
                e.to_string(),
            ),
            std::io::ErrorKind::NotFound => not_found(&key, e.to_string()),
            std::io::ErrorKind::InvalidInput => invalid(e.to_string()),
            _ => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "sandbox", e.to_string()),
        })?;
    Ok(Json(json!({
        "url": format!("http://{addr}"),
        "port": body.port,
        "header": crate::middleware::isolate::ports::TOKEN_HEADER,
        "token": &*token,
    })))
}
