//! File contents packed as they are put, so that an upload sends packs it does not
//! have to fill by reading every object back from the local store.

use std::collections::HashMap;

use crate::cas::hash::Hash;
use crate::cas::pack::PackWriter;

/// File contents new to the local store are packed as they are put, up to this many
/// bytes per sync; an upload then sends those packs as they are instead of reading the
/// objects back (beyond it, they are read back).
pub(super) const PACKED_AT_PUT: usize = 256 << 20;
/// A pack ends with the object that takes it to the pack size or past it (a chunk is at
/// most 1 MiB): room enough that it is never copied to grow.
pub(super) const PACK_SLACK: usize = 2 << 20;

/// File contents packed as they are put, a pack filling per capture thread: a thread
/// puts a directory's files (or a run of them) one after the other, so its pack holds
/// them together, as a restore reads them (one pack for all threads would interleave
/// two directories and a restore would read twice the bytes it wants).
#[derive(Default)]
pub(super) struct PackedAtPut {
    filling: HashMap<Option<usize>, PackWriter>,
    full: Vec<PackWriter>,
    bytes: usize,
}

impl PackedAtPut {
    /// Appends `id` to the calling thread's pack, unless [`PACKED_AT_PUT`] is reached.
    pub(super) fn push(&mut self, id: Hash, stored: &[u8], pack_size: usize) {
        if self.bytes + stored.len() > PACKED_AT_PUT {
            return;
        }
        self.bytes += stored.len();
        let w = self
            .filling
            .entry(rayon::current_thread_index())
            .or_insert_with(|| PackWriter::with_capacity(pack_size + PACK_SLACK));
        w.push(id, stored);
        if w.size() >= pack_size {
            let full = std::mem::replace(w, PackWriter::with_capacity(pack_size + PACK_SLACK));
            self.full.push(full);
        }
    }

    /// The packs: the full ones, then the threads' partial ones joined up to the pack
    /// size (a small capture on many cores makes one pack, not one per thread).
    pub(super) fn into_packs(self, pack_size: usize) -> Vec<PackWriter> {
        let mut packs = self.full;
        let mut filling: Vec<_> = self.filling.into_iter().collect();
        filling.sort_by_key(|(thread, _)| *thread);
        let mut joined: Option<PackWriter> = None;
        for (_, w) in filling.into_iter().filter(|(_, w)| !w.is_empty()) {
            joined = Some(match joined {
                Some(mut j) if j.size() + w.size() <= pack_size => {
                    j.absorb(w);
                    j
                }
                Some(j) => {
                    packs.push(j);
                    w
                }
                None => w,
            });
        }
        packs.extend(joined);
        packs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Puts from a pool's threads fill a pack per thread; what is left in them at the
    /// upload is joined into packs of at most the pack size; every object is in one
    /// pack once, its bytes where its entry says.
    #[test]
    fn packs_filled_at_put_time_are_per_thread_then_joined() {
        let objs: Vec<(Hash, Vec<u8>)> = (0..200u32)
            .map(|i| {
                let v: Vec<u8> = (0..1_000 + i * 37).map(|j| (j ^ i) as u8).collect();
                (Hash::of(&v), v)
            })
            .collect();
        let size = 64 << 10;
        let packed = Mutex::new(PackedAtPut::default());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        // Each of the pool's threads puts every fourth object (a parallel iterator
        // may leave all the work to one thread on a busy machine).
        pool.broadcast(|ctx| {
            for (id, v) in objs.iter().skip(ctx.index()).step_by(ctx.num_threads()) {
                packed.lock().unwrap().push(*id, v, size);
            }
        });
        let packed = packed.into_inner().unwrap();
        assert_eq!(packed.filling.len(), 4, "one pack per thread");
        let full = packed.full.len();
        let packs = packed.into_packs(size);
        let sizes: Vec<usize> = packs.iter().map(|p| p.size()).collect();
        // A full pack ends with the object that takes it to the size or past it; the
        // partial ones are joined while two fit in one.
        assert!(
            sizes[..full]
                .iter()
                .all(|&n| (size..size + 8_400).contains(&n)),
            "{sizes:?}"
        );
        assert!(sizes[full..].iter().all(|&n| n <= size), "{sizes:?}");
        assert!(
            sizes[full..].windows(2).all(|w| w[0] + w[1] > size),
            "{sizes:?}"
        );
        let mut found = HashMap::new();
        for p in packs {
            let (_, bytes, entries) = p.finish();
            for e in &entries {
                let at = &bytes[e.offset as usize..(e.offset + e.len) as usize];
                assert!(found.insert(e.id, at.to_vec()).is_none(), "{} twice", e.id);
            }
        }
        assert_eq!(found.len(), objs.len());
        for (id, v) in &objs {
            assert_eq!(&found[id], v);
        }
    }
}
