//! Pack files and their indexes, the remote store's layout for many small objects (as
//! restic, borg and git pack theirs): objects written by one upload are appended to
//! packs of a target size, and an index names, for every object, its pack, offset and
//! length. Pure encoding and decoding here; the requests are in `remote_store`.
//!
//! - A **pack** is the objects' stored encodings (header byte, raw or zstd: the same
//!   bytes as the local store keeps), back to back, nothing else. Its name is the blake3
//!   hash of its bytes. Every object read out of it is verified against its own hash.
//! - An **index** lists packs and the objects in them. Its name is the hash of its
//!   bytes, so an index is never changed, only replaced: garbage collection writes a
//!   new index and then deletes the ones it covers. Encoding: the magic `casfsidx`, a
//!   version byte, then one zstd frame (declaring its size) of: pack count (u32), per
//!   pack its hash, the time gc marked it for deletion (u64 milliseconds, 0 when it is
//!   not) and its object count (u32); entry count (u32), then the objects in strictly
//!   increasing hash order, in columns: every hash, then every pack number, offset and
//!   length (u32 each), all little endian. Columns keep the hashes, which do not
//!   compress, apart from the numbers, which do: zstd stores the hashes as raw blocks
//!   (a memcpy to decode) and packs the numbers small. (Version 1, still read, held
//!   one row per object, which zstd Huffman-coded: at 100k objects 6% larger, and
//!   loaded in 12-14 ms against 5-7 ms, measured on a fresh host's `casfs cat`.)
//!   Decoding checks every count, order and range and names the index in every error;
//!   a lookup is a binary search over the decoded hashes.

use super::error::{CasError, CasResult};
use super::hash::Hash;

const MAGIC: &[u8; 8] = b"casfsidx";
const VERSION: u8 = 2;
/// Bytes of one entry: hash, pack number, offset, length.
const ENTRY: usize = 32 + 4 + 4 + 4;
/// Where an entry's columns start, in entries' bytes: hashes, pack numbers, offsets,
/// lengths.
const HASHES: usize = 0;
const PACKS: usize = 32;
const OFFSETS: usize = 36;
const LENGTHS: usize = 40;
/// Bytes of one pack's record: hash, marked time, object count.
const PACK: usize = 32 + 8 + 4;
/// The most bytes an index may decode to (46 million objects): a damaged or hostile
/// index cannot make a reader allocate more.
const MAX_DECODED: u64 = 2 << 30;

/// Where an object lives in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub pack: Hash,
    pub offset: u64,
    pub len: u64,
    /// When garbage collection marked the pack for deletion (ms since the epoch).
    pub pending_since_ms: Option<u64>,
}

/// A pack named by an index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackInfo {
    pub id: Hash,
    pub pending_since_ms: Option<u64>,
    pub objects: u32,
}

/// A decoded index: its packs, and its entries sorted by hash, in columns (as
/// encoded): `n` hashes, then `n` pack numbers, offsets and lengths.
#[derive(Debug, Clone)]
pub struct PackIndex {
    packs: Vec<PackInfo>,
    n: usize,
    columns: Vec<u8>,
}

/// One object of a pack being written or described.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    pub id: Hash,
    pub offset: u64,
    pub len: u64,
}

impl PackIndex {
    /// Builds an index of `packs`, each with its entries and deletion mark. An object
    /// in more than one pack keeps the location in the first pack (of those not marked
    /// for deletion, if any is not).
    pub fn build(packs: &[(Hash, Option<u64>, Vec<PackEntry>)]) -> CasResult<PackIndex> {
        let mut all: Vec<(Hash, u32, u32, u32)> = Vec::new();
        let mut infos = Vec::with_capacity(packs.len());
        for (n, (id, pending, entries)) in packs.iter().enumerate() {
            infos.push(PackInfo {
                id: *id,
                pending_since_ms: *pending,
                objects: 0,
            });
            for e in entries {
                let (Ok(off), Ok(len)) = (u32::try_from(e.offset), u32::try_from(e.len)) else {
                    return Err(CasError::Invalid(format!(
                        "pack {id}: object {} at {} (+{}) is beyond 4 GiB",
                        e.id, e.offset, e.len
                    )));
                };
                all.push((e.id, n as u32, off, len));
            }
        }
        // Sorted by hash, then live packs first, then pack order: the first of a hash wins.
        all.sort_by_key(|&(h, p, _, _)| (h, packs[p as usize].1.is_some(), p));
        all.dedup_by_key(|e| e.0);
        let mut columns = Vec::with_capacity(all.len() * ENTRY);
        for (h, p, _, _) in &all {
            infos[*p as usize].objects += 1;
            columns.extend_from_slice(h.as_bytes());
        }
        for e in &all {
            columns.extend_from_slice(&e.1.to_le_bytes());
        }
        for e in &all {
            columns.extend_from_slice(&e.2.to_le_bytes());
        }
        for e in &all {
            columns.extend_from_slice(&e.3.to_le_bytes());
        }
        Ok(PackIndex {
            packs: infos,
            n: all.len(),
            columns,
        })
    }

