//! A sandbox's ports for its client (the framework's `ports.connect`): a server a
//! sandbox's process runs on its own loopback (`127.0.0.1:PORT`, else `[::1]:PORT`) is
//! reached through a channel casfs opens on the host's loopback, a TCP listener that
//! takes a connection only if its request carries the channel's token (header
//! [`TOKEN_HEADER`], 256 random bits, compared in constant time, removed before the
//! request goes on), then relays the connection as it is to the port inside. Each
//! connection carries one request: the request goes on with `Connection: close` (its
//! server closes once it answered), so that every request is checked; a WebSocket or
//! other upgrade keeps its connection once the server inside answers 101 (any other
//! answer is the connection's last). Any user of the host may connect to the
//! listener; only the holder of the token, which the sandbox's owner got from the
//! server, gets through. A connection takes nothing of the sandbox's or of the
//! server's connection limits until its token was shown: those that have not shown it
//! yet are at most [`PRE_AUTH`] per channel, a new one past that evicts the oldest, and
//! each has [`HEAD_WAIT`] to send its request's head; so another user of the host who
//! opens connections and sends nothing keeps no one out. A sandbox on the host's own network gets no channel (its
//! ports are the host's). The channel ends with the sandbox's isolation.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::proxy::{in_netns, refuse, MAX_HEAD, WAIT};

/// The header a request through a channel carries its token in.
pub const TOKEN_HEADER: &str = "x-casfs-port-token";

/// Ports one sandbox may have channels to.
pub const MAX_PORTS: usize = 16;

/// An open channel to a sandbox's port.
pub struct Channel {
    pub addr: SocketAddr,
    pub token: Arc<str>,
    task: tokio::task::AbortHandle,
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Connections through the channels of every sandbox together (a sandbox's own are
/// its `slots`, [`MAX_CONNECTIONS`] over all its channels).
static ALL: Semaphore = Semaphore::const_new(4096);

/// Connections through one sandbox's channels at once.
pub const MAX_CONNECTIONS: usize = 256;

/// Connections of one channel that have not shown its token yet, at most; a new one
/// past them evicts the oldest (a client sends its request's head at once, so what is
/// evicted is almost always a connection that sent nothing).
pub const PRE_AUTH: usize = 32;

/// How long a connection has to send its request's head.
pub const HEAD_WAIT: Duration = Duration::from_secs(5);

/// Opens a channel to `port` in network namespace `netns` (sandbox `key`'s), listening
/// at `bind` (port chosen by the kernel), on the server's runtime; its connections take
/// the sandbox's `slots`.
pub fn open(
    netns: Arc<OwnedFd>,
    port: u16,
    bind: IpAddr,
    key: String,
    slots: Arc<Semaphore>,
) -> std::io::Result<Channel> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| std::io::Error::other(format!("no runtime to run the channel on: {e}")))?;
    let token: Arc<str> = crate::checkpoint::secret_hex().into();
    let listener = std::net::TcpListener::bind((bind, 0))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let _in = runtime.enter();
    let listener = TcpListener::from_std(listener)?;
    let ch = Arc::new(Relay {
        netns,
        port,
        token: token.clone(),
        slots,
        key,
    });
    let task = runtime.spawn(accept_loop(listener, ch)).abort_handle();
    Ok(Channel { addr, token, task })
}

/// A connection's state: waiting for its head, its token shown, or evicted.
const WAITING: u8 = 0;
const SHOWN: u8 = 1;
const EVICTED: u8 = 2;

/// What a channel's connections are relayed with.
struct Relay {
    netns: Arc<OwnedFd>,
    port: u16,
    token: Arc<str>,
    /// The sandbox's connections ([`MAX_CONNECTIONS`]).
    slots: Arc<Semaphore>,
    key: String,
}

