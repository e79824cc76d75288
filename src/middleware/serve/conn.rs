//! The connections of `casfs serve`, guarded before hyper sees a byte: a bound on how
//! many are open, in all and from one peer, timeouts for clients that stall or idle,
//! and every request head checked first, so that a malformed one is answered with the
//! API's JSON error (hyper would answer it with an empty body) and the connection
//! closed.
//!
//! [`OpenCount`]: at most `--max-connections` open, and at most
//! `--max-connections-per-peer` of one peer ([`PeerKey`]: a Unix user by the uid the
//! kernel gives, `SO_PEERCRED`; a TCP client by its address), so that one member's idle
//! connections never turn another member away. The server's own user is held to the
//! total only.
//!
//! [`GuardedIo`] sits between the socket and hyper. It reads a request head in full
//! (at most [`MAX_HEAD`] bytes), checks it as hyper would (httparse, the URI, one
//! `Content-Length` or `Transfer-Encoding: chunked`, never both), and only then hands
//! it on, followed by exactly the body its framing says; the next head is checked
//! again. A head it refuses never reaches hyper: the reader sees the end of the
//! stream, and the refusal is written when hyper closes the connection.
//!
//! Timeouts: a connection with no request going idles out after [`Timeouts::idle`]; a
//! head must arrive within [`Timeouts::head`] of its first byte and a body must make
//! progress every [`Timeouts::stall`]; so must a reply the client does not read. While
//! a request is being answered (a long poll, a capture that takes minutes) no read
//! timeout runs: the request is the server's to finish.

use crate::sys::Locked;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The longest request head read (request line and headers).
pub const MAX_HEAD: usize = 64 << 10;
/// The longest request target.
pub const MAX_URI: usize = 8 << 10;
/// The most header lines in a head.
const MAX_HEADERS: usize = 100;

/// How long a connection may wait on its client.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// No request going, nothing received.
    pub idle: Duration,
    /// From a head's first byte to its last.
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

/// One accepted socket.
pub enum Stream {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

/// Whose a connection is, for the cap of one peer's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A Unix peer's uid.
    Uid(u32),
    /// A Unix peer the kernel did not name.
    Unknown,
    /// A TCP client's address.
    Addr(IpAddr),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Uid(u) => write!(f, "uid {u}"),
            PeerKey::Unknown => write!(f, "a peer of no known uid"),
            PeerKey::Addr(a) => write!(f, "{a}"),
        }
    }
}

impl Stream {
    /// Whose the connection is; None for the server's own user (held to the total).
    pub fn peer_key(&self) -> Option<PeerKey> {
        match self {
            Stream::Unix(s) => match s.peer_cred() {
                // SAFETY: geteuid cannot fail.
                Ok(c) if c.uid() == unsafe { libc::geteuid() } => None,
                Ok(c) => Some(PeerKey::Uid(c.uid())),
                Err(_) => Some(PeerKey::Unknown),
            },
            Stream::Tcp(s) => Some(
                s.peer_addr()
                    .map_or(PeerKey::Unknown, |a| PeerKey::Addr(a.ip())),
            ),
        }
    }

    /// Writes what the socket takes now, without waiting.
    fn try_write(&self, b: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.try_write(b),
            Stream::Tcp(s) => s.try_write(b),
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Stream::Unix($s) => {
                let $s = Pin::new($s);
                $e
            }
            Stream::Tcp($s) => {
                let $s = Pin::new($s);
                $e
            }
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, b))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, b))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

/// What the bytes after the handed-on ones are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// The next request head (or nothing yet).
    Head,
    /// This many body bytes of a request with a `Content-Length`.
    Body(u64),
    /// A chunked body, at this point of its framing.
    Chunked(Chunk),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In a chunk-size line: hex digits seen, whether past them (an extension).
    Size {
        digits: u32,
        size: u64,
        ext: bool,
    },
    /// The LF of a chunk-size line.
    SizeLf {
        size: u64,
    },
    Data(u64),
    DataCr,
    DataLf,
    /// In the trailer section: characters on the current line.
    Trailer {
        on_line: u32,
    },
    TrailerLf {
        on_line: u32,
    },
}

