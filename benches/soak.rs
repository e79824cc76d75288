//! Soak benchmark: a real `casfs serve` driven by concurrent clients for many runs across
//! many threads, mixing every way a run ends (finish, pause, cancel, detach, error,
//! disconnect), one file written per run. Every block of runs prints what the server
//! holds (open descriptors but the RocksDB table files it keeps open, resident memory,
//! mounts under its sandboxes directory),
//! runs per second, and p50/p99 latency of starting and of ending a run; refusals other
//! than 200 are counted by status and kind (409 `lease_held` is expected: two clients
//! picked the same thread).
//!
//! After each block the driver waits (up to `--settle` seconds, default 5) until no
//! mount is left (the server's idle timeouts let sandboxes and abandoned runs go), then
//! measures: descriptors and mounts must be back to where they started.
//!
//! Run: `cargo bench --bench soak -- [--runs 10000] [--clients 8] [--threads 100]
//! [--block 1000] [--settle 5] [--log FILE] [--serve-arg ARG]... [--out FILE]` (`--log`:
//! the server's standard error; `--out`: every block as a result file,
//! docs/results/README.md). Without serve args the server runs with
//! `--run-idle-timeout 1 --sandbox-idle-timeout 1 --max-runs 256` (a sixth of the runs
//! are abandoned by their client and live until the idle timeout ends them). `CASFS_BENCH_BIN` runs
//! another casfs build. Needs root and /dev/fuse.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../tests/common/soak.rs"]
mod soak;
use soak::{Soak, ALL_ENDS};

#[path = "../src/cli/bench/results.rs"]
#[allow(dead_code)]
mod results;

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let (mut runs, mut clients, mut threads, mut block) = (10_000, 8, 100, 1_000);
    let mut settle = 5.0;
    let mut log: Option<PathBuf> = None;
    let mut serve_args: Vec<String> = Vec::new();
    let mut i = 1;
    while i < argv.len() {
        let val = || argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--runs" => runs = val().parse().expect("--runs N"),
            "--clients" => clients = val().parse().expect("--clients N"),
            "--threads" => threads = val().parse().expect("--threads N"),
            "--block" => block = val().parse().expect("--block N"),
            "--settle" => settle = val().parse().expect("--settle SECONDS"),
            "--log" => log = Some(PathBuf::from(val())),
            "--serve-arg" => serve_args.push(val()),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    if serve_args.is_empty() {
        serve_args = [
            "--run-idle-timeout",
            "1",
            "--sandbox-idle-timeout",
            "1",
            "--max-runs",
            "256",
        ]
        .map(String::from)
        .to_vec();
    }
    let mut res = results::Results::cargo_bench("soak");
    for (k, v) in [
        ("runs", runs),
        ("clients", clients),
        ("threads", threads),
        ("block", block),
    ] {
        res.param(k, v);
    }
    res.param("settle_s", settle);
    res.param("serve_args", &serve_args);
    let bin = std::env::var("CASFS_BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_BIN_EXE_casfs")));
    let t = tempfile::tempdir().unwrap();
    res.bench_dir(t.path());
    let store = t.path().join("store");
    let sandboxes = t.path().join("sandboxes");
    let socket = t.path().join("serve.sock");
    let mut child = Command::new(&bin)
        .arg("--store")
        .arg(&store)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--sandboxes")
        .arg(&sandboxes)
        .args(&serve_args)
        .env_remove("CASFS_STORE")
        .stdout(Stdio::null())
        .stderr(match &log {
            Some(p) => Stdio::from(std::fs::File::create(p).expect("--log FILE")),
            None => Stdio::null(),
        })
        .spawn()
        .expect("start casfs serve");
    let t0 = Instant::now();
    while !socket.exists() && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (fds0, rss0) = soak::process_usage_apart(child.id(), Some(&store.join("db")));
    let at_start = serde_json::json!({"after_runs": 0, "what": "at start"});
    res.value(at_start.clone(), "descriptors", fds0 as f64);
    res.value(at_start, "KiB resident", rss0 as f64);
    println!(
        "casfs serve ({}), {runs} runs, {clients} clients, {threads} threads, serve args {serve_args:?}",
        bin.display()
    );
    println!(
        "at start: {fds0} descriptors, {:.1} MB resident",
        rss0 as f64 / 1024.0
    );
    println!("| runs | mounts at block end | settled: descriptors | resident MB | mounts | runs/s | start p50 / p99 ms | end p50 / p99 ms | refused |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let s = Soak {
        socket: socket.clone(),
        server_pid: child.id(),
        sandboxes: sandboxes.clone(),
        runs,
        clients,
        threads,
        block,
        ends: ALL_ENDS.to_vec(),
        db_dir: Some(store.join("db")),
        settle: Duration::from_secs_f64(settle),
    };
    s.run(|b| {
        let at = |what: &str| serde_json::json!({"after_runs": b.runs, "what": what});
        res.value(at("mounts at block end"), "mounts", b.mounts_live as f64);
        res.value(at("settled: descriptors"), "descriptors", b.fds as f64);
        res.value(at("settled: resident"), "KiB resident", b.rss_kib as f64);
        res.value(
            at("settled: resident, anonymous"),
            "KiB resident",
            b.rss_anon_kib as f64,
        );
        res.value(
            at("settled: resident, mapped files"),
            "KiB resident",
            b.rss_file_kib as f64,
        );
        res.value(at("settled: mounts"), "mounts", b.mounts as f64);
        res.value(at("runs per second"), "runs/s", b.runs_per_sec);
        res.value(at("start p50"), "ms", b.start_p50_ms);
        res.value(at("start p99"), "ms", b.start_p99_ms);
        res.value(at("end p50"), "ms", b.finish_p50_ms);
        res.value(at("end p99"), "ms", b.finish_p99_ms);
        for (kind, n) in &b.refused {
            res.value(at(&format!("refused: {kind}")), "answers", *n as f64);
        }
        let refused: Vec<String> = b
            .refused
            .iter()
            .map(|(k, n)| format!("{n} × {k}"))
            .collect();
        println!(
            "| {} | {} | {} | {:.1} | {} | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {} |",
            b.runs,
            b.mounts_live,
            b.fds,
            b.rss_kib as f64 / 1024.0,
            b.mounts,
            b.runs_per_sec,
            b.start_p50_ms,
            b.start_p99_ms,
            b.finish_p50_ms,
            b.finish_p99_ms,
            if refused.is_empty() {
                "-".into()
            } else {
                refused.join(", ")
            }
        );
    });
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let left = soak::mounts_under(&sandboxes);
    println!("after the server stopped: {left} mounts under its sandboxes directory");
    res.value(
        serde_json::json!({"after_runs": runs, "what": "mounts after the server stopped"}),
        "mounts",
        left as f64,
    );
    res.finish();
}
