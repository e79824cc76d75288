//! Which directories of an overlay's upper changed since the last checkpoint.
//!
//! The kernel's overlayfs writes straight to the upper, so casfs hears of no change
//! itself; without help a checkpoint (and `status`) would list the whole upper, which
//! after an untar or an `npm ci` holds tens of thousands of entries. One inotify
//! instance per process watches every directory of every upper (an overlay makes its
//! changes in the upper with the VFS calls that report them: creates, removals,
//! renames, writes, attribute and xattr changes) and keeps, per upper, the entries that
//! changed, by directory. A checkpoint then looks again at those entries only, and at the
//! child on the way in every directory above them.
//!
//! What is watched is what changes an entry: creates, removals, renames, attribute and
//! xattr changes, and the close of a file that was written. A write itself is not
//! watched: every `write(2)` would be an event (a `git clone` writes its pack in
//! thousands), and the kernel's cost of queueing them was most of what the watch added
//! to a create. A file written and closed is its close; a file still open for writing
//! when a checkpoint starts, or mapped shared and writable, is found in `/proc` then
//! (`writers::open_writers`): its writes may have returned with no close yet to
//! announce them.
//!
//! The set is exact for what returned before it is read: inotify queues an event
//! before the system call that caused it returns, [`UpperWatch::changed`] reads the
//! queue empty first, and a write that returned without a close was made through a
//! descriptor or mapping still open then. When events are lost (the queue overflowed)
//! every directory counts as changed until a full walk has been captured; when a
//! directory cannot be watched (`fs.inotify.max_user_watches`), the upper is walked
//! whole from then on. The reader drains the queue a millisecond after it is woken,
//! so a burst of creates costs a wakeup per batch rather than per event.

use crate::sys::Locked;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::upper::{rel_join, split_rel, Rel, Visit};
use super::writers::open_writers;
use crate::sys::dirfd;
use crate::sys::inotify::{self, Event, EventMask, Instance, WatchDescriptor, WatchMask};

/// What is watched on every directory of an upper.
fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::ATTRIB
        | WatchMask::CLOSE_WRITE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ONLYDIR
        | WatchMask::EXCL_UNLINK
}

struct Watcher {
    state: Mutex<State>,
}

struct State {
    inotify: Instance,
    /// Counts events: a directory's mark says which event it came from.
    seq: u64,
    next_id: u64,
    uppers: HashMap<u64, Upper>,
    /// Each watch's upper and directory (relative to the upper's root).
    wds: HashMap<WatchDescriptor, (u64, Rel)>,
}

struct Upper {
    root: PathBuf,
    /// The watched directories, by path.
    paths: BTreeMap<Rel, WatchDescriptor>,
    /// Directories whose entries changed (a directory's own attributes are an entry of
    /// its parent).
    dirty: HashMap<Rel, Mark>,
    /// Events were lost at event `n`: every directory counts as changed until a capture
    /// that started after it is settled.
    lost_at: Option<u64>,
    /// A directory could not be watched: the upper is walked whole from now on.
    unwatched: bool,
}

/// A changed directory.
struct Mark {
    /// The last event that marked it.
    seq: u64,
    /// The entries that changed (all of them: it came in whole).
    changed: Visit,
}

impl Upper {
    /// Marks entry `name` of `dir` changed (`None`: every entry).
    fn mark(&mut self, dir: &[u8], name: Option<&[u8]>, seq: u64) {
        let m = self.dirty.entry(dir.to_vec()).or_insert_with(|| Mark {
            seq,
            changed: Visit::Names(HashSet::new()),
        });
        m.seq = seq;
        m.changed.add(name);
    }
}

/// The watch of one upper; dropping it removes its watches.
pub(super) struct UpperWatch {
    id: u64,
}

/// The upper's changed directories when a capture starts.
pub(super) struct Changed {
    /// Marks up to this event are covered by the capture.
    pub upto: u64,
    /// The changed directories, with the entries that changed; `None`: the whole upper
    /// must be walked.
    pub dirs: Option<HashMap<Rel, Visit>>,
}