/// What the framing makes of the bytes read so far.
enum Step {
    /// This many bytes at the front belong to the current message (a head that
    /// passed, or body): hand them on.
    Pass(usize),
    /// Too few bytes to tell.
    More,
    /// The head at the front is refused with this answer.
    Refuse(Refusal),
    /// A body whose framing is broken: hand on this many bytes, then end the stream
    /// (hyper's reader tells the handler, which answers the error).
    Broken(usize),
}

/// A head refused: its status and the API's error kind and message.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            kind,
            message: message.into(),
        }
    }

    /// The whole answer, as bytes on the wire; the connection closes after it.
    pub fn to_http(&self) -> Vec<u8> {
        let body =
            serde_json::json!({"error": {"kind": self.kind, "message": self.message}}).to_string();
        let reason = axum::http::StatusCode::from_u16(self.status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Error");
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            self.status,
            body.len()
        )
        .into_bytes()
    }
}

/// Checks a request head at the front of `buf` as hyper would read it; returns its
/// length and the framing of its body.
fn check_head(buf: &[u8]) -> Result<Option<(usize, Framing)>, Refusal> {
    let bad = |m: String| Refusal::new(400, "invalid", m);
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(Refusal::new(
                431,
                "headers_too_large",
                format!("the request head is over {MAX_HEAD} bytes"),
            ))
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Refusal::new(
                431,
                "headers_too_large",
                format!("the request has over {MAX_HEADERS} header lines"),
            ))
        }
        Err(e) => {
            return Err(bad(format!(
                "not an HTTP/1.1 request head: {e} (in the {})",
                if req.method.is_none() {
                    "method"
                } else if req.path.is_none() {
                    "request target"
                } else if req.version.is_none() {
                    "version"
                } else {
                    "headers"
                }
            )))
        }
    };
    if len > MAX_HEAD {
        return Err(Refusal::new(
            431,
            "headers_too_large",
            format!("the request head is over {MAX_HEAD} bytes"),
        ));
    }
    let method = req.method.expect("parsed");
    let path = req.path.expect("parsed");
    if path.len() > MAX_URI {
        return Err(Refusal::new(
            414,
            "uri_too_long",
            format!("the request target is over {MAX_URI} bytes"),
        ));
    }
    if method.eq_ignore_ascii_case("CONNECT") {
        return Err(Refusal::new(
            405,
            "method_not_allowed",
            "CONNECT is not served",
        ));
    }
    if axum::http::Method::from_bytes(method.as_bytes()).is_err() {
        return Err(bad(format!("method {method:?}: not a method")));
    }
    if let Err(e) = path.parse::<axum::http::Uri>() {
        return Err(bad(format!(
            "request target {:?}: {e} (percent-encode every byte that is not ASCII)",
            path.escape_default().to_string()
        )));
    }
    let http11 = req.version == Some(1);
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut encoded = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).unwrap_or("").trim();
            // 1*DIGIT, or a list of the same number (as hyper takes it).
            let mut n = None;
            for part in v.split(',').map(str::trim) {
                let ok = !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
                let p = ok.then(|| part.parse::<u64>().ok()).flatten();
                match (p, n) {
                    (None, _) => {
                        return Err(bad(format!(
                            "Content-Length {:?}: not a length (1 or more digits)",
                            String::from_utf8_lossy(h.value)
                        )))
                    }
                    (Some(p), Some(q)) if p != q => {
                        return Err(bad("two different Content-Length values".into()))
                    }
                    (Some(p), _) => n = Some(p),
                }
            }
            match (length, n) {
                (Some(a), Some(b)) if a != b => {
                    return Err(bad("two different Content-Length values".into()))
                }
                _ => length = n,
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !http11 {
                return Err(bad("Transfer-Encoding in an HTTP/1.0 request".to_string()));
            }
            encoded = true;
            let v = String::from_utf8_lossy(h.value);
            chunked = v
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        }
    }
    if encoded && length.is_some() {
        return Err(bad(
            "both Content-Length and Transfer-Encoding: give one".to_string()
        ));
    }
    if encoded && !chunked {
        return Err(bad(
            "Transfer-Encoding must end in chunked (or send a Content-Length)".to_string(),
        ));
    }
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked(Chunk::Size {
            digits: 0,
            size: 0,
            ext: false,
        }),
        (false, Some(n)) if n > 0 => Framing::Body(n),
        _ => Framing::Head,
    };
    Ok(Some((len, framing)))
}

