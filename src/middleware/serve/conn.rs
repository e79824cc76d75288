//! The connections of `casfs serve`: hyper reads HTTP/1.1 off them; what hyper cannot
//! do is here.
//!
//! [`run`] accepts connections and serves each with hyper's HTTP/1 connection
//! ([`hyper::server::conn::http1::Builder`], on Tokio through hyper-util's `TokioIo` and
//! `TokioTimer`). hyper parses every request head and body framing: a head over
//! [`MAX_HEAD`] bytes or with over [`MAX_HEADERS`] header lines is refused with 431; a
//! bad request line or header, a byte outside ASCII in the target, two different or a
//! negative `Content-Length`, or a `Transfer-Encoding` that does not end in `chunked`
//! with 400; either way the connection is closed, so nothing after a refused head is
//! read as a request. A chunked body whose framing breaks fails its handler's read (400)
//! and closes the connection. A request with both `Content-Length` and
//! `Transfer-Encoding: chunked` is framed by its chunks alone, and its connection closed
//! after the answer (RFC 9112, 6.1; hyper drops the length, so a handler cannot tell).
//! A target over [`MAX_URI`] bytes is answered 414 here, before the routes (hyper's own
//! bound is 64 KiB). A request body that makes no progress for [`Timeouts::stall`]
//! fails its handler's read (tower-http's `RequestBodyTimeoutLayer`).
//!
//! Before hyper, [`run`] counts every connection against the caps of `super::caps`
//! ([`OpenCount`]: in all and by peer); one beyond them is answered 503 and closed.
//!
//! [`GuardedIo`] sits between the socket and hyper and parses nothing. The connection's
//! service tells it whether a request is being answered (from the service's call until
//! hyper drops the reply's body), and so it:
//! - closes a connection with no request going, its last reply flushed, that has sent
//!   nothing for [`Timeouts::idle`] since (a new connection is given that long for its
//!   first byte before hyper starts on it);
//! - fails a write of a reply the client has not taken for [`Timeouts::stall`];
//! - takes a reply hyper writes while no request is being answered, every earlier
//!   reply flushed, for hyper's own refusal of a head (hyper writes one only then, with
//!   an empty body) and writes the API's JSON error with its status instead: `invalid`,
//!   `headers_too_large` or `uri_too_long`. Should the client not have taken the reply
//!   before, hyper's empty answer goes out as it is.
//!
//! After an error hyper ends a connection on, the connection is shut down and what the
//! client still sends read and dropped for a second at most, so that closing never cuts
//! the answer short.
//!
//! Timeouts: hyper's header timer ([`Timeouts::head`]) runs from when hyper starts
//! waiting for a head: from a connection's first byte, and from the end of each reply,
//! so a kept-alive connection is closed after the shorter of the idle and head
//! timeouts; if part of a head had come, the answer is 408 `request_timeout`. While a
//! request is being answered (a long poll, a capture that takes minutes) no read timeout
//! runs: the request is the server's to finish.
//!
//! Nothing here parses a request head any more, so the fuzz targets
//! (`casfs::fuzzing`) have none for HTTP: the hand parser they fuzzed is gone.

use crate::sys::Locked;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutBody};

use super::caps::{OpenCount, OpenSlot};
use super::error::ApiError;
use super::peer::Peer;
use super::stream::{Refusal, Stream, MAX_HEAD, MAX_HEADERS};

/// The longest request target.
pub const MAX_URI: usize = 8 << 10;

/// How long a connection may wait on its client.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// No request going, nothing received.
    pub idle: Duration,
    /// For a whole request head (hyper's header timer).
    pub head: Duration,
    /// A body that makes no progress, or a reply the client does not take.
    pub stall: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            idle: Duration::from_secs(60),
            head: Duration::from_secs(30),
            stall: Duration::from_secs(30),
        }
    }
}

/// What a connection's service tells its [`GuardedIo`].
struct Turn {
    /// Requests handed to the service whose replies hyper has not finished.
    going: usize,
    /// Bytes came from the client since the last reply was finished.
    heard: bool,
    /// Every reply is finished and flushed: what hyper writes now is its own.
    flushed: bool,
    /// When the last reply was finished and flushed (or the connection handed to
    /// hyper).
    since: Instant,
}

/// A request being answered, until hyper drops its reply's body.
struct Answering(Arc<Mutex<Turn>>);

