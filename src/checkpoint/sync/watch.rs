//! The watcher: a process that follows a plain directory with inotify, so that a
//! re-capture looks only at the directories that changed (git's fsmonitor, watchman)
//! instead of stat-ing every entry.
//!
//! `casfs watch DIR` adds a watch to every directory of DIR and answers on a Unix
//! socket (`<store>/watch/<id>.sock`, 0600). A capture asks it what changed since the
//! token its last capture of DIR recorded in the directory cache; the watcher first
//! reads every event the kernel has queued (inotify queues an event before the system
//! call that caused it returns, so every change made before the question is in), then
//! answers with a new token and either the directories whose entries changed plus
//! the subtrees that appeared (created or moved in), or "look at everything".
//!
//! "Everything" is the answer whenever the watcher cannot vouch for its list: a
//! token from another watcher (restarted) or from before an event-queue overflow, a
//! tree holding hard-linked files (a write through one name is reported only in that
//! name's directory), a directory it could not watch, or a capture that recorded no
//! token. The capture then walks the whole tree with the stat cache, as without a
//! watcher. The token is recorded only by an unfiltered capture; every other writer
//! of the directory cache (a filtered capture, a restore) removes it.
//!
//! Not seen (as with every inotify-based monitor): writes through a shared memory
//! mapping, changes made through a hard link from outside DIR created after the
//! watcher started, and changes on network or FUSE filesystems (refused).

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use serde::{Deserialize, Serialize};

use crate::cas::Hash;
use crate::sys::dirfd;
use crate::sys::inotify::{Event, EventMask, Instance, WatchDescriptor, WatchMask, READ_BUFFER};
use crate::sys::line_socket::{ask_line, Timeouts};
use crate::sys::signal::Blocked;

/// What a capture recorded of the watcher's state when it asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Token {
    /// Random per watcher process: a token from another one means nothing.
    pub instance: u64,
    pub seq: u64,
}

impl Token {
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.instance.to_le_bytes());
        b[8..].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Token> {
        let b: &[u8; 16] = b.try_into().ok()?;
        Some(Token {
            instance: u64::from_le_bytes(b[..8].try_into().ok()?),
            seq: u64::from_le_bytes(b[8..].try_into().ok()?),
        })
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Question {
    since: Option<Token>,
}

/// The watcher's answer. Paths are relative to the watched directory ("" is the root).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Answer {
    /// Look at everything.
    Full { token: Token, why: String },
    Changes {
        token: Token,
        /// Directories whose entries changed (created, removed, renamed, written,
        /// attributes changed).
        dirs: Vec<Vec<u8>>,
        /// Directories that appeared: walk them whole.
        new: Vec<Vec<u8>>,
    },
}

impl Answer {
    pub fn token(&self) -> Token {
        match self {
            Answer::Full { token, .. } | Answer::Changes { token, .. } => *token,
        }
    }
}

/// What a capture may skip: every directory that is neither changed, nor new, nor an
/// ancestor of one, is as the directory cache holds it.
#[derive(Debug, Default)]
pub struct Changes {
    dirs: HashSet<Vec<u8>>,
    new: HashSet<Vec<u8>>,
    /// The changed and new directories and all their ancestors.
    touched: HashSet<Vec<u8>>,
}

fn ancestors(p: &[u8]) -> impl Iterator<Item = &[u8]> {
    let cuts = p
        .iter()
        .enumerate()
        .filter(|(_, c)| **c == b'/')
        .map(|(i, _)| i);
    std::iter::once(&p[..0])
        .chain(cuts.map(move |i| &p[..i]))
        .chain(std::iter::once(p))
}

impl Changes {
    pub fn new(dirs: Vec<Vec<u8>>, new: Vec<Vec<u8>>) -> Changes {
        let mut touched = HashSet::new();
        for p in dirs.iter().chain(new.iter()) {
            for a in ancestors(p) {
                touched.insert(a.to_vec());
            }
        }
        Changes {
            dirs: dirs.into_iter().collect(),
            new: new.into_iter().collect(),
            touched,
        }
    }

    /// Whether nothing at or below `rel` changed (nothing in a subtree that appeared
    /// counts as unchanged).
    pub fn untouched(&self, rel: &[u8]) -> bool {
        !self.touched.contains(rel) && !self.is_new(rel)
    }

    /// Whether the entries of `rel` itself may have changed.
    pub fn changed(&self, rel: &[u8]) -> bool {
        self.dirs.contains(rel) || self.is_new(rel)
    }