/// Follows a chunked body over `buf`: how many of its bytes are this body's, and the
/// state after them (`Head` once it ended); `None` if the framing is broken.
fn follow_chunks(mut c: Chunk, buf: &[u8]) -> Option<(usize, Framing)> {
    let mut i = 0;
    while i < buf.len() {
        let b = buf[i];
        c = match c {
            Chunk::Size { digits, size, ext } => match b {
                b'\r' if digits > 0 => Chunk::SizeLf { size },
                b'\n' if digits > 0 => {
                    i += 1;
                    c = after_size(size);
                    continue;
                }
                _ if ext => Chunk::Size { digits, size, ext },
                b';' | b' ' | b'\t' if digits > 0 => Chunk::Size {
                    digits,
                    size,
                    ext: true,
                },
                _ => {
                    let d = (b as char).to_digit(16)? as u64;
                    if digits >= 16 {
                        return None;
                    }
                    Chunk::Size {
                        digits: digits + 1,
                        size: size * 16 + d,
                        ext,
                    }
                }
            },
            Chunk::SizeLf { size } => {
                if b != b'\n' {
                    return None;
                }
                after_size(size)
            }
            Chunk::Data(n) => {
                let take = (n as usize).min(buf.len() - i);
                i += take;
                c = if take as u64 == n {
                    Chunk::DataCr
                } else {
                    Chunk::Data(n - take as u64)
                };
                continue;
            }
            Chunk::DataCr => match b {
                b'\r' => Chunk::DataLf,
                b'\n' => Chunk::Size {
                    digits: 0,
                    size: 0,
                    ext: false,
                },
                _ => return None,
            },
            Chunk::DataLf => {
                if b != b'\n' {
                    return None;
                }
                Chunk::Size {
                    digits: 0,
                    size: 0,
                    ext: false,
                }
            }
            Chunk::Trailer { on_line } => match b {
                b'\r' => Chunk::TrailerLf { on_line },
                b'\n' if on_line == 0 => return Some((i + 1, Framing::Head)),
                b'\n' => Chunk::Trailer { on_line: 0 },
                _ if on_line as usize > MAX_HEAD => return None,
                _ => Chunk::Trailer {
                    on_line: on_line + 1,
                },
            },
            Chunk::TrailerLf { on_line } => {
                if b != b'\n' {
                    return None;
                }
                if on_line == 0 {
                    return Some((i + 1, Framing::Head));
                }
                Chunk::Trailer { on_line: 0 }
            }
        };
        i += 1;
    }
    Some((i, Framing::Chunked(c)))
}

fn after_size(size: u64) -> Chunk {
    if size == 0 {
        Chunk::Trailer { on_line: 0 }
    } else {
        Chunk::Data(size)
    }
}

/// Reads `data` as a request head and, past it, a chunked body, checking that what is
/// passed on is within `data` (the fuzz check).
pub(super) fn check_wire(data: &[u8]) {
    let Ok(Some((len, _))) = check_head(data) else {
        return;
    };
    assert!(
        len <= data.len(),
        "a head of {len} bytes in {} bytes",
        data.len()
    );
    let start = Chunk::Size {
        digits: 0,
        size: 0,
        ext: false,
    };
    if let Some((n, _)) = follow_chunks(start, &data[len..]) {
        assert!(n <= data.len() - len);
    }
}

