//! Mount benchmark: checkpoint and restore of a writable casfs mount against git, restic
//! and rsync on the same trees, and I/O through the mount against native ext4 and
//! fuse-overlayfs, all in one run.
//!
//! Per tree size (generated source-like trees, as in the capture bench):
//! - checkpoint after 10 changed files: `casfs checkpoint MP` (the CLI: syncfs, control
//!   socket, hashing, append) vs `git add -A && git commit` vs `restic backup`;
//! - restore of the previous checkpoint: `casfs restore MP ID` (root swap) plus the first
//!   read of a restored file, vs `git checkout` of the previous commit vs
//!   `rsync -a --delete` from a snapshot copy.
//!
//! Then I/O on ext4, through casfs and through fuse-overlayfs: 1 GiB sequential write
//! and read, `find` (again) and `git status` (medians of 3); untar of a 30k-file tree,
//! the first `find` and `rm -rf` (once each); and the daemon's peak RSS after looking up
//! every file of the largest tree.
//!
//! A large file: a 1 GiB file (random bytes) committed once; per repetition 4 KiB are
//! written into it at a new place and `casfs checkpoint MP` runs, against
//! `git add -A && git commit` and `restic backup` of a plain copy getting the same
//! write. And what routing a large file's writes through the daemon costs (that is what
//! lets a checkpoint read only the chunks written): overwriting 256 MiB of it in place
//! (`dd bs=1M conv=notrunc`) and 4,096 writes of 4 KiB, on ext4 and through casfs.
//!
//! Checkpoint and restore figures are medians of `--reps` runs; ratios are peer / casfs.
//! `--out FILE` writes every run as a result file (docs/results/README.md).
//! `CASFS_BENCH_BIN` runs another casfs binary (an older build, say) in the casfs
//! columns.
//!
//! Scale, per size: capture of the plain tree, mount, the first `find` over the mount,
//! restore after a `find` (the kernel then knows every entry) beside restore without
//! one, the daemon's peak RSS after the `find` and its RSS once the kernel dropped its
//! caches (`echo 2 > /proc/sys/vm/drop_caches`, root only) and the daemon unloaded what
//! the kernel forgot. `--sizes 1m` takes it to a million files (about 7 GB of files
//! and 20 minutes here: run by hand, not in CI).
//!
//! Run: `cargo bench --bench mount -- [--sizes 1k,10k,100k] [--reps 5] [--mode fuse|overlay]
//! [--no-peers] [--no-io] [--no-large] [--out FILE]` (`--mode`: the backend of every casfs mount,
//! the I/O and large-file ones included;
//! default: `casfs mount`'s own choice; `--no-peers`: casfs only)

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;
use common::*;

fn casfs(store: &Path, args: &[&str]) -> String {
    casfs_with(store, args, &[])
}

fn casfs_json(store: &Path, args: &[&str]) -> serde_json::Value {
    casfs_json_with(store, args, &[])
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn lazy_umount(p: &Path) {
    let _ = Command::new("umount").arg("-l").arg(p).status();
}

/// A git repository at `git_dir` whose work tree `tree` is committed; its environment.
fn git_init<'a>(git_dir: &'a Path, tree: &'a Path) -> Vec<(&'a str, &'a str)> {
    let env = git_env(git_dir, tree);
    sh(
        &format!(
            "git init -q {0} && git -C {0} config gc.auto 0",
            git_dir.display()
        ),
        &env,
    );
    sh("git add -A && git commit -qm init", &env);
    env
}

/// A restic repository at `repo` holding a first backup of `tree`; its environment.
fn restic_init<'a>(repo: &'a Path, tree: &Path) -> [(&'static str, &'a str); 2] {
    let env = [
        ("RESTIC_PASSWORD", "bench"),
        ("RESTIC_REPOSITORY", repo.to_str().unwrap()),
    ];
    sh("restic init -q", &env);
    sh(&format!("restic backup -q {}", tree.display()), &env);
    env
}

fn touch_files(files: &[PathBuf], round: usize) {
    for (i, f) in files.iter().enumerate() {
        fs::write(f, format!("round {round} change {i}\n")).unwrap();
    }
}

