//! Workloads for benchmarks: parsing sizes (`10k`, `1m`) and generating source-like
//! trees. Shared by `casfs bench` and the bench binaries (included by path): std only.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim().to_ascii_lowercase();
    let (n, mul) = match s.strip_suffix('k') {
        Some(n) => (n, 1_000),
        None => match s.strip_suffix('m') {
            Some(n) => (n, 1_000_000),
            None => (s.as_str(), 1),
        },
    };
    n.parse::<usize>().ok().map(|n| n * mul)
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-normal file sizes like a source tree: median about 3 KiB, a long tail.
    pub fn file_size(&mut self) -> usize {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        ((8.0 + 1.3 * z).exp() as usize).clamp(16, 4 << 20)
    }
}

pub const WORDS: &[&str] = &[
    "fn", "let", "mut", "struct", "impl", "pub", "use", "mod", "match", "if", "else", "return",
    "self", "Some", "None", "Ok", "Err", "String", "Vec", "u64", "=>", "{", "}", "(", ")", ";",
    "const", "static", "trait", "where", "async", "await", "loop", "for", "in", "while",
];

pub fn text(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[(rng.next() % WORDS.len() as u64) as usize].as_bytes());
        out.push(if rng.next() % 9 == 0 { b'\n' } else { b' ' });
    }
    out.truncate(len);
    out
}

/// A tree of `n` files, about 20 per directory, three levels deep. Returns the files.
pub fn generate(root: &Path, n: usize) -> (Vec<PathBuf>, u64) {
    try_generate(root, n).unwrap_or_else(|e| panic!("generating a tree in {}: {e}", root.display()))
}

/// [`generate`], reporting I/O errors.
pub fn try_generate(root: &Path, n: usize) -> std::io::Result<(Vec<PathBuf>, u64)> {
    let mut rng = Rng(0x5eed + n as u64);
    let mut files = Vec::with_capacity(n);
    let mut bytes = 0u64;
    for i in 0..n {
        let d = root
            .join(format!("crate{}", i / 4000))
            .join(format!("mod{}", (i / 200) % 20))
            .join(format!("sub{}", (i / 20) % 10));
        if i % 20 == 0 {
            fs::create_dir_all(&d)?;
        }
        let p = d.join(format!("file{i}.rs"));
        let size = rng.file_size();
        fs::write(&p, text(&mut rng, size))?;
        bytes += size as u64;
        files.push(p);
    }
    Ok((files, bytes))
}