/// Counts the open connections, in all and by peer; one is given back when its
/// [`GuardedIo`] drops.
#[derive(Clone, Default)]
pub struct OpenCount(Arc<Mutex<Open>>);

#[derive(Default)]
struct Open {
    all: usize,
    /// Peers with connections open, and how many.
    by_peer: HashMap<PeerKey, usize>,
    /// Connections being turned away ([`OpenCount::turn_away`]).
    turning: usize,
}

/// Why a connection was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// This many are open in all.
    All(usize),
    /// This many of this peer's are open.
    Peer(PeerKey, usize),
}

impl OpenCount {
    /// Takes one if fewer than `max` are open and, for a peer (None: the server's own
    /// user), fewer than `per_peer` of its own.
    pub fn take(
        &self,
        peer: Option<PeerKey>,
        max: usize,
        per_peer: usize,
    ) -> Result<OpenSlot, Full> {
        let mut o = self.0.locked();
        if o.all >= max {
            return Err(Full::All(max));
        }
        if let Some(k) = peer {
            let mine = o.by_peer.entry(k).or_default();
            if *mine >= per_peer {
                return Err(Full::Peer(k, per_peer));
            }
            *mine += 1;
        }
        o.all += 1;
        Ok(OpenSlot {
            open: self.0.clone(),
            peer,
        })
    }
}

impl OpenCount {
    /// Turns a connection away (a 503, `turn_away`) unless `max` are being turned away
    /// already: then it is closed at once, so that a flood of connections beyond the
    /// caps holds no more descriptors than the caps allow.
    pub fn turn_away(&self, io: Stream, full: Full, max: usize) {
        {
            let mut o = self.0.locked();
            if o.turning >= max {
                return;
            }
            o.turning += 1;
        }
        struct Turning(Arc<Mutex<Open>>);
        impl Drop for Turning {
            fn drop(&mut self) {
                self.0.locked().turning -= 1;
            }
        }
        let turning = Turning(self.0.clone());
        tokio::spawn(async move {
            turn_away(io, full).await;
            drop(turning);
        });
    }
}

/// One open connection, counted until dropped.
pub struct OpenSlot {
    open: Arc<Mutex<Open>>,
    peer: Option<PeerKey>,
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        let mut o = self.open.locked();
        o.all -= 1;
        if let Some(k) = self.peer {
            if let Some(n) = o.by_peer.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    o.by_peer.remove(&k);
                }
            }
        }
    }
}

/// A connection as hyper sees it: see the module's notes.
pub struct GuardedIo {
    io: Stream,
    _slot: OpenSlot,
    t: Timeouts,
    /// Read from the client, not handed on yet.
    buf: Vec<u8>,
    /// How many bytes at the front of `buf` may be handed on.
    pass: usize,
    framing: Framing,
    /// The client ended its side (or a broken body ended the stream for hyper).
    eof: bool,
    /// A refused head's answer, written before the connection closes.
    refusal: Option<Vec<u8>>,
    /// Requests handed on whole whose replies are not written yet.
    answering: u32,
    /// Bytes of a reply were written since the last flush.
    wrote: bool,
    /// A read that waits for a reply to be written (a refusal behind a request, or a
    /// read with no clock running while the reply is due).
    reader: Option<Waker>,
    /// When the current wait for the client began (idle, head or body).
    waiting_since: Instant,
    read_timer: Pin<Box<Sleep>>,
    write_timer: Pin<Box<Sleep>>,
    /// When the current write started waiting for the client.
    write_blocked: Option<Instant>,
}

