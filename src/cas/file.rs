//! File contents: one chunk, or a list of fixed-size chunks.
//!
//! A file of at most [`CHUNK_SIZE`] bytes is one object and its [`FileId`] is that
//! object's hash. A larger file is cut into chunks of exactly `CHUNK_SIZE` bytes (the last
//! one shorter) and its `FileId` is the hash of its encoded [`ChunkList`]. Fixed offsets
//! mean a write inside a big file touches only the chunks under it: they alone are
//! re-hashed and stored. `benches/chunking.rs` measured the choice of size and of fixed
//! against content-defined chunking; docs/checkpoints.md has the figures.

use std::io::{Read, Write};
use std::path::Path;

use super::encoding::{put_varint, Reader};
use super::error::{CasError, CasResult};
use super::hash::{ChunkId, FileId, Hash, ObjectId};
use super::store::{ObjectStore, PutOutcome};
use super::tree::{EntryContent, TreeEntry};

/// The chunk size for large files (1 MiB).
pub const CHUNK_SIZE: usize = 1 << 20;

const CHUNK_LIST_VERSION: u8 = 1;

/// A file's content as the tree names it: its id and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileRef {
    pub id: FileId,
    pub size: u64,
}

impl FileRef {
    pub fn is_chunked(&self) -> bool {
        self.size > CHUNK_SIZE as u64
    }
}

impl TreeEntry {
    pub fn file_ref(&self) -> Option<FileRef> {
        match self.content {
            EntryContent::File(id) => Some(FileRef {
                id,
                size: self.size,
            }),
            _ => None,
        }
    }
}

/// The ordered chunks of a large file. All but the last are exactly [`CHUNK_SIZE`] long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkList {
    pub chunks: Vec<(ChunkId, u32)>,
}

impl ChunkList {
    pub fn total_len(&self) -> u64 {
        self.chunks.iter().map(|c| c.1 as u64).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.chunks.len() * 36);
        out.push(CHUNK_LIST_VERSION);
        put_varint(&mut out, self.chunks.len() as u64);
        for (id, len) in &self.chunks {
            out.extend_from_slice(id.0.as_bytes());
            put_varint(&mut out, *len as u64);
        }
        out
    }

    /// Decodes and checks the fixed-size chunking invariant.
    pub fn decode(bytes: &[u8]) -> Result<ChunkList, String> {
        let mut r = Reader::new(bytes);
        let version = r.u8()?;
        if version != CHUNK_LIST_VERSION {
            return Err(format!("unknown chunk list version {version}"));
        }
        let n = r.len(bytes.len() / 33 + 1, "chunk count")?;
        if n < 2 {
            return Err(format!("a chunk list needs at least 2 chunks, has {n}"));
        }
        let mut chunks = Vec::with_capacity(n);
        for i in 0..n {
            let id = ChunkId(r.hash()?);
            let len = r.len(CHUNK_SIZE, "chunk length")?;
            let last = i + 1 == n;
            if (!last && len != CHUNK_SIZE) || len == 0 {
                return Err(format!("chunk {i} has length {len}"));
            }
            chunks.push((id, len as u32));
        }
        r.finish()?;
        Ok(ChunkList { chunks })
    }
}

/// Totals of what storing some content wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub new_objects: u64,
    pub new_bytes: u64,
    pub reused_objects: u64,
}

impl StoreStats {
    pub fn record(&mut self, p: &PutOutcome) {
        if p.new {
            self.new_objects += 1;
            self.new_bytes += p.stored_len;
        } else {
            self.reused_objects += 1;
        }
    }

    pub fn add(&mut self, o: &StoreStats) {
        self.new_objects += o.new_objects;
        self.new_bytes += o.new_bytes;
        self.reused_objects += o.reused_objects;
    }
}

/// Stores `data` (a whole file held in memory) and returns its reference.
pub fn store_bytes(
    store: &dyn ObjectStore,
    data: &[u8],
    stats: &mut StoreStats,
) -> CasResult<FileRef> {
    if data.len() <= CHUNK_SIZE {
        let p = store.put(data)?;
        stats.record(&p);
        return Ok(FileRef {
            id: FileId(p.id.0),
            size: data.len() as u64,
        });
    }
    let mut list = ChunkList { chunks: Vec::new() };
    for chunk in data.chunks(CHUNK_SIZE) {
        let p = store.put(chunk)?;
        stats.record(&p);
        list.chunks.push((ChunkId(p.id.0), chunk.len() as u32));
    }
    let p = store.put_metadata(&list.encode())?;
    stats.record(&p);
    Ok(FileRef {
        id: FileId(p.id.0),
        size: data.len() as u64,
    })
}

