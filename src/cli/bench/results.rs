//! Benchmark results as data: one JSON file per run (`--out FILE`, or `CASFS_BENCH_OUT`
//! for the bench scripts) holding the command line, the commit, the date, the machine
//! (cores, CPU, memory, kernel, the filesystem of the bench directory) and every
//! measured row with all its repetitions, in the format `docs/results/README.md`
//! describes. `casfs bench` and every `cargo bench` binary write it (the benches take
//! this file in with `#[path]`); `scripts/render-results.py` turns the files under
//! `docs/results/` into the tables of the docs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The `format` of every result file.
pub const FORMAT: &str = "casfs-bench-result/1";

/// The filesystem a directory is on, from `/proc/self/mountinfo`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Filesystem {
    #[serde(rename = "type")]
    pub fs_type: String,
    pub source: String,
    pub mountpoint: String,
    /// The mount's options and the filesystem's own (`rw,relatime` and, say,
    /// `errors=remount-ro`).
    pub options: String,
}

/// The machine a run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Machine {
    pub cores: usize,
    #[serde(default)]
    pub cpu: String,
    #[serde(default)]
    pub memory_bytes: u64,
    pub kernel: String,
    #[serde(default)]
    pub os: String,
    /// Where the bench made its trees, stores and mounts.
    #[serde(default)]
    pub bench_dir: String,
    #[serde(default)]
    pub filesystem: Option<Filesystem>,
}

impl Machine {
    /// This machine, with the filesystem of `bench_dir`.
    pub fn probe(bench_dir: &Path) -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let memory_bytes = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024);
        let os = read("/etc/os-release")
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_default();
        let dir = std::fs::canonicalize(bench_dir).unwrap_or_else(|_| bench_dir.to_path_buf());
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            memory_bytes,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            os,
            bench_dir: dir.display().to_string(),
            filesystem: filesystem_of(&dir),
        }
    }
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if let (b'\\', Some(d)) = (b[i], octal) {
            out.push(
                d.iter()
                    .fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')),
            );
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The filesystem of the mount that holds `dir` (canonical): the longest mountpoint of
/// `/proc/self/mountinfo` above it.
pub fn filesystem_of(dir: &Path) -> Option<Filesystem> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<Filesystem> = None;
    for line in info.lines() {
        // id parent maj:min root mountpoint options [optional...] - type source super
        let (left, right) = line.split_once(" - ")?;
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        let (Some(mp), Some(opts), Some(ty)) = (l.get(4), l.get(5), r.first()) else {
            continue;
        };
        let mp = unescape(mp);
        if !dir.starts_with(&mp) {
            continue;
        }
        if best.as_ref().is_some_and(|b| b.mountpoint.len() > mp.len()) {
            continue;
        }
        let sup = r.get(2).copied().unwrap_or_default();
        best = Some(Filesystem {
            fs_type: ty.to_string(),
            source: unescape(r.get(1).copied().unwrap_or_default()),
            mountpoint: mp,
            options: if sup.is_empty() {
                opts.to_string()
            } else {
                format!("{opts},{sup}")
            },
        });
    }
    best
}

/// Who ran, what and when: the head of every result file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RunInfo {
    #[serde(default)]
    pub format: String,
    #[serde(default)]
    pub bench: String,
    /// The command line, as a person would type it to run it again.
    #[serde(default)]
    pub command: String,
    /// The commit of the source tree the binaries were built from (none outside a git
    /// checkout), and whether it had uncommitted changes.
    #[serde(default)]
    pub commit: Option<String>,
    #[serde(default)]
    pub commit_dirty: bool,
    /// When the run started (RFC 3339, UTC).
    #[serde(default)]
    pub date: String,
    /// How the bench (and so the casfs it runs) was built: "release" (what `cargo
    /// bench` builds) or "debug" (a quick check; its figures are not casfs's).
    #[serde(default)]
    pub profile: String,
    /// The `CASFS_*` variables set for the run (the backend, another binary...).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl RunInfo {
    /// Bench `bench` run as `command`, now, from this source tree.
    pub fn now(bench: &str, command: String) -> RunInfo {
        let (commit, commit_dirty) = commit_of(Path::new(env!("CARGO_MANIFEST_DIR")));
        RunInfo {
            format: FORMAT.into(),
            bench: bench.into(),
            command,
            commit,
            commit_dirty,
            date: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
            env: std::env::vars().filter(|(k, _)| recorded_var(k)).collect(),
        }
    }
}