    pub fn packs(&self) -> &[PackInfo] {
        &self.packs
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn hash_at(&self, i: usize) -> &[u8] {
        let at = HASHES * self.n + i * 32;
        &self.columns[at..at + 32]
    }

    /// Entry `i`'s number in the column that starts at `col` entries' bytes.
    fn u32_at(&self, col: usize, i: usize) -> u32 {
        let at = col * self.n + i * 4;
        u32::from_le_bytes(self.columns[at..at + 4].try_into().expect("4 bytes"))
    }

    fn entry(&self, i: usize) -> (Hash, Location) {
        let h = Hash(self.hash_at(i).try_into().expect("32 bytes"));
        let p = &self.packs[self.u32_at(PACKS, i) as usize];
        (
            h,
            Location {
                pack: p.id,
                offset: self.u32_at(OFFSETS, i) as u64,
                len: self.u32_at(LENGTHS, i) as u64,
                pending_since_ms: p.pending_since_ms,
            },
        )
    }

    /// Where object `id` is, if this index names it.
    pub fn find(&self, id: &Hash) -> Option<Location> {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.hash_at(mid).cmp(id.as_bytes().as_slice()) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.entry(mid).1),
            }
        }
        None
    }

    /// Every object with its location, in hash order.
    pub fn iter(&self) -> impl Iterator<Item = (Hash, Location)> + '_ {
        (0..self.len()).map(|i| self.entry(i))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(8 + self.packs.len() * PACK + self.columns.len());
        body.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        for p in &self.packs {
            body.extend_from_slice(p.id.as_bytes());
            body.extend_from_slice(&p.pending_since_ms.unwrap_or(0).to_le_bytes());
            body.extend_from_slice(&p.objects.to_le_bytes());
        }
        body.extend_from_slice(&(self.len() as u32).to_le_bytes());
        body.extend_from_slice(&self.columns);
        let mut out = Vec::with_capacity(body.len() / 2 + 16);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&zstd::bulk::compress(&body, 3).expect("zstd compresses memory"));
        out
    }

    /// Decodes an index fetched as `name` (named in every error): checks the magic,
    /// version, counts, order and ranges.
    pub fn decode(name: &str, bytes: &[u8]) -> CasResult<PackIndex> {
        let bad = |why: String| CasError::Invalid(format!("pack index {name}: {why}"));
        if bytes.len() < 9 || &bytes[..8] != MAGIC {
            return Err(bad("not a casfs pack index (bad magic)".into()));
        }
        let version = bytes[8];
        if !(1..=VERSION).contains(&version) {
            return Err(bad(format!(
                "version {version} (this casfs reads 1 to {VERSION})"
            )));
        }
        // Every index (either version) is one zstd frame that declares its size: one
        // allocation of that size, no regrowth copies.
        let frame = &bytes[9..];
        let n = match zstd::zstd_safe::get_frame_content_size(frame) {
            Ok(Some(n)) if n <= MAX_DECODED => n,
            Ok(Some(n)) => return Err(bad(format!("decodes to {n} bytes, over {MAX_DECODED}"))),
            Ok(None) => return Err(bad("its zstd frame does not declare its size".into())),
            Err(_) => return Err(bad("not a zstd frame".into())),
        };
        let mut body = Vec::with_capacity(n as usize);
        zstd::bulk::Decompressor::new()
            .and_then(|mut d| d.decompress_to_buffer(frame, &mut body))
            .map_err(|e| bad(format!("zstd: {e}")))?;
        if body.len() as u64 != n {
            return Err(bad(format!(
                "decodes to {} bytes where its frame says {n}",
                body.len()
            )));
        }
        let mut at = 0usize;
        let u32_at = |at: &mut usize| -> CasResult<u32> {
            let r = body
                .get(*at..*at + 4)
                .ok_or_else(|| bad("ends early".into()))?;
            *at += 4;
            Ok(u32::from_le_bytes(r.try_into().expect("4 bytes")))
        };
        let npacks = u32_at(&mut at)? as usize;
        if npacks.saturating_mul(PACK) > body.len() - at {
            return Err(bad(format!("{npacks} packs do not fit")));
        }
        let mut packs = Vec::with_capacity(npacks);
        for _ in 0..npacks {
            let r = &body[at..at + PACK];
            let id = Hash(r[..32].try_into().expect("32 bytes"));
            let marked = u64::from_le_bytes(r[32..40].try_into().expect("8 bytes"));
            let objects = u32::from_le_bytes(r[40..44].try_into().expect("4 bytes"));
            packs.push(PackInfo {
                id,
                pending_since_ms: (marked != 0).then_some(marked),
                objects,
            });
            at += PACK;
        }
        let n = u32_at(&mut at)? as usize;
        let rest = body.len() - at;
        if n.checked_mul(ENTRY) != Some(rest) {
            return Err(bad(format!(
                "{n} entries, but {rest} bytes of entries (want {ENTRY} each)"
            )));
        }
        // The entries stay where they were decoded (version 1's rows are turned into
        // columns).
        let columns = if version == 1 {
            let rows = &body[at..];
            let mut c = Vec::with_capacity(rows.len());
            for (col, width) in [(HASHES, 32), (PACKS, 4), (OFFSETS, 4), (LENGTHS, 4)] {
                for r in rows.chunks_exact(ENTRY) {
                    c.extend_from_slice(&r[col..col + width]);
                }
            }
            c
        } else {
            body.drain(..at);
            body
        };
        let index = PackIndex { packs, n, columns };
        let mut counts = vec![0u32; npacks];
        let mut last: Option<&[u8]> = None;
        for i in 0..n {
            let h = index.hash_at(i);
            if last.is_some_and(|l| l >= h) {
                return Err(bad(format!("entry {i} is out of hash order")));
            }
            last = Some(h);
            let p = index.u32_at(PACKS, i) as usize;
            let len = index.u32_at(LENGTHS, i);
            if p >= npacks {
                return Err(bad(format!("entry {i} names pack {p} of {npacks}")));
            }
            if len == 0 {
                return Err(bad(format!("entry {i} is empty")));
            }
            counts[p] += 1;
        }
        for (p, c) in index.packs.iter().zip(&counts) {
            if p.objects != *c {
                return Err(bad(format!(
                    "pack {} claims {} objects, the entries name {c}",
                    p.id, p.objects
                )));
            }
        }
        Ok(index)
    }
}