fn watcher() -> Option<&'static Watcher> {
    static WATCHER: OnceLock<Option<Watcher>> = OnceLock::new();
    WATCHER
        .get_or_init(|| {
            let inotify = match Instance::new() {
                Ok(i) => i,
                Err(e) => {
                    tracing::warn!("inotify: {e}; overlay checkpoints walk the whole upper");
                    return None;
                }
            };
            let fd = inotify.as_raw_fd();
            let spawned = std::thread::Builder::new()
                .name("casfs-upper-watch".into())
                .spawn(move || read_forever(fd));
            if let Err(e) = spawned {
                tracing::warn!("upper watch thread: {e}; overlay checkpoints walk the whole upper");
                return None;
            }
            Some(Watcher {
                state: Mutex::new(State {
                    inotify,
                    seq: 0,
                    next_id: 0,
                    uppers: HashMap::new(),
                    wds: HashMap::new(),
                }),
            })
        })
        .as_ref()
}

/// Starts the process's upper watch (its inotify instance and reader thread) now rather
/// than at the first overlay mount (a server then holds its descriptor from the start);
/// false where inotify is not available.
pub fn start() -> bool {
    watcher().is_some()
}

/// The reader: waits for events and hands them to [`State::drain`], so the kernel's
/// queue (`fs.inotify.max_queued_events`) does not overflow during a bulk workload.
fn read_forever(fd: std::os::fd::RawFd) {
    loop {
        // The descriptor lives as long as the process.
        if !inotify::wait(fd, -1) {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        // Let a burst gather: one wakeup and one read for many events (a reader that
        // runs at every event costs the writer a context switch each on two cores).
        // The queue holds 16,384 events by default; a millisecond of creates is far
        // fewer. A checkpoint drains the queue itself, so nothing waits on this.
        std::thread::sleep(std::time::Duration::from_millis(1));
        if let Some(w) = watcher() {
            w.lock().drain();
        }
    }
}

impl Watcher {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }
}

/// `rel` of upper `root` as a warning names it: at most 200 bytes of it.
fn shown(root: &Path, rel: &[u8]) -> String {
    let r = String::from_utf8_lossy(rel);
    let cut = r
        .char_indices()
        .map(|(i, _)| i)
        .take_while(|i| *i <= 200)
        .last()
        .unwrap_or(0);
    if r.len() > 200 {
        format!("{}/{}... ({} bytes)", root.display(), &r[..cut], r.len())
    } else {
        format!("{}/{r}", root.display())
    }
}

/// The directory above `rel` (none for the root).
fn parent(rel: &[u8]) -> Option<&[u8]> {
    (!rel.is_empty()).then(|| split_rel(rel).0)
}

/// What a capture visits: the changed directories, and every directory above one with
/// the name of the child on the way.
pub(super) fn visits(dirs: &HashMap<Rel, Visit>) -> HashMap<Rel, Visit> {
    fn at<'a>(out: &'a mut HashMap<Rel, Visit>, dir: &[u8]) -> &'a mut Visit {
        out.entry(dir.to_vec())
            .or_insert_with(|| Visit::Names(HashSet::new()))
    }
    let mut out = HashMap::with_capacity(dirs.len() * 2 + 1);
    at(&mut out, &[]);
    for (d, changed) in dirs {
        at(&mut out, d).merge(changed);
        let mut cur = d.as_slice();
        while let Some(p) = parent(cur) {
            at(&mut out, p).add(Some(split_rel(cur).1));
            cur = p;
        }
    }
    out
}

