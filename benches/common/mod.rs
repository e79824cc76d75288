//! Helpers shared by the bench binaries: generated source-like trees, running shell
//! commands with their wall time, medians.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

// A bench that runs casfs in its own process (the fleet's captures and restores, the
// middleware's runs) has the allocator and settings of the `casfs` binary.
#[path = "../../src/alloc.rs"]
mod alloc;

// Sizes (`10k`, `1m`) read as `casfs bench` reads them.
#[path = "../../src/cli/units.rs"]
mod units;
pub use units::*;

// The workload (source-like trees) is the one `casfs bench` generates; not every bench
// makes trees (the rootless one does not).
#[path = "../../src/cli/bench/workload.rs"]
mod workload;
#[allow(unused_imports)]
pub use workload::*;

// Every bench writes its rows as a result file (`--out FILE`): docs/results/README.md.
#[path = "../../src/cli/bench/results.rs"]
mod results;
pub use results::Results;

pub mod work;

/// The casfs binary under test: this build's, or `CASFS_BENCH_BIN`.
pub fn casfs_bin() -> String {
    std::env::var("CASFS_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_casfs").into())
}

/// Runs `casfs --store STORE args...` with `env` set (and `CASFS_STORE` unset); panics on
/// failure; returns its standard output.
pub fn casfs_with(store: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(casfs_bin())
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("CASFS_STORE")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "casfs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// [`casfs_with`] with `--json`, its output parsed.
pub fn casfs_json_with(store: &Path, args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&casfs_with(store, &a, env)).unwrap_or(serde_json::Value::Null)
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

/// The options every bench binary takes: `--sizes 1k,10k,...`, `--reps N`, `--out FILE`
/// (read by [`Results`]), and any other `--flag` (cargo bench adds `--bench`).
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
            "--out" => i += 1,
            other => a.flags.push(other.to_string()),
        }
        i += 1;
    }
    a
}

/// A path quoted for `sh`.
pub fn q(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', "'\\''"))
}

/// The loop filesystem; unmounted (and its image removed) when dropped.
pub struct LoopFs {
    dir: tempfile::TempDir,
    pub mnt: PathBuf,
}

impl LoopFs {
    pub fn new(gib: u64) -> LoopFs {
        let dir = tempfile::Builder::new()
            .prefix("casfs-ovb")
            .tempdir()
            .unwrap();
        let img = dir.path().join("img");
        let mnt = dir.path().join("fs");
        std::fs::create_dir(&mnt).unwrap();
        sh(
            &format!(
                "truncate -s {gib}G {i} && mkfs.ext4 -q {i} && mount -o loop {i} {m}",
                i = q(&img),
                m = q(&mnt)
            ),
            &[],
        );
        LoopFs { dir, mnt }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        // Whatever is still mounted below it first (lazily: never hang).
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let prefix = format!("{}/", self.mnt.display());
        let mut below: Vec<&str> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        below.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in below {
            let _ = Command::new("umount").args(["-l", m]).status();
        }
        std::thread::sleep(Duration::from_millis(300));
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        let _ = std::fs::remove_file(self.dir.path().join("img"));
    }
}
