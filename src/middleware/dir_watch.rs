//! File events of plain-directory and overlay sandboxes from inotify, through one
//! instance (`sys::inotify`) for the whole process. The kernel allows a user 128
//! instances by default (`fs.inotify.max_user_instances`): an instance per sandbox
//! refused the 129th live sandbox ("Too many open files"), which `casfs serve` reaches
//! with its default limits. Every directory below a watched root is watched (links not
//! followed), a directory made or moved in as soon as its event is read; events are
//! routed to each watch by its root.
//!
//! A file closed after writing is a modify, a rename seen from both sides is a rename,
//! one moved in from outside is a create. (inotify watches a new subdirectory only once
//! it sees it created: what is written into it before that is announced by looking into
//! it, see [`announce_contents`].) One instance has one queue, in order, and inotify
//! queues an event before the call that caused it returns: a drain's marker file, once
//! reported, follows every change made before it in its sandbox.

use crate::sys::Locked;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Mutex, OnceLock};

use crate::fs::{FsEvent, FsEventKind};
use crate::sys::dirfd;
use crate::sys::inotify::{self, Event, EventMask, Instance, WatchDescriptor, WatchMask};

/// Names of the files a drain makes (and removes) to know that inotify has handed
/// over everything before them; never numbered, never reported.
pub(super) const MARKER_PREFIX: &str = ".casfs-drain-";

/// What is watched on every directory: what makes an event below.
fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::CLOSE_WRITE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ONLYDIR
}

/// One watch: events under `root`, numbered from 1, sent to `tx`.
struct Route {
    id: u64,
    root: PathBuf,
    tx: Sender<FsEvent>,
    seq: u64,
    /// The cookie of a rename whose source side came, waiting for its other side.
    pending_from: Option<u32>,
}

/// An inotify event as the routes take it.
enum Kind {
    Create {
        dir: bool,
    },
    CloseWrite,
    Remove {
        dir: bool,
    },
    /// The source side of a rename (its cookie).
    From(u32),
    /// The target side of a rename (its cookie).
    To(u32),
    /// Both sides of a rename: from the first path to the second.
    Both,
}

struct State {
    inotify: Instance,
    next_id: u64,
    routes: Vec<Route>,
    /// Each watch's directory, and each watched directory's watch.
    paths: HashMap<WatchDescriptor, PathBuf>,
    watches: HashMap<PathBuf, WatchDescriptor>,
    /// The source side of the last rename read (its cookie and path).
    rename_from: Option<(u32, PathBuf)>,
}

fn shared() -> Result<&'static Mutex<State>, String> {
    static SHARED: OnceLock<Result<Mutex<State>, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let inotify = Instance::new().map_err(|e| format!("starting inotify: {e}"))?;
            let fd = inotify.as_raw_fd();
            std::thread::Builder::new()
                .name("casfs-dir-watch".into())
                .spawn(move || read_forever(fd))
                .map_err(|e| format!("starting inotify's reader: {e}"))?;
            Ok(Mutex::new(State {
                inotify,
                next_id: 0,
                routes: Vec::new(),
                paths: HashMap::new(),
                watches: HashMap::new(),
                rename_from: None,
            }))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The reader: waits for events and routes them as they come.
fn read_forever(fd: std::os::fd::RawFd) {
    loop {
        if !inotify::wait(fd, -1) {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        if let Ok(s) = shared() {
            s.locked().drain();
        }
    }
}

/// Starts the process's inotify instances now rather than at the first watch (a server
/// then holds their descriptors from the start: its resting count): this module's, and
/// the overlay uppers' (`crate::mount::overlay`).
pub fn start_inotify() -> Result<(), String> {
    crate::mount::overlay::start_upper_watch();
    shared().map(|_| ())
}

/// A directory watched for a run: its route goes (and the kernel's watches, unless
/// another watch of the same root remains) when dropped.
pub(crate) struct DirWatch {
    id: u64,
    root: PathBuf,
}

/// Watches `root` recursively; its changes are sent to `tx`.
pub(crate) fn watch_dir(root: &Path, tx: Sender<FsEvent>) -> Result<DirWatch, String> {
    let mut st = shared()?.locked();
    st.next_id += 1;
    let id = st.next_id;
    st.routes.push(Route {
        id,
        root: root.to_path_buf(),
        tx,
        seq: 0,
        pending_from: None,
    });
    // Watched again even if another watch has the same root: a sandbox mounted anew
    // since (a new overlay over the same path) is another directory to the kernel, and
    // the old watch stays on the old one. The same directory watched twice is one
    // watch (inotify gives back the descriptor it has).
    if let Err(e) = st.watch_tree(root, b"") {
        st.routes.retain(|x| x.id != id);
        return Err(format!("watching {}: {e}", root.display()));
    }
    Ok(DirWatch {
        id,
        root: root.to_path_buf(),
    })
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        let Ok(s) = shared() else { return };
        let mut st = s.locked();
        st.routes.retain(|x| x.id != self.id);
        if !st.routes.iter().any(|x| x.root == self.root) {
            // Gone already when the sandbox was unmounted or removed.
            st.unwatch_tree(&self.root);
        }
    }
}

