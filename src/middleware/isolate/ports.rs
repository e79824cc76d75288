//! A sandbox's ports for its client (the framework's `ports.connect`): a server a
//! sandbox's process runs on `127.0.0.1:PORT` in the sandbox's own network is reached
//! through a channel casfs opens on the host, a TCP listener at an address of the
//! server's (`127.0.0.1` for a socket server) that takes a connection only if its first
//! request carries the channel's token (header [`TOKEN_HEADER`], 256 random bits,
//! compared in constant time, removed before the request goes on), then relays the
//! connection, as it is, to the port inside: keep-alive, streaming and WebSocket
//! upgrades pass. Any user of the host may connect to the listener; only the holder of
//! the token, which the sandbox's owner got from the server, gets through. The channel
//! ends with the sandbox.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The header a request through a channel carries its token in.
pub const TOKEN_HEADER: &str = "x-casfs-port-token";

/// Ports one sandbox may have channels to.
pub const MAX_PORTS: usize = 16;
/// Connections through one channel at once.
const MAX_CONNECTIONS: usize = 256;
/// A first request head's most bytes, and how long it may take to come.
const MAX_HEAD: usize = 16 << 10;
const WAIT: Duration = Duration::from_secs(10);

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

/// Opens a channel to `port` in network namespace `netns` (sandbox `key`'s), listening
/// at `bind` (port chosen by the kernel), on the server's runtime.
pub fn open(netns: Arc<OwnedFd>, port: u16, bind: IpAddr, key: String) -> std::io::Result<Channel> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| std::io::Error::other(format!("no runtime to run the channel on: {e}")))?;
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
    let token: Arc<str> = raw
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
        .into();
    let listener = std::net::TcpListener::bind((bind, 0))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let _in = runtime.enter();
    let listener = TcpListener::from_std(listener)?;
    let task = runtime
        .spawn(serve(listener, netns, port, token.clone(), key))
        .abort_handle();
    Ok(Channel { addr, token, task })
}

async fn serve(
    listener: TcpListener,
    netns: Arc<OwnedFd>,
    port: u16,
    token: Arc<str>,
    key: String,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // Its connections, aborted with it (the sandbox ended) when this task is.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let conn = match listener.accept().await {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!(sandbox = %key, port, "channel: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (netns, token, key) = (netns.clone(), token.clone(), key.clone());
        conns.spawn(async move {
            if let Err(e) = relay(conn, &netns, port, &token).await {
                tracing::debug!(sandbox = %key, port, "channel: {e}");
            }
            drop(permit);
        });
    }
}

async fn answer(conn: &mut TcpStream, status: &str, msg: &str) -> std::io::Result<()> {
    let body = format!("casfs: {msg}\n");
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await?;
    conn.shutdown().await
}

/// Whether `a` and `b` are equal, in time that depends on their lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
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
    /// A request with the channel's token: the header's line, to cut out.
    Allowed(std::ops::Range<usize>),
}

fn check_head(buf: &[u8], token: &str) -> Head {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Head::More,
        Err(_) => return Head::Bad,
    }
    let mut found = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case(TOKEN_HEADER) {
            if found.is_some() || !same(h.value, token.as_bytes()) {
                return Head::Refused;
            }
            // The header's whole line, found by the value's place in `buf`.
            let at = h.value.as_ptr() as usize - buf.as_ptr() as usize;
            let start = buf[..at]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            let after = at + h.value.len();
            let stop = after
                + buf[after..]
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(0, |i| i + 1);
            found = Some(start..stop);
        }
    }
    found.map_or(Head::Refused, Head::Allowed)
}

async fn relay(
    mut conn: TcpStream,
    netns: &Arc<OwnedFd>,
    port: u16,
    token: &str,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    let head = tokio::time::timeout(WAIT, async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            buf.extend_from_slice(&chunk[..n]);
            match check_head(&buf, token) {
                Head::More if buf.len() < MAX_HEAD => {}
                Head::More => return Ok(Some(Head::Bad)),
                h => return Ok(Some(h)),
            }
        }
    })
    .await;
    let line = match head {
        Ok(Ok(Some(Head::Allowed(line)))) => line,
        Ok(Ok(Some(Head::Refused))) => {
            return answer(
                &mut conn,
                "403 Forbidden",
                &format!("a request through this channel carries its token in {TOKEN_HEADER}"),
            )
            .await
        }
        Ok(Ok(Some(_))) => {
            return answer(&mut conn, "400 Bad Request", "not an HTTP request").await
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Err(_) => return answer(&mut conn, "408 Request Timeout", "no request").await,
    };
    buf.drain(line);
    let mut inside = match connect_inside(netns.clone(), port).await {
        Ok(s) => s,
        Err(e) => {
            return answer(
                &mut conn,
                "502 Bad Gateway",
                &format!("nothing answers on port {port} in the sandbox ({e})"),
            )
            .await
        }
    };
    inside.write_all(&buf).await?;
    tokio::io::copy_bidirectional(&mut conn, &mut inside).await?;
    Ok(())
}

/// A connection to `127.0.0.1:port` in network namespace `netns`: its socket is made
/// by a thread of its own that enters the namespace (a socket stays in the namespace
/// it was made in) and ends; the connection is then made here.
async fn connect_inside(netns: Arc<OwnedFd>, port: u16) -> std::io::Result<TcpStream> {
    let fd = std::thread::Builder::new()
        .name("casfs-port-ns".into())
        .spawn(move || -> std::io::Result<OwnedFd> {
            rustix::thread::move_into_link_name_space(
                netns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )?;
            Ok(rustix::net::socket_with(
                rustix::net::AddressFamily::INET,
                rustix::net::SocketType::STREAM,
                rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
                None,
            )?)
        })?
        .join()
        .map_err(|_| {
            std::io::Error::other("the thread entering the sandbox's network panicked")
        })??;
    let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
    tokio::time::timeout(
        WAIT,
        socket.connect(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)),
    )
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_channels_token_opens_it_and_its_line_is_cut() {
        let t = "ab12";
        let req =
            b"GET /x HTTP/1.1\r\nHost: h\r\nX-Casfs-Port-Token: ab12\r\nAccept: */*\r\n\r\nrest";
        let Head::Allowed(line) = check_head(req, t) else {
            panic!("the right token was refused");
        };
        let mut v = req.to_vec();
        v.drain(line);
        assert_eq!(v, b"GET /x HTTP/1.1\r\nHost: h\r\nAccept: */*\r\n\r\nrest");
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
