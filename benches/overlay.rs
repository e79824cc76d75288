//! The two mount backends side by side with the kernel's floor, in one run, on a fresh
//! journaled ext4 loop filesystem (this VM's root ext4 has no journal, and its create
//! times swing tenfold after mass deletes): everything (stores, trees, uppers) lives on
//! it.
//!
//! Backends, each a workspace over the same base tree (the "real" tree below):
//! - `native`: a plain copy of the base on the loop filesystem;
//! - `kernel-overlay`: the kernel's overlayfs, lower a plain copy of the base, upper and
//!   work beside it (the floor of the overlay design);
//! - `casfs-overlay`: `casfs mount --mode overlay` of the base's checkpoint (its
//!   lower an EROFS image of the base over casfs's object view, the default);
//! - `casfs-overlay-view`: the same with `CASFS_OVERLAY_LOWER=view` (the lower is
//!   casfs's FUSE view of the tree);
//! - `casfs-fuse`: `casfs mount --mode fuse` of the same checkpoint, the classic FUSE
//!   transport (`read`/`writev` on /dev/fuse);
//! - `casfs-fuse-uring`: the same over FUSE's io_uring queues (only when
//!   /sys/module/fuse/parameters/enable_uring is Y: the bench does not turn it on);
//! - `fuse-overlayfs` (when installed): the userspace overlay over a plain copy.
//!
//! Fairness: the inputs (tar files, the repository cloned, the C project, npm's cache)
//! live on a tmpfs of their own; every step starts after a `sync` with the page cache
//! dropped (the warm `find` after a `sync` only), so no backend pays for another's (or
//! its own setup's) writeback; the order of the backends alternates between rounds;
//! the table gives the median and the spread of at least 3 rounds, and the native
//! untar is cross-checked against a plain shell `tar -xf` into a fresh directory.
//!
//! Operations (medians of `--reps` rounds, each round on a fresh workspace):
//! cold `find` of the base (caches dropped), warm `find`, `rm -rf` of the base tree;
//! untar of 30,000 files of 100 B ("small") and of the real tree; `rm -rf` of the new
//! small tree; `git clone --no-hardlinks` of a local repository and the first
//! `git status` after it; a small C build (`make -j2` of 120 generated files); `npm ci`
//! from a warm cache (offline) and `rm -rf node_modules`; a 1 GiB
//! sequential write with fsync and its cold read; and the FUSE round trip: 20,000
//! `getxattr` calls on a file of the base, free and with the caller pinned to CPU 0
//! (microseconds per call; the kernel answers it itself on native, on overlays of ext4,
//! and over a casfs view of a tree without extended attributes).
//! `--only a,b` runs only those backends.
//!
//! Then, per casfs backend: `casfs checkpoint` after 10 changed files on trees of
//! 1k/10k/100k files, and `casfs restore` of the previous checkpoint (the daemon's own
//! `duration_us` and the whole command).
//!
//! The real tree is /usr/share/man + /usr/include (about 29k files here). `--out FILE`
//! writes every round as a result file (docs/results/README.md).
//!
//! Run (root): `cargo bench --bench overlay -- [--reps 3] [--sizes 1k,10k,100k]
//! [--repo PATH] [--no-ckpt] [--no-io] [--only a,b] [--out FILE]`

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

#[path = "common/mod.rs"]
mod common;
use common::work::*;
use common::*;

/// casfs with `--json`; the overlay's lower is an image unless `env` says otherwise.
fn casfs_json(store: &Path, args: &[&str]) -> serde_json::Value {
    casfs_json_env(store, args, &[])
}

