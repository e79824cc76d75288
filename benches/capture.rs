//! Capture benchmark: casfs against its peers on generated source-like trees.
//!
//! For each tree size it measures, as wall time of the real commands in one run:
//! - initial capture: `casfs capture` (fresh store) vs `tar -c | zstd -T0 -3` vs
//!   `git add -A && git commit` (fresh repo) vs `restic backup` (fresh repo),
//! - re-capture after 10 changed files: `casfs capture` vs `git add -A && git commit`
//!   vs `restic backup` (incremental).
//!
//! Every figure is the median of `--reps` runs; ratios are peer / casfs of the medians.
//! Peers that are not installed are skipped with a note. Results also go to
//! `target/bench-capture.json`.
//!
//! Run: `cargo bench --bench capture -- [--sizes 1000,10000,100000] [--reps 3]`

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Args {
    sizes: Vec<usize>,
    reps: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        sizes: vec![1_000, 10_000, 100_000],
        reps: 3,
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
            _ => {} // cargo bench passes --bench
        }
        i += 1;
    }
    a
}

fn parse_size(s: &str) -> Option<usize> {
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

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-normal file sizes like a source tree: median about 3 KiB, a long tail.
    fn file_size(&mut self) -> usize {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        ((8.0 + 1.3 * z).exp() as usize).clamp(16, 4 << 20)
    }
}

const WORDS: &[&str] = &[
    "fn", "let", "mut", "struct", "impl", "pub", "use", "mod", "match", "if", "else", "return",
    "self", "Some", "None", "Ok", "Err", "String", "Vec", "u64", "=>", "{", "}", "(", ")", ";",
    "const", "static", "trait", "where", "async", "await", "loop", "for", "in", "while",
];

fn text(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[(rng.next() % WORDS.len() as u64) as usize].as_bytes());
        out.push(if rng.next() % 9 == 0 { b'\n' } else { b' ' });
    }
    out.truncate(len);
    out
}

