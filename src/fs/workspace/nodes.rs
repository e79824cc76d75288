//! The inode table's map from inode number to node: a hash table of boxed nodes that
//! each carry their own number, so that a bucket is one pointer (8 bytes, not 16 with
//! the key beside it). At a million nodes the kernel knows, that is 17 MB less.

use hashbrown::HashTable;

use super::node::Node;

#[derive(Default)]
pub(super) struct Nodes {
    table: HashTable<Box<Node>>,
}

/// splitmix64's finalizer: inode numbers are consecutive, their hashes must not be.
fn hash(ino: u64) -> u64 {
    let mut z = ino.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Nodes {
    pub(super) fn get(&self, ino: &u64) -> Option<&Node> {
        self.table.find(hash(*ino), |n| n.ino == *ino).map(|n| &**n)
    }

    pub(super) fn get_mut(&mut self, ino: &u64) -> Option<&mut Node> {
        self.table
            .find_mut(hash(*ino), |n| n.ino == *ino)
            .map(|n| &mut **n)
    }

    pub(super) fn contains_key(&self, ino: &u64) -> bool {
        self.get(ino).is_some()
    }

    /// Puts `node` in as inode `ino` (its number is set here), returning the node that
    /// had the number.
    pub(super) fn insert(&mut self, ino: u64, mut node: Box<Node>) -> Option<Box<Node>> {
        node.ino = ino;
        match self
            .table
            .entry(hash(ino), |n| n.ino == ino, |n| hash(n.ino))
        {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                Some(std::mem::replace(o.get_mut(), node))
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(node);
                None
            }
        }
    }

    pub(super) fn remove(&mut self, ino: &u64) -> Option<Box<Node>> {
        match self.table.find_entry(hash(*ino), |n| n.ino == *ino) {
            Ok(o) => Some(o.remove().0),
            Err(_) => None,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn capacity(&self) -> usize {
        self.table.capacity()
    }

    pub(super) fn shrink_to_fit(&mut self) {
        self.table.shrink_to_fit(|n| hash(n.ino));
    }

    /// Every node, consumed (each knows its number).
    pub(super) fn into_nodes(self) -> impl Iterator<Item = Box<Node>> {
        self.table.into_iter()
    }
}

impl std::ops::Index<&u64> for Nodes {
    type Output = Node;

    fn index(&self, ino: &u64) -> &Node {
        self.get(ino)
            .unwrap_or_else(|| panic!("inode {ino} is not in the table"))
    }
}
