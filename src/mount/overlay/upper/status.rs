//! An upper's status: what changed in it since the stamps the last checkpoint
//! recorded, and listings merged from what a walk saw.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use super::stamp::{rel_join, split_rel, DirTrees, Listings, Partial, Rel, Stamp, Visit};
use crate::sys::dirfd::{self, Meta};

/// What of the upper changed since the last checkpoint.
#[derive(Debug, Default)]
pub(in crate::mount::overlay) struct UpperChanges {
    /// Changed, new and vanished entries, directories included.
    pub nodes: usize,
    /// Of them, not directories.
    pub files: usize,
    pub bytes: u64,
    /// The first few paths (sorted).
    pub paths: Vec<String>,
}

pub(in crate::mount::overlay) fn is_dir(s: &Stamp) -> bool {
    s.mode & libc::S_IFMT == libc::S_IFDIR
}

/// Whether `now` differs from `then` as a change counts: a directory when its mode or
/// mtime changed (an entry made in it changes its mtime: both count, as with the FUSE
/// backend's dirty nodes), anything else when any of its stamp did.
fn differs(now: &Stamp, then: Option<&Stamp>) -> bool {
    match then {
        None => true,
        Some(c) if is_dir(now) => (c.mode, c.mtime_ns) != (now.mode, now.mtime_ns),
        Some(c) => c != now,
    }
}

impl UpperChanges {
    fn changed(&mut self, rel: &[u8], s: &Stamp) {
        self.nodes += 1;
        // A whiteout (a 0/0 character device) is a removal: a change of its directory,
        // as with the FUSE backend.
        let whiteout = s.mode & libc::S_IFMT == libc::S_IFCHR && s.rdev == 0;
        if !is_dir(s) && !whiteout {
            self.files += 1;
            self.bytes += s.size;
        }
        self.paths.push(String::from_utf8_lossy(rel).into_owned());
    }

    /// Counts entry `rel` (captured with `stamp`) gone, and what it held.
    fn gone(&mut self, captured: &Listings, rel: Rel, stamp: &Stamp) {
        if is_dir(stamp) {
            for (name, s) in captured.get(&rel).into_iter().flatten() {
                self.gone(captured, rel_join(&rel, name), s);
            }
        }
        self.nodes += 1;
        self.paths.push(String::from_utf8_lossy(&rel).into_owned());
    }
}

