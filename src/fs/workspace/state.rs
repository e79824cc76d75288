//! What the workspace's lock guards: the inode table with its numbering, the dirty
//! set, the numbers of unloaded directories' children, subscribers and local copies.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::events::Events;
use super::nodes::Nodes;
use crate::cas::TreeId;
use crate::fs::dirty::Tag;

/// The inode table and all that changes with it, under the workspace's one mutex.
pub(super) struct State {
    /// Boxed, each with its number: a bucket is one pointer, not a whole node (192
    /// bytes), and the table's spare capacity (up to half its buckets after a growth)
    /// costs little.
    pub(super) nodes: Nodes,
    pub(super) next_ino: u64,
    pub(super) base: TreeId,
    pub(super) tag: Tag,
    pub(super) dirty: BTreeSet<u64>,
    /// Nodes with an open handle (a root swap keeps exactly these, detached).
    pub(super) open: HashSet<u64>,
    /// Directories whose children were unloaded (the kernel had forgotten them): their
    /// tree and the children's inode numbers in name order, given back to the same
    /// names when the directory is loaded again, so that an unchanged file keeps its
    /// inode number (git's index compares them). Emptied by a root swap: numbers the
    /// kernel may still hold for the old tree are never handed out again.
    pub(super) unloaded: HashMap<u64, (TreeId, Numbers)>,
    pub(super) events: Events,
    pub(super) copies: Copies,
}

/// The inode numbers an unloaded directory's children had, in name order.
pub(super) enum Numbers {
    /// `count` numbers from `first` on: children loaded together from one tree get
    /// consecutive numbers, so this is the common case, and it holds nothing on the heap
    /// (small allocations made while a table is unloaded would pin the pages of the
    /// freed nodes around them).
    Run {
        first: u64,
        count: usize,
    },
    List(Vec<u64>),
}

impl Numbers {
    pub(super) fn of(inos: Vec<u64>) -> Numbers {
        let first = inos.first().copied().unwrap_or(0);
        if inos.iter().zip(first..).all(|(&i, n)| i == n) {
            Numbers::Run {
                first,
                count: inos.len(),
            }
        } else {
            Numbers::List(inos)
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Numbers::Run { count, .. } => *count,
            Numbers::List(v) => v.len(),
        }
    }

    pub(super) fn get(&self, k: usize) -> u64 {
        match self {
            Numbers::Run { first, .. } => first + k as u64,
            Numbers::List(v) => v[k],
        }
    }
}

/// Local copies of clean files (made for passthrough reads, or left by a checkpoint
/// of a written file) that no handle has open: kept for the next open, evicted oldest
/// first beyond the workspace's limit (reads then come from the store again).
#[derive(Default)]
pub(super) struct Copies {
    /// (inode, generation), oldest first; entries whose generation is not the one in
    /// `sizes` are stale.
    pub(super) order: std::collections::VecDeque<(u64, u64)>,
    /// inode -> (size, generation)
    pub(super) sizes: HashMap<u64, (u64, u64)>,
    pub(super) bytes: u64,
    pub(super) generation: u64,
}
