//! The only way out of a sandbox without the host's network: an HTTP proxy that the
//! server runs inside the sandbox's own network namespace (`127.0.0.1:3128` there, the
//! sandbox's `HTTP_PROXY` and `HTTPS_PROXY`), letting through only destinations on the
//! server's allow-list (`--sandbox-allow`). Anything else has no route: the namespace
//! holds only loopback, so a program that ignores the proxy reaches nothing.
//!
//! The listening socket is made by a thread that enters the sandbox's network namespace
//! (its init passes it at start) and leaves again; the connections out are the
//! server's own, in the host's namespace. `CONNECT host:port` (HTTPS, any TLS or TCP
//! protocol) and plain `http://` requests in absolute form are served; every other
//! request, and every destination not on the list, is answered 403 and logged. A name
//! on the list that resolves to an address off the public internet (loopback, private,
//! link-local, shared or reserved ranges) or to one of the host's own is refused (a
//! name made to point at the host's or its network's services): only an address
//! written on the list as itself reaches one. A plain `http://` request goes out with
//! `Host` the authority checked, `Connection: close` and no `Proxy-*` header.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Where the proxy listens inside a sandbox.
pub const PORT: u16 = 3128;

/// The most connections one sandbox's proxy serves at once (more wait for a slot).
pub(super) const MAX_CONNECTIONS: usize = 256;

/// The longest request head read before the destination is known.
pub(super) const MAX_HEAD: usize = 16 << 10;

/// How long a client may take to send its request head, and the proxy to connect.
pub(super) const WAIT: Duration = Duration::from_secs(10);

/// A destination the sandboxes may reach: a host name (`example.com`), every name under
/// a domain (`*.example.com`), or an address (`192.0.2.1`, `[2001:db8::1]`); with a
/// port, only that port, else 80 and 443.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowed {
    host: String,
    port: Option<u16>,
}

impl std::str::FromStr for Allowed {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{s:?}: {why} (give HOST, *.DOMAIN or ADDRESS, and :PORT)");
        let (host, port) = match s.strip_prefix('[') {
            Some(rest) => {
                let (h, after) = rest.split_once(']').ok_or_else(|| bad("no closing ]"))?;
                (h, after.strip_prefix(':'))
            }
            None => match s.rsplit_once(':') {
                Some((h, p)) if !h.contains(':') => (h, Some(p)),
                _ => (s, None),
            },
        };
        let port = match port {
            Some(p) => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| bad("a port is 1 to 65535"))?,
            ),
            None => None,
        };
        let host = host.to_ascii_lowercase();
        let name = host.strip_prefix("*.").unwrap_or(&host);
        let ok = host.parse::<IpAddr>().is_ok()
            || (!name.is_empty()
                && name.len() <= 253
                && name.split('.').all(|l| {
                    !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                }));
        if !ok {
            return Err(bad("not a host name or address"));
        }
        Ok(Allowed { host, port })
    }
}

impl std::fmt::Display for Allowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v6 = self.host.contains(':');
        match (v6, self.port) {
            (true, Some(p)) => write!(f, "[{}]:{p}", self.host),
            (false, Some(p)) => write!(f, "{}:{p}", self.host),
            _ => f.write_str(&self.host),
        }
    }
}

impl Allowed {
    fn matches(&self, host: &str, port: u16) -> bool {
        let port_ok = match self.port {
            Some(p) => p == port,
            None => port == 80 || port == 443,
        };
        let host_ok = match self.host.strip_prefix("*.") {
            Some(domain) => host.len() > domain.len() + 1 && host.ends_with(&format!(".{domain}")),
            None => host == self.host,
        };
        port_ok && host_ok
    }

