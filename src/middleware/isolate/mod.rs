//! Sandboxes that isolate: a sandbox's processes run in an existing isolation engine
//! (bubblewrap, [`engine`]), in a control group with limits ([`limits`]), behind a
//! system-call filter ([`seccomp`]), started by a small init inside it ([`init`]) that
//! the server talks to over a socket pair ([`wire`]).
//!
//! A [`Jail`] is one sandbox's isolation: started with the sandbox's first process and
//! ended with the sandbox (every process it started ends with it: the pid namespace
//! goes with its init, and the control group is killed). Its [`Process`]es keep their
//! output, bounded, for clients to read from any cursor while they run and after.

mod engine;
pub mod init;
mod limits;
mod memfile;
pub mod ports;
mod process;
pub mod proxy;
mod seccomp;
mod spare;
mod warm;
mod wire;

use crate::sys::Locked;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

pub use engine::{bwrap, Network};
pub use limits::Limits;
pub use process::{Output, Process, Stream, MAX_OUTPUT, MAX_SANDBOX_OUTPUT};
pub use spare::run as spare_main;
pub use warm::{keep_ahead, Busy, DEFAULT_AHEAD};

/// The server stops: the sandboxes and processes it started ahead are ended.
pub fn end_spare() {
    warm::end();
    spare::end();
}

use crate::fs::Owner;
use wire::{Event, Request, START_WAIT};

/// How a server isolates its sandboxes.
#[derive(Debug, Clone)]
pub struct Options {
    pub limits: Limits,
    pub network: Network,
    /// Bytes of each sandbox's private `/tmp`.
    pub tmp_bytes: u64,
    /// Who the processes of a sandbox the server's own user owns run as (never root).
    pub stand_in: Owner,
    /// Where a sandbox without the host's network may go, through its proxy
    /// ([`proxy`]); empty: nowhere.
    pub allow: Vec<proxy::Allowed>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            limits: Limits::default(),
            network: Network::None,
            tmp_bytes: 256 << 20,
            stand_in: Owner {
                uid: 65534,
                gid: 65534,
            },
            allow: Vec::new(),
        }
    }
}

/// The most processes a sandbox keeps (running, or ended with their output kept).
pub const MAX_PROCESSES: usize = 256;

/// Process ids, unique across every sandbox of the server (a sandbox started again
/// never reuses one).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One sandbox's isolation: its bubblewrap, its init's socket, its control group and
/// its processes.
pub struct Jail {
    key: String,
    control: OwnedFd,
    send: Mutex<()>,
    /// Bubblewrap and the control group, until the sandbox ends (then reaped).
    engine: Mutex<Option<(std::process::Child, Option<limits::Group>)>>,
    /// The sandbox's proxy, while it runs.
    proxy: Mutex<Option<tokio::task::AbortHandle>>,
    /// The sandbox's network namespace, while it runs (channels to its ports enter it).
    netns: Mutex<Option<Arc<OwnedFd>>>,
    /// Channels to its ports, by port, closed when it ends.
    ports: Mutex<HashMap<u16, ports::Channel>>,
    /// Connections through its channels at once ([`ports::MAX_CONNECTIONS`]).
    channel_slots: Arc<tokio::sync::Semaphore>,
    procs: Mutex<HashMap<u64, Arc<Process>>>,
    kept: Arc<AtomicUsize>,
    ended: AtomicBool,
    /// What bubblewrap said on stderr (its last bytes): why a sandbox failed to start.
    engine_err: Arc<Mutex<Vec<u8>>>,
    /// Which sandbox it is (not an earlier one of its key).
    instance: usize,
    pub limited: bool,
    pub network: Network,
    pub uid: u32,
    /// Its pid namespace's inode: its processes are there, and cannot leave.
    pub pid_ns: u64,
}