/// Objects appended into one pack until it reaches its target size.
#[derive(Default)]
pub struct PackWriter {
    bytes: Vec<u8>,
    entries: Vec<PackEntry>,
}

impl PackWriter {
    /// A writer whose pack grows to about `size` bytes without being copied.
    pub fn with_capacity(size: usize) -> PackWriter {
        PackWriter {
            bytes: Vec::with_capacity(size),
            entries: Vec::new(),
        }
    }

    pub fn push(&mut self, id: Hash, stored: &[u8]) {
        self.entries.push(PackEntry {
            id,
            offset: self.bytes.len() as u64,
            len: stored.len() as u64,
        });
        self.bytes.extend_from_slice(stored);
    }

    pub fn size(&self) -> usize {
        self.bytes.len()
    }

    pub fn entries(&self) -> &[PackEntry] {
        &self.entries
    }

    /// Appends `other`'s objects, in their order.
    pub fn absorb(&mut self, other: PackWriter) {
        let base = self.bytes.len() as u64;
        self.bytes.extend_from_slice(&other.bytes);
        self.entries
            .extend(other.entries.into_iter().map(|e| PackEntry {
                offset: e.offset + base,
                ..e
            }));
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The pack's name, bytes and entries.
    pub fn finish(self) -> (Hash, Vec<u8>, Vec<PackEntry>) {
        (Hash::of(&self.bytes), self.bytes, self.entries)
    }
}

/// A ranged read that serves several objects of one pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: u64,
    /// (object, offset, length), offsets within the pack.
    pub objects: Vec<(Hash, u64, u64)>,
}

/// A read that wants at least half of the bytes from its first object to its last in
/// a pack reads all of them at once, up to this many bytes (a restore wants most of a
/// pack: one request instead of one per gap)...
pub const MAX_WHOLE: u64 = 64 << 20;

/// ...which is the `(max_gap, max_span)` to [`coalesce`] `objects` of one pack with,
/// if so.
pub fn read_whole(objects: &[(Hash, u64, u64)]) -> Option<(u64, u64)> {
    let start = objects.iter().map(|o| o.1).min()?;
    let end = objects.iter().map(|o| o.1 + o.2).max()?;
    let wanted: u64 = objects.iter().map(|o| o.2).sum();
    let extent = end - start;
    (extent <= MAX_WHOLE && wanted.saturating_mul(2) >= extent).then_some((extent, extent))
}

