//! The report of a `casfs bench` run (what the `--out` JSON holds), its table and the
//! comparison of two reports.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::opts::{PEERS, SCENARIOS};
pub use super::results::Machine;
use super::results::RunInfo;

/// A result file (docs/results/README.md): the run, the machine, and every sample with
/// all its repetitions (`rows`; `results` in reports from before).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    #[serde(flatten)]
    pub run: RunInfo,
    pub casfs_version: String,
    pub machine: Machine,
    pub settings: Settings,
    pub workloads: Vec<Workload>,
    #[serde(rename = "rows", alias = "results")]
    pub results: Vec<Sample>,
    /// casfs / peer, pair by pair (below 1: casfs is faster).
    pub ratios: Vec<Ratio>,
    /// How time grows with the workload: t ~ files^slope (log-log least squares).
    pub slopes: Vec<Slope>,
    pub skipped: Vec<Skip>,
    pub total_seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Settings {
    pub changes: usize,
    pub reps: usize,
    pub runs: usize,
    pub io_mb: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Workload {
    pub files: u64,
    pub bytes: u64,
    pub source: String,
    /// For a generated tree: directory levels, files a directory, median file size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<[usize; 3]>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    pub scenario: String,
    /// The operation within the scenario (for io: write, read, untar, find, git-status).
    pub op: String,
    pub files: u64,
    pub tool: String,
    /// Always "ms".
    #[serde(default = "ms")]
    pub unit: String,
    #[serde(rename = "median", alias = "median_ms")]
    pub median_ms: f64,
    /// Every repetition, in the order run.
    #[serde(rename = "runs", alias = "runs_ms")]
    pub runs_ms: Vec<f64>,
}

fn ms() -> String {
    "ms".into()
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Ratio {
    pub scenario: String,
    pub op: String,
    pub files: u64,
    pub peer: String,
    pub casfs_ms: f64,
    pub peer_ms: f64,
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Slope {
    pub scenario: String,
    pub op: String,
    pub tool: String,
    pub slope: f64,
    pub sizes: Vec<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Skip {
    pub scenario: String,
    pub tool: String,
    pub why: String,
}

/// casfs / peer for every (scenario, op, size) both measured.
pub(super) fn ratios(samples: &[Sample]) -> Vec<Ratio> {
    let mut out = Vec::new();
    for c in samples.iter().filter(|s| s.tool == "casfs") {
        for p in samples.iter().filter(|s| {
            s.tool != "casfs" && s.scenario == c.scenario && s.op == c.op && s.files == c.files
        }) {
            out.push(Ratio {
                scenario: c.scenario.clone(),
                op: c.op.clone(),
                files: c.files,
                peer: p.tool.clone(),
                casfs_ms: c.median_ms,
                peer_ms: p.median_ms,
                ratio: if p.median_ms > 0.0 {
                    ((c.median_ms / p.median_ms) * 1000.0).round() / 1000.0
                } else {
                    f64::NAN
                },
            });
        }
    }
    out
}

/// Least-squares slope of ln(time) against ln(files), per (scenario, op, tool) measured
/// at two sizes or more.
pub(super) fn slopes(samples: &[Sample]) -> Vec<Slope> {
    // (scenario, op, tool) -> (ln files, ln ms, files)
    type Key = (String, String, String);
    let mut groups: BTreeMap<Key, Vec<(f64, f64, u64)>> = BTreeMap::new();
    for s in samples {
        if s.files > 0 && s.median_ms > 0.0 {
            groups
                .entry((s.scenario.clone(), s.op.clone(), s.tool.clone()))
                .or_default()
                .push(((s.files as f64).ln(), s.median_ms.ln(), s.files));
        }
    }
    groups
        .into_iter()
        .filter(|(_, v)| {
            v.iter()
                .map(|p| p.2)
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                >= 2
        })
        .map(|((scenario, op, tool), v)| {
            let n = v.len() as f64;
            let mx = v.iter().map(|p| p.0).sum::<f64>() / n;
            let my = v.iter().map(|p| p.1).sum::<f64>() / n;
            let sxy: f64 = v.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
            let sxx: f64 = v.iter().map(|p| (p.0 - mx).powi(2)).sum();
            Slope {
                scenario,
                op,
                tool,
                slope: ((sxy / sxx) * 100.0).round() / 100.0,
                sizes: v.iter().map(|p| p.2).collect(),
            }
        })
        .collect()
}

/// The report as tables: per scenario, one row per (op, size), one column per tool,
/// then casfs/peer ratios and slopes.
pub fn table(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "casfs bench {} on {} cores, kernel {}: {} changed files, medians of {} (loop: {} runs); {:.0} s",
        r.casfs_version,
        r.machine.cores,
        r.machine.kernel,
        r.settings.changes,
        r.settings.reps,
        r.settings.runs,
        r.total_seconds
    );
    for w in &r.workloads {
        let _ = writeln!(
            out,
            "workload: {} files, {:.1} MB ({})",
            w.files,
            w.bytes as f64 / 1e6,
            w.source
        );
    }
    for sc in SCENARIOS {
        let rows: Vec<&Sample> = r.results.iter().filter(|s| s.scenario == *sc).collect();
        if rows.is_empty() {
            continue;
        }
        // casfs first, then the peers in a fixed order.
        let tools: Vec<String> = ["casfs", "casfs+watch"]
            .into_iter()
            .chain(PEERS.iter().copied())
            .filter(|t| rows.iter().any(|s| s.tool == *t))
            .map(String::from)
            .collect();
        let _ = writeln!(out, "\n{sc} (median ms; casfs/peer in brackets)\n");
        let _ = write!(out, "| {:<28} | {:>7} |", "op", "files");
        for t in &tools {
            let _ = write!(out, " {t:>16} |");
        }
        let _ = write!(out, "\n|---|---:|");
        for _ in &tools {
            out.push_str("---:|");
        }
        out.push('\n');
        let mut keys: Vec<(String, u64)> = Vec::new();
        for s in &rows {
            let k = (s.op.clone(), s.files);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        for (op, files) in keys {
            let _ = write!(out, "| {op:<28} | {files:>7} |");
            let casfs = rows
                .iter()
                .find(|s| s.op == op && s.files == files && s.tool == "casfs")
                .map(|s| s.median_ms);
            for t in &tools {
                match rows
                    .iter()
                    .find(|s| s.op == op && s.files == files && &s.tool == t)
                {
                    Some(s) if t != "casfs" && casfs.is_some() => {
                        let ratio = casfs.unwrap_or(0.0) / s.median_ms;
                        let _ = write!(out, " {:>9.1} [{:>4.2}] |", s.median_ms, ratio);
                    }
                    Some(s) => {
                        let _ = write!(out, " {:>16.1} |", s.median_ms);
                    }
                    None => {
                        let _ = write!(out, " {:>16} |", "-");
                    }
                }
            }
            out.push('\n');
        }
    }
    if !r.slopes.is_empty() {
        let _ = writeln!(out, "\nscaling: time ~ files^slope");
        for s in &r.slopes {
            let _ = writeln!(
                out,
                "  {:<10} {:<28} {:<16} {:>5.2}",
                s.scenario, s.op, s.tool, s.slope
            );
        }
    }
    for s in &r.skipped {
        let _ = writeln!(out, "skipped: {} {}: {}", s.scenario, s.tool, s.why);
    }
    out
}

/// The change from report `a` to report `b`, for every sample both have.
pub fn compare(a: &Report, b: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| scenario | op | files | tool | before ms | after ms | change |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for s in &b.results {
        if let Some(p) = a.results.iter().find(|p| {
            p.scenario == s.scenario && p.op == s.op && p.files == s.files && p.tool == s.tool
        }) {
            let change = (s.median_ms / p.median_ms - 1.0) * 100.0;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:+.1}% |",
                s.scenario, s.op, s.files, s.tool, p.median_ms, s.median_ms, change
            );
        }
    }
    out
}
