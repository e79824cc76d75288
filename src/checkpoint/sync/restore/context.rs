//! What a restore carries through its walk, and what it asks of it: the trees and
//! chunk lists the preflight loaded, the directory cache, the counters ([`Ctx`]); where
//! objects are read from ([`Reading`]); the objects an entry's restore will read
//! (`Ctx::needed`); and the paths below the destination (`join_rel`) and the cache's
//! view of what is on disk (`seen_on_disk`). The restore itself (the parent) and the
//! look for uncaptured work build on it.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cas::{EntryContent, FileId, ObjectId, ObjectStore, Tree, TreeEntry, TreeId};
use crate::checkpoint::ids::{CheckpointError, CheckpointResult};
use crate::checkpoint::sync::cstr;
use crate::checkpoint::sync::dircache::{DirCache, DirCacheSet};
use crate::sys::dirfd::{child, is_dir, lstat_at, open_dir_at, Fingerprint, Meta};

/// What a restore has done so far, for a caller to watch while it runs.
#[derive(Debug, Default)]
pub struct RestoreProgress {
    pub files: AtomicU64,
    pub bytes_written: AtomicU64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) files_written: AtomicU64,
    pub(super) files_unchanged: AtomicU64,
    pub(super) bytes_written: AtomicU64,
    pub(super) dirs: AtomicU64,
    pub(super) symlinks: AtomicU64,
    pub(super) special: AtomicU64,
    pub(super) removed: AtomicU64,
}

pub(super) struct Ctx<'a> {
    pub(super) trees: HashMap<TreeId, Tree>,
    /// The chunks of every large file (from a remote store; empty otherwise).
    pub(super) chunks: HashMap<FileId, Vec<ObjectId>>,
    /// The bytes of the files below each tree (from a remote store; empty otherwise).
    pub(super) weights: HashMap<TreeId, u64>,
    pub(super) stage_bytes: u64,
    pub(super) cache: DirCacheSet<'a>,
    pub(super) fresh_before_ns: i64,
    pub(super) progress: Option<&'a RestoreProgress>,
    pub(super) n: Counters,
    pub(super) tmp_counter: AtomicU64,
    pub(super) owner: Option<(u32, u32)>,
}

impl Ctx<'_> {
    /// A restored entry's fingerprint can be trusted when its mtime is old: a later
    /// change would set a new mtime and so a new fingerprint.
    pub(super) fn trusted(&self, e: &TreeEntry, st: &Meta) -> Option<Fingerprint> {
        (e.mtime_ns < self.fresh_before_ns).then(|| Fingerprint::of(st))
    }

    /// Counts a file written (and its bytes, for the progress too).
    pub(super) fn wrote(&self, size: u64) {
        self.n.files_written.fetch_add(1, Ordering::Relaxed);
        self.n.bytes_written.fetch_add(size, Ordering::Relaxed);
        if let Some(p) = self.progress {
            p.bytes_written.fetch_add(size, Ordering::Relaxed);
        }
    }

    /// The bytes of content an entry needs: a file's size, a directory's files'.
    pub(super) fn weight(&self, e: &TreeEntry) -> u64 {
        match &e.content {
            EntryContent::File(_) => e.size,
            EntryContent::Dir(t) => self.weights.get(t).copied().unwrap_or(0),
            _ => 0,
        }
    }

    /// The objects the restore of `e` (at `path`, `rel` below the destination, in the
    /// directory `dir` if that exists, which the cache `cached` describes) will read:
    /// those of every file at or below it but the ones the directory cache shows on
    /// disk with that content.
    pub(super) fn needed(
        &self,
        dir: Option<BorrowedFd<'_>>,
        path: &Path,
        rel: &[u8],
        e: &TreeEntry,
        cached: Option<&DirCache>,
        out: &mut Vec<ObjectId>,
    ) -> CheckpointResult<()> {
        let Some(dir) = dir else {
            self.objects_of(e, out);
            return Ok(());
        };
        let name = cstr(&e.name, path)?;
        match &e.content {
            EntryContent::File(_) => {
                // As restore_entry decides: the content is there if the cache shows it
                // and the file is as the cache saw it (no look without a cache entry).
                let cached = cached.filter(|c| c.find(&e.name).is_some());
                let st = match cached {
                    Some(_) => {
                        lstat_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?
                    }
                    None => None,
                };
                let there = st
                    .and_then(|st| seen_on_disk(cached, &e.name, &st))
                    .is_some_and(|(c, _)| c.content == e.content && c.size == e.size);
                if !there {
                    self.objects_of(e, out);
                }
            }
            EntryContent::Dir(t) => {
                let sub = match lstat_at(dir, &name)
                    .map_err(|err| CheckpointError::io(path, err))?
                {
                    Some(st) if is_dir(&st) => Some(
                        open_dir_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?,
                    ),
                    _ => None,
                };
                let cached = match &sub {
                    Some(_) => self.cache.get(rel)?,
                    None => None,
                };
                for e in self.trees.get(t).map(Tree::entries).unwrap_or_default() {
                    let fd = sub.as_ref().map(|f| f.as_fd());
                    let (p, r) = (child(path, &e.name), join_rel(rel, &e.name));
                    self.needed(fd, &p, &r, e, cached.as_ref(), out)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Every object the files at or below `e` are made of.
    pub(super) fn objects_of(&self, e: &TreeEntry, out: &mut Vec<ObjectId>) {
        match &e.content {
            EntryContent::File(id) => match self.chunks.get(id) {
                Some(chunks) => out.extend_from_slice(chunks),
                None => out.push(ObjectId(id.0)),
            },
            EntryContent::Dir(t) => {
                for e in self.trees.get(t).map(Tree::entries).unwrap_or_default() {
                    self.objects_of(e, out);
                }
            }
            _ => {}
        }
    }

    pub(super) fn tmp_name(&self) -> Vec<u8> {
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        format!(".casfs-restore-{}-{n}", std::process::id()).into_bytes()
    }
}

/// Where a restore reads objects: the store, or what a group staged in front of it.
#[derive(Clone, Copy)]
pub(super) struct Reading<'r> {
    pub(super) objects: &'r dyn ObjectStore,
    /// Whether the contents below here are still to be staged (from a remote store,
    /// outside any group).
    pub(super) stage: bool,
}

pub(super) fn join_rel(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut r = parent.to_vec();
    if !r.is_empty() {
        r.push(b'/');
    }
    r.extend_from_slice(name);
    r
}

/// The cached entry named `name` with its fingerprint, if what is on disk (`st`) is
/// still exactly what the cache saw.
pub(super) fn seen_on_disk<'c>(
    cached: Option<&'c DirCache>,
    name: &[u8],
    st: &Meta,
) -> Option<(&'c TreeEntry, Fingerprint)> {
    let (_, c, fp) = cached?.find(name)?;
    let fp = fp.filter(|fp| *fp == Fingerprint::of(st))?;
    Some((c, fp))
}
