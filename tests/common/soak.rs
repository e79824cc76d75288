//! A soak driver for `casfs serve`: clients on the server's Unix socket run many short
//! agent runs across many threads, mixing every way a run ends, and every block of runs
//! reports what the server holds (open descriptors, resident memory, mounts) and how
//! fast it answered. Shared by the soak benchmark (`cargo bench --bench soak`) and the
//! CI-sized test (`tests/fuse/soak.rs`).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How a run ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Finish,
    /// A pause (`run_finished` with an interrupt), then finish: nothing published.
    Pause,
    Cancel,
    Detach,
    Error,
    /// The client says it disconnected and never calls again: the server's idle
    /// timeout ends the run.
    Disconnect,
}

pub const ALL_ENDS: [End; 6] = [
    End::Finish,
    End::Pause,
    End::Cancel,
    End::Detach,
    End::Error,
    End::Disconnect,
];

/// One HTTP/1.1 request on a new connection; returns the status and the JSON body.
pub fn request(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = UnixStream::connect(socket).expect("connect to casfs serve");
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let body = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let text = String::from_utf8_lossy(&resp);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, serde_json::from_str(rest).unwrap_or(Value::Null))
}

/// What a process holds: open descriptors and resident memory (KiB).
pub fn process_usage(pid: u32) -> (usize, u64) {
    process_usage_apart(pid, None)
}

/// [`process_usage`], not counting descriptors of files under `apart` (a RocksDB
/// directory: it keeps each table file open once, and their number follows flushes and
/// compactions, not runs).
pub fn process_usage_apart(pid: u32, apart: Option<&Path>) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    apart.is_none_or(|a| {
                        std::fs::read_link(e.path()).map_or(true, |t| !t.starts_with(a))
                    })
                })
                .count()
        })
        .unwrap_or(0);
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0);
    (fds, rss)
}

/// What each of a process's descriptors points at (sorted), for a failure to name
/// what was kept.
pub fn descriptors(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let t = std::fs::read_link(e.path()).unwrap_or_default();
                    format!("{}: {}", e.file_name().to_string_lossy(), t.display())
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Of a process's resident memory, its anonymous pages (heaps, stacks) and its pages
/// of mapped files (the binary's and libraries' code, read as it runs), in KiB: the
/// two grow for different reasons.
pub fn rss_split(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("RssAnon:"), field("RssFile:"))
}

/// FUSE mounts under `dir`.
pub fn mounts_under(dir: &Path) -> usize {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let prefix = format!("{}/", dir.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let fstype = l.split(" - ").nth(1).unwrap_or("");
            f.len() > 4 && f[4].starts_with(&prefix) && fstype.starts_with("fuse")
        })
        .count()
}

/// One block of runs, as the driver reports it.
#[derive(Debug, Clone, Default)]
pub struct Block {
    /// Runs started so far (all blocks).
    pub runs: usize,
    /// Mounts under the sandboxes directory when the block's last run ended.
    pub mounts_live: usize,
    /// After the block settled (see [`Soak::settle`]).
    pub fds: usize,
    pub rss_kib: u64,
    /// Of it, anonymous pages and pages of mapped files ([`rss_split`]).
    pub rss_anon_kib: u64,
    pub rss_file_kib: u64,
    pub mounts: usize,
    pub runs_per_sec: f64,
    pub start_p50_ms: f64,
    pub start_p99_ms: f64,
    pub finish_p50_ms: f64,
    pub finish_p99_ms: f64,
    /// Answers other than 200, by `status kind`, in this block.
    pub refused: BTreeMap<String, u64>,
}

