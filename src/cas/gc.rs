//! What garbage collection needs from the object layer: a fence between writers and a
//! collection, a walk that marks (and, for fsck, verifies) everything reachable from a
//! set of roots, and the sweep of unmarked objects.
//!
//! The fence: every path that puts objects and then makes something refer to them (a
//! capture up to its append, a restore up to its new base) holds a [`WriteSession`]; a
//! collection holds the fence exclusively from before it reads its roots until its sweep
//! ends, so no session is halfway between a put and the reference when the roots are
//! read. Sessions are counted per thread and re-entrant. As a second line, a put made
//! while a collection runs (a writer outside any session) is remembered, and the sweep
//! skips it.

use crate::sys::{Locked, ReadWriteLocked};
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::file::{load_chunk_list, read_chunk};
use super::{load_tree, CasError, EntryContent, FileRef, Hash, ObjectStore, TreeId};

thread_local! {
    /// The fences this thread holds a session of (addresses), for re-entrance.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Keeps collections and writers apart.
#[derive(Default)]
pub struct Fence {
    lock: RwLock<()>,
    collecting: AtomicBool,
    touched: Mutex<HashSet<Hash>>,
}

/// A writer's hold on the fence (nothing when the store has none, or when this thread
/// holds one already).
pub struct WriteSession<'a> {
    guard: Option<(RwLockReadGuard<'a, ()>, usize)>,
}

impl Drop for WriteSession<'_> {
    fn drop(&mut self) {
        if let Some((_, addr)) = self.guard.take() {
            HELD.with(|h| {
                let mut h = h.borrow_mut();
                if let Some(i) = h.iter().rposition(|&a| a == addr) {
                    h.remove(i);
                }
            });
        }
    }
}

/// A collection's exclusive hold on the fence.
pub struct Collecting<'a> {
    fence: &'a Fence,
    _guard: RwLockWriteGuard<'a, ()>,
}

impl Drop for Collecting<'_> {
    fn drop(&mut self) {
        self.fence.collecting.store(false, Ordering::SeqCst);
        self.fence.touched().clear();
    }
}

impl Collecting<'_> {
    /// Runs `f` with the ids put since the collection began, under the lock that a
    /// put takes to record its id: an object `f` deletes cannot be in a put's hands.
    pub fn with_touched<T>(&self, f: impl FnOnce(&HashSet<Hash>) -> T) -> T {
        f(&self.fence.touched())
    }
}

impl Fence {
    fn touched(&self) -> std::sync::MutexGuard<'_, HashSet<Hash>> {
        self.touched.locked()
    }

    /// Waits until no collection runs and holds it off until the session is dropped.
    pub fn session(&self) -> WriteSession<'_> {
        let addr = self as *const Fence as usize;
        if HELD.with(|h| h.borrow().contains(&addr)) {
            return WriteSession { guard: None };
        }
        let g = self.lock.read_locked();
        HELD.with(|h| h.borrow_mut().push(addr));
        WriteSession {
            guard: Some((g, addr)),
        }
    }

    /// Waits for every session to end and holds new ones off until dropped. Refuses
    /// (instead of deadlocking) on a thread that holds a session itself.
    pub fn collect(&self) -> Result<Collecting<'_>, CasError> {
        let addr = self as *const Fence as usize;
        if HELD.with(|h| h.borrow().contains(&addr)) {
            return Err(CasError::Invalid(
                "a collection cannot start inside a write session".into(),
            ));
        }
        let g = self.lock.write_locked();
        self.touched().clear();
        self.collecting.store(true, Ordering::SeqCst);
        Ok(Collecting {
            fence: self,
            _guard: g,
        })
    }

    /// Called by a put before it looks for or writes the object.
    pub fn note_put(&self, id: &Hash) {
        if self.collecting.load(Ordering::SeqCst) {
            self.touched().insert(*id);
        }
    }
}

/// Holds a write session on `store`'s fence, if it has one.
pub fn write_session(store: &dyn ObjectStore) -> WriteSession<'_> {
    match store.fence() {
        Some(f) => f.session(),
        None => WriteSession { guard: None },
    }
}

/// A problem found while walking objects: which object, what it was, where it was
/// reached from, and what is wrong.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Problem {
    pub object: String,
    pub what: &'static str,
    pub path: String,
    pub detail: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} (at {}): {}",
            self.what, self.object, self.path, self.detail
        )
    }
}

/// Marks every object reachable from the roots it is given. With `verify`, every
/// object is read and checked (file contents included); without, only trees and chunk
/// lists are read, which is all a collection needs to find the rest (a tree or chunk
/// list that cannot be read is a problem either way: what it names is unknown).
pub struct Marker<'a> {
    store: &'a dyn ObjectStore,
    verify: bool,
    marked: HashSet<Hash>,
    pub problems: Vec<Problem>,
    /// Objects read (verified) during the walk.
    pub objects_read: u64,
}

impl<'a> Marker<'a> {
    pub fn new(store: &'a dyn ObjectStore, verify: bool) -> Self {
        Marker {
            store,
            verify,
            marked: HashSet::new(),
            problems: Vec::new(),
            objects_read: 0,
        }
    }

    pub fn marked(&self) -> &HashSet<Hash> {
        &self.marked
    }

    pub fn into_marked(self) -> HashSet<Hash> {
        self.marked
    }

    fn problem(&mut self, id: Hash, what: &'static str, path: &str, e: impl ToString) {
        self.problems.push(Problem {
            object: id.to_hex(),
            what,
            path: path.to_string(),
            detail: e.to_string(),
        });
    }

    /// Marks a file's objects (its chunk list and chunks, or its single object).
    pub fn file(&mut self, f: FileRef, path: &str) {
        if !self.marked.insert(f.id.0) {
            return;
        }
        if !f.is_chunked() {
            if self.verify {
                self.objects_read += 1;
                match read_chunk(self.store, &super::ChunkId(f.id.0), f.size) {
                    Ok(_) => {}
                    Err(e) => self.problem(f.id.0, "file", path, e),
                }
            }
            return;
        }
        self.objects_read += 1;
        let list = match load_chunk_list(self.store, &f) {
            Ok(l) => l,
            Err(e) => return self.problem(f.id.0, "chunk list", path, e),
        };
        for (id, len) in &list.chunks {
            if !self.marked.insert(id.0) {
                continue;
            }
            if self.verify {
                self.objects_read += 1;
                if let Err(e) = read_chunk(self.store, id, *len as u64) {
                    self.problem(id.0, "chunk", path, e);
                }
            }
        }
    }

    /// Marks a tree and everything below it. `path` names where it was reached from
    /// (for problems).
    pub fn tree(&mut self, root: TreeId, path: &str) {
        let mut stack = vec![(root, path.to_string())];
        while let Some((id, path)) = stack.pop() {
            if !self.marked.insert(id.0) {
                continue;
            }
            self.objects_read += 1;
            let tree = match load_tree(self.store, &id) {
                Ok(t) => t,
                Err(e) => {
                    self.problem(id.0, "tree", &path, e);
                    continue;
                }
            };
            for e in tree.entries() {
                let child = if path.is_empty() || path.ends_with('/') {
                    format!("{path}{}", e.name_lossy())
                } else {
                    format!("{path}/{}", e.name_lossy())
                };
                match &e.content {
                    EntryContent::Dir(t) => stack.push((*t, child)),
                    EntryContent::File(_) => {
                        let f = e.file_ref().expect("a file entry");
                        self.file(f, &child);
                    }
                    _ => {}
                }
            }
        }
    }
}