impl Answering {
    fn begin(turn: &Arc<Mutex<Turn>>) -> Answering {
        let mut t = turn.locked();
        t.going += 1;
        t.flushed = false;
        Answering(turn.clone())
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        let mut t = self.0.locked();
        t.going -= 1;
        if t.going == 0 {
            t.heard = false;
            t.since = Instant::now();
        }
    }
}

/// A connection as hyper sees it: see the module's notes.
pub struct GuardedIo {
    io: Stream,
    _slot: OpenSlot,
    t: Timeouts,
    turn: Arc<Mutex<Turn>>,
    idle_timer: Pin<Box<Sleep>>,
    write_timer: Pin<Box<Sleep>>,
    /// When the current write started waiting for the client.
    write_blocked: Option<Instant>,
    /// The JSON refusal written in place of hyper's own, and how much of it is out;
    /// what hyper writes after it is dropped (hyper closes the connection).
    replacing: Option<(Vec<u8>, usize)>,
}

impl GuardedIo {
    fn new(io: Stream, slot: OpenSlot, t: Timeouts) -> GuardedIo {
        let now = Instant::now();
        GuardedIo {
            io,
            _slot: slot,
            t,
            turn: Arc::new(Mutex::new(Turn {
                going: 0,
                heard: false,
                flushed: true,
                since: now,
            })),
            idle_timer: Box::pin(tokio::time::sleep_until(now + t.idle)),
            write_timer: Box::pin(tokio::time::sleep_until(now + t.stall)),
            write_blocked: None,
            replacing: None,
        }
    }

