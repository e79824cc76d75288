//! `casfs bench`: capture, re-capture, restore, a run-like loop and mounted I/O, casfs
//! and its peers side by side in one run, on generated source-like trees of several
//! sizes or on a copy of a directory the user names. Every casfs figure is a `casfs`
//! command timed from the outside (as `/usr/bin/time` would see it); peers are skipped
//! with a note when not installed.
//!
//! `run.rs` runs the scenarios, `report.rs` holds the report (JSON), its table and a
//! comparison of two, `plot.rs` draws it, `workload.rs` makes the trees.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context;

mod plot;
mod report;
mod run;
pub mod workload;

pub use report::Report;
use report::{compare, table};
use run::run;

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

/// `casfs bench`: runs (or compares), prints the table or JSON, writes the files asked.
pub fn main(cli: &crate::cli::Cli) -> anyhow::Result<()> {
    let crate::cli::Command::Bench {
        sizes,
        depth,
        files_per_dir,
        median_size,
        from,
        changes,
        reps,
        runs,
        scenarios,
        peers,
        io_mb,
        out,
        plot,
        keep,
        compare: cmp,
    } = &cli.command
    else {
        unreachable!("dispatched on Bench")
    };
    let read = |p: &Path| -> anyhow::Result<Report> {
        let text = fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{}: not a casfs bench report", p.display()))
    };
    if let Some(pair) = cmp {
        let (a, b) = (read(&pair[0])?, read(&pair[1])?);
        print!("{}", compare(&a, &b));
        return Ok(());
    }
    let opts = BenchOpts {
        sizes: sizes.clone(),
        shape: workload::Shape {
            depth: *depth,
            files_per_dir: *files_per_dir,
            median_bytes: *median_size,
        },
        from: from.clone(),
        changes: *changes,
        reps: *reps,
        runs: *runs,
        scenarios: scenarios.clone(),
        peers: peers.clone(),
        io_mb: *io_mb,
        json: cli.json,
        out: out.clone(),
        plot: plot.clone(),
        keep: keep.clone(),
    };
    let report = run(&opts)?;
    let json = serde_json::to_string_pretty(&report).expect("a report serializes");
    if let Some(o) = &opts.out {
        fs::write(o, format!("{json}\n")).with_context(|| format!("writing {}", o.display()))?;
    }
    if let Some(p) = &opts.plot {
        plot::draw(&report, p).with_context(|| format!("drawing {}", p.display()))?;
    }
    if opts.json {
        println!("{json}");
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}