impl State {
    /// Watches directory `top` below the watched root `root` (`b""`: the root itself)
    /// and every directory below it, each opened beneath the root's handle (no link
    /// followed, never out of the root) and watched through its descriptor. Only `top`
    /// itself, and running out of watches, are errors: what is gone meanwhile is passed
    /// over.
    fn watch_tree(&mut self, root: &Path, top: &[u8]) -> std::io::Result<()> {
        let handle = dirfd::open_dir_path(root)?;
        let mut stack: Vec<Vec<u8>> = vec![top.to_vec()];
        while let Some(rel) = stack.pop() {
            let dir = match dirfd::open_dir_beneath(handle.as_fd(), &rel) {
                Ok(d) => d,
                Err(e) if rel == top => return Err(e),
                Err(_) => continue,
            };
            let wd = match self.inotify.watch_dir(dir.as_fd(), mask()) {
                Ok(wd) => wd,
                Err(e) if rel == top || e.raw_os_error() == Some(libc::ENOSPC) => return Err(e),
                Err(_) => continue,
            };
            let path = match rel.is_empty() {
                true => root.to_path_buf(),
                false => root.join(OsStr::from_bytes(&rel)),
            };
            self.paths.insert(wd.clone(), path.clone());
            self.watches.insert(path, wd);
            let Ok(listed) = dirfd::list_dir_typed(dir.as_fd()) else {
                continue;
            };
            for (name, is_dir) in listed {
                if dirfd::listed_dir(dir.as_fd(), &name, is_dir) {
                    let mut child = rel.clone();
                    if !child.is_empty() {
                        child.push(b'/');
                    }
                    child.extend_from_slice(&name);
                    stack.push(child);
                }
            }
        }
        Ok(())
    }

    /// Stops watching `top` and every directory below it.
    fn unwatch_tree(&mut self, top: &Path) {
        let gone: Vec<WatchDescriptor> = self
            .paths
            .iter()
            .filter(|(_, p)| p.starts_with(top))
            .map(|(wd, _)| wd.clone())
            .collect();
        for wd in gone {
            if let Some(p) = self.paths.remove(&wd) {
                if self.watches.get(&p) == Some(&wd) {
                    self.watches.remove(&p);
                }
            }
            self.inotify.unwatch(wd);
        }
    }

    /// Reads every queued event and routes it.
    fn drain(&mut self) {
        let mut buf = vec![0u8; inotify::READ_BUFFER];
        loop {
            let events = match self.inotify.read(&mut buf) {
                Ok(Some(evs)) => evs,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("reading sandboxes' inotify events: {e}");
                    return;
                }
            };
            for e in events {
                self.event(e);
            }
        }
    }

    fn event(&mut self, e: Event<'_>) {
        let (wd, mask, cookie, name) = match e {
            Event::Overflow => {
                tracing::warn!("sandboxes' inotify event queue overflowed: file events lost");
                return;
            }
            Event::Watched {
                wd,
                mask,
                cookie,
                name,
            } => (wd, mask, cookie, name),
        };
        if mask.contains(EventMask::IGNORED) {
            if let Some(p) = self.paths.remove(&wd) {
                if self.watches.get(&p) == Some(&wd) {
                    self.watches.remove(&p);
                }
            }
            return;
        }
        let Some(dir) = self.paths.get(&wd) else {
            return;
        };
        let path = match name {
            Some(n) => dir.join(OsStr::from_bytes(n)),
            None => dir.clone(),
        };
        let is_dir = mask.contains(EventMask::ISDIR);
        if mask.contains(EventMask::MOVED_FROM) {
            self.forget(&path);
            self.rename_from = Some((cookie, path.clone()));
            self.route(Kind::From(cookie), &path, None);
        } else if mask.contains(EventMask::MOVED_TO) {
            if is_dir {
                self.watch_new(&path);
            }
            self.route(Kind::To(cookie), &path, None);
            if let Some((_, from)) = self.rename_from.take_if(|(c, _)| *c == cookie) {
                self.route(Kind::Both, &from, Some(&path));
            }
        }
        if mask.contains(EventMask::CREATE) {
            // Watched before it is announced: what is made in it from now on is an event.
            if is_dir {
                self.watch_new(&path);
            }
            self.route(Kind::Create { dir: is_dir }, &path, None);
        }
        if mask.contains(EventMask::DELETE) {
            self.route(Kind::Remove { dir: is_dir }, &path, None);
            self.forget(&path);
        }
        if mask.contains(EventMask::CLOSE_WRITE) {
            self.route(Kind::CloseWrite, &path, None);
        }
    }

    /// Watches a directory made or moved in (and what it holds already), opened beneath
    /// the root of a watch that holds it.
    fn watch_new(&mut self, path: &Path) {
        let Some(root) = self
            .routes
            .iter()
            .find(|rt| path.starts_with(&rt.root))
            .map(|rt| rt.root.clone())
        else {
            return;
        };
        let Ok(rel) = path.strip_prefix(&root) else {
            return;
        };
        let rel = rel.as_os_str().as_bytes().to_vec();
        let _ = self.watch_tree(&root, &rel);
    }

    /// A watched directory moved away or removed: its watches and those below go.
    fn forget(&mut self, path: &Path) {
        if self.watches.contains_key(path) {
            self.unwatch_tree(path);
        }
    }

    /// Hands one event to every watch whose root holds its (first) path.
    fn route(&mut self, kind: Kind, first: &Path, second: Option<&Path>) {
        for rt in self
            .routes
            .iter_mut()
            .filter(|rt| first.starts_with(&rt.root))
        {
            translate(rt, &kind, first, second);
        }
    }
}