    /// Whether every destination `other` lets through this entry lets through too (a
    /// sandbox's own list may only narrow the server's).
    pub fn covers(&self, other: &Allowed) -> bool {
        let ports_ok = match (self.port, other.port) {
            (None, None) => true,
            (None, Some(p)) => p == 80 || p == 443,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        let hosts_ok = match self.host.strip_prefix("*.") {
            None => self.host == other.host,
            // `*.d` covers `x.d`, `*.x.d` and `*.d`, never `d` itself.
            Some(d) => {
                let o = other.host.strip_prefix("*.").unwrap_or(&other.host);
                o == d && other.host.starts_with("*.") || o.ends_with(&format!(".{d}"))
            }
        };
        ports_ok && hosts_ok
    }

    /// Whether this entry names `host` as an address literally.
    fn is_address(&self) -> bool {
        self.host.parse::<IpAddr>().is_ok()
    }
}

/// An address a name must not lead to: any that is not the public internet's (the
/// host's loopback, private networks, link-local, shared and reserved ranges, metadata
/// services on them) or that is one of the host's own.
fn inward(ip: IpAddr) -> bool {
    let v4 = |a: std::net::Ipv4Addr| {
        let o = a.octets();
        a.is_loopback()
            || a.is_private()
            || a.is_link_local()
            || a.is_unspecified()
            || a.is_broadcast()
            || a.is_multicast()
            || o[0] == 0
            || (o[0] == 100 && (o[1] & 0xc0) == 64)
            || (o[0] == 192 && o[1] == 0 && o[2] == 0)
            || o[0] >= 240
    };
    let outside = match ip {
        IpAddr::V4(a) => v4(a),
        IpAddr::V6(a) => {
            let s = a.segments();
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || a.to_ipv4_mapped().is_some_and(v4)
                // NAT64 carries an IPv4 address in its last 32 bits.
                || (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
                    && v4(std::net::Ipv4Addr::new(
                        (s[6] >> 8) as u8,
                        s[6] as u8,
                        (s[7] >> 8) as u8,
                        s[7] as u8,
                    )))
        }
    };
    outside || host_addresses().contains(&ip)
}

/// The addresses of the host's own interfaces (where a connection lands on the host).
fn host_addresses() -> Vec<IpAddr> {
    crate::sys::interfaces::addresses().unwrap_or_default()
}

/// `f` run in network namespace `netns`, by a thread of its own that enters it and
/// ends (a socket `f` makes stays in the namespace it was made in). Blocks: async code
/// calls it through `spawn_blocking`.
pub(super) fn in_netns<T: Send>(
    netns: &OwnedFd,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("casfs-netns".into())
            .spawn_scoped(s, || {
                rustix::thread::move_into_link_name_space(
                    std::os::fd::AsFd::as_fd(netns),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                f()
            })?
            .join()
            .map_err(|_| io::Error::other("the thread entering the sandbox's network panicked"))?
    })
}

/// Starts the proxy of sandbox `key` in the network namespace `netns`, on the server's
/// runtime; it runs until the handle is aborted (the sandbox ends).
pub fn start(
    netns: OwnedFd,
    allow: Arc<[Allowed]>,
    key: String,
) -> io::Result<tokio::task::AbortHandle> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| io::Error::other(format!("no runtime to run the proxy on: {e}")))?;
    let listener = in_netns(&netns, || {
        let l = std::net::TcpListener::bind(("127.0.0.1", PORT))?;
        l.set_nonblocking(true)?;
        Ok(l)
    })?;
    let _in = runtime.enter();
    let listener = TcpListener::from_std(listener)?;
    Ok(runtime.spawn(serve(listener, allow, key)).abort_handle())
}

/// The most proxy connections of all sandboxes together.
const MAX_ALL_CONNECTIONS: usize = 4096;
static ALL: Semaphore = Semaphore::const_new(MAX_ALL_CONNECTIONS);

async fn serve(listener: TcpListener, allow: Arc<[Allowed]>, key: String) {
    let k = key.clone();
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    accept_loop(listener, "proxy", key, slots, &ALL, move |conn| {
        let (allow, key) = (allow.clone(), k.clone());
        async move { relay(conn, &allow, &key).await }
    })
    .await
}