/// Groups objects of one pack into ranged reads: neighbours whose gap is at most
/// `max_gap` share one, up to `max_span` bytes a read (a single larger object gets one
/// of its own).
pub fn coalesce(mut objects: Vec<(Hash, u64, u64)>, max_gap: u64, max_span: u64) -> Vec<Span> {
    objects.sort_by_key(|o| (o.1, o.0));
    objects.dedup_by_key(|o| o.0);
    let mut out: Vec<Span> = Vec::new();
    for (id, off, len) in objects {
        let end = off + len;
        match out.last_mut() {
            Some(s)
                if off >= s.end
                    && off - s.end <= max_gap
                    && end.saturating_sub(s.start) <= max_span =>
            {
                s.end = end;
                s.objects.push((id, off, len));
            }
            Some(s) if off < s.end && end <= s.end => s.objects.push((id, off, len)),
            _ => out.push(Span {
                start: off,
                end,
                objects: vec![(id, off, len)],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u32) -> Hash {
        Hash::of(&n.to_le_bytes())
    }

    #[test]
    fn an_index_round_trips_and_finds_every_object() {
        let mut a = PackWriter::default();
        for n in 0..100 {
            a.push(h(n), &vec![n as u8; 10 + n as usize]);
        }
        let (aid, abytes, aentries) = a.finish();
        assert_eq!(aid, Hash::of(&abytes));
        let mut b = PackWriter::default();
        b.push(h(5), b"again");
        b.push(h(1000), b"other");
        let (bid, _, bentries) = b.finish();
        // h(5) is in both: the live pack wins over the one marked for deletion.
        let idx = PackIndex::build(&[(aid, Some(7), aentries), (bid, None, bentries)]).unwrap();
        let back = PackIndex::decode("test", &idx.encode()).unwrap();
        assert_eq!(back.len(), 101);
        let five = back.find(&h(5)).unwrap();
        assert_eq!((five.pack, five.offset, five.len), (bid, 0, 5));
        let nine = back.find(&h(9)).unwrap();
        assert_eq!(nine.pack, aid);
        assert_eq!(nine.pending_since_ms, Some(7));
        assert_eq!(
            &abytes[nine.offset as usize..(nine.offset + nine.len) as usize],
            &[9u8; 19][..]
        );
        assert!(back.find(&h(5000)).is_none());
        assert_eq!(back.packs()[0].objects + back.packs()[1].objects, 101);
        let hashes: Vec<Hash> = back.iter().map(|(h, _)| h).collect();
        assert!(hashes.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_damaged_index_is_an_error_naming_it() {
        let mut w = PackWriter::default();
        w.push(h(1), b"x");
        w.push(h(2), b"y");
        let (id, _, e) = w.finish();
        let good = PackIndex::build(&[(id, None, e)]).unwrap().encode();
        let mut bad_magic = good.clone();
        bad_magic[0] ^= 1;
        let mut bad_version = good.clone();
        bad_version[8] = 9;
        let truncated = good[..good.len() - 3].to_vec();
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x55;
        for (what, b) in [
            ("magic", bad_magic),
            ("version", bad_version),
            ("truncated", truncated),
            ("flipped", flipped),
            ("empty", Vec::new()),
        ] {
            let err = PackIndex::decode("index/abc", &b).unwrap_err().to_string();
            assert!(err.contains("index/abc"), "{what}: {err}");
        }
        // Entries out of order, a pack number out of range, counts that disagree: in
        // both versions (1: a row per entry; 2: columns).
        let (lo, hi) = if h(1) < h(2) {
            (h(1), h(2))
        } else {
            (h(2), h(1))
        };
        for version in [1, 2] {
            let body = |entries: &[(Hash, u32, u32, u32)], claim: u32| {
                index_bytes(version, id, entries, claim)
            };
            let ok = PackIndex::decode("i", &body(&[(lo, 0, 0, 1), (hi, 0, 1, 1)], 2)).unwrap();
            assert_eq!(ok.find(&hi).unwrap().offset, 1, "version {version}");
            for (why, b) in [
                ("order", body(&[(hi, 0, 0, 1), (lo, 0, 1, 1)], 2)),
                ("pack", body(&[(lo, 1, 0, 1)], 1)),
                ("count", body(&[(lo, 0, 0, 1)], 3)),
                ("empty", body(&[(lo, 0, 0, 0)], 1)),
            ] {
                assert!(
                    PackIndex::decode("i", &b).is_err(),
                    "{why}, version {version}"
                );
            }
        }
    }

    /// An index of one pack `id` in the layout of `version`, by hand.
    fn index_bytes(
        version: u8,
        id: Hash,
        entries: &[(Hash, u32, u32, u32)],
        claim: u32,
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(id.as_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&claim.to_le_bytes());
        b.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        if version == 1 {
            for (hh, p, o, l) in entries {
                b.extend_from_slice(hh.as_bytes());
                b.extend_from_slice(&p.to_le_bytes());
                b.extend_from_slice(&o.to_le_bytes());
                b.extend_from_slice(&l.to_le_bytes());
            }
        } else {
            for (hh, ..) in entries {
                b.extend_from_slice(hh.as_bytes());
            }
            for (_, p, _, _) in entries {
                b.extend_from_slice(&p.to_le_bytes());
            }
            for (_, _, o, _) in entries {
                b.extend_from_slice(&o.to_le_bytes());
            }
            for (_, _, _, l) in entries {
                b.extend_from_slice(&l.to_le_bytes());
            }
        }
        let mut out = MAGIC.to_vec();
        out.push(version);
        out.extend_from_slice(&zstd::bulk::compress(&b, 1).unwrap());
        out
    }

    /// An index written by an earlier casfs (version 1, rows) reads as the same index
    /// written now (version 2, columns), which is smaller.
    #[test]
    fn a_version_1_index_reads_as_the_version_2_one() {
        let mut w = PackWriter::default();
        for i in 0..2_000u32 {
            w.push(h(i), &vec![i as u8; 10 + (i as usize % 300)]);
        }
        let (id, _, entries) = w.finish();
        let v2 = PackIndex::build(&[(id, None, entries)]).unwrap();
        let rows: Vec<(Hash, u32, u32, u32)> = v2
            .iter()
            .map(|(hh, l)| (hh, 0, l.offset as u32, l.len as u32))
            .collect();
        let v1 = PackIndex::decode("v1", &index_bytes(1, id, &rows, 2_000)).unwrap();
        let encoded = v2.encode();
        assert_eq!(encoded[8], 2);
        let back = PackIndex::decode("v2", &encoded).unwrap();
        assert_eq!(
            v1.iter().collect::<Vec<_>>(),
            back.iter().collect::<Vec<_>>()
        );
        assert_eq!(v1.packs(), back.packs());
        assert!(encoded.len() < index_bytes(1, id, &rows, 2_000).len());
    }

    #[test]
    fn neighbours_share_a_ranged_read() {
        let objs = vec![
            (h(3), 1000, 10),
            (h(1), 0, 100),
            (h(2), 150, 50),
            (h(4), 5000, 10),
            (h(5), 5010, 4000),
        ];
        let spans = coalesce(objs, 64, 1 << 20);
        assert_eq!(spans.len(), 3);
        assert_eq!((spans[0].start, spans[0].end), (0, 200));
        assert_eq!(spans[0].objects.len(), 2);
        assert_eq!((spans[1].start, spans[1].end), (1000, 1010));
        assert_eq!((spans[2].start, spans[2].end), (5000, 9010));
        // A span stops growing at max_span.
        let many: Vec<_> = (0..10).map(|i| (h(i), i as u64 * 100, 100)).collect();
        let spans = coalesce(many, 0, 300);
        assert_eq!(spans.len(), 4);
        assert!(spans.iter().all(|s| s.end - s.start <= 300));
    }

    #[test]
    fn a_read_of_most_of_a_pack_reads_it_in_one_span() {
        // Ten objects of 1 MiB with 1 MiB gaps between them: half the extent is wanted.
        let most: Vec<_> = (0..10)
            .map(|i| (h(i), i as u64 * (2 << 20), 1 << 20))
            .collect();
        let (gap, span) = read_whole(&most).expect("whole");
        assert_eq!(coalesce(most, gap, span).len(), 1);
        // Two small objects 10 MiB apart are read apart.
        let few = vec![(h(0), 0, 1 << 10), (h(1), 10 << 20, 1 << 10)];
        assert_eq!(read_whole(&few), None);
        assert_eq!(coalesce(few, 256 << 10, 8 << 20).len(), 2);
        // Never more than MAX_WHOLE bytes at once.
        let huge = vec![(h(0), 0, MAX_WHOLE), (h(1), MAX_WHOLE, 1)];
        assert_eq!(read_whole(&huge), None);
        assert_eq!(read_whole(&[]), None);
    }
}