/// A control group with `limits` for a sandbox (a root server's; none else, or where
/// none can be made).
fn new_group(limits: Limits) -> Option<limits::Group> {
    if !rustix::process::getuid().is_root() {
        return None;
    }
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "casfs/{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    match limits::Group::make(&name, &limits) {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!("a sandbox without limits: {e}");
            None
        }
    }
}

impl Jail {
    /// Starts the isolation of sandbox `key` (its `instance`) whose workspace is
    /// `workspace`, for its owner `owner`. Blocking.
    pub fn start(
        key: &str,
        instance: usize,
        workspace: &Path,
        owner: Owner,
        opts: &Options,
    ) -> io::Result<Arc<Jail>> {
        let who = if owner.uid == 0 { opts.stand_in } else { owner };
        let t0 = std::time::Instant::now();
        let shape = warm::Shape {
            uid: who.uid,
            gid: who.gid,
            network: opts.network,
            tmp_bytes: opts.tmp_bytes,
            limits: opts.limits,
        };
        let limits = opts.limits;
        let failed =
            |e: io::Error| io::Error::new(e.kind(), format!("sandbox {key:?} did not start: {e}"));
        // A root server's sandbox takes the one booted ahead (its workspace mounted into
        // it); else one boots now.
        let root = rustix::process::getuid().is_root();
        let (mut booted, ahead) = match root.then(|| warm::take(&shape)).flatten() {
            Some(b) => {
                b.foreground();
                (b, true)
            }
            None => {
                let spare = spare::take(limits, move || new_group(limits))?;
                let ws = (!root).then_some(workspace);
                (
                    warm::Booted::boot(&shape, ws, spare).map_err(failed)?,
                    false,
                )
            }
        };
        let t_boot = t0.elapsed();
        booted.attach(workspace).map_err(failed)?;
        let t_attach = t0.elapsed();
        let parts = booted.into_parts();
        let netns = Arc::new(parts.netns);
        let jail = Arc::new(Jail {
            key: key.to_string(),
            control: parts.control,
            send: Mutex::new(()),
            limited: parts.group.is_some(),
            engine: Mutex::new(Some((parts.child, parts.group))),
            proxy: Mutex::new(None),
            netns: Mutex::new(Some(netns.clone())),
            ports: Mutex::new(HashMap::new()),
            channel_slots: Arc::new(tokio::sync::Semaphore::new(ports::MAX_CONNECTIONS)),
            procs: Mutex::new(HashMap::new()),
            kept: Arc::new(AtomicUsize::new(0)),
            ended: AtomicBool::new(false),
            engine_err: parts.engine_err,
            instance,
            network: opts.network,
            uid: who.uid,
            pid_ns: parts.pid_ns,
        });
        let reader = Arc::downgrade(&jail);
        let sock = jail.control.as_fd().try_clone_to_owned()?;
        std::thread::Builder::new()
            .name("casfs-sandbox".into())
            .spawn(move || Self::read_events(reader, sock))?;
        if opts.network == Network::None && !opts.allow.is_empty() {
            let netns = netns.as_fd().try_clone_to_owned()?;
            match proxy::start(netns, opts.allow.clone().into(), key.to_string()) {
                Ok(h) => *jail.proxy.locked() = Some(h),
                // Without its proxy a sandbox reaches nothing: it goes on, closed.
                Err(e) => tracing::warn!("sandbox {key}: no proxy, no network: {e}"),
            }
        }
        // The next sandbox's, booted while this one's first process runs.
        if root {
            // In the background: the CPU goes to whatever else runs first (this
            // sandbox's first process, say).
            warm::replenish(shape, move || {
                let spare = spare::take(limits, move || new_group(limits))?;
                if let Some(g) = spare.group() {
                    g.set_background(true);
                }
                warm::Booted::boot(&shape, None, spare)
            });
        }
        tracing::debug!(
            "sandbox {key}: {} at {t_boot:?}, its workspace there at {t_attach:?}, \
             isolated in {:?}",
            if ahead {
                "booted ahead, taken"
            } else {
                "booted"
            },
            t0.elapsed()
        );
        Ok(jail)
    }