/// Accepts connections on `listener` until this task is aborted (its sandbox ended),
/// each handled by `handle` on a task of its own, aborted with this one: at most
/// `slots` at once (the listener's own, or its sandbox's: more wait for one), and a
/// connection that finds none of `all` (shared by every sandbox's listeners of one
/// kind) left is closed at once, so that an idle listener holds none of it and one
/// sandbox's connections cannot make every other sandbox's wait.
pub(super) async fn accept_loop<F, Fut>(
    listener: TcpListener,
    what: &str,
    key: String,
    slots: Arc<Semaphore>,
    all: &'static Semaphore,
    handle: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: std::future::Future<Output = io::Result<()>> + Send + 'static,
{
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let conn = match listener.accept().await {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!(sandbox = %key, "{what}: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(shared) = all.try_acquire() else {
            tracing::warn!(sandbox = %key, "{what}: every sandbox's connections are taken");
            continue;
        };
        let job = handle(conn);
        let (what, key) = (what.to_string(), key.clone());
        conns.spawn(async move {
            if let Err(e) = job.await {
                tracing::debug!(sandbox = %key, "{what}: {e}");
            }
            drop(permit);
            drop(shared);
        });
    }
}

/// Answers `status` with `msg` and closes the connection.
pub(super) async fn refuse(conn: &mut TcpStream, status: &str, msg: &str) -> io::Result<()> {
    let body = format!("casfs: {msg}\n");
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await?;
    conn.shutdown().await
}

/// Splits `authority` (`host:port`, `[v6]:port`, or a bare host with `default`).
fn host_port(authority: &str, default: Option<u16>) -> Option<(String, u16)> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (h, after) = rest.split_once(']')?;
            (h, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default?,
    };
    (!host.is_empty()).then(|| (host.to_ascii_lowercase(), port))
}