    /// Whether `rel` is in a subtree that appeared (nothing of it may be skipped).
    pub fn is_new(&self, rel: &[u8]) -> bool {
        ancestors(rel).any(|a| self.new.contains(a))
    }
}

/// The socket of the watcher of `root` (absolute, canonical) for the store at `store`.
pub fn socket_path(store: &Path, root: &Path) -> PathBuf {
    let id = Hash::of(root.as_os_str().as_bytes()).short(16);
    store.join("watch").join(format!("{id}.sock"))
}

/// Asks the watcher of `root`, if one runs, what changed since `since`. `None` when no
/// watcher answers (the capture then looks at everything).
pub fn ask(store: &Path, root: &Path, since: Option<Token>) -> Option<Answer> {
    let socket = socket_path(store, root);
    if !socket.exists() {
        return None;
    }
    let timeouts = Timeouts {
        read: Some(Duration::from_secs(30)),
        write: Some(Duration::from_secs(5)),
    };
    let r = ask_line(&socket, &Question { since }, timeouts)
        .map_err(|e| e.to_string())
        .and_then(|line| serde_json::from_str(&line).map_err(|e| e.to_string()));
    match r {
        Ok(a) => Some(a),
        Err(e) => {
            tracing::warn!(
                "the watcher of {} did not answer ({e}); looking at every file",
                root.display()
            );
            None
        }
    }
}

/// What is watched on every directory.
fn mask() -> WatchMask {
    WatchMask::MODIFY
        | WatchMask::ATTRIB
        | WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ONLYDIR
}

/// Filesystems whose changes can happen elsewhere, unseen by inotify.
const REMOTE_FS: &[i64] = &[
    0x6546_5546, // fuse
    0x6969,      // nfs
    0xFF53_4D42, // cifs
    0xFE53_4D42, // smb2
    0x0102_1997, // 9p
    0x00C3_6400, // ceph
];

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    if dir.is_empty() {
        return name.to_vec();
    }
    let mut v = dir.to_vec();
    v.push(b'/');
    v.extend_from_slice(name);
    v
}

fn parent(p: &[u8]) -> Option<&[u8]> {
    if p.is_empty() {
        return None;
    }
    Some(match p.iter().rposition(|c| *c == b'/') {
        Some(i) => &p[..i],
        None => &p[..0],
    })
}

/// The inotify state of one watched tree.
pub struct Watcher {
    root: PathBuf,
    inotify: Instance,
    instance: u64,
    /// The stamp of events read now; a token names the last stamp it covers.
    seq: u64,
    wds: HashMap<WatchDescriptor, Vec<u8>>,
    /// Directory -> stamp of its last change.
    dirs: HashMap<Vec<u8>, u64>,
    /// Directory that appeared -> stamp.
    new: HashMap<Vec<u8>, u64>,
    /// Events before this stamp may be lost (queue overflow, a directory not watched).
    lost_at: u64,
    lost_why: String,
    /// Hard-linked files are in the tree: every answer is "everything".
    hard_links: Option<String>,
    /// The watched directory itself was removed or moved: nothing is watched any more
    /// (a directory made again under its name is another one).
    root_gone: bool,
    /// Where events are read into.
    buf: Vec<u8>,
}