    fn turn(&self) -> std::sync::MutexGuard<'_, Turn> {
        self.turn.locked()
    }

    /// Fails a write the client has not taken for the stall timeout.
    fn write_waits(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let since = *self.write_blocked.get_or_insert_with(Instant::now);
        self.write_timer.as_mut().reset(since + self.t.stall);
        match self.write_timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read the reply",
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Writes the JSON refusal in place of hyper's reply `b` (its first bytes) if `b`
    /// is hyper's own: a reply while no request is being answered. None: `b` is ours.
    fn poll_replace(&mut self, cx: &mut Context<'_>, b: &[u8]) -> Option<Poll<io::Result<usize>>> {
        if self.replacing.is_none() {
            let status = b
                .strip_prefix(b"HTTP/1.1 ")
                .and_then(|s| std::str::from_utf8(s.get(..3)?).ok())
                .and_then(|s| s.parse::<u16>().ok())
                .filter(|s| (400..500).contains(s))?;
            let t = self.turn();
            if t.going > 0 || !t.flushed {
                return None;
            }
            drop(t);
            tracing::debug!(status, "hyper refused a request head");
            self.replacing = Some((Refusal::of_hyper(status).to_http(), 0));
        }
        loop {
            let (r, at) = self.replacing.as_ref().expect("set above");
            if *at == r.len() {
                self.write_blocked = None;
                return Some(Poll::Ready(Ok(b.len())));
            }
            match Pin::new(&mut self.io).poll_write(cx, &r[*at..]) {
                Poll::Ready(Ok(0)) => {
                    return Some(Poll::Ready(Err(io::ErrorKind::WriteZero.into())))
                }
                Poll::Ready(Ok(n)) => self.replacing.as_mut().expect("set").1 += n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => return Some(self.write_waits(cx).map(Err)),
            }
        }
    }

    /// Answers a client whose head did not arrive within the head timeout with 408 (if
    /// part of one had come), then closes the connection without cutting the answer
    /// short: what the client still sends is read and dropped for a second at most.
    async fn close(&mut self, timed_out: bool) {
        if timed_out && self.turn().heard && self.replacing.is_none() {
            let r = Refusal::new(
                408,
                "request_timeout",
                format!("the request head did not arrive within {:?}", self.t.head),
            );
            let _ = tokio::time::timeout(self.t.stall, self.io.write_all(&r.to_http())).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let _ = self.io.shutdown().await;
            let mut buf = [0u8; 4096];
            while let Ok(1..) = self.io.read(&mut buf).await {}
        })
        .await;
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut me.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    me.turn().heard = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                // Idle only once the last reply is out: hyper drops a reply's body when
                // its last bytes are buffered, and reads on while it sends them.
                let idle_since = {
                    let t = me.turn();
                    (t.going == 0 && t.flushed && !t.heard).then_some(t.since)
                };
                // A head under way is hyper's to time; a request going, the server's.
                if let Some(since) = idle_since {
                    me.idle_timer.as_mut().reset(since + me.t.idle);
                    if me.idle_timer.as_mut().poll(cx).is_ready() {
                        // Idle: the end of the stream, which hyper takes quietly.
                        return Poll::Ready(Ok(()));
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if let Some(r) = me.poll_replace(cx, b) {
            return r;
        }
        match Pin::new(&mut me.io).poll_write(cx, b) {
            Poll::Ready(Ok(n)) => {
                me.write_blocked = None;
                Poll::Ready(Ok(n))
            }
            Poll::Pending => me.write_waits(cx).map(Err),
            r => r,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let first = b.iter().find(|s| !s.is_empty()).map_or(&[][..], |s| &s[..]);
        if let Some(r) = me.poll_replace(cx, first) {
            return r;
        }
        match Pin::new(&mut me.io).poll_write_vectored(cx, b) {
            Poll::Ready(Ok(n)) => {
                me.write_blocked = None;
                Poll::Ready(Ok(n))
            }
            Poll::Pending => me.write_waits(cx).map(Err),
            r => r,
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        match Pin::new(&mut me.io).poll_flush(cx) {
            Poll::Ready(Ok(())) => {
                me.write_blocked = None;
                let mut t = me.turn();
                if t.going == 0 && !t.flushed {
                    // The last reply's bytes are out: the connection idles from now.
                    t.flushed = true;
                    t.heard = false;
                    t.since = Instant::now();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => me.write_waits(cx).map(Err),
            r => r,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The server's listening socket.
pub enum Socket {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

impl Socket {
    /// The next connection, and who made it (handlers take it as [`Peer`]).
    async fn accept(&self) -> (Stream, Peer) {
        loop {
            let got = match self {
                Socket::Unix(l) => l
                    .accept()
                    .await
                    .map(|(s, _)| (Peer::of_unix(&s), Stream::Unix(s))),
                Socket::Tcp(l) => l.accept().await.map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    (Peer::tcp(), Stream::Tcp(s))
                }),
            };
            match got {
                Ok((peer, s)) => return (s, peer),
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was taken:
                    // wait a little rather than spin, and go on.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// How many connections, and how long they wait.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub max: usize,
    /// At most this many of one peer ([`PeerKey`]).
    pub per_peer: usize,
    pub timeouts: Timeouts,
}

/// Serves `app` on `socket` until `shutdown` completes, then lets the connections
/// finish the requests they are answering.
pub async fn run(socket: Socket, app: Router, caps: Caps, shutdown: impl Future<Output = ()>) {
    let open = OpenCount::default();
    // Each connection holds a receiver: told to finish when the server stops, and
    // waited for until the last is dropped.
    let (stop, stopping) = tokio::sync::watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            got = socket.accept() => got,
        };
        match open.take(stream.peer_key(), caps.max, caps.per_peer) {
            Ok(slot) => {
                let io = GuardedIo::new(stream, slot, caps.timeouts);
                tokio::spawn(connection(io, peer, app.clone(), stopping.clone()));
            }
            Err(full) => open.turn_away(stream, full, caps.max),
        }
    }
    drop(socket);
    drop(stopping);
    let _ = stop.send(());
    stop.closed().await;
}

/// Serves one connection with hyper.
async fn connection(
    mut io: GuardedIo,
    peer: Peer,
    app: Router,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    let t = io.t;
    // A new connection is given the idle timeout for its first byte; hyper's header
    // timer starts with it.
    let first = tokio::select! {
        r = tokio::time::timeout(t.idle, io.io.first_byte()) => matches!(r, Ok(Ok(()))),
        _ = stop.changed() => false,
    };
    if !first {
        return;
    }
    io.turn().since = Instant::now();
    let turn = io.turn.clone();
    let service = tower::ServiceBuilder::new()
        .layer(RequestBodyTimeoutLayer::new(t.stall))
        .service(tower::service_fn(
            move |mut req: Request<TimeoutBody<Incoming>>| {
                let answering = Answering::begin(&turn);
                req.extensions_mut().insert(ConnectInfo(peer.clone()));
                let app = app.clone();
                async move {
                    let reply = match target_too_long(&req) {
                        Some(e) => e.into_response(),
                        None => app.oneshot(req).await?,
                    };
                    // The request is being answered until hyper drops the reply's body.
                    Ok::<Response, Infallible>(reply.map(|b| {
                        axum::body::Body::new(b.map_err(move |e| {
                            let _answering = &answering;
                            e
                        }))
                    }))
                }
            },
        ));
    let mut h1 = hyper::server::conn::http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(t.head)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEAD);
    let result = {
        let conn = h1.serve_connection(TokioIo::new(&mut io), TowerToHyperService::new(service));
        let mut conn = pin!(conn);
        let mut stopping = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => break r,
                _ = stop.changed(), if !stopping => {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!("serving a connection: {e}");
        io.close(e.is_timeout()).await;
    }
}

/// 414 for a request target over [`MAX_URI`] bytes (hyper's own bound is 64 KiB).
fn target_too_long<B>(req: &Request<B>) -> Option<ApiError> {
    let u = req.uri();
    let len = u.path_and_query().map_or(0, |p| p.as_str().len())
        + u.authority().map_or(0, |a| a.as_str().len());
    (len > MAX_URI).then(|| {
        ApiError::new(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            format!("the request target is over {} KiB", MAX_URI >> 10),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_s_refusals_become_the_api_s_errors() {
        for (status, kind) in [
            (400, "invalid"),
            (431, "headers_too_large"),
            (414, "uri_too_long"),
        ] {
            let r = Refusal::of_hyper(status);
            assert_eq!((r.status, r.kind), (status, kind));
            let wire = String::from_utf8(r.to_http()).unwrap();
            assert!(wire.starts_with(&format!("HTTP/1.1 {status} ")), "{wire}");
            let (_, body) = wire.split_once("\r\n\r\n").unwrap();
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(v["error"]["kind"], kind);
        }
        let long = Request::get(format!("/{}", "a".repeat(MAX_URI)))
            .body(())
            .unwrap();
        assert!(target_too_long(&long).is_some());
        let fine = Request::get("/v1/health?x=1").body(()).unwrap();
        assert!(target_too_long(&fine).is_none());
    }

    /// The body `/big` answers with: far more than a socket buffer holds.
    const BIG: usize = 16 << 20;

    /// Serves one end of a socket pair as `run` serves a connection; the other end, and
    /// how many requests reached a handler.
    fn served(t: Timeouts) -> (tokio::net::UnixStream, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let slot = OpenCount::default().take(None, 1, 1).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let seen = ran.clone();
        let app = Router::new()
            .route(
                "/ok",
                axum::routing::get(move || async move {
                    seen.fetch_add(1, Ordering::SeqCst);
                    "fine"
                }),
            )
            .route("/big", axum::routing::get(|| async { vec![b'x'; BIG] }));
        let (stop, stopping) = tokio::sync::watch::channel(());
        let io = GuardedIo::new(Stream::Unix(ours), slot, t);
        tokio::spawn(async move {
            connection(io, Peer::default(), app, stopping).await;
            drop(stop);
        });
        (theirs, ran)
    }

    #[tokio::test]
    async fn a_head_hyper_refuses_gets_the_json_error_and_reaches_no_handler() {
        let (mut c, ran) = served(Timeouts::default());
        c.write_all(
            b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n\
              GET /ok HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n\
              GET /ok HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .await
        .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        let (first, refusal) = out.split_once("fine").expect(&out);
        assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(
            refusal.starts_with("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json"),
            "{out}"
        );
        let (_, body) = refusal.split_once("\r\n\r\n").unwrap();
        let v: serde_json::Value = serde_json::from_str(body).expect(body);
        assert_eq!(v["error"]["kind"], "invalid");
        // Only the first request ran: the connection closed at the refused head.
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_head_cut_short_is_408_and_an_idle_connection_just_closes() {
        let t = Timeouts {
            idle: Duration::from_millis(300),
            head: Duration::from_millis(200),
            stall: Duration::from_secs(5),
        };
        let (mut c, _) = served(t);
        c.write_all(b"GET /ok HTTP/1.1\r\nHo").await.unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 408 Request Timeout\r\n"), "{out}");
        assert!(out.contains(r#""kind":"request_timeout""#), "{out}");
        let (mut c, ran) = served(t);
        let start = Instant::now();
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        assert!(out.is_empty() && start.elapsed() >= t.idle, "{out:?}");
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    /// A reply the client takes slowly is not cut short by the idle timeout: the
    /// connection idles only once the reply's last bytes are out (hyper drops a body
    /// once it is buffered, and reads on while it sends it).
    #[tokio::test]
    async fn a_reply_read_slowly_is_sent_whole() {
        let t = Timeouts {
            idle: Duration::from_millis(200),
            head: Duration::from_millis(200),
            stall: Duration::from_secs(10),
        };
        let (mut c, _) = served(t);
        c.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        let at = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert!(out.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert_eq!(out.len() - at, BIG, "the whole body");
    }
}