/// Accepts a channel's connections and relays each (see the module's comment for who
/// waits where).
async fn accept_loop(listener: TcpListener, ch: Arc<Relay>) {
    let mut conns = tokio::task::JoinSet::new();
    // Those that have not shown the token yet, oldest first: their state and task.
    let mut waiting: VecDeque<(Arc<AtomicU8>, tokio::task::AbortHandle)> = VecDeque::new();
    loop {
        while conns.try_join_next().is_some() {}
        let conn = match listener.accept().await {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!(sandbox = %ch.key, "channel: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        waiting
            .retain(|(state, task)| state.load(Ordering::SeqCst) == WAITING && !task.is_finished());
        if waiting.len() >= PRE_AUTH {
            // Evicted only if it has still not shown the token: one that has is never
            // cut off (it and its eviction decide it with one compare-and-swap).
            while let Some((state, oldest)) = waiting.pop_front() {
                if state
                    .compare_exchange(WAITING, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    oldest.abort();
                    break;
                }
            }
        }
        let shown = Arc::new(AtomicU8::new(WAITING));
        let (c, flag) = (ch.clone(), shown.clone());
        let task = conns.spawn(async move {
            if let Err(e) = relay(conn, &c, &flag).await {
                tracing::debug!(sandbox = %c.key, "channel: {e}");
            }
        });
        waiting.push_back((shown, task));
    }
}

/// What the bytes a connection sent first are.
#[derive(Debug, PartialEq)]
enum Head {
    /// Not a whole request head yet.
    More,
    /// Not an HTTP request.
    Bad,
    /// A request without the channel's token (or with two).
    Refused,
    /// A request with the channel's token: the head to send on instead (the token's
    /// line cut out; unless it asks for an upgrade, `Connection: close` in place of
    /// what it said of its connection), where the head ended, and whether it asks for
    /// an upgrade.
    Allowed(Vec<u8>, usize, bool),
}

fn check_head(buf: &[u8], token: &str) -> Head {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    let end = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Head::More,
        Err(_) => return Head::Bad,
    };
    let is = |h: &httparse::Header, name: &str| h.name.eq_ignore_ascii_case(name);
    let tokens: Vec<_> = req.headers.iter().filter(|h| is(h, TOKEN_HEADER)).collect();
    if tokens.len() != 1 || !crate::checkpoint::same_secret(tokens[0].value, token.as_bytes()) {
        return Head::Refused;
    }
    let upgrade = req.headers.iter().any(|h| is(h, "upgrade"));
    // httparse took the head as valid: one header per line, so lines are headers.
    let mut lines = buf[..end].split_inclusive(|&b| b == b'\n');
    let mut out = Vec::with_capacity(end + 20);
    out.extend_from_slice(lines.next().unwrap_or_default());
    for line in lines {
        let name = line.split(|&b| b == b':').next().unwrap_or_default();
        let name = String::from_utf8_lossy(name);
        let name = name.trim();
        if name.is_empty() {
            break;
        }
        let drop = name.eq_ignore_ascii_case(TOKEN_HEADER)
            || (!upgrade
                && ["connection", "keep-alive", "proxy-connection"]
                    .iter()
                    .any(|n| name.eq_ignore_ascii_case(n)));
        if !drop {
            out.extend_from_slice(line);
        }
    }
    if !upgrade {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Head::Allowed(out, end, upgrade)
}

async fn relay(mut conn: TcpStream, ch: &Relay, state: &AtomicU8) -> std::io::Result<()> {
    let (port, token) = (ch.port, &*ch.token);
    let mut buf = Vec::with_capacity(4096);
    let head = tokio::time::timeout(HEAD_WAIT, async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            // Parsed once the head's end has come (not again for each byte).
            let from = buf.len().saturating_sub(3);
            buf.extend_from_slice(&chunk[..n]);
            if memchr::memmem::find(&buf[from..], b"\r\n\r\n").is_none() {
                if buf.len() >= MAX_HEAD {
                    return Ok(Some(Head::Bad));
                }
                continue;
            }
            return Ok(Some(check_head(&buf, token)));
        }
    })
    .await;
    let (head, end, upgrade) = match head {
        Ok(Ok(Some(Head::Allowed(head, end, upgrade)))) => (head, end, upgrade),
        Ok(Ok(Some(Head::Refused))) => {
            return refuse(
                &mut conn,
                "403 Forbidden",
                &format!("a request through this channel carries its token in {TOKEN_HEADER}"),
            )
            .await
        }
        Ok(Ok(Some(_))) => {
            return refuse(&mut conn, "400 Bad Request", "not an HTTP request").await
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(&mut conn, "408 Request Timeout", "no request").await,
    };
    // Shown (unless it was evicted first): from here on it counts against the
    // sandbox's connections and all of them.
    if state
        .compare_exchange(WAITING, SHOWN, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return Ok(());
    }
    let (Ok(_mine), Ok(_all)) = (ch.slots.clone().try_acquire_owned(), ALL.try_acquire()) else {
        return refuse(
            &mut conn,
            "503 Service Unavailable",
            "too many connections through the sandbox's channels; try again",
        )
        .await;
    };
    let mut inside = match connect_inside(ch.netns.clone(), port).await {
        Ok(s) => s,
        Err(e) => {
            return refuse(
                &mut conn,
                "502 Bad Gateway",
                &format!("nothing answers on port {port} in the sandbox ({e})"),
            )
            .await
        }
    };
    inside.write_all(&head).await?;
    if !upgrade {
        // With `Connection: close`: the server inside answers this request only.
        inside.write_all(&buf[end..]).await?;
        tokio::io::copy_bidirectional(&mut conn, &mut inside).await?;
        return Ok(());
    }
    // An upgrade keeps its connection only if the server inside switches protocols
    // (101); otherwise its answer is the connection's last: nothing more goes in.
    let mut answer = Vec::with_capacity(1024);
    let switched = tokio::time::timeout(WAIT, async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = inside.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(false);
            }
            answer.extend_from_slice(&chunk[..n]);
            if memchr::memmem::find(&answer, b"\r\n\r\n").is_some() || answer.len() >= MAX_HEAD {
                return Ok(
                    answer.starts_with(b"HTTP/1.1 101 ") || answer.starts_with(b"HTTP/1.0 101 ")
                );
            }
        }
    })
    .await
    .unwrap_or(Ok(false))?;
    conn.write_all(&answer).await?;
    if switched {
        inside.write_all(&buf[end..]).await?;
        tokio::io::copy_bidirectional(&mut conn, &mut inside).await?;
    } else {
        inside.shutdown().await?;
        tokio::io::copy(&mut inside, &mut conn).await?;
        conn.shutdown().await?;
    }
    Ok(())
}