/// Whether a run's file keeps environment variable `name`: the `CASFS_*` settings, but
/// not the test suite's, the output's own, or anything that may hold a secret.
fn recorded_var(name: &str) -> bool {
    name.starts_with("CASFS_")
        && !name.starts_with("CASFS_TEST_")
        && name != "CASFS_BENCH_OUT"
        && !["TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL"]
            .iter()
            .any(|w| name.contains(w))
}

/// The commit checked out at `repo`, and whether tracked files differ from it.
pub fn commit_of(repo: &Path) -> (Option<String>, bool) {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"]);
    let dirty = commit.is_some()
        && git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    (commit, dirty)
}

/// The median as the benches print it: the middle of the sorted runs (the upper of the
/// two middles for an even count).
pub fn median_f64(runs: &[f64]) -> f64 {
    let mut s = runs.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Milliseconds, to the microsecond.
pub fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// `path`, or when it is a directory (or ends in `/`) a file in it named for the run:
/// `<date>-<commit>.json`.
pub fn out_path(path: &Path, info: &RunInfo) -> PathBuf {
    let dir = path.is_dir() || path.to_string_lossy().ends_with('/');
    if !dir {
        return path.to_path_buf();
    }
    let date: String = info
        .date
        .chars()
        .map(|c| if c == ':' { '-' } else { c })
        .collect();
    let commit = info
        .commit
        .as_deref()
        .map_or("nocommit", |c| &c[..c.len().min(7)]);
    path.join(format!("{date}-{commit}.json"))
}

/// The rows of a bench binary's run, written as a result file when it ends (if asked).
pub struct Results {
    info: RunInfo,
    out: Option<PathBuf>,
    machine: Machine,
    params: Map<String, Value>,
    rows: Vec<Value>,
    notes: Vec<String>,
    start: Instant,
}

impl Results {
    /// The results of `cargo bench --bench NAME -- ARGS` (this process's arguments):
    /// written to `--out FILE` if given.
    pub fn cargo_bench(name: &str) -> Results {
        let argv: Vec<String> = std::env::args().skip(1).collect();
        let out = argv
            .iter()
            .position(|a| a == "--out")
            .and_then(|i| argv.get(i + 1))
            .map(PathBuf::from);
        // cargo passes `--bench` to every bench binary.
        let args: Vec<&str> = argv
            .iter()
            .map(String::as_str)
            .filter(|a| *a != "--bench")
            .collect();
        let mut command = format!("cargo bench --bench {name}");
        if !args.is_empty() {
            command.push_str(" -- ");
            command.push_str(&shell_words(&args));
        }
        Results::new(name, command, out)
    }

    pub fn new(bench: &str, command: String, out: Option<PathBuf>) -> Results {
        Results {
            info: RunInfo::now(bench, command),
            out,
            machine: Machine::probe(&std::env::temp_dir()),
            params: Map::new(),
            rows: Vec::new(),
            notes: Vec::new(),
            start: Instant::now(),
        }
    }

    /// Where the bench makes its trees (default: the temporary directory): its
    /// filesystem is looked up now, while it is mounted.
    pub fn bench_dir(&mut self, dir: &Path) {
        self.machine = Machine::probe(dir);
    }

    /// A setting of the run (sizes, repetitions, backend...).
    pub fn param(&mut self, key: &str, value: impl Serialize) {
        let v = serde_json::to_value(value).unwrap_or(Value::Null);
        self.params.insert(key.into(), v);
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// A measured row: `labels` (a JSON object: what was measured, with what, at which
    /// size) and every repetition in `unit`. Returns the median.
    pub fn values(&mut self, labels: Value, unit: &str, runs: &[f64]) -> f64 {
        let median = median_f64(runs);
        let mut row = match labels {
            Value::Object(m) => m,
            other => {
                let mut m = Map::new();
                m.insert("what".into(), other);
                m
            }
        };
        for k in ["unit", "runs", "median"] {
            assert!(!row.contains_key(k), "a row's label may not be named {k:?}");
        }
        row.insert("unit".into(), unit.into());
        row.insert("runs".into(), runs.to_vec().into());
        row.insert("median".into(), median.into());
        self.rows.push(Value::Object(row));
        median
    }

    /// A row measured once.
    pub fn value(&mut self, labels: Value, unit: &str, value: f64) -> f64 {
        self.values(labels, unit, &[value])
    }

    /// A timed row (milliseconds); returns the median as the benches compute it.
    pub fn times(&mut self, labels: Value, runs: &[Duration]) -> Duration {
        let ms: Vec<f64> = runs.iter().map(|d| millis(*d)).collect();
        self.values(labels, "ms", &ms);
        let mut s = runs.to_vec();
        s.sort();
        s.get(s.len() / 2).copied().unwrap_or_default()
    }

    /// A row timed once.
    pub fn time(&mut self, labels: Value, run: Duration) -> Duration {
        self.times(labels, &[run])
    }

    /// The result file's content.
    pub fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(&self.info).expect("run info serializes");
        let m = v.as_object_mut().expect("an object");
        m.insert("casfs_version".into(), env!("CARGO_PKG_VERSION").into());
        m.insert(
            "duration_s".into(),
            ((self.start.elapsed().as_secs_f64() * 10.0).round() / 10.0).into(),
        );
        m.insert(
            "machine".into(),
            serde_json::to_value(&self.machine).expect("serializes"),
        );
        m.insert("params".into(), Value::Object(self.params.clone()));
        m.insert("rows".into(), Value::Array(self.rows.clone()));
        m.insert("notes".into(), self.notes.clone().into());
        v
    }

    /// Writes the result file if `--out` was given; returns its path.
    pub fn write(&self) -> std::io::Result<Option<PathBuf>> {
        let Some(out) = &self.out else {
            return Ok(None);
        };
        let path = out_path(out, &self.info);
        let text = serde_json::to_string_pretty(&self.to_json()).expect("serializes") + "\n";
        std::fs::write(&path, text).map_err(|e| {
            std::io::Error::new(e.kind(), format!("writing {}: {e}", path.display()))
        })?;
        Ok(Some(path))
    }

    /// [`Results::write`] for a bench binary: says where on stderr, exits 1 on failure.
    pub fn finish(&self) {
        match self.write() {
            Ok(Some(p)) => eprintln!("results: wrote {}", p.display()),
            Ok(None) => {}
            Err(e) => {
                eprintln!("results: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// Arguments joined for a shell, each quoted when it needs it.
pub fn shell_words(args: &[&str]) -> String {
    args.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c));
            if plain {
                a.to_string()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    // A bench binary (no test harness) compiles this module without its tests.
    #[allow(unused_imports)]
    use super::*;

    #[test]
    fn rows_keep_every_run_and_the_median() {
        let mut r = Results::new("t", "t".into(), None);
        let m = r.times(
            serde_json::json!({"tool": "casfs", "files": 10}),
            &[
                Duration::from_millis(3),
                Duration::from_millis(1),
                Duration::from_millis(2),
            ],
        );
        assert_eq!(m, Duration::from_millis(2));
        r.param("reps", 3);
        let v = r.to_json();
        assert_eq!(v["format"], FORMAT);
        assert_eq!(v["rows"][0]["runs"], serde_json::json!([3.0, 1.0, 2.0]));
        assert_eq!(v["rows"][0]["median"], 2.0);
        assert_eq!(v["rows"][0]["unit"], "ms");
        assert_eq!(v["rows"][0]["tool"], "casfs");
        assert!(v["machine"]["cores"].as_u64().unwrap() >= 1);
        assert!(!v["machine"]["kernel"].as_str().unwrap().is_empty());
        assert!(v["machine"]["filesystem"]["type"].is_string(), "{v}");
        assert!(v["date"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn no_secret_or_test_setting_is_recorded() {
        assert!(recorded_var("CASFS_MOUNT_MODE"));
        assert!(recorded_var("CASFS_BENCH_BIN"));
        for v in [
            "CASFS_TOKEN",
            "CASFS_TEST_PG",
            "CASFS_BENCH_OUT",
            "CASFS_S3_KEY",
            "HOME",
        ] {
            assert!(!recorded_var(v), "{v}");
        }
    }

    #[test]
    fn mountinfo_escapes_and_shell_words() {
        assert_eq!(unescape(r"/mnt/a\040b"), "/mnt/a b");
        assert_eq!(unescape(r"/x\"), r"/x\");
        assert_eq!(
            shell_words(&["--sizes", "1k,10k", "a b"]),
            "--sizes 1k,10k 'a b'"
        );
    }

    #[test]
    fn a_directory_out_names_the_file_for_the_run() {
        let info = RunInfo {
            date: "2026-01-02T03:04:05Z".into(),
            commit: Some("0123456789abcdef".into()),
            ..RunInfo::default()
        };
        assert_eq!(
            out_path(Path::new("docs/results/capture/"), &info),
            Path::new("docs/results/capture/2026-01-02T03-04-05Z-0123456.json")
        );
        assert_eq!(out_path(Path::new("x.json"), &info), Path::new("x.json"));
    }
}