/// How one tree size scales (see the module's doc).
struct Scale {
    size: usize,
    capture: Duration,
    mount: Duration,
    first_find: Duration,
    restore_after_find: Duration,
    restore_after_find_daemon: Duration,
    peak_rss_kb: u64,
    rss_after_drop_kb: u64,
    nodes_after_drop: u64,
}

/// A field of `/proc/PID/status` in kB (VmHWM, VmRSS).
fn proc_kb(pid: u64, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
}

struct Row {
    tool: &'static str,
    scenario: &'static str,
    size: usize,
    median: Duration,
}

/// An I/O or large-file row: scenario, tool and every run.
type IoRow = (&'static str, &'static str, Vec<Duration>);

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let args = parse_bench_args(5);
    let mut res = Results::cargo_bench("mount");
    res.param("sizes", &args.sizes);
    res.param("reps", args.reps);
    res.param("flags", &args.flags);
    // `--no-peers`: casfs only (the million-file scale run).
    let peers = !args.flags.iter().any(|f| f == "--no-peers");
    let (git, restic, rsync) = (
        peers && have("git"),
        peers && have("restic"),
        peers && have("rsync"),
    );
    let overlay = have("fuse-overlayfs");
    let base = std::env::temp_dir().join(format!("casfs-bench-mount-{}", std::process::id()));
    fs::create_dir_all(&base).unwrap();
    res.bench_dir(&base);
    let mut rows: Vec<Row> = Vec::new();
    let mut scale: Vec<Scale> = Vec::new();
    let mut peak_rss_kb = 0u64;
    let mode: Vec<&str> = match args.flags.iter().position(|f| f == "--mode") {
        Some(i) => vec![
            "--mode",
            args.flags.get(i + 1).expect("--mode fuse|overlay"),
        ],
        None => vec![],
    };

    for &n in &args.sizes {
        let dir = base.join(format!("n{n}"));
        let plain = dir.join("plain");
        let store = dir.join("store");
        let mp = dir.join("mnt");
        fs::create_dir_all(&plain).unwrap();
        fs::create_dir_all(&mp).unwrap();
        let (files, bytes) = generate(&plain, n);
        eprintln!("{n} files, {} MB", bytes / 1_000_000);
        let at = |what: &str, tool: &str| serde_json::json!({"scenario": what, "tool": tool, "files": n});
        res.value(at("workload", "generated"), "B", bytes as f64);
        // The tree enters the store once, then is mounted lazily.
        let capture = timed(|| {
            casfs(&store, &["capture", plain.to_str().unwrap(), "-t", "b"]);
        });
        let mut mount_args = vec!["mount", mp.to_str().unwrap(), "-t", "b"];
        mount_args.extend(&mode);
        let mount = timed(|| {
            casfs(&store, &mount_args);
        });
        let step = files.len() / 10;
        let changed: Vec<PathBuf> = (0..10)
            .map(|i| mp.join(files[i * step].strip_prefix(&plain).unwrap()))
            .collect();
        let (mut cp_times, mut cp_daemon, mut rs_times, mut rs_daemon) =
            (vec![], vec![], vec![], vec![]);
        let mut last_two = [String::new(), String::new()];
        for r in 0..args.reps {
            touch_files(&changed, r);
            let mut v = serde_json::Value::Null;
            cp_times.push(timed(|| {
                v = casfs_json(&store, &["checkpoint", mp.to_str().unwrap()]);
            }));
            assert_eq!(v["changed_files"], 10, "{v}");
            cp_daemon.push(Duration::from_micros(v["duration_us"].as_u64().unwrap()));
            let parent = v["parent"].as_str().unwrap().to_string();
            last_two = [
                parent.clone(),
                v["checkpoint"].as_str().unwrap().to_string(),
            ];
            // Restore the previous checkpoint and read a restored file.
            let mut rv = serde_json::Value::Null;
            rs_times.push(timed(|| {
                rv = casfs_json(&store, &["restore", mp.to_str().unwrap(), &parent]);
                fs::read(&changed[0]).unwrap();
            }));
            rs_daemon.push(Duration::from_micros(rv["duration_us"].as_u64().unwrap()));
        }
        // Restore after the kernel has looked up every entry (a `find` first), back and
        // forth between the last two checkpoints; the first find's time and the
        // daemon's peak RSS after it.
        let st = casfs_json(&store, &["status", mp.to_str().unwrap()]);
        let pid = st["pid"].as_u64().unwrap();
        // The mount is at the first of the two now.
        let ids = last_two.clone();
        let (mut af_times, mut af_daemon, mut first_find) = (vec![], vec![], Duration::ZERO);
        for r in 0..args.reps {
            let f = sh(&format!("find {} | wc -l", mp.display()), &[]);
            if r == 0 {
                first_find = f;
            }
            let target = &ids[(r + 1) % 2];
            let mut rv = serde_json::Value::Null;
            af_times.push(timed(|| {
                rv = casfs_json(
                    &store,
                    &["restore", mp.to_str().unwrap(), target, "--force"],
                );
            }));
            af_daemon.push(Duration::from_micros(rv["duration_us"].as_u64().unwrap()));
        }
        sh(&format!("find {} -type f | wc -l", mp.display()), &[]);
        let rss = proc_kb(pid, "VmHWM:");
        peak_rss_kb = peak_rss_kb.max(rss);
        eprintln!("  daemon peak RSS after lookups: {} MB", rss / 1024);
        // What the daemon holds once the kernel forgot (needs root).
        let mut nodes_after_drop = 0;
        if fs::write("/proc/sys/vm/drop_caches", b"2").is_ok() {
            let mut last = u64::MAX;
            for _ in 0..30 {
                std::thread::sleep(Duration::from_millis(500));
                let n = casfs_json(&store, &["status", mp.to_str().unwrap()])["nodes_loaded"]
                    .as_u64()
                    .unwrap_or(0);
                if n == last {
                    break;
                }
                last = n;
            }
            nodes_after_drop = last;
        }
        let after_drop = proc_kb(pid, "VmRSS:");
        res.value(
            at("daemon peak RSS after a find", "casfs"),
            "KiB",
            rss as f64,
        );
        res.value(
            at("daemon RSS after drop_caches", "casfs"),
            "KiB",
            after_drop as f64,
        );
        res.value(
            at("nodes loaded after drop_caches", "casfs"),
            "nodes",
            nodes_after_drop as f64,
        );
        scale.push(Scale {
            size: n,
            capture: res.time(at("capture of the plain tree", "casfs"), capture),
            mount: res.time(at("mount", "casfs"), mount),
            first_find: res.time(at("first find", "casfs"), first_find),
            restore_after_find: res.times(at("restore after find (CLI)", "casfs"), &af_times),
            restore_after_find_daemon: res
                .times(at("restore after find (daemon)", "casfs"), &af_daemon),
            peak_rss_kb: rss,
            rss_after_drop_kb: after_drop,
            nodes_after_drop,
        });
        casfs(&store, &["unmount", mp.to_str().unwrap()]);
        rows.push(Row {
            tool: "casfs",
            scenario: "checkpoint (CLI)",
            size: n,
            median: res.times(at("checkpoint (CLI)", "casfs"), &cp_times),
        });
        rows.push(Row {
            tool: "casfs",
            scenario: "checkpoint (daemon)",
            size: n,
            median: res.times(at("checkpoint (daemon)", "casfs"), &cp_daemon),
        });
        rows.push(Row {
            tool: "casfs",
            scenario: "restore+read (CLI)",
            size: n,
            median: res.times(at("restore+read (CLI)", "casfs"), &rs_times),
        });
        rows.push(Row {
            tool: "casfs",
            scenario: "restore (daemon)",
            size: n,
            median: res.times(at("restore (daemon)", "casfs"), &rs_daemon),
        });

        let changed_plain: Vec<PathBuf> = (0..10).map(|i| files[i * step].clone()).collect();
        if git {
            let gd = dir.join("git");
            let env = git_init(&gd, &plain);
            let (mut c, mut r_) = (vec![], vec![]);
            for r in 0..args.reps {
                touch_files(&changed_plain, 100 + r);
                c.push(sh("git add -A && git commit -qm change", &env));
                r_.push(sh("git checkout -q HEAD~1 -- . && git reset -q", &env));
                sh("git checkout -q HEAD -- .", &env);
            }
            rows.push(Row {
                tool: "git",
                scenario: "checkpoint (CLI)",
                size: n,
                median: res.times(at("checkpoint (CLI)", "git"), &c),
            });
            rows.push(Row {
                tool: "git",
                scenario: "restore+read (CLI)",
                size: n,
                median: res.times(at("restore+read (CLI)", "git"), &r_),
            });
        }
        if restic {
            let repo = dir.join("restic");
            let env = restic_init(&repo, &plain);
            let mut c = vec![];
            for r in 0..args.reps {
                touch_files(&changed_plain, 200 + r);
                c.push(sh(&format!("restic backup -q {}", plain.display()), &env));
            }
            rows.push(Row {
                tool: "restic",
                scenario: "checkpoint (CLI)",
                size: n,
                median: res.times(at("checkpoint (CLI)", "restic"), &c),
            });
        }
        if rsync {
            let snap = dir.join("snap");
            sh(
                &format!("rsync -a {}/ {}/", plain.display(), snap.display()),
                &[],
            );
            let mut r_ = vec![];
            for r in 0..args.reps {
                touch_files(&changed_plain, 300 + r);
                r_.push(sh(
                    &format!("rsync -a --delete {}/ {}/", snap.display(), plain.display()),
                    &[],
                ));
            }
            rows.push(Row {
                tool: "rsync",
                scenario: "restore+read (CLI)",
                size: n,
                median: res.times(at("restore+read (CLI)", "rsync"), &r_),
            });
        }
        let _ = fs::remove_dir_all(&dir);
    }

    let mut io_rows: Vec<IoRow> = Vec::new();
    if !args.flags.iter().any(|f| f == "--no-io") {
        io_rows = io_bench(&base, overlay, &mode);
    }
    let mut large_rows: Vec<IoRow> = Vec::new();
    if !args.flags.iter().any(|f| f == "--no-large") {
        large_rows = large_file_bench(&base, args.reps, git, restic, &mode);
    }

    println!();
    println!("checkpoint after 10 changed files / restore of the previous checkpoint");
    println!("(medians of {}; ratio = peer / casfs)", args.reps);
    println!(
        "{:<22} {:>8} {:>12} {:>12} {:>8}",
        "scenario", "files", "tool", "median", "ratio"
    );
    for r in &rows {
        let casfs_row = rows
            .iter()
            .find(|c| c.tool == "casfs" && c.size == r.size && c.scenario == r.scenario);
        let ratio = match casfs_row {
            Some(c) if r.tool != "casfs" => {
                format!("{:.0}x", r.median.as_secs_f64() / c.median.as_secs_f64())
            }
            _ => String::new(),
        };
        println!(
            "{:<22} {:>8} {:>12} {:>12} {:>8}",
            r.scenario,
            r.size,
            r.tool,
            ms(r.median),
            ratio
        );
    }
    println!();
    println!(
        "scale (restore after find: medians of {}; RSS of the mount daemon)",
        args.reps
    );
    println!(
        "{:>8} {:>11} {:>10} {:>11} {:>22} {:>9} {:>20}",
        "files",
        "capture",
        "mount",
        "first find",
        "restore after find",
        "peak RSS",
        "after drop_caches"
    );
    for c in &scale {
        println!(
            "{:>8} {:>11} {:>10} {:>11} {:>22} {:>6} MB {:>8} MB, {} nodes",
            c.size,
            ms(c.capture),
            ms(c.mount),
            ms(c.first_find),
            format!(
                "{} / {}",
                ms(c.restore_after_find_daemon),
                ms(c.restore_after_find)
            ),
            c.peak_rss_kb / 1024,
            c.rss_after_drop_kb / 1024,
            c.nodes_after_drop
        );
    }
    if !io_rows.is_empty() {
        println!();
        println!("I/O (medians of 3; untar, first find and rm -rf once; ratio = time / native)");
        for (scenario, tool, runs) in &io_rows {
            let d = &median(runs.clone());
            let native = io_rows
                .iter()
                .find(|(s, t, _)| s == scenario && *t == "ext4")
                .map(|x| median(x.2.clone()))
                .unwrap_or(*d);
            println!(
                "{:<26} {:>16} {:>12} {:>8.2}x",
                scenario,
                tool,
                ms(*d),
                d.as_secs_f64() / native.as_secs_f64()
            );
        }
    }
    if !large_rows.is_empty() {
        println!();
        println!(
            "a 1 GiB file (medians of {}; ratio = time / casfs checkpoint, or / ext4)",
            args.reps
        );
        for (scenario, tool, runs) in &large_rows {
            let d = &median(runs.clone());
            let reference = large_rows
                .iter()
                .find(|(s, t, _)| {
                    s == scenario && (*t == "ext4" || *t == "casfs" || *t == "casfs (CLI)")
                })
                .map(|x| median(x.2.clone()))
                .unwrap_or(*d);
            println!(
                "{:<34} {:>16} {:>12} {:>8.2}x",
                scenario,
                tool,
                ms(*d),
                d.as_secs_f64() / reference.as_secs_f64()
            );
        }
    }
    println!("daemon peak RSS: {} MB", peak_rss_kb / 1024);
    if !overlay {
        println!("note: fuse-overlayfs not installed; skipped");
    }

    for (group, list) in [("io", &io_rows), ("large file", &large_rows)] {
        for (scenario, tool, runs) in list {
            let labels = serde_json::json!({"group": group, "scenario": scenario, "tool": tool});
            res.times(labels, runs);
        }
    }
    if !overlay {
        res.note("fuse-overlayfs not installed; skipped");
    }
    res.finish();
    let _ = fs::remove_dir_all(&base);
}

