//! A bounded cache of verified chunks, so sequential reads of a large file fetch and
//! decompress each 1 MiB chunk once, not once per kernel read request, and the reader
//! of stored file contents built on it (shared by the read-only view and the workspace).

use crate::sys::Locked;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::cas::file::{read_chunk, ChunkList};
use crate::cas::{CasResult, ChunkId, FileRef, ObjectStore, CHUNK_SIZE};

/// Reads byte ranges of stored files through a [`ChunkCache`], fetching each chunk once
/// even when the kernel asks for it from several threads at once (readahead).
pub struct ChunkReader {
    objects: Arc<dyn ObjectStore>,
    cache: ChunkCache,
    fetching: Mutex<HashMap<ChunkId, Arc<Mutex<()>>>>,
}

impl ChunkReader {
    pub fn new(objects: Arc<dyn ObjectStore>, capacity_bytes: usize) -> ChunkReader {
        ChunkReader {
            objects,
            cache: ChunkCache::new(capacity_bytes),
            fetching: Mutex::new(HashMap::new()),
        }
    }

    /// One verified chunk of `len` bytes.
    pub fn chunk(&self, id: ChunkId, len: u64) -> CasResult<Arc<Vec<u8>>> {
        if let Some(c) = self.cache.get(&id) {
            return Ok(c);
        }
        let slot = {
            let mut f = self.fetching.locked();
            f.entry(id).or_default().clone()
        };
        let _turn = slot.locked();
        let result = match self.cache.get(&id) {
            Some(c) => Ok(c),
            None => read_chunk(self.objects.as_ref(), &id, len).map(|d| {
                let d = Arc::new(d);
                self.cache.insert(id, d.clone());
                d
            }),
        };
        self.fetching.locked().remove(&id);
        result
    }

    /// Up to `size` bytes of `file` from `offset`; `list` gives a chunked file's chunk
    /// list (asked for only when the file is chunked).
    pub fn read(
        &self,
        file: &FileRef,
        list: impl FnOnce() -> CasResult<Arc<ChunkList>>,
        offset: u64,
        size: u32,
    ) -> CasResult<Vec<u8>> {
        if offset >= file.size {
            return Ok(Vec::new());
        }
        let end = (offset + size as u64).min(file.size);
        if !file.is_chunked() {
            let data = self.chunk(ChunkId(file.id.0), file.size)?;
            return Ok(data[offset as usize..end as usize].to_vec());
        }
        let list = list()?;
        let cs = CHUNK_SIZE as u64;
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut pos = offset;
        while pos < end {
            let i = (pos / cs) as usize;
            let (id, len) = list.chunks[i];
            let data = self.chunk(id, len as u64)?;
            let start = (pos - i as u64 * cs) as usize;
            let stop = ((end - i as u64 * cs) as usize).min(data.len());
            out.extend_from_slice(&data[start..stop]);
            pos = i as u64 * cs + stop as u64;
        }
        Ok(out)
    }
}

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
        self.inner.locked().map.get(id).cloned()
    }

    pub fn insert(&self, id: ChunkId, data: Arc<Vec<u8>>) {
        let mut g = self.inner.locked();
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
        self.inner.locked().bytes
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