/// What of the upper changed since `captured` (the stamps of the upper's entries when
/// the last checkpoint was taken); at most `limit` paths are listed. `dirs`: the only
/// directories that can have changed (from the upper's watch), or `None` to walk the
/// whole upper.
pub(in crate::mount::overlay) fn changes_since(
    upper: &Path,
    captured: &Listings,
    dirs: Option<&HashMap<Rel, Visit>>,
    limit: usize,
) -> std::io::Result<UpperChanges> {
    let mut out = UpperChanges::default();
    // The upper (the store's own directory) is the one path opened: everything in it
    // is looked at through handles, beneath it, no link followed.
    let root = dirfd::open_dir_path_noatime(upper)?;
    let mut stack: Vec<Rel> = match dirs {
        Some(d) => d
            .iter()
            .filter(|(_, v)| **v == Visit::All)
            .map(|(k, _)| k.clone())
            .collect(),
        None => vec![Vec::new()],
    };
    // Entries to compare one by one: those named by the watch, and a changed
    // directory's own stamp where its parent's entries are not looked at.
    let mut entries: Vec<Rel> = Vec::new();
    for (rel, v) in dirs.into_iter().flatten() {
        if let Visit::Names(names) = v {
            entries.extend(names.iter().map(|n| rel_join(rel, n)));
        }
        if rel.is_empty() {
            continue;
        }
        let (p, name) = split_rel(rel);
        let covered = dirs.and_then(|d| d.get(p)).is_some_and(|v| match v {
            Visit::All => true,
            Visit::Names(n) => n.contains(name),
        });
        if !covered {
            entries.push(rel.clone());
        }
    }
    entries.sort();
    entries.dedup();
    for rel in entries {
        let (p, name) = split_rel(&rel);
        let then = captured.get(p).and_then(|l| l.get(name));
        match lstat_beneath(root.as_fd(), p, name) {
            Ok(Some(m)) => {
                let s = Stamp::of(&m);
                if differs(&s, then) {
                    out.changed(&rel, &s);
                }
            }
            Ok(None) => {
                if let Some(t) = then {
                    out.gone(captured, rel, t);
                }
            }
            Err(e) => return Err(e),
        }
    }
    while let Some(rel) = stack.pop() {
        // Listed without touching the directory's access time (the user's).
        let dir = match dirfd::open_dir_beneath(root.as_fd(), &rel) {
            Ok(d) => d,
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(e),
        };
        let rd = dirfd::list_dir_typed(dir.as_fd())?;
        let then = captured.get(&rel);
        let mut seen = HashSet::new();
        for (name, _) in rd {
            let Ok(c) = CString::new(name.clone()) else {
                continue;
            };
            let Ok(Some(m)) = dirfd::lstat_at(dir.as_fd(), &c) else {
                continue;
            };
            let s = Stamp::of(&m);
            let r = rel_join(&rel, &name);
            if differs(&s, then.and_then(|l| l.get(&name))) {
                out.changed(&r, &s);
            }
            if m.is_dir() && dirs.is_none() {
                stack.push(r);
            }
            seen.insert(name);
        }
        for (name, s) in then.into_iter().flatten() {
            if !seen.contains(name) {
                out.gone(captured, rel_join(&rel, name), s);
            }
        }
    }
    out.paths.sort();
    out.paths.dedup();
    out.paths.truncate(limit);
    Ok(out)
}

/// A path that is not there (any more) as a directory: removed, or replaced by a file or
/// a symlink (which no lookup beneath the upper follows).
fn gone(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
    )
}

/// The metadata of entry `name` of directory `dir` (a path beneath `root`), no link
/// followed; `None` if it is not there.
fn lstat_beneath(root: BorrowedFd<'_>, dir: &[u8], name: &[u8]) -> std::io::Result<Option<Meta>> {
    let d = match dirfd::open_dir_beneath(root, dir) {
        Ok(d) => d,
        Err(e) if gone(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let c = CString::new(name)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in a name"))?;
    dirfd::lstat_at(d.as_fd(), &c)
}

/// Applies a capture's `listings` (directories it looked at whole) and `partial`
/// (entries of directories it looked at in part) to `captured`, dropping what
/// directories gone from them held; the same for `trees`.
pub(in crate::mount::overlay) fn merge_listings(
    captured: &mut Listings,
    trees: &mut DirTrees,
    listings: Listings,
    partial: Partial,
) {
    fn drop_dir(captured: &mut Listings, trees: &mut DirTrees, rel: &[u8]) {
        trees.remove(rel);
        if let Some(old) = captured.remove(rel) {
            for (name, s) in old {
                if is_dir(&s) {
                    drop_dir(captured, trees, &rel_join(rel, &name));
                }
            }
        }
    }
    for (rel, listing) in listings {
        let old = captured.insert(rel.clone(), listing);
        for (name, s) in old.into_iter().flatten() {
            let now = captured.get(&rel).and_then(|l| l.get(&name));
            if is_dir(&s) && !now.is_some_and(is_dir) {
                drop_dir(captured, trees, &rel_join(&rel, &name));
            }
        }
    }
    for (rel, changes) in partial {
        let mut gone = Vec::new();
        let l = captured.entry(rel.clone()).or_default();
        for (name, now) in changes {
            let old = match now {
                Some(s) => l.insert(name.clone(), s),
                None => l.remove(&name),
            };
            if old.is_some_and(|o| is_dir(&o)) && !now.is_some_and(|s| is_dir(&s)) {
                gone.push(rel_join(&rel, &name));
            }
        }
        for d in gone {
            drop_dir(captured, trees, &d);
        }
    }
}
