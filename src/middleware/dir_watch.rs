//! File events of plain-directory and overlay sandboxes from inotify, through one
//! `notify` watcher (one inotify instance) for the whole process. The kernel allows a
//! user 128 instances by default (`fs.inotify.max_user_instances`): an instance per
//! sandbox refused the 129th live sandbox ("Too many open files"), which `casfs serve`
//! reaches with its default limits. Events are routed to each watch by its root.
//!
//! A file closed after writing is a modify, a rename seen from both sides is a rename,
//! one moved in from outside is a create. (inotify watches a new subdirectory only once
//! it sees it created: what is written into it before that is reported only by the
//! drain.) One instance has one queue, in order: a drain's marker file, once reported,
//! follows every change made before it in its sandbox.

use crate::sys::Locked;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher as _};

use crate::fs::{FsEvent, FsEventKind};

/// Names of the files a drain makes (and removes) to know that inotify has handed
/// over everything before them; never numbered, never reported.
pub(super) const MARKER_PREFIX: &str = ".casfs-drain-";

/// One watch: events under `root`, numbered from 1, sent to `tx`.
struct Route {
    id: u64,
    root: PathBuf,
    tx: Sender<FsEvent>,
    seq: u64,
    /// The tracker of a rename whose source side came, waiting for its other side.
    pending_from: Option<usize>,
}

#[derive(Default)]
struct Routes {
    next_id: u64,
    list: Vec<Route>,
}

struct Shared {
    /// Held while a root is watched or unwatched, so that two watches of one root
    /// (a run's and the next run's) agree on whether the kernel's watch goes.
    watcher: Mutex<notify::RecommendedWatcher>,
    /// Taken alone (the watcher's thread takes it for every event): never held while
    /// calling the watcher, which waits for that thread.
    routes: Arc<Mutex<Routes>>,
}

fn shared() -> Result<&'static Shared, String> {
    static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let routes = Arc::new(Mutex::new(Routes::default()));
            let r = routes.clone();
            // Links in a sandbox are not followed into (its agent makes them).
            let watcher = notify::RecommendedWatcher::new(
                move |res: notify::Result<notify::Event>| {
                    if let Ok(ev) = res {
                        route(&r, &ev);
                    }
                },
                notify::Config::default().with_follow_symlinks(false),
            )
            .map_err(|e| format!("starting inotify: {e}"))?;
            Ok(Shared {
                watcher: Mutex::new(watcher),
                routes,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Starts the process's inotify instances now rather than at the first watch (a server
/// then holds their descriptors from the start: its resting count): this module's, and
/// the overlay uppers' (`crate::mount::overlay`).
pub fn start_inotify() -> Result<(), String> {
    crate::mount::overlay::start_upper_watch();
    shared().map(|_| ())
}

/// A directory watched for a run: its route goes (and the kernel's watch, unless
/// another watch of the same root remains) when dropped.
pub(crate) struct DirWatch {
    id: u64,
    root: PathBuf,
}

/// Watches `root` recursively; its changes are sent to `tx`.
pub(crate) fn watch_dir(root: &Path, tx: Sender<FsEvent>) -> Result<DirWatch, String> {
    let s = shared()?;
    let mut w = s.watcher.locked();
    let id = {
        let mut r = s.routes.locked();
        r.next_id += 1;
        let id = r.next_id;
        r.list.push(Route {
            id,
            root: root.to_path_buf(),
            tx,
            seq: 0,
            pending_from: None,
        });
        id
    };
    // Watched again even if another watch has the same root: a sandbox mounted anew
    // since (a new overlay over the same path) is another directory to the kernel, and
    // the old watch stays on the old one. The same directory watched twice is one
    // watch (inotify gives back the descriptor it has).
    if let Err(e) = w.watch(root, RecursiveMode::Recursive) {
        s.routes.locked().list.retain(|x| x.id != id);
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
        let mut w = s.watcher.locked();
        let last = {
            let mut r = s.routes.locked();
            r.list.retain(|x| x.id != self.id);
            !r.list.iter().any(|x| x.root == self.root)
        };
        if last {
            // Gone already when the sandbox was unmounted or removed.
            let _ = w.unwatch(&self.root);
        }
    }
}

/// Hands one inotify event to every watch whose root holds its path.
fn route(routes: &Mutex<Routes>, ev: &notify::Event) {
    let Some(first) = ev.paths.first() else {
        return;
    };
    let mut r = routes.locked();
    for rt in r.list.iter_mut().filter(|rt| first.starts_with(&rt.root)) {
        translate(rt, ev);
    }
}

fn translate(rt: &mut Route, ev: &notify::Event) {
    let rel = |p: &Path| -> Option<String> {
        let r = p
            .strip_prefix(&rt.root)
            .ok()?
            .to_string_lossy()
            .into_owned();
        (!r.is_empty()).then_some(r)
    };
    let first = ev.paths.first().and_then(|p| rel(p));
    let (kind, path, to, is_dir) = match ev.kind {
        EventKind::Create(k) => (FsEventKind::Create, first, None, k == CreateKind::Folder),
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
            (FsEventKind::Modify, first, None, false)
        }
        EventKind::Remove(k) => (FsEventKind::Delete, first, None, k == RemoveKind::Folder),
        EventKind::Modify(ModifyKind::Name(RenameMode::From)) => {
            rt.pending_from = ev.tracker();
            return;
        }
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
            if ev.tracker().is_some() && rt.pending_from == ev.tracker() {
                return; // the Both event follows
            }
            let is_dir = first
                .as_deref()
                .is_some_and(|p| is_dir_beneath(&rt.root, p));
            (FsEventKind::Create, first, None, is_dir)
        }
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
            rt.pending_from = None;
            let to = ev.paths.get(1).and_then(|p| rel(p));
            let is_dir = to.as_deref().is_some_and(|p| is_dir_beneath(&rt.root, p));
            (FsEventKind::Rename, first, to, is_dir)
        }
        _ => return,
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
