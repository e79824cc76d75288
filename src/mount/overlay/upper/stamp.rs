//! An upper entry's stamp (what identifies it unchanged), the hash cache keyed by it,
//! and the maps a capture and a status keep by directory path in the upper: listings
//! of stamps, the merged trees, what of a directory to visit again.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use crate::cas::{FileId, TreeId};
use crate::sys::dirfd::Meta;

/// What identifies an unchanged upper file: if any differs, it is read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(in crate::mount::overlay) struct Stamp {
    pub(super) ino: u64,
    pub(super) size: u64,
    pub(super) mode: u32,
    pub(super) mtime_ns: i64,
    pub(super) ctime_ns: i64,
    pub(super) rdev: u64,
}

impl Stamp {
    pub(in crate::mount::overlay) fn of(m: &Meta) -> Stamp {
        Stamp {
            ino: m.ino,
            size: m.size,
            mode: m.mode,
            mtime_ns: m.mtime_ns,
            ctime_ns: m.ctime_ns,
            rdev: m.rdev,
        }
    }
}

/// Files already stored from the upper, by stamp: a checkpoint after ten changes reads
/// ten files, not every file changed since the mount.
pub(in crate::mount::overlay) type HashCache = Mutex<HashMap<Stamp, Hashed>>;

/// An upper file stored at its stamp.
#[derive(Debug, Clone, Copy)]
pub(in crate::mount::overlay) struct Hashed {
    pub id: FileId,
    pub size: u64,
    /// Whether a checkpoint holds it: until one does, the read was done for the next
    /// checkpoint (ahead of it: when a mount looks at what a killed daemon left, or by a
    /// checkpoint that was refused), which counts the file as hashed.
    pub in_checkpoint: bool,
}

/// A directory's path in the upper, as bytes (names need not be UTF-8), `/`-separated,
/// empty for the root: the key of the maps below.
pub(in crate::mount::overlay) type Rel = Vec<u8>;

/// `dir/name` as a [`Rel`].
pub(in crate::mount::overlay) fn rel_join(dir: &[u8], name: &[u8]) -> Rel {
    let mut r = Vec::with_capacity(dir.len() + 1 + name.len());
    if !dir.is_empty() {
        r.extend_from_slice(dir);
        r.push(b'/');
    }
    r.extend_from_slice(name);
    r
}

/// `rel`'s directory and name (the root's: both empty).
pub(in crate::mount::overlay) fn split_rel(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|b| *b == b'/') {
        Some(i) => (&rel[..i], &rel[i + 1..]),
        None => (&[], rel),
    }
}

/// The stamps of an upper's entries, by directory and name.
pub(in crate::mount::overlay) type Listings = HashMap<Rel, HashMap<Vec<u8>, Stamp>>;

/// Stamps of some entries of directories, by directory (none: not in the upper).
pub(in crate::mount::overlay) type Partial = HashMap<Rel, Vec<(Vec<u8>, Option<Stamp>)>>;

/// The merged tree of each upper directory at a capture, by path, with the lower tree it
/// was merged with (none: a new or opaque directory).
pub(in crate::mount::overlay) type DirTrees = HashMap<Rel, (Option<TreeId>, TreeId)>;

/// What of a directory changed, and so what a capture looks at again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::mount::overlay) enum Visit {
    /// Every entry: it is new, or came in whole (moved in), or events were lost.
    All,
    /// These entries: they changed, or lead to what changed.
    Names(HashSet<Vec<u8>>),
}

impl Visit {
    /// Adds entry `name` (`None`: every entry).
    pub(in crate::mount::overlay) fn add(&mut self, name: Option<&[u8]>) {
        match (name, &mut *self) {
            (None, v) => *v = Visit::All,
            (Some(n), Visit::Names(names)) => {
                names.insert(n.to_vec());
            }
            (Some(_), Visit::All) => {}
        }
    }

    /// Adds what `other` names.
    pub(in crate::mount::overlay) fn merge(&mut self, other: &Visit) {
        match other {
            Visit::All => *self = Visit::All,
            Visit::Names(n) => {
                for name in n {
                    self.add(Some(name));
                }
            }
        }
    }
}