async fn relay(mut conn: TcpStream, allow: &[Allowed], key: &str) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    let end = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                return Ok(Some(i + 4));
            }
            if buf.len() >= MAX_HEAD {
                return Ok(None);
            }
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before a request",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no request head in time"))??;
    let Some(end) = end else {
        return refuse(
            &mut conn,
            "431 Request Header Fields Too Large",
            "the request head is too long",
        )
        .await;
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let rest = buf[end..].to_vec();
    let first = head.lines().next().unwrap_or_default();
    let mut words = first.split_whitespace();
    let (method, target, version) = match (words.next(), words.next(), words.next()) {
        (Some(m), Some(t), Some(v)) => (m, t, v),
        _ => return refuse(&mut conn, "400 Bad Request", "not an HTTP request").await,
    };
    let connect = method.eq_ignore_ascii_case("CONNECT");
    let (authority, forward) = if connect {
        (target.to_string(), None)
    } else {
        let Some(after) = target
            .get(..7)
            .filter(|s| s.eq_ignore_ascii_case("http://"))
            .map(|_| &target[7..])
        else {
            return refuse(
                &mut conn,
                "400 Bad Request",
                "give the proxy CONNECT host:port or an absolute http:// URL",
            )
            .await;
        };
        let (authority, path) = match after.find(['/', '?']) {
            Some(i) => (&after[..i], &after[i..]),
            None => (after, "/"),
        };
        let path = if path.starts_with('?') {
            format!("/{path}")
        } else {
            path.to_string()
        };
        // The request as the origin takes it: its path, `Host` the authority checked
        // (not one the client wrote), one request per connection, nothing for proxies.
        let host = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
        let mut out = format!("{method} {path} {version}\r\nHost: {host}\r\nConnection: close\r\n");
        for line in head[first.len()..].split("\r\n").filter(|l| !l.is_empty()) {
            let name = line
                .split(':')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase();
            if !matches!(name.as_str(), "host" | "connection" | "keep-alive")
                && !name.starts_with("proxy-")
            {
                out.push_str(line);
                out.push_str("\r\n");
            }
        }
        out.push_str("\r\n");
        (authority.to_string(), Some(out))
    };
    let authority = authority
        .rsplit_once('@')
        .map_or(authority.as_str(), |(_, a)| a);
    let Some((host, port)) = host_port(authority, if connect { None } else { Some(80) }) else {
        return refuse(
            &mut conn,
            "400 Bad Request",
            &format!("no host and port in {target:?}"),
        )
        .await;
    };
    let Some(entry) = allow.iter().find(|a| a.matches(&host, port)) else {
        tracing::info!(sandbox = %key, "proxy: refused {host}:{port} (not on the allow-list)");
        return refuse(
            &mut conn,
            "403 Forbidden",
            &format!("{host}:{port} is not on this sandbox's network allow-list"),
        )
        .await;
    };
    let addrs: Vec<SocketAddr> =
        match tokio::time::timeout(WAIT, tokio::net::lookup_host((host.as_str(), port))).await {
            Ok(Ok(a)) => a
                .filter(|a| entry.is_address() || !inward(a.ip()))
                .collect(),
            _ => Vec::new(),
        };
    if addrs.is_empty() {
        return refuse(
            &mut conn,
            "502 Bad Gateway",
            &format!("{host}:{port} has no address the proxy may reach"),
        )
        .await;
    }
    let mut upstream = None;
    for a in &addrs {
        if let Ok(Ok(s)) = tokio::time::timeout(WAIT, TcpStream::connect(a)).await {
            upstream = Some(s);
            break;
        }
    }
    let Some(mut upstream) = upstream else {
        return refuse(
            &mut conn,
            "502 Bad Gateway",
            &format!("{host}:{port} did not answer"),
        )
        .await;
    };
    match forward {
        None => {
            conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await?
        }
        Some(h) => upstream.write_all(h.as_bytes()).await?,
    }
    upstream.write_all(&rest).await?;
    tokio::io::copy_bidirectional(&mut conn, &mut upstream).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_and_match_as_written() {
        let a: Allowed = "Example.com".parse().unwrap();
        assert!(a.matches("example.com", 443) && a.matches("example.com", 80));
        assert!(!a.matches("example.com", 22) && !a.matches("x.example.com", 443));
        let w: Allowed = "*.example.com:8443".parse().unwrap();
        assert!(w.matches("a.b.example.com", 8443));
        assert!(!w.matches("example.com", 8443) && !w.matches("a.example.com", 443));
        assert!(!w.matches("badexample.com", 8443));
        let v6: Allowed = "[2001:db8::1]:22".parse().unwrap();
        assert!(v6.matches("2001:db8::1", 22) && v6.is_address());
        assert_eq!(v6.to_string(), "[2001:db8::1]:22");
        let p = |s: &str| s.parse::<Allowed>().unwrap();
        assert!(p("*.example.com").covers(&p("api.example.com:443")));
        assert!(p("*.example.com").covers(&p("*.api.example.com")));
        assert!(p("*.example.com").covers(&p("*.example.com")));
        assert!(!p("*.example.com").covers(&p("example.com")));
        assert!(!p("*.example.com").covers(&p("api.example.com:22")));
        assert!(p("example.com:8080").covers(&p("example.com:8080")));
        assert!(!p("example.com:8080").covers(&p("example.com")));
        assert!(!p("example.com").covers(&p("*.example.com")));
        for bad in ["", "a b", "x:0", "x:99999", "[::1", "*.", "a..b"] {
            assert!(bad.parse::<Allowed>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_never_lead_inward() {
        for ip in [
            "127.0.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "169.254.169.254",
            "10.0.0.1",
            "172.17.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "64:ff9b::7f00:1",
        ] {
            assert!(inward(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["93.184.216.34", "2606:4700::1111", "64:ff9b::5db8:d822"] {
            assert!(!inward(ip.parse().unwrap()), "{ip}");
        }
        // The host's own addresses, whatever they are.
        for ip in host_addresses() {
            assert!(inward(ip), "{ip}");
        }
        assert_eq!(host_port("[::1]:80", None), Some(("::1".into(), 80)));
        assert_eq!(
            host_port("Example.com", Some(80)),
            Some(("example.com".into(), 80))
        );
        assert_eq!(host_port("example.com", None), None);
    }
}