fn casfs_json_env(store: &Path, args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut e = vec![("CASFS_OVERLAY_LOWER", "image")];
    e.extend_from_slice(env);
    casfs_json_with(store, args, &e)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A workspace of one backend over the base tree.
struct Ws {
    root: PathBuf,
    unmount: Vec<PathBuf>,
}

impl Drop for Ws {
    fn drop(&mut self) {
        for m in &self.unmount {
            let _ = Command::new("umount").arg(m).status();
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        // casfs daemons let their store go after the unmount.
        std::thread::sleep(Duration::from_millis(300));
    }
}

struct Bench {
    fs: PathBuf,
    base: PathBuf,
    /// Per backend: the casfs store holding the base's checkpoint.
    stores: BTreeMap<String, PathBuf>,
    results: BTreeMap<(String, String), Vec<f64>>,
    failed: Vec<String>,
    round: usize,
    /// casfs backends mounted once already.
    mounted: Vec<String>,
}

impl Bench {
    fn workspace(&mut self, backend: &str) -> Ws {
        self.round += 1;
        let d = self.fs.join(format!("{backend}-{}", self.round));
        fs::create_dir_all(&d).unwrap();
        let m = d.join("ws");
        fs::create_dir_all(&m).unwrap();
        match backend {
            "native" => {
                sh(&format!("cp -a {}/. {}", q(&self.base), q(&m)), &[]);
                Ws {
                    root: m,
                    unmount: vec![],
                }
            }
            "kernel-overlay" | "fuse-overlayfs" => {
                let (l, u, w) = (d.join("lower"), d.join("upper"), d.join("work"));
                for p in [&l, &u, &w] {
                    fs::create_dir_all(p).unwrap();
                }
                sh(&format!("cp -a {}/. {}", q(&self.base), q(&l)), &[]);
                let opts = format!(
                    "lowerdir={},upperdir={},workdir={}",
                    l.display(),
                    u.display(),
                    w.display()
                );
                if backend == "kernel-overlay" {
                    sh(
                        &format!(
                            "mount -t overlay overlay -o {opts},redirect_dir=on,xino=auto {}",
                            q(&m)
                        ),
                        &[],
                    );
                } else {
                    sh(&format!("fuse-overlayfs -o {opts} {}", q(&m)), &[]);
                }
                Ws {
                    root: m.clone(),
                    unmount: vec![m],
                }
            }
            casfs => {
                let (mode, env): (&str, &[(&str, &str)]) = match casfs {
                    "casfs-overlay-view" => ("overlay", &[("CASFS_OVERLAY_LOWER", "view")]),
                    "casfs-fuse" => ("fuse", &[("CASFS_FUSE_TRANSPORT", "classic")]),
                    "casfs-fuse-uring" => ("fuse", &[("CASFS_FUSE_TRANSPORT", "io_uring")]),
                    other => (other.strip_prefix("casfs-").unwrap(), &[]),
                };
                let store = self.stores[casfs].clone();
                let first = !self.mounted.iter().any(|m| m == casfs);
                self.mounted.push(casfs.to_string());
                let t = std::time::Instant::now();
                casfs_json_env(
                    &store,
                    &["mount", m.to_str().unwrap(), "-t", "base", "--mode", mode],
                    env,
                );
                let op = if first {
                    "mount (first; the overlay builds its image)"
                } else {
                    "mount (again)"
                };
                self.add(op, casfs, ms(t.elapsed()));
                Ws {
                    root: m.clone(),
                    unmount: vec![m],
                }
            }
        }
    }

    fn add(&mut self, op: &str, backend: &str, v: f64) {
        self.results
            .entry((op.to_string(), backend.to_string()))
            .or_default()
            .push(v);
    }

    /// Times `cmd` after a `sync` and with the page cache dropped, so every backend
    /// starts every step with nothing of an earlier step still being written back and
    /// the same (cold) cache; a failure is noted (and reported) instead of a figure.
    fn timed(&mut self, op: &str, backend: &str, cmd: &str, env: &[(&str, &str)]) {
        drop_caches();
        self.run_timed(op, backend, cmd, env)
    }

    /// [`Bench::timed`] with the cache as the last step left it (after a `sync`): for
    /// the warm `find`.
    fn timed_warm(&mut self, op: &str, backend: &str, cmd: &str, env: &[(&str, &str)]) {
        let _ = sh("sync", &[]);
        self.run_timed(op, backend, cmd, env)
    }

    fn run_timed(&mut self, op: &str, backend: &str, cmd: &str, env: &[(&str, &str)]) {
        let t = std::time::Instant::now();
        let out = Command::new("sh")
            .args(["-c", cmd])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let d = t.elapsed();
        if out.status.success() {
            self.add(op, backend, ms(d));
        } else {
            let why = String::from_utf8_lossy(&out.stderr);
            let why = why.lines().next().unwrap_or("").to_string();
            eprintln!("{op} on {backend} failed: {why}");
            self.failed.push(format!("{op} on {backend}: {why}"));
        }
    }
}

/// Microseconds per `getxattr` of `path` (20,000 calls after 1,000 to warm up), the
/// calling thread pinned to `cpu` if given.
fn round_trip_us(path: &Path, cpu: Option<usize>) -> f64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let name = c"user.casfs.bench";
    let run = || {
        let call = || {
            let mut buf = [0u8; 64];
            // SAFETY: NUL-terminated strings and a buffer of the length given.
            unsafe {
                libc::getxattr(
                    c.as_ptr(),
                    name.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
        };
        for _ in 0..1_000 {
            call();
        }
        let t = std::time::Instant::now();
        for _ in 0..20_000 {
            call();
        }
        t.elapsed().as_secs_f64() * 1e6 / 20_000.0
    };
    match cpu {
        None => run(),
        Some(cpu) => std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: a zeroed cpu_set_t with one bit set, for this thread.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                run()
            })
            .join()
            .unwrap()
        }),
    }
}

