//! An accepted connection's bytes, as hyper and the connection caps both see them: the
//! socket ([`Stream`], Unix or TCP), the bounds on a request head hyper is given, and
//! a [`Refusal`], the API's JSON error written raw as a whole HTTP answer (a head
//! hyper refused, a connection beyond a cap).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The longest request head read (request line and headers).
pub const MAX_HEAD: usize = 64 << 10;
/// The most header lines in a head.
pub(super) const MAX_HEADERS: usize = 100;

/// One accepted socket.
pub enum Stream {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

impl Stream {
    /// Waits until the client has sent a byte, or closed its side (tokio's readiness
    /// alone may come first: the byte is peeked at).
    pub(super) async fn first_byte(&self) -> io::Result<()> {
        use rustix::net::RecvFlags;
        let peek = |fd: std::os::fd::BorrowedFd<'_>| {
            rustix::net::recv(fd, &mut [0u8; 1][..], RecvFlags::PEEK | RecvFlags::DONTWAIT)
                .map(drop)
                .map_err(io::Error::from)
        };
        let interest = tokio::io::Interest::READABLE;
        loop {
            let peeked = match self {
                Stream::Unix(s) => {
                    s.readable().await?;
                    s.try_io(interest, || peek(std::os::fd::AsFd::as_fd(s)))
                }
                Stream::Tcp(s) => {
                    s.readable().await?;
                    s.try_io(interest, || peek(std::os::fd::AsFd::as_fd(s)))
                }
            };
            match peeked {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
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

/// A head refused: its status and the API's error kind and message.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

impl Refusal {
    pub(super) fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Refusal {
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

impl Refusal {
    /// The API's error for a head hyper refused with `status`.
    pub(super) fn of_hyper(status: u16) -> Refusal {
        match status {
            431 => Refusal::new(
                431,
                "headers_too_large",
                format!(
                    "the request head is over {} KiB or has over {MAX_HEADERS} header lines",
                    MAX_HEAD >> 10
                ),
            ),
            414 => Refusal::new(414, "uri_too_long", "the request target is too long"),
            s => Refusal::new(
                s,
                "invalid",
                "not a well-formed HTTP/1.1 request head (the request line, a header, \
                 Content-Length or Transfer-Encoding); percent-encode every byte of the \
                 target that is not ASCII",
            ),
        }
    }
}
