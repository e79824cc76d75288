//! Workloads for benchmarks: generating source-like trees. Shared by `casfs bench`
//! and the bench binaries (included by path): std only.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

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
        self.file_size_around(Shape::default().median_bytes)
    }

    /// Log-normal file sizes with this median (sigma 1.3, as measured on source trees),
    /// between 16 bytes and 4 MiB.
    pub fn file_size_around(&mut self, median: usize) -> usize {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        (((median.max(16) as f64).ln() + 1.3 * z).exp() as usize).clamp(16, 4 << 20)
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

/// The shape of a generated tree.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Levels of directories above the files.
    pub depth: usize,
    pub files_per_dir: usize,
    /// Median file size (sizes are log-normal around it, with a long tail).
    pub median_bytes: usize,
}

impl Default for Shape {
    fn default() -> Shape {
        Shape {
            depth: 3,
            files_per_dir: 20,
            median_bytes: 2981, // e^8
        }
    }
}

/// A tree of `n` files of the default shape (20 a directory, three levels). Returns the
/// files and their total size.
pub fn generate(root: &Path, n: usize) -> (Vec<PathBuf>, u64) {
    try_generate(root, n, Shape::default())
        .unwrap_or_else(|e| panic!("generating a tree in {}: {e}", root.display()))
}

/// A tree of `n` files of the given shape, reporting I/O errors. Directories branch 10
/// ways below the top level; the same `n` and shape give the same tree.
pub fn try_generate(root: &Path, n: usize, shape: Shape) -> std::io::Result<(Vec<PathBuf>, u64)> {
    let mut rng = Rng(0x5eed + n as u64);
    let mut files = Vec::with_capacity(n);
    let mut bytes = 0u64;
    let per = shape.files_per_dir.max(1);
    let mut dir = root.to_path_buf();
    for i in 0..n {
        if i % per == 0 {
            // Directory number i/per written in base 10 over `depth` levels.
            let mut k = i / per;
            let mut parts = Vec::new();
            for level in 0..shape.depth {
                if level + 1 == shape.depth {
                    parts.push(format!("d{k}"));
                } else {
                    parts.push(format!("d{}", k % 10));
                    k /= 10;
                }
            }
            parts.reverse();
            dir = parts.iter().fold(root.to_path_buf(), |p, s| p.join(s));
            fs::create_dir_all(&dir)?;
        }
        let p = dir.join(format!("file{i}.rs"));
        let size = rng.file_size_around(shape.median_bytes);
        fs::write(&p, text(&mut rng, size))?;
        bytes += size as u64;
        files.push(p);
    }
    Ok((files, bytes))
}