    /// A channel to `port` inside the sandbox (opened at `bind` if there is none yet):
    /// its address and token ([`ports`]).
    pub fn channel(&self, port: u16, bind: std::net::IpAddr) -> io::Result<(SocketAddr, Arc<str>)> {
        if self.network == Network::Host {
            // Its ports are the host's own: a channel would only let its owner reach
            // the host's loopback services through the server.
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "sandbox {:?} is on the host's network: a port it listens on is the \
                     host's, at 127.0.0.1:{port}",
                    self.key
                ),
            ));
        }
        let netns = self
            .netns
            .locked()
            .clone()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the sandbox has ended"))?;
        let mut open = self.ports.locked();
        if let Some(c) = open.get(&port) {
            return Ok((c.addr, c.token.clone()));
        }
        if open.len() >= ports::MAX_PORTS {
            return Err(io::Error::new(
                io::ErrorKind::QuotaExceeded,
                format!(
                    "a sandbox has channels to at most {} ports",
                    ports::MAX_PORTS
                ),
            ));
        }
        let c = ports::open(
            netns,
            port,
            bind,
            self.key.clone(),
            self.channel_slots.clone(),
        )?;
        let got = (c.addr, c.token.clone());
        // Ended meanwhile (its end took the namespace after this took it): closed here.
        if self.ended.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the sandbox has ended",
            ));
        }
        open.insert(port, c);
        Ok(got)
    }

    /// Whether the sandbox's processes have a proxy to the allow-list (at
    /// `127.0.0.1:`[`proxy::PORT`]).
    pub fn proxied(&self) -> bool {
        self.proxy.locked().is_some()
    }

    /// Follows the init's events until its socket closes (or it says something
    /// malformed: then the sandbox ends).
    fn read_events(jail: std::sync::Weak<Jail>, sock: OwnedFd) {
        let mut buf = Vec::new();
        loop {
            let got = wire::recv::<Event>(sock.as_fd(), &mut buf);
            let Some(j) = jail.upgrade() else { return };
            match got {
                Ok(Some((ev, _))) => j.on_event(ev),
                Ok(None) | Err(_) => {
                    j.end();
                    return;
                }
            }
        }
    }

    fn process(&self, id: u64) -> Option<Arc<Process>> {
        self.procs.locked().get(&id).cloned()
    }

    fn on_event(&self, ev: Event) {
        match ev {
            Event::Ready => {}
            Event::Started { id, pid } => {
                if let Some(p) = self.process(id) {
                    p.update(|s| s.pid = Some(pid));
                    if let Some(tx) = p.started.locked().take() {
                        let _ = tx.send(Ok(pid));
                    }
                }
            }
            Event::Failed { id, error } => {
                if let Some(p) = self.process(id) {
                    if let Some(tx) = p.started.locked().take() {
                        let _ =
                            tx.send(Err(io::Error::new(io::ErrorKind::NotFound, error.clone())));
                    }
                    p.update(|s| {
                        s.exit = Some(127);
                        s.error = Some(error);
                    });
                }
            }
            Event::Exited { id, code } => {
                if let Some(p) = self.process(id) {
                    p.update(|s| s.exit = Some(code));
                }
            }
        }
    }

    fn why_ended(&self) -> String {
        let err = String::from_utf8_lossy(&self.engine_err.locked())
            .trim()
            .to_string();
        if err.is_empty() {
            format!("sandbox {:?} ended", self.key)
        } else {
            format!("sandbox {:?} ended: {err}", self.key)
        }
    }

    /// Whether the sandbox's init is gone (nothing more can start in it).
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Which sandbox this is the isolation of.
    pub fn instance(&self) -> usize {
        self.instance
    }

    /// Sends `req` (with `fds`) to the init without waiting: an init that stops taking
    /// requests (stopped by a signal from its own sandbox, say) ends its sandbox rather
    /// than stall the server.
    fn request(&self, req: &Request, fds: &[std::os::fd::BorrowedFd<'_>]) -> io::Result<()> {
        let sent = {
            let _g = self.send.locked();
            wire::send_now(self.control.as_fd(), req, fds)
        };
        match sent {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.end();
                Err(io::Error::other(format!(
                    "sandbox {:?} ended: its init stopped taking requests",
                    self.key
                )))
            }
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!("{}: {e}", self.why_ended()),
            )),
        }
    }

    /// Starts `argv` in `cwd` (inside the sandbox) with exactly `env`. Its stdin stays
    /// open for [`Process::write_stdin`] when `stdin`, else it reads end of file.
    pub async fn spawn(
        self: &Arc<Self>,
        argv: Vec<String>,
        cwd: String,
        env: Vec<(String, String)>,
        stdin: bool,
    ) -> io::Result<Arc<Process>> {
        if self.ended() {
            return Err(io::Error::other(self.why_ended()));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let p = Process::new(id, self.kept.clone());
        let (tx, rx) = oneshot::channel();
        *p.started.locked() = Some(tx);
        let flags = rustix::pipe::PipeFlags::CLOEXEC;
        let (in_r, in_w) = rustix::pipe::pipe_with(flags)?;
        let (out_r, out_w) = rustix::pipe::pipe_with(flags)?;
        let (err_r, err_w) = rustix::pipe::pipe_with(flags)?;
        {
            let mut procs = self.procs.locked();
            // The oldest finished processes are forgotten past MAX_PROCESSES: their
            // output goes with them.
            if procs.len() >= MAX_PROCESSES {
                let mut done: Vec<u64> = procs
                    .iter()
                    .filter(|(_, p)| Process::done(&p.state.locked()))
                    .map(|(id, _)| *id)
                    .collect();
                done.sort_unstable();
                let over = procs.len() + 1 - MAX_PROCESSES;
                for id in done.into_iter().take(over) {
                    procs.remove(&id);
                }
            }
            if procs.len() >= MAX_PROCESSES {
                return Err(io::Error::new(
                    io::ErrorKind::QuotaExceeded,
                    format!(
                        "{MAX_PROCESSES} processes of sandbox {:?} still run",
                        self.key
                    ),
                ));
            }
            procs.insert(id, p.clone());
        }
        let sent = self.request(
            &Request::Spawn { id, argv, cwd, env },
            &[in_r.as_fd(), out_w.as_fd(), err_w.as_fd()],
        );
        drop((in_r, out_w, err_w));
        if let Err(e) = sent {
            self.procs.locked().remove(&id);
            return Err(e);
        }
        if stdin {
            *p.stdin.lock().await = Some(pipe::Sender::from_owned_fd(in_w)?);
        } else {
            drop(in_w);
        }
        for (fd, stream) in [(out_r, Stream::Stdout), (err_r, Stream::Stderr)] {
            let mut r = pipe::Receiver::from_owned_fd(fd)?;
            let p = p.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    match r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => p.push(stream, buf[..n].to_vec()),
                    }
                }
                p.update(|s| s.open -= 1);
            });
        }
        match tokio::time::timeout(START_WAIT, rx).await {
            Ok(Ok(Ok(_))) => Ok(p),
            Ok(Ok(Err(e))) => {
                self.procs.locked().remove(&id);
                Err(e)
            }
            Ok(Err(_)) => Err(io::Error::other(self.why_ended())),
            Err(_) => {
                let this = self.clone();
                tokio::task::spawn_blocking(move || this.end());
                Err(io::Error::other(format!(
                    "sandbox {:?} ended: its init did not start a process in {}s",
                    self.key,
                    START_WAIT.as_secs()
                )))
            }
        }
    }

    /// A process of this sandbox.
    pub fn get(&self, id: u64) -> Option<Arc<Process>> {
        self.process(id)
    }

    /// Forgets process `id` and its output (an exec whose answer was made).
    pub fn forget(&self, id: u64) {
        self.procs.locked().remove(&id);
    }

    /// `signal` to process `id`'s group.
    pub fn kill(&self, id: u64, signal: i32) -> io::Result<()> {
        self.request(&Request::Kill { id, signal }, &[])
    }

    /// Ends the sandbox: its init, and every process in it; waits (a second at most)
    /// for bubblewrap. Blocking; only the first call does anything.
    pub fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        let _ = rustix::net::shutdown(&self.control, rustix::net::Shutdown::Both);
        if let Some(p) = self.proxy.locked().take() {
            p.abort();
        }
        self.ports.locked().clear();
        self.netns.locked().take();
        let Some((mut child, group)) = self.engine.locked().take() else {
            return;
        };
        warm::stop_engine(&mut child, group.as_ref());
        drop(group);
        let why = self.why_ended();
        for p in self.procs.locked().values() {
            if let Some(tx) = p.started.locked().take() {
                let _ = tx.send(Err(io::Error::other(why.clone())));
            }
            p.update(|s| {
                if s.exit.is_none() {
                    s.exit = Some(128 + libc::SIGKILL);
                    s.error.get_or_insert_with(|| why.clone());
                }
            });
        }
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        self.end();
    }
}