/// A tree of `n` files, about 20 per directory, three levels deep. Returns the files.
fn generate(root: &Path, n: usize) -> (Vec<PathBuf>, u64) {
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

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs a shell command and returns its wall time; panics on failure.
fn sh(cmd: &str, env: &[(&str, &str)]) -> Duration {
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

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

const GIT_ENV: &[(&str, &str)] = &[
    ("GIT_AUTHOR_NAME", "bench"),
    ("GIT_AUTHOR_EMAIL", "bench@example.invalid"),
    ("GIT_COMMITTER_NAME", "bench"),
    ("GIT_COMMITTER_EMAIL", "bench@example.invalid"),
    ("RESTIC_PASSWORD", "bench"),
];

/// Environment for git with its repository at `git_dir` and work tree at `tree`.
fn git_env<'a>(git_dir: &'a Path, tree: &'a Path) -> Vec<(&'a str, &'a str)> {
    let mut env = GIT_ENV.to_vec();
    env.push(("GIT_DIR", git_dir.to_str().unwrap()));
    env.push(("GIT_WORK_TREE", tree.to_str().unwrap()));
    env
}

struct Row {
    tool: &'static str,
    scenario: &'static str,
    size: usize,
    median: Duration,
}

fn main() {
    let args = parse_args();
    let casfs = env!("CARGO_BIN_EXE_casfs");
    let (git, tar_zstd, restic) = (have("git"), have("tar") && have("zstd"), have("restic"));
    for (ok, name) in [(git, "git"), (tar_zstd, "tar+zstd"), (restic, "restic")] {
        if !ok {
            println!("note: {name} is not installed; skipped");
        }
    }
    let base = std::env::var_os("CASFS_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let mut rows = Vec::new();
    for &n in &args.sizes {
        let tmp = tempfile::tempdir_in(&base).unwrap();
        let tree = tmp.path().join("tree");
        let (files, bytes) = generate(&tree, n);
        println!(
            "\n{n} files, {:.1} MB (median of {} runs)",
            bytes as f64 / 1e6,
            args.reps
        );
        // Let the clock pass the files' timestamps (see the directory cache's racy rule).
        std::thread::sleep(Duration::from_millis(200));
        let tree_s = tree.to_str().unwrap();
        let out = tmp.path().join("out");
        let out_s = out.to_str().unwrap();
        let mut add = |tool, scenario, v: Vec<Duration>| {
            let m = median(v);
            println!("  {scenario:<28} {tool:<10} {:>9.3} s", m.as_secs_f64());
            rows.push(Row {
                tool,
                scenario,
                size: n,
                median: m,
            });
        };

        // Initial capture, each run into a fresh store / repo.
        let mut t = Vec::new();
        for _ in 0..args.reps {
            let _ = fs::remove_dir_all(&out);
            t.push(sh(
                &format!("{casfs} --store {out_s} capture {tree_s} -t b"),
                &[],
            ));
        }
        add("casfs", "initial capture", t);
        if tar_zstd {
            let mut t = Vec::new();
            for _ in 0..args.reps {
                let _ = fs::remove_dir_all(&out);
                fs::create_dir_all(&out).unwrap();
                t.push(sh(
                    &format!("tar -cf - -C {tree_s} . | zstd -T0 -3 -q -o {out_s}/t.tar.zst"),
                    &[],
                ));
            }
            add("tar+zstd", "initial capture", t);
        }
        if restic {
            let mut t = Vec::new();
            for _ in 0..args.reps {
                let _ = fs::remove_dir_all(&out);
                sh(&format!("restic init -q -r {out_s}"), GIT_ENV);
                t.push(sh(
                    &format!("cd {tree_s} && restic backup -q -r {out_s} ."),
                    GIT_ENV,
                ));
            }
            add("restic", "initial capture", t);
        }
        if git {
            // The repository lives outside the tree, so no tool ever sees another's files.
            let mut t = Vec::new();
            for _ in 0..args.reps {
                let _ = fs::remove_dir_all(&out);
                let env = git_env(&out, &tree);
                sh("git init -q && git config gc.auto 0", &env);
                t.push(sh("git add -A && git commit -q -m initial", &env));
            }
            add("git", "initial capture", t);
        }

        // Fresh stores that hold the tree, then re-captures after 10 changes each.
        let _ = fs::remove_dir_all(&out);
        let store = tmp.path().join("store");
        let store_s = store.to_str().unwrap();
        let restic_repo = tmp.path().join("restic");
        let restic_s = restic_repo.to_str().unwrap();
        sh(
            &format!("{casfs} --store {store_s} capture {tree_s} -t b"),
            &[],
        );
        let git_dir = tmp.path().join("git");
        let genv = git_env(&git_dir, &tree);
        if git {
            sh("git init -q && git config gc.auto 0", &genv);
            sh("git add -A && git commit -q -m initial", &genv);
        }
        if restic {
            sh(&format!("restic init -q -r {restic_s}"), GIT_ENV);
            sh(
                &format!("cd {tree_s} && restic backup -q -r {restic_s} ."),
                GIT_ENV,
            );
        }
        let (mut tc, mut tg, mut tr) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..args.reps {
            for k in 0..10 {
                let f = &files[(k * 7919 + rep * 104_729) % files.len()];
                let mut data = fs::read(f).unwrap();
                data.extend_from_slice(format!("\n// change {rep} {k}\n").as_bytes());
                fs::write(f, data).unwrap();
            }
            tc.push(sh(
                &format!("{casfs} --store {store_s} capture {tree_s} -t b"),
                &[],
            ));
            if git {
                tg.push(sh("git add -A && git commit -q -m change", &genv));
            }
            if restic {
                tr.push(sh(
                    &format!("cd {tree_s} && restic backup -q -r {restic_s} ."),
                    GIT_ENV,
                ));
            }
        }
        add("casfs", "re-capture after 10 changes", tc);
        if git {
            add("git", "re-capture after 10 changes", tg);
        }
        if restic {
            add("restic", "re-capture after 10 changes", tr);
        }
        let mb = bytes as f64 / 1e6;
        let c = rows
            .iter()
            .find(|r| r.size == n && r.tool == "casfs" && r.scenario == "initial capture")
            .unwrap()
            .median
            .as_secs_f64();
        println!(
            "  casfs initial capture: {:.0} MB/s, {:.0} files/s",
            mb / c,
            n as f64 / c
        );
    }

    println!("\nratios (peer median / casfs median; above 1 means casfs is faster)");
    for r in &rows {
        if r.tool == "casfs" {
            continue;
        }
        let c = rows
            .iter()
            .find(|x| x.tool == "casfs" && x.scenario == r.scenario && x.size == r.size)
            .unwrap();
        println!(
            "  {:>7} files  {:<28} {:<10} {:>6.2}x",
            r.size,
            r.scenario,
            r.tool,
            r.median.as_secs_f64() / c.median.as_secs_f64()
        );
    }
    let json: Vec<_> = rows
        .iter()
        .map(|r| {
            serde_json::json!({"tool": r.tool, "scenario": r.scenario, "files": r.size,
                "median_s": r.median.as_secs_f64(), "reps": args.reps})
        })
        .collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-capture.json");
    fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    println!("\nwrote {}", path.display());
}
