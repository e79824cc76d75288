//! `casfs bench`: capture, re-capture, restore, a run-like loop and mounted I/O, casfs
//! and its peers side by side in one run, on generated source-like trees of several
//! sizes or on a copy of a directory the user names. Every casfs figure is a `casfs`
//! command timed from the outside (as `/usr/bin/time` would see it); peers are skipped
//! with a note when not installed.
//!
//! `opts.rs` says what a run is asked, `run.rs` runs the scenarios, `report.rs` holds
//! the report (JSON), its table and a comparison of two, `plot.rs` draws it,
//! `workload.rs` makes the trees.

use std::fs;
use std::path::Path;

use anyhow::Context;

mod opts;
mod plot;
mod report;
// What of it the bench binaries use (they take the file in with `#[path]`) is not
// all used here.
#[allow(dead_code)]
pub mod results;
mod run;
pub mod workload;

pub use opts::BenchOpts;
pub use report::Report;
use report::{compare, table};
use run::run;

/// `casfs bench`: runs (or compares), prints the table or JSON, writes the files asked.
pub fn main(cli: &crate::cli::args::Cli) -> anyhow::Result<()> {
    let crate::cli::args::Command::Bench {
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
        record,
        command,
        bench_dir,
    } = &cli.command
    else {
        unreachable!("dispatched on Bench")
    };
    if let Some(name) = record {
        let out = out.as_deref().expect("clap requires --out with --record");
        return record_rows(name, command.clone(), bench_dir.as_deref(), out);
    }
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
        let o = results::out_path(o, &report.run);
        fs::write(&o, format!("{json}\n")).with_context(|| format!("writing {}", o.display()))?;
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

/// `casfs bench --record NAME`: the result file of a bench script, from the rows it
/// writes to standard input.
fn record_rows(
    name: &str,
    command: Option<String>,
    bench_dir: Option<&Path>,
    out: &Path,
) -> anyhow::Result<()> {
    use std::io::BufRead;
    let command = command.unwrap_or_else(|| name.to_string());
    let mut r = results::Results::new(name, command, Some(out.to_path_buf()));
    if let Some(d) = bench_dir {
        r.bench_dir(d);
    }
    for (i, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.context("reading the rows from standard input")?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("standard input, line {}", i + 1);
        let v: serde_json::Value = serde_json::from_str(&line).with_context(at)?;
        let mut m = match v {
            serde_json::Value::Object(m) => m,
            _ => anyhow::bail!("{}: not a JSON object", at()),
        };
        if let Some(p) = m.remove("param") {
            let serde_json::Value::Object(p) = p else {
                anyhow::bail!("{}: \"param\" is not an object", at());
            };
            for (k, v) in p {
                r.param(&k, v);
            }
            continue;
        }
        if let Some(n) = m.remove("note") {
            r.note(
                n.as_str()
                    .map(String::from)
                    .unwrap_or_else(|| n.to_string()),
            );
            continue;
        }
        let unit = match m.remove("unit") {
            Some(serde_json::Value::String(u)) => u,
            _ => anyhow::bail!("{}: a row needs \"unit\" (a string)", at()),
        };
        let runs: Vec<f64> = match m.remove("runs") {
            Some(serde_json::Value::Array(a)) if !a.is_empty() => a
                .iter()
                .map(|x| x.as_f64())
                .collect::<Option<_>>()
                .with_context(|| format!("{}: \"runs\" holds a non-number", at()))?,
            _ => anyhow::bail!("{}: a row needs \"runs\" (numbers, at least one)", at()),
        };
        r.values(serde_json::Value::Object(m), &unit, &runs);
    }
    if let Some(p) = r.write()? {
        eprintln!("results: wrote {}", p.display());
    }
    Ok(())
}