/// Notes one round of `op` by `casfs`: the daemon's time under `op`, the command's
/// under `op (command)`.
fn note(
    rows: &mut BTreeMap<(String, String), Vec<f64>>,
    op: &str,
    casfs: &str,
    daemon: f64,
    whole: f64,
) {
    let mut add = |op: String, v| rows.entry((op, casfs.into())).or_default().push(v);
    add(op.to_string(), daemon);
    add(format!("{op} (command)"), whole);
}

/// Changes 10 of the `n` files `make_files` made under mount `mp` (round `r`) and
/// checkpoints: the checkpoint's answer, the daemon's time and the command's (ms).
fn ten_changes_and_checkpoint(
    store: &Path,
    mp: &Path,
    n: usize,
    r: usize,
) -> (serde_json::Value, f64, f64) {
    for k in 0..10 {
        let i = k * (n / 10);
        let f = mp.join(format!("d{:03}/f{i}.txt", i / 100));
        let mut s = fs::read_to_string(&f).unwrap_or_default();
        s.push_str(&format!("change {r}\n"));
        fs::write(&f, s).unwrap();
    }
    let t = std::time::Instant::now();
    let cp = casfs_json(store, &["checkpoint", mp.to_str().unwrap()]);
    let whole = ms(t.elapsed());
    let daemon = cp["duration_us"].as_f64().unwrap() / 1000.0;
    (cp, daemon, whole)
}