impl Watcher {
    /// Watches every directory under `root`.
    pub fn new(root: &Path) -> std::io::Result<Watcher> {
        let root = std::fs::canonicalize(root)?;
        let sfs = rustix::fs::statfs(&root)?;
        if REMOTE_FS.contains(&(sfs.f_type as i64)) {
            return Err(std::io::Error::other(format!(
                "{} is on a network or FUSE filesystem (type {:#x}), whose changes inotify \
                 does not see",
                root.display(),
                sfs.f_type
            )));
        }
        let inotify = Instance::new()?;
        let instance = {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let h = Hash::of(format!("{t}:{}", std::process::id()).as_bytes());
            u64::from_le_bytes(h.0[..8].try_into().expect("8 bytes"))
        };
        let mut w = Watcher {
            root,
            inotify,
            instance,
            seq: 1,
            wds: HashMap::new(),
            dirs: HashMap::new(),
            new: HashMap::new(),
            lost_at: 0,
            lost_why: String::new(),
            hard_links: None,
            root_gone: false,
            buf: vec![0u8; READ_BUFFER],
        };
        w.add_tree(b"");
        Ok(w)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directories watched.
    pub fn watched(&self) -> usize {
        self.wds.len()
    }

    fn abs(&self, rel: &[u8]) -> PathBuf {
        if rel.is_empty() {
            self.root.clone()
        } else {
            self.root.join(std::ffi::OsStr::from_bytes(rel))
        }
    }

    fn lose(&mut self, why: String) {
        tracing::warn!("{why}: the next capture looks at every file");
        self.lost_at = self.seq;
        self.lost_why = why;
    }

    /// Watches `rel` and every directory below it, noting hard-linked files. Each
    /// directory is opened beneath the root's handle (no link followed, never out of
    /// the root) and watched and listed through its descriptor.
    fn add_tree(&mut self, rel: &[u8]) {
        use std::os::fd::AsFd;
        let root = match dirfd::open_dir_path(&self.root) {
            Ok(r) => r,
            Err(e) => {
                self.lose(format!("cannot open {}: {e}", self.root.display()));
                return;
            }
        };
        let mut stack = vec![rel.to_vec()];
        while let Some(d) = stack.pop() {
            let abs = self.abs(&d);
            let dir = match dirfd::open_dir_beneath(root.as_fd(), &d) {
                Ok(f) => f,
                Err(e) => {
                    match e.raw_os_error() {
                        // Gone or replaced meanwhile: its parent's event says so.
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP) => {}
                        _ => self.lose(format!("cannot open {}: {e}", abs.display())),
                    }
                    continue;
                }
            };
            let wd = match self.inotify.watch_dir(dir.as_fd(), mask()) {
                Ok(wd) => wd,
                Err(e) => {
                    match e.raw_os_error() {
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) => {}
                        Some(libc::ENOSPC) => self.lose(format!(
                            "cannot watch {}: out of inotify watches \
                         (raise fs.inotify.max_user_watches)",
                            abs.display()
                        )),
                        _ => self.lose(format!("cannot watch {}: {e}", abs.display())),
                    }
                    continue;
                }
            };
            self.wds.insert(wd, d.clone());
            let entries = match dirfd::list_dir_typed(dir.as_fd()) {
                Ok(e) => e,
                Err(e) => {
                    self.lose(format!("cannot list {}: {e}", abs.display()));
                    continue;
                }
            };
            for (name, _) in entries {
                let Ok(c) = CString::new(name.clone()) else {
                    continue;
                };
                let Ok(Some(m)) = dirfd::lstat_at(dir.as_fd(), &c) else {
                    continue;
                };
                let child = join(&d, &name);
                if m.is_dir() {
                    stack.push(child);
                } else if m.is_file() {
                    self.note_links(&child, &m);
                }
            }
        }
    }

    /// The metadata of entry `name` of directory `dir` (below the root), looked up
    /// beneath the root's handle, no link followed.
    fn lstat(&self, dir: &[u8], name: &[u8]) -> Option<dirfd::Meta> {
        use std::os::fd::AsFd;
        let root = dirfd::open_dir_path(&self.root).ok()?;
        let d = dirfd::open_dir_beneath(root.as_fd(), dir).ok()?;
        dirfd::lstat_at(d.as_fd(), &CString::new(name).ok()?).ok()?
    }

    /// A regular file with more than one name makes every answer "everything".
    fn note_links(&mut self, rel: &[u8], m: &dirfd::Meta) {
        if self.hard_links.is_some() {
            return;
        }
        if m.is_file() && m.nlink > 1 {
            self.hard_links = Some(format!(
                "{} has {} hard links",
                self.abs(rel).display(),
                m.nlink
            ));
        }
    }

    /// Stops watching `rel` and everything below it (removed or moved away; a move
    /// within the tree watches it again under its new name).
    fn drop_tree(&mut self, rel: &[u8]) {
        let gone: Vec<WatchDescriptor> = self
            .wds
            .iter()
            .filter(|(_, p)| {
                p.as_slice() == rel || (p.starts_with(rel) && p.get(rel.len()) == Some(&b'/'))
            })
            .map(|(wd, _)| wd.clone())
            .collect();
        for wd in gone {
            self.wds.remove(&wd);
            self.inotify.unwatch(wd);
        }
    }

    fn mark(&mut self, dir: &[u8]) {
        self.dirs.insert(dir.to_vec(), self.seq);
    }

    fn event(&mut self, e: Event<'_>) {
        let (wd, mask, name) = match e {
            Event::Overflow => {
                self.lose("the inotify event queue overflowed".into());
                return;
            }
            Event::Watched { wd, mask, name, .. } => (wd, mask, name),
        };
        let Some(dir) = self.wds.get(&wd).cloned() else {
            return;
        };
        if mask.contains(EventMask::IGNORED) {
            self.wds.remove(&wd);
            if dir.is_empty() {
                self.root_gone = true;
            }
            return;
        }
        let Some(name) = name else {
            // The directory itself: its entry in its parent changed too.
            self.mark(&dir);
            if let Some(p) = parent(&dir) {
                let p = p.to_vec();
                self.mark(&p);
            } else if mask.intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF) {
                self.root_gone = true;
            }
            return;
        };
        self.mark(&dir);
        let child = join(&dir, name);
        if mask.contains(EventMask::ISDIR) {
            if mask.intersects(EventMask::MOVED_FROM | EventMask::DELETE) {
                self.drop_tree(&child);
            }
            if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
                // Marked before its watches exist: whatever happens in it before then
                // is found by walking it whole.
                self.new.insert(child.clone(), self.seq);
                self.add_tree(&child);
            }
        } else if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
            if let Some(m) = self.lstat(&dir, name) {
                self.note_links(&child, &m);
            }
        }
    }

    /// Reads every queued event.
    pub fn drain(&mut self) -> std::io::Result<()> {
        // The buffer is taken out while events are handled (they change `self`).
        let mut buf = std::mem::take(&mut self.buf);
        let r = self.drain_with(&mut buf);
        self.buf = buf;
        r
    }

    fn drain_with(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        while let Some(events) = self.inotify.read(buf)? {
            for e in events {
                self.event(e);
            }
        }
        Ok(())
    }

    /// Reads every queued event and answers a capture that last asked at `since`.
    pub fn answer(&mut self, since: Option<Token>) -> std::io::Result<Answer> {
        self.drain()?;
        let token = Token {
            instance: self.instance,
            seq: self.seq,
        };
        // Events read from now on come after this answer.
        self.seq += 1;
        let full = |why: &str| Answer::Full {
            token,
            why: why.to_string(),
        };
        let since = match since {
            None => return Ok(full("no earlier capture recorded a token")),
            Some(s) if s.instance != self.instance => {
                return Ok(full("the token is from another watcher"))
            }
            Some(s) => s.seq,
        };
        if self.root_gone {
            return Ok(full(&format!(
                "{} was removed or moved away",
                self.root.display()
            )));
        }
        if let Some(why) = &self.hard_links {
            return Ok(full(why));
        }
        if self.lost_at > since {
            return Ok(full(&self.lost_why.clone()));
        }
        let after = |m: &HashMap<Vec<u8>, u64>| {
            m.iter()
                .filter(|(_, s)| **s > since)
                .map(|(p, _)| p.clone())
                .collect::<Vec<_>>()
        };
        Ok(Answer::Changes {
            token,
            dirs: after(&self.dirs),
            new: after(&self.new),
        })
    }
}