impl State {
    /// Reads the events queued when it is called and applies them. Bounded: events that
    /// arrive while it reads are left for the next drain, so a workload that renames
    /// without pause (a member's exchange loop) never keeps the lock from a checkpoint,
    /// which needs only the changes made before it began.
    fn drain(&mut self) {
        let mut buf = [0u8; 16 * 1024];
        let queued = self.inotify.queued().unwrap_or(usize::MAX);
        // A read takes as many whole events as fit in the buffer: all but the room of
        // one event (16 bytes and a name of at most 256) is filled while more wait.
        let mut reads = if queued == usize::MAX {
            usize::MAX
        } else {
            queued.div_ceil(buf.len() - 272) + 1
        };
        loop {
            if reads == 0 {
                return;
            }
            reads -= 1;
            let events = match self.inotify.read(&mut buf) {
                Ok(Some(evs)) => evs,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("reading inotify events: {e}");
                    self.lose_all();
                    return;
                }
            };
            for e in events {
                self.apply(e);
            }
        }
    }

    /// Events were lost: every upper is walked whole until captured, and watched again
    /// (directories made meanwhile have no watch yet).
    fn lose_all(&mut self) {
        self.seq += 1;
        let seq = self.seq;
        let ids: Vec<u64> = self.uppers.keys().copied().collect();
        for id in ids {
            if let Some(u) = self.uppers.get_mut(&id) {
                if u.lost_at.is_none() {
                    tracing::warn!(
                        "{}: inotify events lost; the next checkpoint walks the whole upper",
                        u.root.display()
                    );
                }
                u.lost_at = Some(seq);
            }
            self.watch_tree(id, &[]);
        }
    }

    fn apply(&mut self, e: Event<'_>) {
        let (wd, mask, name) = match e {
            Event::Overflow => return self.lose_all(),
            Event::Watched { wd, mask, name, .. } => (wd, mask, name),
        };
        let Some((id, dir)) = self.wds.get(&wd).cloned() else {
            return;
        };
        if mask.contains(EventMask::IGNORED) {
            self.wds.remove(&wd);
            if let Some(u) = self.uppers.get_mut(&id) {
                if u.paths.get(&dir) == Some(&wd) {
                    u.paths.remove(&dir);
                }
            }
            return;
        }
        self.seq += 1;
        let seq = self.seq;
        let Some(u) = self.uppers.get_mut(&id) else {
            return;
        };
        let Some(name) = name else {
            // The directory itself (its attributes): its entry is in its parent.
            if let Some(p) = parent(&dir) {
                u.mark(p, Some(split_rel(&dir).1), seq);
            }
            return;
        };
        u.mark(&dir, Some(name), seq);
        if !mask.contains(EventMask::ISDIR) {
            return;
        }
        let child = rel_join(&dir, name);
        if mask.intersects(EventMask::MOVED_FROM | EventMask::DELETE) {
            // Its watches keep their descriptors; a move elsewhere in the upper
            // names them again (MOVED_TO), a removal ends them (IGNORED).
            let below = rel_join(&child, b"");
            let gone: Vec<Rel> = u
                .paths
                .range(child.clone()..)
                .take_while(|(k, _)| **k == child || k.starts_with(&below))
                .map(|(k, _)| k.clone())
                .collect();
            for k in gone {
                u.paths.remove(&k);
            }
        }
        if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
            self.watch_tree(id, &child);
        }
    }

    /// Watches directory `rel` of upper `id` and every directory below it (a directory
    /// made or moved in: whatever it holds came in unseen), marking each changed.
    fn watch_tree(&mut self, id: u64, rel: &[u8]) {
        self.seq += 1;
        let seq = self.seq;
        // An upper walked whole already (one that could not be watched) is not tried
        // again at every event of it, nor warned about again.
        let Some(root) = self
            .uppers
            .get(&id)
            .filter(|u| !u.unwatched)
            .map(|u| u.root.clone())
        else {
            return;
        };
        // Every directory is opened beneath the upper's handle (no link followed, never
        // out of it) and watched through its descriptor: a directory replaced by a
        // symlink meanwhile is not followed out of the upper.
        let Ok(top) = dirfd::open_dir_path(&root) else {
            return;
        };
        let mut stack = vec![rel.to_vec()];
        while let Some(d) = stack.pop() {
            // Named shortly in warnings: a member's names may be long, and many.
            let path = shown(&root, &d);
            // Deeper than any tree casfs stores: the upper is walked whole (and its
            // capture refused) rather than watched a level at a time without end.
            if d.iter().filter(|b| **b == b'/').count() >= crate::cas::MAX_TREE_DEPTH {
                tracing::warn!(
                    "{path}: more than {} directories deep; overlay checkpoints walk the \
                     whole upper",
                    crate::cas::MAX_TREE_DEPTH
                );
                if let Some(u) = self.uppers.get_mut(&id) {
                    u.unwatched = true;
                }
                return;
            }
            let dir = match dirfd::open_dir_beneath(top.as_fd(), &d) {
                Ok(f) => f,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    tracing::warn!("opening {path}: {e}; overlay checkpoints walk the whole upper");
                    if let Some(u) = self.uppers.get_mut(&id) {
                        u.unwatched = true;
                    }
                    return;
                }
            };
            // Watched through its descriptor (its magic link followed to the directory
            // opened), before it is listed: an entry made after the listing is an event.
            let wd = match self.inotify.watch_dir(dir.as_fd(), mask()) {
                Ok(wd) => wd,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                    continue
                }
                Err(e) => {
                    tracing::warn!(
                        "watching {path}: {e}; overlay checkpoints walk the whole upper"
                    );
                    if let Some(u) = self.uppers.get_mut(&id) {
                        u.unwatched = true;
                    }
                    return;
                }
            };
            self.wds.insert(wd.clone(), (id, d.clone()));
            let Some(u) = self.uppers.get_mut(&id) else {
                return;
            };
            u.paths.insert(d.clone(), wd);
            u.mark(&d, None, seq);
            // Listed without touching its access time (a user's `utimensat` may have
            // set it just before): opened with O_NOATIME where that is allowed.
            let Ok(rd) = dirfd::list_dir_typed(dir.as_fd()) else {
                continue;
            };
            for (name, is_dir) in rd {
                if dirfd::listed_dir(dir.as_fd(), &name, is_dir) {
                    stack.push(rel_join(&d, &name));
                }
            }
        }
    }
}

