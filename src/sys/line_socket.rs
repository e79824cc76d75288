//! The client end of casfs's local line protocols: one JSON line to a Unix socket, one
//! line back (a mount's control socket, a directory watcher's socket).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

/// Why a question went unanswered.
#[derive(Debug)]
pub enum AskError {
    /// Nothing answers at the socket (it could not be connected to).
    Connect(std::io::Error),
    /// Connected, but the question could not be sent or its answer read.
    Io(std::io::Error),
}

impl std::fmt::Display for AskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskError::Connect(e) | AskError::Io(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for AskError {}

/// How long a question may take to send (`write`) and to be answered (`read`); `None`:
/// without end.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timeouts {
    pub read: Option<Duration>,
    pub write: Option<Duration>,
}

/// Sends `question` as one JSON line to the socket at `socket` and reads one line back
/// (its newline included, as sent).
pub fn ask_line<Q: Serialize + ?Sized>(
    socket: &Path,
    question: &Q,
    timeouts: Timeouts,
) -> Result<String, AskError> {
    let s = UnixStream::connect(socket).map_err(AskError::Connect)?;
    let r = (|| -> std::io::Result<String> {
        s.set_read_timeout(timeouts.read)?;
        s.set_write_timeout(timeouts.write)?;
        let mut line = serde_json::to_vec(question).map_err(std::io::Error::other)?;
        line.push(b'\n');
        (&s).write_all(&line)?;
        let mut answer = String::new();
        BufReader::new(&s).read_line(&mut answer)?;
        Ok(answer)
    })();
    r.map_err(AskError::Io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_out_and_a_line_back() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (c, _) = l.accept().unwrap();
            let mut q = String::new();
            BufReader::new(&c).read_line(&mut q).unwrap();
            (&c).write_all(b"{\"ok\":true}\n").unwrap();
            q
        });
        let a = ask_line(&path, &[1, 2], Timeouts::default()).unwrap();
        assert_eq!(a, "{\"ok\":true}\n");
        assert_eq!(server.join().unwrap(), "[1,2]\n");
        assert!(matches!(
            ask_line(&d.path().join("none"), &(), Timeouts::default()),
            Err(AskError::Connect(_))
        ));
    }
}