/// The isolation of each live sandbox, by sandbox key: the provider ends a sandbox's
/// before it unmounts or removes its workspace.
#[derive(Default)]
pub struct Jails {
    map: Mutex<HashMap<String, Arc<Jail>>>,
    /// One start at a time per key (a start waits for its sandbox's init, which its own
    /// processes could stall: it never holds `map`, which every request reads).
    starting: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Jails {
    /// Sandbox `key`'s isolation, started by `start` if it has none (or its init is
    /// gone, or it is an earlier sandbox's of the key). Blocking.
    pub fn get_or_start(
        &self,
        key: &str,
        instance: usize,
        start: impl FnOnce() -> io::Result<Arc<Jail>>,
    ) -> io::Result<Arc<Jail>> {
        let cell = self
            .starting
            .locked()
            .entry(key.to_string())
            .or_default()
            .clone();
        let started = {
            let _one = cell.locked();
            let live = self
                .map
                .locked()
                .get(key)
                .filter(|j| !j.ended() && j.instance() == instance)
                .cloned();
            match live {
                Some(j) => Ok((j, None)),
                // A sandbox destroyed meanwhile is the caller's to find out (its
                // instance is gone): it ends this one then.
                None => start().map(|j| {
                    let old = self.map.locked().insert(key.to_string(), j.clone());
                    (j, old)
                }),
            }
        };
        {
            let mut starting = self.starting.locked();
            if Arc::strong_count(&cell) == 2 {
                starting.remove(key);
            }
        }
        let (j, old) = started?;
        if let Some(old) = old.filter(|o| !Arc::ptr_eq(o, &j)) {
            old.end();
        }
        Ok(j)
    }

    /// Sandbox `key`'s isolation, if it has one.
    pub fn get(&self, key: &str) -> Option<Arc<Jail>> {
        self.map.locked().get(key).cloned()
    }

    /// Ends sandbox `key`'s isolation and every process in it.
    pub fn end(&self, key: &str) {
        let j = self.map.locked().remove(key);
        if let Some(j) = j {
            j.end();
        }
    }

    /// Ends sandbox `key`'s isolation if it is that of `instance` (a sandbox that went
    /// while its isolation was being started).
    pub fn end_instance(&self, key: &str, instance: usize) {
        let j = {
            let mut map = self.map.locked();
            match map.get(key) {
                Some(j) if j.instance() == instance => map.remove(key),
                _ => None,
            }
        };
        if let Some(j) = j {
            j.end();
        }
    }

    /// How many sandboxes have isolation running.
    pub fn len(&self) -> usize {
        self.map.locked().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Jails {
    fn drop(&mut self) {
        for (_, j) in self.map.locked().drain() {
            j.end();
        }
    }
}