impl UpperWatch {
    /// Watches the upper at `root` and every directory in it; `None` where inotify is
    /// not available (checkpoints then walk the whole upper). Whatever the upper holds
    /// already counts as changed.
    pub(super) fn start(root: &Path) -> Option<UpperWatch> {
        let w = watcher()?;
        let mut st = w.lock();
        st.drain();
        let id = st.next_id;
        st.next_id += 1;
        st.uppers.insert(
            id,
            Upper {
                root: root.to_path_buf(),
                paths: BTreeMap::new(),
                dirty: HashMap::new(),
                lost_at: None,
                unwatched: false,
            },
        );
        st.watch_tree(id, &[]);
        Some(UpperWatch { id })
    }

    /// The changed directories now (every event of a call that returned is read
    /// first, and every file of the overlay at `mountpoint` open for writing or mapped
    /// writable counts as changed). They stay marked until [`settle`](Self::settle).
    /// `dev`: the overlay's device, as recorded when it was mounted (where a process of
    /// another mount namespace, a sandbox's, has it mounted, its descriptors name its
    /// files from there).
    /// `pid_ns`: the pid namespace (its inode) whose processes alone are looked at
    /// (`None`: every process).
    pub(super) fn changed(
        &self,
        mountpoint: &Path,
        dev: Option<u64>,
        pid_ns: Option<u64>,
    ) -> Changed {
        self.changed_with(mountpoint, Some((dev, pid_ns)))
    }

    /// [`changed`](Self::changed) as announced: without looking in `/proc` for files
    /// still open for writing (a read of every process's descriptors and mappings,
    /// which costs with the number of processes on the host).
    pub(super) fn announced(&self, mountpoint: &Path) -> Changed {
        self.changed_with(mountpoint, None)
    }