/// Watches `root` and answers captures on the socket for `store` until SIGINT or
/// SIGTERM (or the root goes away). `ready` runs once the watches are in place and
/// the socket listens.
pub fn serve(store: &Path, root: &Path, ready: impl FnOnce(&Watcher)) -> std::io::Result<()> {
    let mut w = Watcher::new(root)?;
    let socket = socket_path(store, w.root());
    let dir = socket.parent().expect("socket in a directory");
    std::fs::create_dir_all(dir)?;
    if let Ok(s) = UnixStream::connect(&socket) {
        drop(s);
        return Err(std::io::Error::other(format!(
            "{} is already watched (socket {})",
            w.root().display(),
            socket.display()
        )));
    }
    let listener = crate::bind_private_socket(&socket)?;
    listener.set_nonblocking(true)?;
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _cleanup = Cleanup(socket);

    // SIGINT and SIGTERM (and SIGHUP) arrive through a signalfd polled with the rest.
    let signals = Blocked::block(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP]);
    let sfd = signals.fd()?;
    ready(&w);
    loop {
        let mut fds = [
            PollFd::new(&w.inotify, PollFlags::IN),
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(&sfd, PollFlags::IN),
        ];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let [events, conns, signalled] = fds.map(|f| !f.revents().is_empty());
        if signalled {
            tracing::info!("stopping the watcher of {}", w.root().display());
            return Ok(());
        }
        if events {
            w.drain()?;
        }
        if conns {
            while let Ok((conn, _)) = listener.accept() {
                if let Err(e) = reply(&mut w, conn) {
                    tracing::warn!("a capture's question went unanswered: {e}");
                }
            }
        }
        if w.root_gone {
            return Err(std::io::Error::other(format!(
                "{} was removed or moved away: stopping",
                w.root().display()
            )));
        }
    }
}