/// The I/O workloads on ext4, a casfs mount and fuse-overlayfs.
fn io_bench(base: &Path, overlay: bool, mode: &[&str]) -> Vec<IoRow> {
    let mut out = Vec::new();
    let src = base.join("io-src");
    fs::create_dir_all(&src).unwrap();
    generate(&src, 30_000);
    let tarball = base.join("tree.tar");
    sh(
        &format!("tar -C {} -cf {} .", src.display(), tarball.display()),
        &[],
    );
    let _ = fs::remove_dir_all(&src);

    let mut targets: Vec<(&'static str, PathBuf)> = Vec::new();
    let native = base.join("native");
    fs::create_dir_all(&native).unwrap();
    targets.push(("ext4", native));
    let store = base.join("io-store");
    let cmp = base.join("casfs-mnt");
    fs::create_dir_all(&cmp).unwrap();
    let mut mount = vec!["mount", cmp.to_str().unwrap(), "-t", "io"];
    mount.extend(mode);
    casfs(&store, &mount);
    targets.push(("casfs", cmp.clone()));
    let omp = base.join("overlay-mnt");
    if overlay {
        for d in ["lower", "upper", "work"] {
            fs::create_dir_all(base.join(d)).unwrap();
        }
        fs::create_dir_all(&omp).unwrap();
        sh(
            &format!(
                "fuse-overlayfs -o lowerdir={0}/lower,upperdir={0}/upper,workdir={0}/work {1}",
                base.display(),
                omp.display()
            ),
            &[],
        );
        targets.push(("fuse-overlayfs", omp.clone()));
    }
    let env = GIT_ENV.to_vec();
    // The cheap scenarios are repeated (median of 3); untar, the first find and rm -rf
    // run once.
    let med3 = |f: &dyn Fn() -> Duration| (0..3).map(|_| f()).collect::<Vec<_>>();
    for (tool, dir) in &targets {
        let big = dir.join("big");
        let write = || {
            sh(
                &format!(
                    "dd if=/dev/zero of={} bs=1M count=1024 status=none",
                    big.display()
                ),
                &[],
            )
        };
        out.push(("write 1 GiB", *tool, med3(&write)));
        let read = || sh(&format!("cat {} > /dev/null", big.display()), &[]);
        out.push(("read 1 GiB", *tool, med3(&read)));
        fs::remove_file(&big).unwrap();
        let t = dir.join("tree");
        fs::create_dir_all(&t).unwrap();
        out.push((
            "untar 30k files",
            *tool,
            vec![sh(
                &format!("tar -C {} -xf {}", t.display(), tarball.display()),
                &[],
            )],
        ));
        // The first find lists every directory for the first time; the next ones may
        // be served from the kernel's caches.
        let find = || sh(&format!("find {} | wc -l", t.display()), &[]);
        out.push(("find (first)", *tool, vec![find()]));
        out.push(("find (again)", *tool, med3(&find)));
        sh(
            &format!(
                "cd {} && git init -q && git config gc.auto 0 && git add -A",
                t.display()
            ),
            &env,
        );
        let status = || {
            sh(
                &format!("cd {} && git status --short | wc -l", t.display()),
                &env,
            )
        };
        out.push(("git status", *tool, med3(&status)));
        out.push((
            "rm -rf",
            *tool,
            vec![sh(&format!("rm -rf {}", t.display()), &[])],
        ));
    }
    casfs(&store, &["unmount", cmp.to_str().unwrap()]);
    if overlay {
        lazy_umount(&omp);
    }
    out
}

/// A 1 GiB file changed by 4 KiB per repetition: the checkpoint against git and restic,
/// and the cost of writing a large file through the daemon against ext4.
fn large_file_bench(
    base: &Path,
    reps: usize,
    git: bool,
    restic: bool,
    mode: &[&str],
) -> Vec<IoRow> {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let dir = base.join("large");
    let plain = dir.join("plain");
    let store = dir.join("store");
    let mp = dir.join("mnt");
    for d in [&plain, &mp] {
        fs::create_dir_all(d).unwrap();
    }
    let name = "big.bin";
    sh(
        &format!(
            "head -c 1073741824 /dev/urandom > {}",
            plain.join(name).display()
        ),
        &[],
    );
    casfs(&store, &["capture", plain.to_str().unwrap(), "-t", "large"]);
    let mut mount = vec!["mount", mp.to_str().unwrap(), "-t", "large"];
    mount.extend(mode);
    casfs(&store, &mount);
    // 4 KiB at a new place each round (round 0 also copies the file up, untimed).
    let write_4k = |file: &Path, round: usize| {
        let f = fs::OpenOptions::new().write(true).open(file).unwrap();
        let at = (round as u64 * 97 + 13) % 1023 * MIB + 12_345;
        f.write_all_at(&[round as u8 ^ 0x5a; 4096], at).unwrap();
    };
    write_4k(&mp.join(name), 0);
    casfs(&store, &["checkpoint", mp.to_str().unwrap()]);
    let mut out = Vec::new();
    let scenario = "checkpoint after a 4 KiB write";
    let (mut cli, mut daemon) = (vec![], vec![]);
    for r in 1..=reps {
        write_4k(&mp.join(name), r);
        let mut v = serde_json::Value::Null;
        cli.push(timed(|| {
            v = casfs_json(&store, &["checkpoint", mp.to_str().unwrap()]);
        }));
        daemon.push(Duration::from_micros(v["duration_us"].as_u64().unwrap()));
        eprintln!(
            "  large file round {r}: read {} bytes",
            v["stats"]["bytes_hashed"]
        );
    }
    out.push((scenario, "casfs (CLI)", cli));
    out.push((scenario, "casfs (daemon)", daemon));
    // A peer: per round the same 4 KiB write into the plain copy, then its command.
    let peer = |seed: usize, cmd: &str, env: &[(&str, &str)]| {
        let times = (1..=reps).map(|r| {
            write_4k(&plain.join(name), seed + r);
            sh(cmd, env)
        });
        times.collect::<Vec<_>>()
    };
    if git {
        let gd = dir.join("git");
        let env = git_init(&gd, &plain);
        out.push((
            scenario,
            "git",
            peer(100, "git add -A && git commit -qm change", &env),
        ));
        let _ = fs::remove_dir_all(&gd);
    }
    if restic {
        let repo = dir.join("restic");
        let env = restic_init(&repo, &plain);
        let cmd = format!("restic backup -q {}", plain.display());
        out.push((scenario, "restic", peer(200, &cmd, &env)));
        let _ = fs::remove_dir_all(&repo);
    }

    // What writing a large file through the daemon costs, against ext4: `dd` in place
    // with the block size, count and offset given (median of 3).
    for (tool, file) in [("ext4", plain.join(name)), ("casfs", mp.join(name))] {
        let dd = |blocks: &str| {
            let cmd = format!(
                "dd if=/dev/zero of={} {blocks} conv=notrunc status=none",
                file.display()
            );
            (0..3).map(|_| sh(&cmd, &[])).collect::<Vec<_>>()
        };
        out.push((
            "overwrite 256 MiB in place",
            tool,
            dd("bs=1M count=256 seek=300"),
        ));
        out.push((
            "4,096 writes of 4 KiB",
            tool,
            dd("bs=4k count=4096 seek=1000"),
        ));
    }
    casfs(&store, &["unmount", mp.to_str().unwrap()]);
    let _ = fs::remove_dir_all(&dir);
    out
}
