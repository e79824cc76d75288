//! The fence between writers and a garbage collection: every path that puts objects
//! and then makes something refer to them (a capture up to its append, a restore up to
//! its new base) holds a [`WriteSession`]; a collection holds the fence exclusively
//! ([`Collecting`]) from before it reads its roots until its sweep ends, so no session
//! is halfway between a put and the reference when the roots are read. Sessions are
//! counted per thread and re-entrant. As a second line, a put made while a collection
//! runs (a writer outside any session) is remembered, and the sweep skips it.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::error::CasError;
use super::hash::Hash;
use crate::sys::{Locked, ReadWriteLocked};

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

impl WriteSession<'_> {
    /// No hold: for a store without a fence.
    pub fn none() -> WriteSession<'static> {
        WriteSession { guard: None }
    }
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