    /// `writers`: whether to look in `/proc`, with which device, among which processes.
    fn changed_with(
        &self,
        mountpoint: &Path,
        writers: Option<(Option<u64>, Option<u64>)>,
    ) -> Changed {
        let Some(w) = watcher() else {
            return Changed {
                upto: 0,
                dirs: None,
            };
        };
        // Mappings of an overlay's file name it (kernels before 6.8: its upper file).
        let root = w.lock().uppers.get(&self.id).map(|u| u.root.clone());
        let mut under = vec![mountpoint];
        under.extend(root.as_deref());
        let writers = match writers {
            Some((dev, pid_ns)) => open_writers(&under, dev, pid_ns),
            None => Vec::new(),
        };
        let mut st = w.lock();
        st.drain();
        st.seq += 1;
        let seq = st.seq;
        if let Some(u) = st.uppers.get_mut(&self.id) {
            for rel in &writers {
                let (dir, name) = split_rel(rel);
                u.mark(dir, Some(name), seq);
            }
        }
        let upto = st.seq;
        let dirs = st
            .uppers
            .get(&self.id)
            .filter(|u| u.lost_at.is_none() && !u.unwatched)
            .map(|u| {
                u.dirty
                    .iter()
                    .map(|(k, m)| (k.clone(), m.changed.clone()))
                    .collect()
            });
        Changed { upto, dirs }
    }

    /// A capture that started at `upto` is the checkpoint: marks up to then are done.
    /// `again`: entries to look at next time anyway (left uncaptured).
    pub(super) fn settle(&self, upto: u64, again: &[Rel]) {
        let Some(w) = watcher() else { return };
        let mut st = w.lock();
        st.seq += 1;
        let seq = st.seq;
        let Some(u) = st.uppers.get_mut(&self.id) else {
            return;
        };
        u.dirty.retain(|_, m| m.seq > upto);
        if u.lost_at.is_some_and(|l| l <= upto) {
            u.lost_at = None;
        }
        for k in again {
            match parent(k) {
                Some(p) => u.mark(p, Some(split_rel(k).1), seq),
                None => u.mark(k, None, seq),
            }
        }
    }
}

impl Drop for UpperWatch {
    fn drop(&mut self) {
        let Some(w) = watcher() else { return };
        let mut st = w.lock();
        let Some(u) = st.uppers.remove(&self.id) else {
            return;
        };
        for wd in u.paths.into_values() {
            st.inotify.unwatch(wd);
        }
        // Its descriptors, those of directories moved out of it (no path) included.
        st.wds.retain(|_, (id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_visited_with_every_directory_above_it() {
        let n = |v: &[&[u8]]| -> HashSet<Vec<u8>> { v.iter().map(|s| s.to_vec()).collect() };
        let dirs: HashMap<Rel, Visit> = [
            (b"a/b/c".to_vec(), Visit::Names(n(&[b"f"]))),
            (b"x".to_vec(), Visit::All),
            (b"a/d".to_vec(), Visit::Names(n(&[b"g", b"h"]))),
        ]
        .into();
        let v = visits(&dirs);
        assert_eq!(v.len(), 6);
        assert_eq!(v[&b""[..]], Visit::Names(n(&[b"a", b"x"])));
        assert_eq!(v[&b"a"[..]], Visit::Names(n(&[b"b", b"d"])));
        assert_eq!(v[&b"a/b"[..]], Visit::Names(n(&[b"c"])));
        assert_eq!(v[&b"a/b/c"[..]], Visit::Names(n(&[b"f"])));
        assert_eq!(v[&b"a/d"[..]], Visit::Names(n(&[b"g", b"h"])));
        assert_eq!(v[&b"x"[..]], Visit::All);
        assert_eq!(parent(b"a/b"), Some(&b"a"[..]));
        assert_eq!(parent(b"a"), Some(&b""[..]));
        assert_eq!(parent(b""), None);
        assert_eq!(split_rel(b"a/b"), (&b"a"[..], &b"b"[..]));
        assert_eq!(split_rel(b"a"), (&b""[..], &b"a"[..]));
    }
}