fn reply(w: &mut Watcher, conn: UnixStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let q: Question = serde_json::from_str(&line)
        .map_err(|e| std::io::Error::other(format!("not a question: {e}")))?;
    let a = w.answer(q.since)?;
    let mut out = serde_json::to_vec(&a)?;
    out.push(b'\n');
    (&conn).write_all(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_cover_the_root_and_every_prefix() {
        let a: Vec<&[u8]> = ancestors(b"a/b/c").collect();
        assert_eq!(a, vec![&b""[..], b"a", b"a/b", b"a/b/c"]);
        let c = Changes::new(vec![b"a/b".to_vec()], vec![b"x".to_vec()]);
        assert!(!c.untouched(b""));
        assert!(!c.untouched(b"a"));
        assert!(c.untouched(b"a/c"));
        assert!(c.changed(b"a/b"));
        assert!(!c.changed(b"a"));
        assert!(c.is_new(b"x/y/z"));
        assert!(!c.untouched(b"x/y"));
        assert!(!c.is_new(b"xy"));
        assert_eq!(parent(b"a/b"), Some(&b"a"[..]));
        assert_eq!(parent(b"a"), Some(&b""[..]));
        assert_eq!(parent(b""), None);
        let t = Token {
            instance: 7,
            seq: 9,
        };
        assert_eq!(Token::decode(&t.encode()), Some(t));
        assert_eq!(Token::decode(b"short"), None);
    }

    #[test]
    fn answers_name_what_changed_since_the_token() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::create_dir_all(d.path().join("c")).unwrap();
        std::fs::write(d.path().join("a/b/f"), b"1").unwrap();
        let mut w = Watcher::new(d.path()).unwrap();
        assert_eq!(w.watched(), 4);
        let first = w.answer(None).unwrap();
        assert!(matches!(first, Answer::Full { .. }));
        let t = first.token();
        std::fs::write(d.path().join("a/b/f"), b"2").unwrap();
        std::fs::create_dir_all(d.path().join("c/new/deep")).unwrap();
        let a = w.answer(Some(t)).unwrap();
        let Answer::Changes { token, dirs, new } = &a else {
            panic!("{a:?}")
        };
        let mut dirs = dirs.clone();
        dirs.sort();
        assert_eq!(dirs, vec![b"a/b".to_vec(), b"c".to_vec()]);
        assert_eq!(new, &vec![b"c/new".to_vec()]);
        // Nothing since: nothing changed; the new subtree is watched now.
        let a = w.answer(Some(*token)).unwrap();
        assert!(
            matches!(&a, Answer::Changes { dirs, new, .. } if dirs.is_empty() && new.is_empty())
        );
        std::fs::write(d.path().join("c/new/deep/g"), b"x").unwrap();
        let b = w.answer(Some(a.token())).unwrap();
        assert!(
            matches!(&b, Answer::Changes { dirs, .. } if dirs == &vec![b"c/new/deep".to_vec()])
        );
        // A token from another watcher, and a hard link, mean "everything".
        let other = Token {
            instance: t.instance ^ 1,
            seq: 1,
        };
        assert!(matches!(
            w.answer(Some(other)).unwrap(),
            Answer::Full { .. }
        ));
        std::fs::hard_link(d.path().join("a/b/f"), d.path().join("c/f2")).unwrap();
        let c = w.answer(Some(b.token())).unwrap();
        assert!(
            matches!(&c, Answer::Full { why, .. } if why.contains("hard links")),
            "{c:?}"
        );
        // The root moved away and another directory made under its name: nothing of
        // the new one is watched, so every answer is "everything".
        let moved = d.path().with_extension("moved");
        std::fs::rename(d.path(), &moved).unwrap();
        std::fs::create_dir(d.path()).unwrap();
        let e = w.answer(Some(c.token())).unwrap();
        assert!(
            matches!(&e, Answer::Full { why, .. } if why.contains("moved away")),
            "{e:?}"
        );
        std::fs::remove_dir(d.path()).unwrap();
        std::fs::rename(&moved, d.path()).unwrap();
    }
}