impl GuardedIo {
    pub fn new(io: Stream, slot: OpenSlot, t: Timeouts) -> GuardedIo {
        let now = Instant::now();
        GuardedIo {
            io,
            _slot: slot,
            t,
            buf: Vec::new(),
            pass: 0,
            framing: Framing::Head,
            eof: false,
            refusal: None,
            answering: 0,
            wrote: false,
            reader: None,
            waiting_since: now,
            read_timer: Box::pin(tokio::time::sleep_until(now + t.idle)),
            write_timer: Box::pin(tokio::time::sleep_until(now + t.stall)),
            write_blocked: None,
        }
    }

    /// What the framing makes of the buffered bytes past those already passed.
    fn step(&mut self) -> Step {
        let rest = &self.buf[self.pass..];
        if rest.is_empty() && self.framing == Framing::Head {
            return Step::More;
        }
        match self.framing {
            Framing::Head => match check_head(rest) {
                Ok(None) => Step::More,
                Ok(Some((len, framing))) => {
                    self.framing = framing;
                    self.waiting_since = Instant::now();
                    if framing == Framing::Head {
                        self.answering += 1;
                    }
                    Step::Pass(len)
                }
                Err(r) => Step::Refuse(r),
            },
            Framing::Body(n) => {
                if rest.is_empty() {
                    return Step::More;
                }
                let take = (n as usize).min(rest.len());
                self.framing = if take as u64 == n {
                    self.answering += 1;
                    Framing::Head
                } else {
                    Framing::Body(n - take as u64)
                };
                Step::Pass(take)
            }
            Framing::Chunked(c) => {
                if rest.is_empty() {
                    return Step::More;
                }
                match follow_chunks(c, rest) {
                    Some((n, f)) => {
                        self.framing = f;
                        if f == Framing::Head {
                            self.answering += 1;
                        }
                        Step::Pass(n)
                    }
                    None => Step::Broken(rest.len()),
                }
            }
        }
    }

    /// When the read in progress gives up on the client, if it does.
    fn read_deadline(&self) -> Option<Instant> {
        if self.answering > 0 {
            return None;
        }
        let limit = match self.framing {
            Framing::Head if self.buf.len() == self.pass => self.t.idle,
            Framing::Head => self.t.head,
            _ => self.t.stall,
        };
        Some(self.waiting_since + limit)
    }

    /// Hands on up to `out`'s room of the passable bytes.
    fn hand_on(&mut self, out: &mut ReadBuf<'_>) -> bool {
        if self.pass == 0 {
            return false;
        }
        let n = self.pass.min(out.remaining());
        out.put_slice(&self.buf[..n]);
        self.buf.drain(..n);
        self.pass -= n;
        true
    }

