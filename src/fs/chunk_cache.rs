//! A bounded cache of verified chunks, so sequential reads of a large file fetch and
//! decompress each 1 MiB chunk once, not once per kernel read request.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::cas::ChunkId;

/// Least-recently-inserted eviction by total bytes.
pub struct ChunkCache {
    inner: Mutex<Inner>,
    capacity: usize,
}

struct Inner {
    map: HashMap<ChunkId, Arc<Vec<u8>>>,
    order: VecDeque<ChunkId>,
    bytes: usize,
}

impl ChunkCache {
    pub fn new(capacity_bytes: usize) -> Self {
        ChunkCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: VecDeque::new(),
                bytes: 0,
            }),
            capacity: capacity_bytes,
        }
    }

    pub fn get(&self, id: &ChunkId) -> Option<Arc<Vec<u8>>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(id)
            .cloned()
    }

    pub fn insert(&self, id: ChunkId, data: Arc<Vec<u8>>) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if data.len() > self.capacity || g.map.contains_key(&id) {
            return;
        }
        g.bytes += data.len();
        g.map.insert(id, data);
        g.order.push_back(id);
        while g.bytes > self.capacity {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some(d) = g.map.remove(&old) {
                g.bytes -= d.len();
            }
        }
    }

    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::Hash;

    #[test]
    fn evicts_oldest_beyond_capacity() {
        let c = ChunkCache::new(10);
        let id = |n: u8| ChunkId(Hash::of(&[n]));
        c.insert(id(1), Arc::new(vec![0; 4]));
        c.insert(id(2), Arc::new(vec![0; 4]));
        c.insert(id(3), Arc::new(vec![0; 4]));
        assert!(c.get(&id(1)).is_none());
        assert!(c.get(&id(2)).is_some() && c.get(&id(3)).is_some());
        assert_eq!(c.bytes(), 8);
        c.insert(id(4), Arc::new(vec![0; 11]));
        assert!(c.get(&id(4)).is_none(), "larger than the cache");
    }
}