fn main() {
    let args = parse_bench_args(3);
    let mut res = Results::cargo_bench("overlay");
    res.param("reps", args.reps);
    res.param("sizes", &args.sizes);
    let flag = |f: &str| args.flags.iter().any(|a| a == f);
    let repo = args
        .flags
        .windows(2)
        .find(|w| w[0] == "--repo")
        .map(|w| PathBuf::from(&w[1]))
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the overlay bench mounts loop filesystems and overlays: run it as root");
        return;
    }
    let lfs = LoopFs::new(12);
    let root = lfs.mnt.clone();
    res.bench_dir(&root);
    eprintln!("loop filesystem at {}", root.display());
    let base = root.join("base");
    fs::create_dir_all(&base).unwrap();
    for src in ["/usr/share/man", "/usr/include"] {
        if Path::new(src).is_dir() {
            let name = Path::new(src).file_name().unwrap();
            sh(&format!("cp -a {} {}", src, q(&base.join(name))), &[]);
        }
    }
    let count = String::from_utf8(
        Command::new("sh")
            .args(["-c", &format!("find {} | wc -l", q(&base))])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    // The inputs (tar files, the repository cloned, the C project, npm's cache) on a
    // tmpfs of their own.
    let inputs = Inputs::new(6, &base, &repo);
    let Inputs {
        small,
        real,
        bare,
        cproj,
        ..
    } = &inputs;
    let npm = npm_project(&inputs.tmpfs.dir);

    let mut backends = vec![
        "native",
        "kernel-overlay",
        "casfs-overlay",
        "casfs-overlay-view",
        "casfs-fuse",
    ];
    if casfs::fs::fuse_uring_enabled() {
        backends.push("casfs-fuse-uring");
    } else {
        eprintln!(
            "FUSE over io_uring is off (/sys/module/fuse/parameters/enable_uring): \
             no casfs-fuse-uring column"
        );
    }
    if have("fuse-overlayfs") {
        backends.push("fuse-overlayfs");
    }
    if let Some(i) = args.flags.iter().position(|f| f == "--only") {
        let only: Vec<String> = args.flags[i + 1].split(',').map(String::from).collect();
        backends.retain(|b| only.iter().any(|o| o == b));
    }
    let mut b = Bench {
        fs: root.clone(),
        base: base.clone(),
        stores: BTreeMap::new(),
        results: BTreeMap::new(),
        failed: Vec::new(),
        round: 0,
        mounted: Vec::new(),
    };
    for casfs in backends.iter().filter(|b| b.starts_with("casfs-")) {
        let store = root.join(format!("store-{casfs}"));
        casfs_json(&store, &["capture", base.to_str().unwrap(), "-t", "base"]);
        b.stores.insert(casfs.to_string(), store);
    }
    eprintln!("base: {} entries", count.trim());
    if let Ok(n) = count.trim().parse::<f64>() {
        res.value(
            serde_json::json!({"op": "base tree", "backend": "native"}),
            "entries",
            n,
        );
    }
    // A file of the base, for the round trip.
    let probe_rel = PathBuf::from(
        String::from_utf8(
            Command::new("sh")
                .args([
                    "-c",
                    &format!("cd {} && find . -type f | head -1", q(&base)),
                ])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim(),
    );

    if !flag("--no-io") {
        for r in 0..args.reps {
            // Order alternated between rounds: no backend always goes first (or last).
            let order: Vec<&str> = if r % 2 == 0 {
                backends.clone()
            } else {
                backends.iter().rev().copied().collect()
            };
            for be in &order {
                eprintln!("round {}: {be}", r + 1);
                let ws = b.workspace(be);
                let w = ws.root.clone();
                b.timed(
                    "cold find (base)",
                    be,
                    &format!("find {} | wc -l", q(&w)),
                    &[],
                );
                let probe = w.join(&probe_rel);
                for (op, cpu) in [
                    ("round trip, us (getxattr)", None),
                    ("round trip, us (getxattr, caller on CPU 0)", Some(0)),
                ] {
                    let mut us: Vec<f64> = (0..3).map(|_| round_trip_us(&probe, cpu)).collect();
                    us.sort_by(f64::total_cmp);
                    b.add(op, be, us[1]);
                }
                b.timed_warm(
                    "warm find (base)",
                    be,
                    &format!("find {} | wc -l", q(&w)),
                    &[],
                );
                b.timed(
                    "rm -rf (base tree)",
                    be,
                    &format!("rm -rf {}/*", q(&w)),
                    &[],
                );
                fs::create_dir_all(w.join("small")).unwrap();
                b.timed(
                    "untar small",
                    be,
                    &format!("tar -xf {} -C {}", q(small), q(&w.join("small"))),
                    &[],
                );
                b.timed(
                    "rm -rf (new files)",
                    be,
                    &format!("rm -rf {}", q(&w.join("small"))),
                    &[],
                );
                fs::create_dir_all(w.join("real")).unwrap();
                b.timed(
                    "untar real",
                    be,
                    &format!("tar -xf {} -C {}", q(real), q(&w.join("real"))),
                    &[],
                );
                b.timed(
                    "git clone",
                    be,
                    &format!(
                        "git -c gc.auto=0 clone -q --no-hardlinks {} {}",
                        q(bare),
                        q(&w.join("clone"))
                    ),
                    GIT_ENV,
                );
                b.timed(
                    "git status (first)",
                    be,
                    &format!(
                        "git -C {} -c gc.auto=0 status --porcelain > /dev/null",
                        q(&w.join("clone"))
                    ),
                    GIT_ENV,
                );
                sh(&format!("cp -a {} {}", q(cproj), q(&w.join("cproj"))), &[]);
                b.timed(
                    "build (make -j2, 121 files)",
                    be,
                    &format!("make -s -j2 -C {} > /dev/null", q(&w.join("cproj"))),
                    &[],
                );
                if let Some(npm) = &npm {
                    let d = w.join("npmproj");
                    fs::create_dir_all(&d).unwrap();
                    for f in ["package.json", "package-lock.json"] {
                        fs::copy(npm.join(f), d.join(f)).unwrap();
                    }
                    let cache = npm.join("cache");
                    let env = [("npm_config_cache", cache.to_str().unwrap())];
                    b.timed(
                        "npm ci (warm cache)",
                        be,
                        &format!(
                            "cd {} && npm ci --offline --no-audit --no-fund --ignore-scripts \
                             --loglevel=error > /dev/null",
                            q(&d)
                        ),
                        &env,
                    );
                    b.timed(
                        "rm -rf node_modules",
                        be,
                        &format!("rm -rf {}", q(&d.join("node_modules"))),
                        &[],
                    );
                }
                let big = w.join("big.bin");
                b.timed(
                    "write 1 GiB + fsync",
                    be,
                    &format!(
                        "dd if=/dev/zero of={} bs=1M count=1024 conv=fsync status=none",
                        q(&big)
                    ),
                    &[],
                );
                b.timed(
                    "cold read 1 GiB",
                    be,
                    &format!("cat {} > /dev/null", q(&big)),
                    &[],
                );
                drop(ws);
                // Give the space back: the round's directory, and a casfs store's
                // uncaptured work (upper files) of the mount just dropped.
                let _ = fs::remove_dir_all(w.parent().unwrap());
                if let Some(store) = b.stores.get(*be) {
                    let _ = fs::remove_dir_all(store.join("mounts"));
                }
            }
        }
    }

    // The native untar cross-checked: a plain `tar -xf` in a shell into a fresh
    // directory right under the loop filesystem's root, as one would time it by hand.
    if !flag("--no-io") && backends.contains(&"native") {
        for i in 0..args.reps {
            let d = root.join(format!("plain-{i}"));
            fs::create_dir_all(&d).unwrap();
            b.timed(
                "untar small (plain shell tar, fresh directory)",
                "native",
                &format!("tar -xf {} -C {}", q(small), q(&d)),
                &[],
            );
            let _ = fs::remove_dir_all(&d);
        }
    }

    let mut ckpt: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    if !flag("--no-ckpt") {
        for &n in &args.sizes {
            let tree = root.join(format!("tree-{n}"));
            make_files(&tree, n);
            for casfs in ["casfs-overlay", "casfs-fuse"] {
                let mode = casfs.strip_prefix("casfs-").unwrap();
                let store = root.join(format!("ck-{casfs}-{n}"));
                let th = format!("t{n}");
                casfs_json(&store, &["capture", tree.to_str().unwrap(), "-t", &th]);
                let mp = root.join(format!("ck-mp-{casfs}-{n}"));
                fs::create_dir_all(&mp).unwrap();
                casfs_json(
                    &store,
                    &["mount", mp.to_str().unwrap(), "-t", &th, "--mode", mode],
                );
                let _ws = Ws {
                    root: mp.clone(),
                    unmount: vec![mp.clone()],
                };
                let mut prev = casfs_json(&store, &["status", mp.to_str().unwrap()])["base"]
                    .as_str()
                    .unwrap()
                    .to_string();
                for r in 0..args.reps.max(3) {
                    let (cp, daemon, whole) = ten_changes_and_checkpoint(&store, &mp, n, r);
                    let op = format!("checkpoint after 10 changes, {n} files");
                    note(&mut ckpt, &op, casfs, daemon, whole);
                    let id = cp["checkpoint"].as_str().unwrap().to_string();
                    // Restore of the previous checkpoint (after the kernel saw the tree).
                    let _ = sh(&format!("find {} > /dev/null", q(&mp)), &[]);
                    let t = std::time::Instant::now();
                    let rs =
                        casfs_json(&store, &["restore", mp.to_str().unwrap(), &prev, "--force"]);
                    let whole = ms(t.elapsed());
                    let daemon = rs["duration_us"].as_f64().unwrap() / 1000.0;
                    note(
                        &mut ckpt,
                        &format!("restore, {n} files"),
                        casfs,
                        daemon,
                        whole,
                    );
                    // Back to the newest, to change it again.
                    casfs_json(&store, &["restore", mp.to_str().unwrap(), &id, "--force"]);
                    prev = id;
                }
            }
            let _ = fs::remove_dir_all(&tree);
        }
        // The same with the files made in the mount since it was mounted (an untar, an
        // `npm ci`): the overlay's upper holds them all, and a checkpoint after 10
        // changes must not list it whole.
        for &n in &args.sizes {
            for casfs in ["casfs-overlay", "casfs-fuse"] {
                let mode = casfs.strip_prefix("casfs-").unwrap();
                let store = root.join(format!("up-{casfs}-{n}"));
                let mp = root.join(format!("up-mp-{casfs}-{n}"));
                fs::create_dir_all(&mp).unwrap();
                casfs_json(
                    &store,
                    &["mount", mp.to_str().unwrap(), "-t", "u", "--mode", mode],
                );
                let _ws = Ws {
                    root: mp.clone(),
                    unmount: vec![mp.clone()],
                };
                make_files(&mp, n);
                casfs_json(&store, &["checkpoint", mp.to_str().unwrap()]);
                for r in 0..args.reps.max(3) {
                    let (_, daemon, whole) = ten_changes_and_checkpoint(&store, &mp, n, r);
                    let op = format!("checkpoint after 10 changes, {n} files made in the mount");
                    note(&mut ckpt, &op, casfs, daemon, whole);
                }
            }
        }
    }

    // Report: medians, and each backend's ratio to native (and to the kernel's overlay).
    let med = |v: &Vec<f64>| {
        let mut v = v.clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let ops: Vec<String> = {
        let mut o: Vec<String> = b.results.keys().map(|(op, _)| op.clone()).collect();
        o.dedup();
        o
    };
    println!(
        "\n| operation (ms, median of {}) | {} |",
        args.reps,
        backends.join(" | ")
    );
    println!("|---|{}", "---|".repeat(backends.len()));
    for op in &ops {
        let native = b.results.get(&(op.clone(), "native".into())).map(med);
        let kovl = b
            .results
            .get(&(op.clone(), "kernel-overlay".into()))
            .map(med);
        let mut row = format!("| {op} |");
        for be in &backends {
            match b.results.get(&(op.clone(), be.to_string())) {
                Some(v) => {
                    let m = med(v);
                    let r = native.map(|n| m / n).unwrap_or(f64::NAN);
                    let k = kovl.map(|n| m / n).unwrap_or(f64::NAN);
                    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let spread = format!("{lo:.0}-{hi:.0}");
                    if native.is_some() && kovl.is_some() {
                        row.push_str(&format!(" {m:.0} [{spread}] ({r:.2}x / {k:.2}x) |"));
                    } else if native.is_some() {
                        row.push_str(&format!(" {m:.0} [{spread}] ({r:.2}x) |"));
                    } else {
                        row.push_str(&format!(" {m:.0} [{spread}] |"));
                    }
                }
                None => row.push_str(" - |"),
            }
        }
        println!("{row}");
    }
    println!(
        "(median [min-max] of the rounds; ratios: to native / to the kernel's overlayfs \
         over ext4, the overlay design's floor)"
    );
    // The overlay backend against its floor, operation by operation.
    for (op, target) in [
        ("untar small", 1.15),
        ("untar real", 1.15),
        ("rm -rf (new files)", 1.15),
        ("rm -rf (base tree)", 1.15),
        ("git clone", 1.15),
        ("cold find (base)", 1.3),
    ] {
        let get = |be: &str| b.results.get(&(op.to_string(), be.to_string())).map(med);
        if let (Some(c), Some(k), Some(n)) =
            (get("casfs-overlay"), get("kernel-overlay"), get("native"))
        {
            println!(
                "{op}: casfs-overlay {:.2}x the floor (target {target}x), {:.2}x native; \
                 the floor is {:.2}x native",
                c / k,
                c / n,
                k / n
            );
        }
    }
    for f in &b.failed {
        println!("failed: {f}");
    }
    for f in &b.failed {
        res.note(format!("failed: {f}"));
    }
    // Every round of every operation, and of the checkpoints and restores.
    for ((op, be), runs) in b.results.iter().chain(ckpt.iter()) {
        let unit = if op.contains(", us") { "us" } else { "ms" };
        res.values(serde_json::json!({"op": op, "backend": be}), unit, runs);
    }
    if !ckpt.is_empty() {
        println!(
            "\n| casfs (ms, median of {}) | casfs-overlay | casfs-fuse |",
            args.reps.max(3)
        );
        println!("|---|---|---|");
        let mut ops: Vec<String> = ckpt.keys().map(|(op, _)| op.clone()).collect();
        ops.dedup();
        for op in ops {
            let o = ckpt.get(&(op.clone(), "casfs-overlay".into())).map(med);
            let f = ckpt.get(&(op.clone(), "casfs-fuse".into())).map(med);
            println!(
                "| {op} | {:.1} | {:.1} |",
                o.unwrap_or(f64::NAN),
                f.unwrap_or(f64::NAN)
            );
        }
    }
    res.param("backends", &backends);
    res.finish();
    drop(b);
    drop(lfs);
}
