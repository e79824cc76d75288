//! What garbage collection needs from the object layer beyond the fence
//! ([`super::fence`]): a walk that marks (and, for fsck, verifies) everything reachable
//! from a set of roots.

use std::collections::HashSet;

use super::file::FileRef;
use super::file::{load_chunk_list, read_chunk};
use super::hash::{Hash, ObjectId, TreeId};
use super::store::ObjectStore;
use super::tree::EntryContent;
use super::tree_io::load_tree;

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
    /// Whether what a tree or chunk list names is fetched ahead, together.
    fetch_ahead: bool,
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
            fetch_ahead: false,
            marked: HashSet::new(),
            problems: Vec::new(),
            objects_read: 0,
        }
    }

    /// With `verify`, asks the store for what each tree (and chunk list) names in one
    /// [`ObjectStore::prefetch`] before reading it: a remote store then fetches a
    /// directory's objects by the pack, in a few ranged reads, instead of one each.
    pub fn fetching_ahead(mut self) -> Self {
        self.fetch_ahead = self.verify;
        self
    }

    /// Fetches ahead those of `ids` not marked yet (see [`Marker::fetching_ahead`]).
    fn ahead(&self, ids: impl Iterator<Item = Hash>) {
        if !self.fetch_ahead {
            return;
        }
        let ids: Vec<ObjectId> = ids
            .filter(|h| !self.marked.contains(h))
            .map(ObjectId)
            .collect();
        if ids.len() > 1 {
            self.store.prefetch(&ids);
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
                match read_chunk(self.store, &super::hash::ChunkId(f.id.0), f.size) {
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
        self.ahead(list.chunks.iter().map(|(id, _)| id.0));
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
            self.ahead(tree.entries().iter().filter_map(|e| match &e.content {
                EntryContent::Dir(t) => Some(t.0),
                EntryContent::File(_) => e.file_ref().map(|f| f.id.0),
                _ => None,
            }));
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