pub struct Soak {
    pub socket: PathBuf,
    pub server_pid: u32,
    pub sandboxes: PathBuf,
    pub runs: usize,
    pub clients: usize,
    pub threads: usize,
    pub block: usize,
    pub ends: Vec<End>,
    /// Descriptors of files under this directory (the store's RocksDB) are not counted.
    pub db_dir: Option<PathBuf>,
    /// After each block, wait up to this long for the server to let idle sandboxes
    /// and abandoned runs go (no mount left, descriptors back to where they started)
    /// before measuring it.
    pub settle: Duration,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[derive(Default)]
struct Tally {
    starts: Vec<f64>,
    finishes: Vec<f64>,
    refused: BTreeMap<String, u64>,
}

impl Soak {
    /// Runs the soak; `on_block` gets each block as it completes (after the clients
    /// have finished its runs).
    pub fn run(&self, mut on_block: impl FnMut(&Block)) {
        let next = Arc::new(AtomicUsize::new(0));
        let mut done = 0;
        let usage = || process_usage_apart(self.server_pid, self.db_dir.as_deref());
        let fds0 = usage().0;
        while done < self.runs {
            let upto = (done + self.block).min(self.runs);
            let tally = Arc::new(Mutex::new(Tally::default()));
            let started = Instant::now();
            std::thread::scope(|scope| {
                for c in 0..self.clients {
                    let (next, tally) = (next.clone(), tally.clone());
                    scope.spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= upto {
                            next.fetch_sub(1, Ordering::SeqCst);
                            return;
                        }
                        self.one_run(c, i, &tally);
                    });
                }
            });
            let secs = started.elapsed().as_secs_f64();
            let mut t = std::mem::take(&mut *tally.lock().unwrap());
            let mounts_live = mounts_under(&self.sandboxes);
            let t0 = Instant::now();
            while (mounts_under(&self.sandboxes) > 0 || usage().0 > fds0)
                && t0.elapsed() < self.settle
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let (fds, rss_kib) = usage();
            let (rss_anon_kib, rss_file_kib) = rss_split(self.server_pid);
            let b = Block {
                runs: upto,
                mounts_live,
                fds,
                rss_kib,
                rss_anon_kib,
                rss_file_kib,
                mounts: mounts_under(&self.sandboxes),
                runs_per_sec: (upto - done) as f64 / secs,
                start_p50_ms: percentile(&mut t.starts, 0.5),
                start_p99_ms: percentile(&mut t.starts, 0.99),
                finish_p50_ms: percentile(&mut t.finishes, 0.5),
                finish_p99_ms: percentile(&mut t.finishes, 0.99),
                refused: t.refused,
            };
            on_block(&b);
            done = upto;
        }
    }

    fn one_run(&self, client: usize, i: usize, tally: &Mutex<Tally>) {
        let thread = format!("thread-{}", (i * 7 + client) % self.threads);
        let run = format!("run-{i}");
        let end = self.ends[i % self.ends.len()];
        let call = |method: &str, path: &str, body: Option<&Value>| -> (u16, Value, f64) {
            let t = Instant::now();
            let (st, v) = request(&self.socket, method, path, body);
            (st, v, t.elapsed().as_secs_f64() * 1e3)
        };
        let refuse = |st: u16, v: &Value| {
            let kind = v["error"]["kind"].as_str().unwrap_or("?");
            let mut t = tally.lock().unwrap();
            let n = t.refused.entry(format!("{st} {kind}")).or_default();
            if *n == 0 && kind != "lease_held" {
                eprintln!("soak: {run}: {st} {v}");
            }
            *n += 1;
        };
        let (st, v, ms) = call(
            "POST",
            "/v1/runs",
            Some(&json!({"thread": thread, "run_id": run})),
        );
        if st != 200 {
            refuse(st, &v);
            return;
        }
        tally.lock().unwrap().starts.push(ms);
        if let Some(p) = v["sandbox"]["path"].as_str() {
            let _ = std::fs::write(
                Path::new(p).join(format!("f{}.txt", i % 50)),
                format!("{i}\n"),
            );
        }
        let base = format!("/v1/runs/{run}");
        let (st, v, ms) = match end {
            End::Finish => call("POST", &format!("{base}/finish"), None),
            End::Pause => {
                let chunk = json!({"type": "run_finished", "interrupt": true});
                call("POST", &format!("{base}/chunk"), Some(&chunk));
                call("POST", &format!("{base}/finish"), None)
            }
            End::Cancel => call(
                "POST",
                &format!("{base}/abort"),
                Some(&json!({"cancelled": true})),
            ),
            End::Detach => call(
                "POST",
                &format!("{base}/abort"),
                Some(&json!({"cancelled": false})),
            ),
            End::Error => call(
                "POST",
                &format!("{base}/error"),
                Some(&json!({"message": "soak"})),
            ),
            End::Disconnect => call("POST", &format!("{base}/disconnect"), None),
        };
        if st == 200 {
            tally.lock().unwrap().finishes.push(ms);
        } else {
            refuse(st, &v);
        }
    }
}
