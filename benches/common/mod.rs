//! Helpers shared by the bench binaries: generated source-like trees, running shell
//! commands with their wall time, medians.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    let mut rng = Rng(0x5eed + n as u64);
    let mut files = Vec::with_capacity(n);
    let mut bytes = 0u64;
    for i in 0..n {
        let d = root
            .join(format!("crate{}", i / 4000))
            .join(format!("mod{}", (i / 200) % 20))
            .join(format!("sub{}", (i / 20) % 10));
        if i % 20 == 0 {
            fs::create_dir_all(&d).unwrap();
        }
        let p = d.join(format!("file{i}.rs"));
        let size = rng.file_size();
        fs::write(&p, text(&mut rng, size)).unwrap();
        bytes += size as u64;
        files.push(p);
    }
    (files, bytes)
}

pub fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs a shell command and returns its wall time; panics on failure.
pub fn sh(cmd: &str, env: &[(&str, &str)]) -> Duration {
    let t = Instant::now();
    let out = Command::new("sh")
        .args(["-c", cmd])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let d = t.elapsed();
    assert!(
        out.status.success(),
        "{cmd} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    d
}

pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub const GIT_ENV: &[(&str, &str)] = &[
    ("GIT_AUTHOR_NAME", "bench"),
    ("GIT_AUTHOR_EMAIL", "bench@example.invalid"),
    ("GIT_COMMITTER_NAME", "bench"),
    ("GIT_COMMITTER_EMAIL", "bench@example.invalid"),
    ("RESTIC_PASSWORD", "bench"),
];

/// Environment for git with its repository at `git_dir` and work tree at `tree`.
pub fn git_env<'a>(git_dir: &'a Path, tree: &'a Path) -> Vec<(&'a str, &'a str)> {
    let mut env = GIT_ENV.to_vec();
    env.push(("GIT_DIR", git_dir.to_str().unwrap()));
    env.push(("GIT_WORK_TREE", tree.to_str().unwrap()));
    env
}

/// The options every bench binary takes: `--sizes 1k,10k,...`, `--reps N`, and any
/// other `--flag` (cargo bench adds `--bench`).
pub struct BenchArgs {
    pub sizes: Vec<usize>,
    pub reps: usize,
    pub flags: Vec<String>,
}

pub fn parse_bench_args(reps: usize) -> BenchArgs {
    let mut a = BenchArgs {
        sizes: vec![1_000, 10_000, 100_000],
        reps,
        flags: Vec::new(),
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        match argv[i].as_str() {
            "--sizes" => {
                a.sizes = argv[i + 1]
                    .split(',')
                    .map(|s| parse_size(s).unwrap_or_else(|| panic!("bad size {s}")))
                    .collect();
                i += 1;
            }
            "--reps" => {
                a.reps = argv[i + 1].parse().expect("--reps N");
                i += 1;
            }
            other => a.flags.push(other.to_string()),
        }
        i += 1;
    }
    a
}
