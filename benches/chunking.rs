//! Chunking choice for large files: fixed-size chunks of several sizes against
//! content-defined chunking (FastCDC) at similar average sizes.
//!
//! For a 256 MiB file it reports chunking+hashing throughput and, after three kinds of
//! edit, how many bytes of new chunks a re-capture must store:
//! - `overwrite`: 16 scattered 4 KiB writes in place (databases, images, build outputs),
//! - `insert`: 100 bytes inserted in the middle (an edited text file or archive),
//! - `append`: 1 MiB appended (logs).
//!
//! Run: `cargo bench --bench chunking [-- --out FILE]` (`--out`: every run as a result
//! file, docs/results/README.md)

use std::collections::HashSet;
use std::time::Instant;

#[path = "../src/cli/bench/results.rs"]
#[allow(dead_code)]
mod results;

const FILE_LEN: usize = 256 << 20;

fn data(len: usize, seed: u64) -> Vec<u8> {
    // Text-like, compressible bytes: words from a small vocabulary.
    let words: Vec<&[u8]> = b"the of and to in is that for it as with was on be at by this had not are but from or have an they which one you were her all she there would their we him been has when who will more no if out so said what up its about into than them can only other new some could time these two may then do first any my now such like our over man me even most made after also did many before must through back years where much your way well down should because each just those people".split(|&b| b == b' ').collect();
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(words[(x % words.len() as u64) as usize]);
        out.push(if x % 17 == 0 { b'\n' } else { b' ' });
    }
    out.truncate(len);
    out
}

#[derive(Clone, Copy)]
enum Chunker {
    Fixed(usize),
    Cdc(u32),
}

impl Chunker {
    fn name(&self) -> String {
        match self {
            Chunker::Fixed(n) => format!("fixed {} KiB", n >> 10),
            Chunker::Cdc(n) => format!("fastcdc avg {} KiB", n >> 10),
        }
    }

    /// (offset, length) of each chunk.
    fn cut(&self, d: &[u8]) -> Vec<(usize, usize)> {
        match *self {
            Chunker::Fixed(n) => (0..d.len())
                .step_by(n)
                .map(|o| (o, n.min(d.len() - o)))
                .collect(),
            Chunker::Cdc(avg) => fastcdc::v2020::FastCDC::new(d, avg / 4, avg, avg * 4)
                .map(|c| (c.offset, c.length))
                .collect(),
        }
    }

    fn hashes(&self, d: &[u8]) -> Vec<(blake3::Hash, usize)> {
        self.cut(d)
            .into_iter()
            .map(|(o, l)| (blake3::hash(&d[o..o + l]), l))
            .collect()
    }
}

fn new_bytes(base: &HashSet<blake3::Hash>, after: &[(blake3::Hash, usize)]) -> usize {
    let mut seen = HashSet::new();
    after
        .iter()
        .filter(|(h, _)| !base.contains(h) && seen.insert(*h))
        .map(|(_, l)| l)
        .sum()
}

fn main() {
    let mut res = results::Results::cargo_bench("chunking");
    res.param("file_bytes", FILE_LEN);
    let original = data(FILE_LEN, 7);
    let mut overwrite = original.clone();
    let mut x: u64 = 99;
    for _ in 0..16 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x as usize) % (FILE_LEN - 4096);
        overwrite[at..at + 4096].fill(b'#');
    }
    let mut insert = original.clone();
    insert.splice(FILE_LEN / 2..FILE_LEN / 2, std::iter::repeat_n(b'+', 100));
    let mut append = original.clone();
    append.extend(data(1 << 20, 8));

    println!(
        "{:<22} {:>10} {:>9} {:>13} {:>13} {:>13}",
        "chunker", "MB/s", "chunks", "overwrite", "insert", "append"
    );
    for c in [
        Chunker::Fixed(256 << 10),
        Chunker::Fixed(1 << 20),
        Chunker::Fixed(4 << 20),
        Chunker::Cdc(256 << 10),
        Chunker::Cdc(1 << 20),
    ] {
        // Throughput: the median of 3 runs of cutting and hashing the whole file.
        let mut times = Vec::new();
        let mut base = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            base = c.hashes(&original);
            times.push(t.elapsed().as_secs_f64());
        }
        let at = |what: &str| serde_json::json!({"chunker": c.name(), "what": what});
        let runs: Vec<f64> = times.iter().map(|t| FILE_LEN as f64 / 1e6 / t).collect();
        let mbps = res.values(at("chunking and hashing"), "MB/s", &runs);
        let set: HashSet<_> = base.iter().map(|(h, _)| *h).collect();
        let kib = |n: usize| format!("{} KiB", n >> 10);
        res.value(at("chunks"), "chunks", base.len() as f64);
        let new: Vec<usize> = [&overwrite, &insert, &append]
            .iter()
            .map(|after| new_bytes(&set, &c.hashes(after)))
            .collect();
        for (edit, n) in ["overwrite", "insert", "append"].iter().zip(&new) {
            res.value(at(&format!("new bytes after {edit}")), "B", *n as f64);
        }
        println!(
            "{:<22} {:>10.0} {:>9} {:>13} {:>13} {:>13}",
            c.name(),
            mbps,
            base.len(),
            kib(new[0]),
            kib(new[1]),
            kib(new[2]),
        );
    }
    res.finish();
}