/// Stores everything `reader` yields, holding at most two chunks in memory.
/// A read error is reported against `path`.
pub fn store_reader(
    store: &dyn ObjectStore,
    reader: &mut dyn Read,
    path: &Path,
    stats: &mut StoreStats,
) -> CasResult<FileRef> {
    store_reader_over(store, reader, path, None, stats)
}

/// [`store_reader`] for a new version of a large file whose previous version had chunk
/// list `base`: a chunk equal to the chunk at the same position in `base` is known to be
/// stored and is neither looked up nor written again, so a small change inside a large
/// file costs hashing it, not storing it.
pub fn store_reader_over(
    store: &dyn ObjectStore,
    reader: &mut dyn Read,
    path: &Path,
    base: Option<&ChunkList>,
    stats: &mut StoreStats,
) -> CasResult<FileRef> {
    let put_chunk = |data: &[u8], index: usize, stats: &mut StoreStats| -> CasResult<ChunkId> {
        if let Some((id, len)) = base.and_then(|b| b.chunks.get(index)) {
            if *len as usize == data.len() && id.0 == crate::cas::hash::Hash::of(data) {
                stats.reused_objects += 1;
                return Ok(*id);
            }
        }
        let p = store.put(data)?;
        stats.record(&p);
        Ok(ChunkId(p.id.0))
    };
    let io = |e| CasError::io(path, e);
    let mut pending = vec![0u8; CHUNK_SIZE];
    let mut pending_len = read_full(reader, &mut pending).map_err(io)?;
    if pending_len < CHUNK_SIZE {
        return store_bytes(store, &pending[..pending_len], stats);
    }
    let mut next = vec![0u8; CHUNK_SIZE];
    let mut list = ChunkList { chunks: Vec::new() };
    loop {
        let m = read_full(reader, &mut next).map_err(io)?;
        if m == 0 && list.chunks.is_empty() {
            // Exactly one chunk long: a single object.
            return store_bytes(store, &pending, stats);
        }
        let id = put_chunk(&pending[..pending_len], list.chunks.len(), stats)?;
        list.chunks.push((id, pending_len as u32));
        if m == 0 {
            break;
        }
        std::mem::swap(&mut pending, &mut next);
        pending_len = m;
        if m < CHUNK_SIZE {
            let id = put_chunk(&pending[..m], list.chunks.len(), stats)?;
            list.chunks.push((id, m as u32));
            break;
        }
    }
    let size = list.total_len();
    let p = store.put_metadata(&list.encode())?;
    stats.record(&p);
    Ok(FileRef {
        id: FileId(p.id.0),
        size,
    })
}

/// Stores a new version of a large file (`size` bytes of `file`, more than one chunk)
/// whose previous version had chunk list `base`, when only the chunks numbered in
/// `changed` may differ from `base` (the caller saw every write since): those, and
/// chunks `base` lacks or has at another length, are read, hashed and stored; every
/// other chunk is taken from `base` unread. Returns the reference and the bytes read.
pub fn store_changed_chunks(
    store: &dyn ObjectStore,
    file: &std::fs::File,
    path: &Path,
    size: u64,
    base: &ChunkList,
    changed: &std::collections::BTreeSet<u64>,
    stats: &mut StoreStats,
) -> CasResult<(FileRef, u64)> {
    use std::os::unix::fs::FileExt;
    debug_assert!(size > CHUNK_SIZE as u64);
    let chunk = CHUNK_SIZE as u64;
    let mut list = ChunkList {
        chunks: Vec::with_capacity(size.div_ceil(chunk) as usize),
    };
    let mut buf = Vec::new();
    let mut read = 0u64;
    for i in 0..size.div_ceil(chunk) {
        let len = chunk.min(size - i * chunk) as u32;
        match base.chunks.get(i as usize) {
            Some(&(id, l)) if l == len && !changed.contains(&i) => {
                stats.reused_objects += 1;
                list.chunks.push((id, len));
                continue;
            }
            _ => {}
        }
        buf.resize(len as usize, 0);
        file.read_exact_at(&mut buf, i * chunk)
            .map_err(|e| CasError::io(path, e))?;
        read += len as u64;
        let p = store.put(&buf)?;
        stats.record(&p);
        list.chunks.push((ChunkId(p.id.0), len));
    }
    let p = store.put_metadata(&list.encode())?;
    stats.record(&p);
    Ok((
        FileRef {
            id: FileId(p.id.0),
            size,
        },
        read,
    ))
}

fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Loads a large file's chunk list and checks it against the expected size.
pub fn load_chunk_list(store: &dyn ObjectStore, file: &FileRef) -> CasResult<ChunkList> {
    let bytes = store.get(&ObjectId(file.id.0), "chunk list")?;
    let list = ChunkList::decode(&bytes).map_err(|detail| CasError::Decode {
        what: "chunk list",
        id: file.id.0,
        detail,
    })?;
    if list.total_len() != file.size {
        return Err(CasError::Decode {
            what: "chunk list",
            id: file.id.0,
            detail: format!(
                "chunks add up to {} bytes, the tree says {}",
                list.total_len(),
                file.size
            ),
        });
    }
    Ok(list)
}

/// Reads one chunk and checks its length.
pub fn read_chunk(store: &dyn ObjectStore, id: &ChunkId, expected_len: u64) -> CasResult<Vec<u8>> {
    let data = store.get(&ObjectId(id.0), "chunk")?;
    if data.len() as u64 != expected_len {
        return Err(CasError::Decode {
            what: "chunk",
            id: id.0,
            detail: format!("{} bytes, expected {expected_len}", data.len()),
        });
    }
    Ok(data)
}

/// Writes a file's whole content to `out`, verifying every object before it is
/// written. A write error is reported against `path`.
pub fn write_file_to(
    store: &dyn ObjectStore,
    file: &FileRef,
    out: &mut dyn Write,
    path: &Path,
) -> CasResult<()> {
    if !file.is_chunked() {
        let data = read_chunk(store, &ChunkId(file.id.0), file.size)?;
        return out.write_all(&data).map_err(|e| CasError::io(path, e));
    }
    let list = load_chunk_list(store, file)?;
    for (id, len) in &list.chunks {
        let data = read_chunk(store, id, *len as u64)?;
        out.write_all(&data).map_err(|e| CasError::io(path, e))?;
    }
    Ok(())
}

/// Reads a whole file into memory.
pub fn read_file(store: &dyn ObjectStore, file: &FileRef) -> CasResult<Vec<u8>> {
    let mut out = Vec::with_capacity(file.size as usize);
    write_file_to(store, file, &mut out, Path::new("<memory>"))?;
    Ok(out)
}

/// The reference a file read from `reader` would get, without storing anything; holds
/// one chunk in memory at a time.
pub fn hash_reader(reader: &mut dyn Read) -> std::io::Result<FileRef> {
    let mut buf = vec![0u8; CHUNK_SIZE];
    let mut chunks = Vec::new();
    loop {
        let n = read_full(reader, &mut buf)?;
        if n == 0 && !chunks.is_empty() {
            break;
        }
        chunks.push((ChunkId(Hash::of(&buf[..n])), n as u32));
        if n < CHUNK_SIZE {
            break;
        }
    }
    let size: u64 = chunks.iter().map(|c| c.1 as u64).sum();
    if chunks.len() == 1 {
        return Ok(FileRef {
            id: FileId(chunks[0].0 .0),
            size,
        });
    }
    let list = ChunkList { chunks };
    Ok(FileRef {
        id: FileId(Hash::of(&list.encode())),
        size,
    })
}

