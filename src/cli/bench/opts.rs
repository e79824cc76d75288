//! What a `casfs bench` run is asked to do ([`BenchOpts`]), and the scenarios and
//! peers it knows.

use std::path::PathBuf;

use super::workload;

/// What to run.
pub struct BenchOpts {
    pub sizes: Vec<usize>,
    /// The shape of generated trees.
    pub shape: workload::Shape,
    pub from: Option<PathBuf>,
    pub changes: usize,
    pub reps: usize,
    pub runs: usize,
    pub scenarios: Vec<String>,
    pub peers: Vec<String>,
    pub io_mb: usize,
    pub json: bool,
    pub out: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub keep: Option<PathBuf>,
}

pub const SCENARIOS: &[&str] = &["capture", "recapture", "restore", "loop", "io"];
pub const PEERS: &[&str] = &[
    "git",
    "restic",
    "tar+zstd",
    "rsync",
    "ext4",
    "fuse-overlayfs",
];