    fn refuse(&mut self, r: Refusal) {
        tracing::debug!(status = r.status, "refused a request head: {}", r.message);
        self.refusal = Some(r.to_http());
        self.buf.clear();
        self.pass = 0;
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if me.hand_on(out) {
                return Poll::Ready(Ok(()));
            }
            if me.refusal.is_some() {
                // Behind a request being answered, the refusal waits for that answer.
                if me.answering > 0 {
                    me.reader = Some(cx.waker().clone());
                    return Poll::Pending;
                }
                return Poll::Ready(Ok(()));
            }
            if me.eof {
                return Poll::Ready(Ok(()));
            }
            match me.step() {
                Step::Pass(n) => {
                    me.pass = n;
                    continue;
                }
                Step::Refuse(r) => {
                    me.refuse(r);
                    continue;
                }
                Step::Broken(n) => {
                    me.pass = n;
                    me.eof = true;
                    continue;
                }
                Step::More => {}
            }
            // Read more from the client.
            let mut chunk = [0u8; 16 << 10];
            let mut rb = ReadBuf::new(&mut chunk);
            match Pin::new(&mut me.io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    me.eof = true;
                    // A head cut short never reached hyper: nothing to answer.
                    if me.framing == Framing::Head {
                        me.buf.truncate(me.pass);
                    }
                }
                Poll::Ready(Ok(())) => {
                    let started = me.framing == Framing::Head && me.buf.len() == me.pass;
                    me.buf.extend_from_slice(rb.filled());
                    // A body that moves, or the first byte of a head, restarts the clock.
                    if started || me.framing != Framing::Head {
                        me.waiting_since = Instant::now();
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    let Some(deadline) = me.read_deadline() else {
                        // No clock runs while a reply is due: once it is out, this
                        // read is woken to start the idle one.
                        me.reader = Some(cx.waker().clone());
                        return Poll::Pending;
                    };
                    me.read_timer.as_mut().reset(deadline);
                    if me.read_timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // Timed out.
                    let (partial, body) = (me.buf.len() > me.pass, me.framing != Framing::Head);
                    if body {
                        // Part of the request reached hyper: its reader tells.
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the request body stalled",
                        )));
                    }
                    if partial {
                        me.refuse(Refusal::new(
                            408,
                            "request_timeout",
                            format!("the request head did not arrive within {:?}", me.t.head),
                        ));
                        continue;
                    }
                    // Idle: close quietly.
                    me.eof = true;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl GuardedIo {
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

    fn wrote(&mut self, n: usize) {
        self.write_blocked = None;
        if n > 0 {
            self.wrote = true;
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        match Pin::new(&mut me.io).poll_write(cx, b) {
            Poll::Ready(Ok(n)) => {
                me.wrote(n);
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
        match Pin::new(&mut me.io).poll_write_vectored(cx, b) {
            Poll::Ready(Ok(n)) => {
                me.wrote(n);
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
                if me.wrote {
                    // The reply is out: the client's turn again.
                    me.wrote = false;
                    me.answering = me.answering.saturating_sub(1);
                    me.waiting_since = Instant::now();
                    if let Some(w) = me.reader.take() {
                        w.wake();
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => me.write_waits(cx).map(Err),
            r => r,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        while let Some(r) = me.refusal.as_mut() {
            match Pin::new(&mut me.io).poll_write(cx, r) {
                Poll::Ready(Ok(n)) if n > 0 && n < r.len() => {
                    r.drain(..n);
                }
                Poll::Ready(Ok(_)) | Poll::Ready(Err(_)) => me.refusal = None,
                Poll::Pending => {
                    if let Poll::Ready(e) = me.write_waits(cx) {
                        me.refusal = None;
                        return Poll::Ready(Err(e));
                    }
                    return Poll::Pending;
                }
            }
        }
        Pin::new(&mut me.io).poll_shutdown(cx)
    }
}

impl Drop for GuardedIo {
    fn drop(&mut self) {
        // Closed without a shutdown: the refusal goes out if the socket takes it now.
        if let Some(r) = self.refusal.take() {
            let _ = self.io.try_write(&r);
        }
    }
}

/// Answers a connection beyond a cap with a 503 and closes it. The answer follows the
/// client's request head (a client such as curl takes an answer that comes before it
/// has sent its request as a failure to connect), waiting at most a second for it, and
/// at most a second more for the client to take the answer.
async fn turn_away(io: Stream, full: Full) {
    let message = match full {
        Full::All(max) => {
            format!("the server has {max} connections open (casfs serve --max-connections)")
        }
        Full::Peer(k, max) => format!(
            "{k} has {max} connections open to the server (casfs serve \
             --max-connections-per-peer); close one"
        ),
    };
    let r = Refusal::new(503, "too_many_connections", message);
    let mut io = io;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
        while let Ok(n @ 1..) = io.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
            if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() > MAX_HEAD {
                break;
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = io.write_all(&r.to_http()).await;
        let _ = io.shutdown().await;
        // What else the client sends (a body) is read and dropped until it closes, so
        // that closing never cuts the answer short.
        let mut buf = [0u8; 4096];
        while let Ok(1..) = io.read(&mut buf).await {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framing(head: &str) -> Result<Option<(usize, Framing)>, Refusal> {
        check_head(head.as_bytes())
    }

    #[test]
    fn heads_are_checked_as_hyper_reads_them() {
        let ok = "GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(framing(ok).unwrap(), Some((ok.len(), Framing::Head)));
        assert_eq!(framing("GET /v1/health HTTP/1.1\r\nHo").unwrap(), None);
        let body = "POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(
            framing(body).unwrap(),
            Some((body.len() - 5, Framing::Body(5)))
        );
        for (head, status) in [
            ("GARBAGE\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                400,
            ),
            ("GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                400,
            ),
            ("GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                400,
            ),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            ("CONNECT a:1 HTTP/1.1\r\n\r\n", 405),
        ] {
            let r = framing(head).expect_err(head);
            assert_eq!(r.status, status, "{head}: {r:?}");
        }
        let mut ff = b"GET /\xff HTTP/1.1\r\n\r\n".to_vec();
        assert_eq!(check_head(&ff).unwrap_err().status, 400);
        ff = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_URI)).into_bytes();
        assert_eq!(check_head(&ff).unwrap_err().status, 414);
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("X-{i}: y\r\n"))
            .collect();
        let r = framing(&format!("GET / HTTP/1.1\r\n{many}\r\n")).unwrap_err();
        assert_eq!(r.status, 431);
        let big = format!("GET / HTTP/1.1\r\nX: {}", "y".repeat(MAX_HEAD));
        assert_eq!(framing(&big).unwrap_err().status, 431);
        // Equal lengths twice, as hyper takes them.
        let twice = "POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n";
        assert_eq!(
            framing(twice).unwrap(),
            Some((twice.len(), Framing::Body(2)))
        );
    }

    #[test]
    fn one_peer_holds_at_most_its_share_of_connections() {
        let open = OpenCount::default();
        let (a, b) = (Some(PeerKey::Uid(1000)), Some(PeerKey::Uid(1001)));
        let a1 = open.take(a, 5, 2).unwrap();
        let _a2 = open.take(a, 5, 2).unwrap();
        assert_eq!(
            open.take(a, 5, 2).err(),
            Some(Full::Peer(PeerKey::Uid(1000), 2))
        );
        let _b1 = open.take(b, 5, 2).unwrap();
        // The server's own user: the total only.
        let _own = open.take(None, 5, 2).unwrap();
        let _own2 = open.take(None, 5, 2).unwrap();
        assert_eq!(open.take(b, 5, 2).err(), Some(Full::All(5)));
        drop(a1);
        let _a3 = open.take(a, 5, 2).unwrap();
        assert_eq!(open.take(None, 5, 2).err(), Some(Full::All(5)));
    }

    #[test]
    fn a_chunked_body_ends_where_its_last_chunk_and_trailers_do() {
        let start = Chunk::Size {
            digits: 0,
            size: 0,
            ext: false,
        };
        let body = b"5\r\nhello\r\nA;ext=1\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\nGET";
        let (n, f) = follow_chunks(start, body).unwrap();
        assert_eq!(f, Framing::Head);
        assert_eq!(&body[n..], b"GET");
        // Fed a byte at a time, the same.
        let mut c = start;
        let mut used = 0;
        for (i, b) in body.iter().enumerate() {
            let (k, f) = follow_chunks(c, std::slice::from_ref(b)).unwrap();
            used += k;
            match f {
                Framing::Chunked(next) => c = next,
                Framing::Head => {
                    assert_eq!(i + 1, n);
                    break;
                }
                Framing::Body(_) => unreachable!(),
            }
        }
        assert_eq!(used, n);
        assert!(follow_chunks(start, b"zz\r\n").is_none());
        assert!(follow_chunks(start, b"5\r\nhelloX").is_none());
        assert!(follow_chunks(start, b"11111111111111111\r\n").is_none());
    }
}