/// The id a file with this content would get, without storing anything.
pub fn file_id_of(data: &[u8]) -> FileId {
    if data.len() <= CHUNK_SIZE {
        return FileId(Hash::of(data));
    }
    let list = ChunkList {
        chunks: data
            .chunks(CHUNK_SIZE)
            .map(|c| (ChunkId(Hash::of(c)), c.len() as u32))
            .collect(),
    };
    FileId(Hash::of(&list.encode()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::kv::Database;
    use crate::cas::rocks_store::RocksObjectStore;
    use std::sync::Arc;

    fn store() -> (tempfile::TempDir, RocksObjectStore) {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::open(&dir.path().join("db"), &[]).unwrap());
        (dir, RocksObjectStore::new(db))
    }

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Reading only the chunks named changed gives the same reference as reading the
    /// whole new version, for growth, shrinking and writes inside.
    #[test]
    fn changed_chunks_give_the_reference_of_a_full_read() {
        let (d, s) = store();
        let c = CHUNK_SIZE;
        let old = pattern(5 * c + 100, 1);
        let old_ref = store_bytes(&s, &old, &mut StoreStats::default()).unwrap();
        let base = load_chunk_list(&s, &old_ref).unwrap();
        let edits: Vec<(Vec<u8>, Vec<u64>)> = vec![
            (old.clone(), vec![]),
            // A write inside chunk 2.
            (
                {
                    let mut v = old.clone();
                    v[2 * c + 7] ^= 1;
                    v
                },
                vec![2],
            ),
            // Grown by 3 chunks (chunk 5 gets longer).
            (
                {
                    let mut v = old.clone();
                    v.extend(pattern(3 * c, 2));
                    v
                },
                vec![5, 6, 7, 8],
            ),
            // Shrunk into chunk 3.
            (old[..3 * c + 10].to_vec(), vec![3, 4, 5]),
            // Shrunk to a chunk boundary: chunk 1 keeps its length and content.
            (old[..2 * c].to_vec(), vec![2, 3, 4, 5]),
        ];
        for (i, (new, changed)) in edits.into_iter().enumerate() {
            let path = d.path().join(format!("f{i}"));
            std::fs::write(&path, &new).unwrap();
            let f = std::fs::File::open(&path).unwrap();
            let changed: std::collections::BTreeSet<u64> = changed.into_iter().collect();
            let mut st = StoreStats::default();
            let (r, read) =
                store_changed_chunks(&s, &f, &path, new.len() as u64, &base, &changed, &mut st)
                    .unwrap();
            let full = store_bytes(&s, &new, &mut StoreStats::default()).unwrap();
            assert_eq!(r, full, "edit {i}");
            assert_eq!(read_file(&s, &r).unwrap(), new, "edit {i}");
            let expect_read: u64 = changed
                .iter()
                .filter(|&&k| (k as usize) * c < new.len())
                .map(|&k| (new.len() - k as usize * c).min(c) as u64)
                .sum();
            assert_eq!(read, expect_read, "edit {i}: read only the changed chunks");
        }
    }

    #[test]
    fn sizes_around_the_chunk_boundary_round_trip() {
        let (_d, s) = store();
        for len in [
            0,
            1,
            CHUNK_SIZE - 1,
            CHUNK_SIZE,
            CHUNK_SIZE + 1,
            2 * CHUNK_SIZE,
            2 * CHUNK_SIZE + 7,
        ] {
            let data = pattern(len, len as u64);
            let mut st = StoreStats::default();
            let a = store_bytes(&s, &data, &mut st).unwrap();
            let b = store_reader(&s, &mut &data[..], Path::new("x"), &mut st).unwrap();
            assert_eq!(a, b, "len {len}");
            assert_eq!(a.id, file_id_of(&data));
            assert_eq!(hash_reader(&mut &data[..]).unwrap(), a);
            assert_eq!(a.size, len as u64);
            assert_eq!(read_file(&s, &a).unwrap(), data, "len {len}");
        }
    }

    #[test]
    fn a_write_inside_a_large_file_stores_only_its_chunk() {
        let (_d, s) = store();
        let mut data = pattern(5 * CHUNK_SIZE + 100, 1);
        let mut st = StoreStats::default();
        store_bytes(&s, &data, &mut st).unwrap();
        assert_eq!(st.new_objects, 7);
        data[3 * CHUNK_SIZE + 10] ^= 0xff;
        let mut st = StoreStats::default();
        store_bytes(&s, &data, &mut st).unwrap();
        // The changed chunk and the new chunk list.
        assert_eq!(st.new_objects, 2);
        assert_eq!(st.reused_objects, 5);
    }

    #[test]
    fn storing_over_a_base_skips_its_unchanged_chunks() {
        let (_d, s) = store();
        let mut data = pattern(4 * CHUNK_SIZE + 100, 2);
        let mut st = StoreStats::default();
        let first = store_bytes(&s, &data, &mut st).unwrap();
        let base = load_chunk_list(&s, &first).unwrap();
        data[2 * CHUNK_SIZE + 1] ^= 0xff;
        data.extend_from_slice(b"grown");
        let mut st = StoreStats::default();
        let second =
            store_reader_over(&s, &mut &data[..], Path::new("x"), Some(&base), &mut st).unwrap();
        // Chunks 0, 1 and 3 match the base and are not looked up; chunk 2 and the last
        // (it grew) are new, and so is the list.
        assert_eq!(st.reused_objects, 3);
        assert_eq!(st.new_objects, 3);
        assert_eq!(
            second,
            store_bytes(&s, &data, &mut StoreStats::default()).unwrap()
        );
        assert_eq!(read_file(&s, &second).unwrap(), data);
    }

    #[test]
    fn chunk_list_decoder_refuses_bad_input() {
        let list = ChunkList {
            chunks: vec![
                (ChunkId(Hash::of(b"a")), CHUNK_SIZE as u32),
                (ChunkId(Hash::of(b"b")), 5),
            ],
        };
        let enc = list.encode();
        assert_eq!(ChunkList::decode(&enc).unwrap(), list);
        for cut in 0..enc.len() {
            assert!(ChunkList::decode(&enc[..cut]).is_err());
        }
        let mut bad = enc.clone();
        bad.push(0);
        assert!(ChunkList::decode(&bad).is_err());
        let short_first = ChunkList {
            chunks: vec![(ChunkId(Hash::of(b"a")), 10), (ChunkId(Hash::of(b"b")), 5)],
        };
        assert!(ChunkList::decode(&short_first.encode()).is_err());
    }
}