fn translate(rt: &mut Route, kind: &Kind, first: &Path, second: Option<&Path>) {
    let rel = |p: &Path| -> Option<String> {
        let r = p
            .strip_prefix(&rt.root)
            .ok()?
            .to_string_lossy()
            .into_owned();
        (!r.is_empty()).then_some(r)
    };
    let first = rel(first);
    let (kind, path, to, is_dir) = match *kind {
        Kind::Create { dir } => (FsEventKind::Create, first, None, dir),
        Kind::CloseWrite => (FsEventKind::Modify, first, None, false),
        Kind::Remove { dir } => (FsEventKind::Delete, first, None, dir),
        Kind::From(cookie) => {
            rt.pending_from = Some(cookie);
            return;
        }
        Kind::To(cookie) => {
            if rt.pending_from == Some(cookie) {
                return; // the Both event follows
            }
            let is_dir = first
                .as_deref()
                .is_some_and(|p| is_dir_beneath(&rt.root, p));
            (FsEventKind::Create, first, None, is_dir)
        }
        Kind::Both => {
            rt.pending_from = None;
            let to = second.and_then(rel);
            let is_dir = to.as_deref().is_some_and(|p| is_dir_beneath(&rt.root, p));
            (FsEventKind::Rename, first, to, is_dir)
        }
    };
    let Some(path) = path else {
        return;
    };
    let made_dir = kind == FsEventKind::Create && is_dir;
    send(rt, kind, path.clone(), to, is_dir);
    if made_dir {
        announce_contents(rt, &path);
    }
}

/// Whether `rel` beneath `root` is a directory, looked up through handles (a link is
/// not one: none is followed).
fn is_dir_beneath(root: &Path, rel: &str) -> bool {
    use crate::sys::dirfd;
    use std::os::fd::AsFd;
    dirfd::open_dir_path(root)
        .and_then(|r| dirfd::Entry::open_beneath(r.as_fd(), rel.as_bytes()))
        .is_ok_and(|e| e.meta.is_dir())
}

fn send(rt: &mut Route, kind: FsEventKind, path: String, to: Option<String>, is_dir: bool) {
    let marker = path.starts_with(MARKER_PREFIX);
    if !marker {
        rt.seq += 1;
    }
    let _ = rt.tx.send(FsEvent {
        // Markers carry no number: the host never sees them.
        seq: if marker { 0 } else { rt.seq },
        kind,
        path,
        to,
        is_dir,
    });
}

/// The most entries of a new directory announced by looking into it.
const MAX_ANNOUNCED: usize = 10_000;

/// A directory just made may hold entries made before its watch was added (the kernel
/// reports nothing for them): `mkdir d && echo > d/f` races the watcher. The watch is
/// in place when the directory's event arrives, so what is in it now is announced as
/// created; an entry made in between is announced twice, never missed.
fn announce_contents(rt: &mut Route, dir: &str) {
    use crate::sys::dirfd;
    use std::os::fd::AsFd;
    // Looked into through handles beneath the root: no link followed, nothing outside
    // it listed, whatever is renamed meanwhile.
    let Ok(root) = dirfd::open_dir_path(&rt.root) else {
        return;
    };
    let mut stack = vec![dir.to_string()];
    let mut n = 0;
    while let Some(d) = stack.pop() {
        let Ok(fd) = dirfd::open_dir_beneath(root.as_fd(), d.as_bytes()) else {
            continue;
        };
        let Ok(listed) = dirfd::list_dir_typed(fd.as_fd()) else {
            continue;
        };
        for (name, is_dir) in listed {
            let e = crate::fs::Listed {
                is_dir: dirfd::listed_dir(fd.as_fd(), &name, is_dir),
                name,
            };
            if n >= MAX_ANNOUNCED {
                tracing::warn!(
                    dir,
                    "more than {MAX_ANNOUNCED} entries made at once: not all announced"
                );
                return;
            }
            n += 1;
            let rel = format!("{d}/{}", String::from_utf8_lossy(&e.name));
            let is_dir = e.is_dir;
            send(rt, FsEventKind::Create, rel.clone(), None, is_dir);
            if is_dir {
                stack.push(rel);
            }
        }
    }
}