/// A connection to `port` on the loopback of network namespace `netns`: 127.0.0.1, else
/// ::1 (a server listening on `localhost` may have taken either). Its socket is made in
/// the namespace ([`in_netns`]), the connection then here.
async fn connect_inside(netns: Arc<OwnedFd>, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for ip in [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ] {
        let ns = netns.clone();
        let fd = tokio::task::spawn_blocking(move || {
            in_netns(&ns, || {
                let family = match ip {
                    IpAddr::V4(_) => rustix::net::AddressFamily::INET,
                    IpAddr::V6(_) => rustix::net::AddressFamily::INET6,
                };
                Ok(rustix::net::socket_with(
                    family,
                    rustix::net::SocketType::STREAM,
                    rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
                    None,
                )?)
            })
        })
        .await
        .map_err(std::io::Error::other)??;
        let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
        match tokio::time::timeout(WAIT, socket.connect(SocketAddr::new(ip, port))).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = Some(e),
            Err(_) => last = Some(std::io::Error::from(std::io::ErrorKind::TimedOut)),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_channels_token_opens_it_and_each_connection_carries_one_request() {
        let t = "ab12";
        let req = b"GET /x HTTP/1.1\r\nHost: h\r\nX-Casfs-Port-Token: ab12\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nAccept: */*\r\n\r\nrest";
        let Head::Allowed(head, end, false) = check_head(req, t) else {
            panic!("the right token was refused");
        };
        assert_eq!(
            head,
            b"GET /x HTTP/1.1\r\nHost: h\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        assert_eq!(&req[end..], b"rest");
        // An upgrade keeps its connection; the token goes all the same.
        let ws = b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nx-casfs-port-token: ab12\r\n\r\n";
        let Head::Allowed(head, _, true) = check_head(ws, t) else {
            panic!("an upgrade with the token was refused");
        };
        assert_eq!(
            head,
            b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        );
        // Wrong, missing, repeated, a prefix: refused.
        for bad in [
            &b"GET / HTTP/1.1\r\nx-casfs-port-token: ab13\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1.1\r\nx-casfs-port-token: ab12\r\nx-casfs-port-token: ab12\r\n\r\n",
            b"GET / HTTP/1.1\r\nx-casfs-port-token: ab1\r\n\r\n",
        ] {
            assert_eq!(check_head(bad, t), Head::Refused, "{bad:?}");
        }
        assert_eq!(check_head(b"GET / HTTP/1.1\r\nHost", t), Head::More);
        assert_eq!(check_head(b"\x00\x01 nonsense\r\n\r\n", t), Head::Bad);
    }
}
