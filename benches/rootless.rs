//! Rootless: the overlay bench's workloads run by an ordinary user, in one run, on a
//! fresh journaled ext4 loop filesystem (everything, stores, trees and uppers, on it).
//!
//! Backends, each a workspace over the same base tree (/usr/share/man + /usr/include),
//! every one made and used by the user:
//! - `native`: a plain copy of the base;
//! - `kernel-overlay-userns`: the kernel's overlayfs with `userxattr` in the user's
//!   namespace (casfs's own, see docs/mount.md), lower a plain copy of the base: the
//!   floor of the rootless design;
//! - `casfs-rootless`: `casfs mount --mode overlay` by the user (rootless: the same
//!   namespace, over casfs's FUSE view of the base's checkpoint);
//! - `casfs-fuse`: `casfs mount --mode fuse` by the user (fusermount3; io_uring where
//!   /sys/module/fuse/parameters/enable_uring is Y).
//!
//! Fairness: the inputs (tar files, the repository cloned, the C project) live on a
//! tmpfs of their own; every step starts after a `sync` with the page cache dropped;
//! the order of the backends alternates between rounds; each step is timed inside the
//! shell that runs it (so entering the namespace, `casfs exec`, is not counted for the
//! backends that live there, nor `runuser` for the others). Untars keep no owners
//! (`--no-same-owner`: the namespace maps the user alone).
//!
//! Operations: cold `find` and `ls -lR` of the base, `rm -rf` of the base, untar of 30,000 files of
//! 100 B ("small") and of the base ("real"), `rm -rf` of the small tree, `git clone
//! --no-hardlinks` of a local repository and the first `git status`, a C build (`make
//! -j2` of 121 files). Then `casfs checkpoint` after 10 changed files on trees of
//! 1k/10k/100k files and `casfs restore` of the previous checkpoint, for the rootless
//! overlay, the FUSE backend and (as root) the root overlay beside them.
//!
//! Run (root, which makes the loop filesystem and drops caches; the user must exist):
//! `cargo bench --bench rootless -- [--user casfs-rootless] [--reps 3]
//! [--sizes 1k,10k,100k] [--repo PATH] [--out FILE]`

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "common/mod.rs"]
mod common;
use common::work::*;
use common::*;

/// The ordinary user everything runs as.
struct User {
    name: String,
    home: String,
}

impl User {
    /// `runuser -u USER -- env -i ...` with a clean environment and `env` set.
    fn command(&self, env: &[(&str, &str)]) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", &self.name, "--", "env", "-i"])
            .arg(format!("HOME={}", self.home))
            .arg("PATH=/usr/local/bin:/usr/bin:/bin")
            .arg("LANG=C.UTF-8");
        for (k, v) in env {
            c.arg(format!("{k}={v}"));
        }
        c
    }

    /// Runs `args` as the user; panics on failure; its standard output.
    fn run(&self, args: &[&str]) -> String {
        let out = self.command(&[]).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?} as {}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `casfs --json --store STORE args` as the user.
    fn casfs(&self, store: &Path, args: &[&str]) -> serde_json::Value {
        let bin = casfs_bin();
        let mut a = vec![bin.as_str(), "--json", "--store", store.to_str().unwrap()];
        a.extend_from_slice(args);
        serde_json::from_str(&self.run(&a)).unwrap_or(serde_json::Value::Null)
    }

    /// `casfs exec --namespace` as the user (with the right to mount when `mount`).
    fn in_namespace(&self, mount: bool, args: &[&str]) -> String {
        let bin = casfs_bin();
        let mut a = vec![bin.as_str(), "exec", "--namespace"];
        if mount {
            a.push("--keep-mount-rights");
        }
        a.extend_from_slice(&["/", "--"]);
        a.extend_from_slice(args);
        self.run(&a)
    }
}

/// Whether a backend's workspace lives in the user's namespace.
fn namespaced(backend: &str) -> bool {
    matches!(backend, "kernel-overlay-userns" | "casfs-rootless")
}

struct Bench {
    user: User,
    fs: PathBuf,
    base: PathBuf,
    stores: BTreeMap<String, PathBuf>,
    results: BTreeMap<(String, String), Vec<f64>>,
    failed: Vec<String>,
    round: usize,
}

impl Bench {
    /// A fresh workspace of `backend` over the base: its directory and how to end it.
    fn workspace(&mut self, backend: &str) -> PathBuf {
        self.round += 1;
        let d = self.fs.join(format!("{backend}-{}", self.round));
        let m = d.join("ws");
        self.user.run(&["mkdir", "-p", m.to_str().unwrap()]);
        let copy = |to: &Path| {
            self.user.run(&[
                "cp",
                "-a",
                &format!("{}/.", self.base.display()),
                to.to_str().unwrap(),
            ])
        };
        match backend {
            "native" => {
                copy(&m);
            }
            "kernel-overlay-userns" => {
                let (l, u, w) = (d.join("lower"), d.join("upper"), d.join("work"));
                for p in [&l, &u, &w] {
                    self.user.run(&["mkdir", "-p", p.to_str().unwrap()]);
                }
                copy(&l);
                let opts = format!(
                    "lowerdir={},upperdir={},workdir={},userxattr,xino=auto,index=off",
                    l.display(),
                    u.display(),
                    w.display()
                );
                self.user.in_namespace(
                    true,
                    &[
                        "mount",
                        "-t",
                        "overlay",
                        "overlay",
                        "-o",
                        &opts,
                        m.to_str().unwrap(),
                    ],
                );
            }
            casfs => {
                let mode = if casfs == "casfs-rootless" {
                    "overlay"
                } else {
                    "fuse"
                };
                let store = self.stores[casfs].clone();
                self.user.casfs(
                    &store,
                    &["mount", m.to_str().unwrap(), "-t", "base", "--mode", mode],
                );
            }
        }
        m
    }

    fn end(&mut self, backend: &str, m: &Path) {
        match backend {
            "native" => {}
            "kernel-overlay-userns" => {
                self.user
                    .in_namespace(true, &["umount", "-l", m.to_str().unwrap()]);
            }
            casfs => {
                let store = self.stores[casfs].clone();
                self.user.run(&[
                    &casfs_bin(),
                    "--store",
                    store.to_str().unwrap(),
                    "unmount",
                    m.to_str().unwrap(),
                ]);
            }
        }
        let _ = fs::remove_dir_all(m.parent().unwrap());
        if let Some(store) = self.stores.get(backend) {
            let _ = fs::remove_dir_all(store.join("mounts"));
        }
    }

    /// Times `cmd` as the user in `dir` (inside the namespace for the backends there),
    /// after a `sync` with the page cache dropped; the time is taken by the shell
    /// around `cmd` alone.
    fn timed(&mut self, op: &str, backend: &str, dir: &Path, cmd: &str, env: &[(&str, &str)]) {
        drop_caches();
        let script = format!(
            "cd {} && s=$(date +%s%N) && {{ {cmd} ; }} > /dev/null && e=$(date +%s%N) && \
             echo $((e - s))",
            q(dir)
        );
        let mut c = self.user.command(env);
        if namespaced(backend) {
            c.args([&casfs_bin(), "exec", "--namespace", "/", "--"]);
        }
        let out = c.args(["sh", "-c", &script]).output().unwrap();
        let ns = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<f64>()
            .ok();
        match ns {
            Some(ns) if out.status.success() => self
                .results
                .entry((op.to_string(), backend.to_string()))
                .or_default()
                .push(ns / 1e6),
            _ => {
                let why = String::from_utf8_lossy(&out.stderr);
                let why = why.lines().next().unwrap_or("").to_string();
                eprintln!("{op} on {backend} failed: {why}");
                self.failed.push(format!("{op} on {backend}: {why}"));
            }
        }
    }
}

fn main() {
    let args = parse_bench_args(3);
    let mut res = Results::cargo_bench("rootless");
    res.param("reps", args.reps);
    res.param("sizes", &args.sizes);
    let after = |f: &str| {
        args.flags
            .windows(2)
            .find(|w| w[0] == f)
            .map(|w| w[1].clone())
    };
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the rootless bench makes a loop filesystem and drops caches: run it as root");
        return;
    }
    let name = after("--user").unwrap_or_else(|| "casfs-rootless".into());
    let home = String::from_utf8(
        Command::new("getent")
            .args(["passwd", &name])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let Some(home) = home.trim().split(':').nth(5).map(String::from) else {
        eprintln!("no user {name}: make one (useradd -m {name}) or pass --user");
        return;
    };
    let user = User {
        name: name.clone(),
        home,
    };
    res.param("user", &name);
    let repo = after("--repo")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    // The user's namespace is made after the filesystems below are mounted, so that it
    // has them: an earlier one of the user's is stopped first.
    let _ = Command::new("pkill")
        .args(["-u", &name, "-f", "casfs namespace-holder"])
        .status();
    let lfs = LoopFs::new(12);
    let root = lfs.mnt.clone();
    res.bench_dir(&root);
    sh(&format!("chown {name}: {}", q(&root)), &[]);
    let base = root.join("base");
    fs::create_dir_all(&base).unwrap();
    for src in ["/usr/share/man", "/usr/include"] {
        if Path::new(src).is_dir() {
            let n = Path::new(src).file_name().unwrap();
            sh(&format!("cp -a {} {}", src, q(&base.join(n))), &[]);
        }
    }
    sh(&format!("chown -R {name}: {}", q(&base)), &[]);
    let inputs = Inputs::new(4, &base, &repo);
    let Inputs {
        small,
        real,
        bare,
        cproj,
        ..
    } = &inputs;
    // The user's own (git refuses a repository of another owner).
    sh(&format!("chown -R {name}: {}", q(&inputs.tmpfs.dir)), &[]);
    user.in_namespace(false, &["true"]);

    let fuse = if casfs::fs::fuse_uring_enabled() {
        "casfs-fuse (io_uring)"
    } else {
        "casfs-fuse (classic)"
    };
    res.param("fuse_transport", fuse);
    let backends = vec![
        "native",
        "kernel-overlay-userns",
        "casfs-rootless",
        "casfs-fuse",
    ];
    let mut b = Bench {
        user,
        fs: root.clone(),
        base: base.clone(),
        stores: BTreeMap::new(),
        results: BTreeMap::new(),
        failed: Vec::new(),
        round: 0,
    };
    for casfs in ["casfs-rootless", "casfs-fuse"] {
        let store = root.join(format!("store-{casfs}"));
        b.user
            .casfs(&store, &["capture", base.to_str().unwrap(), "-t", "base"]);
        b.stores.insert(casfs.to_string(), store);
    }
    let git = [
        ("GIT_AUTHOR_NAME", "bench"),
        ("GIT_AUTHOR_EMAIL", "bench@example.invalid"),
        ("GIT_COMMITTER_NAME", "bench"),
        ("GIT_COMMITTER_EMAIL", "bench@example.invalid"),
    ];
    for r in 0..args.reps {
        let order: Vec<&str> = if r % 2 == 0 {
            backends.clone()
        } else {
            backends.iter().rev().copied().collect()
        };
        for be in order {
            eprintln!("round {}: {be}", r + 1);
            let w = b.workspace(be);
            b.timed("cold find (base)", be, &w, "find . | wc -l", &[]);
            // Every file's attributes and an extended attribute of each (`ls -l`).
            b.timed("cold ls -lR (base)", be, &w, "ls -lR . | wc -l", &[]);
            b.timed("rm -rf (base tree)", be, &w, "rm -rf ./*", &[]);
            let st = format!(
                "mkdir small && tar --no-same-owner -xf {} -C small",
                q(small)
            );
            b.timed("untar small", be, &w, &st, &[]);
            b.timed("rm -rf (new files)", be, &w, "rm -rf small", &[]);
            let rt = format!("mkdir real && tar --no-same-owner -xf {} -C real", q(real));
            b.timed("untar real", be, &w, &rt, &[]);
            let clone = format!("git -c gc.auto=0 clone -q --no-hardlinks {} clone", q(bare));
            b.timed("git clone", be, &w, &clone, &git);
            b.timed(
                "git status (first)",
                be,
                &w,
                "git -C clone -c gc.auto=0 status --porcelain",
                &git,
            );
            let build = format!("cp -a {} cproj && make -s -j2 -C cproj", q(cproj));
            b.timed("build (copy + make -j2, 121 files)", be, &w, &build, &[]);
            b.end(be, &w);
        }
    }

    // Checkpoints and restores: trees of n files captured, mounted, 10 files changed.
    let mut ckpt: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for (k, &n) in args.sizes.iter().enumerate() {
        let tree = root.join(format!("tree-{n}"));
        make_files(&tree, n);
        sh(&format!("chown -R {name}: {}", q(&tree)), &[]);
        // Each backend in its turn first (the first after a tree is made would otherwise
        // meet its writeback in every synced write).
        let mut order = ["casfs-rootless", "casfs-fuse", "casfs-overlay (root)"];
        order.rotate_left(k % 3);
        for casfs in order {
            let as_root = casfs.ends_with("(root)");
            let mode = if casfs == "casfs-fuse" {
                "fuse"
            } else {
                "overlay"
            };
            let store = root.join(format!("ck-{}-{n}", casfs.replace([' ', '(', ')'], "")));
            let mp = root.join(format!("ck-mp-{}-{n}", casfs.replace([' ', '(', ')'], "")));
            let run = |args: &[&str]| {
                if as_root {
                    casfs_json_with(&store, args, &[])
                } else {
                    b.user.casfs(&store, args)
                }
            };
            if !as_root {
                b.user.run(&["mkdir", "-p", mp.to_str().unwrap()]);
            } else {
                fs::create_dir_all(&mp).unwrap();
            }
            let th = format!("t{n}");
            run(&["capture", tree.to_str().unwrap(), "-t", &th]);
            run(&["mount", mp.to_str().unwrap(), "-t", &th, "--mode", mode]);
            // The tree's and the capture's writes on disk before anything is timed.
            sh("sync", &[]);
            let st = run(&["status", mp.to_str().unwrap()]);
            // Changes (and the look before a restore) are made by the mount's user, where
            // the mount is seen: in the namespace for the rootless one.
            let shell = |script: &str| {
                if as_root {
                    sh(script, &[]);
                } else if casfs == "casfs-rootless" {
                    b.user.in_namespace(false, &["sh", "-c", script]);
                } else {
                    b.user.run(&["sh", "-c", script]);
                }
            };
            let mut prev = st["base"].as_str().unwrap().to_string();
            for r in 0..args.reps.max(3) {
                let changes: String = (0..10)
                    .map(|k| {
                        let i = k * (n / 10);
                        let f = mp.join(format!("d{:03}/f{i}.txt", i / 100));
                        format!("echo 'change {r}' >> {} && ", q(&f))
                    })
                    .collect();
                shell(&format!("{changes}true"));
                let t = std::time::Instant::now();
                let cp = run(&["checkpoint", mp.to_str().unwrap()]);
                let whole = t.elapsed().as_secs_f64() * 1000.0;
                let op = format!("checkpoint after 10 changes, {n} files");
                let mut add =
                    |op: String, v: f64| ckpt.entry((op, casfs.to_string())).or_default().push(v);
                add(op.clone(), cp["duration_us"].as_f64().unwrap() / 1000.0);
                add(format!("{op} (command)"), whole);
                let id = cp["checkpoint"].as_str().unwrap().to_string();
                shell(&format!("find {} > /dev/null", q(&mp)));
                let t = std::time::Instant::now();
                let rs = run(&["restore", mp.to_str().unwrap(), &prev, "--force"]);
                let whole = t.elapsed().as_secs_f64() * 1000.0;
                add(
                    format!("restore, {n} files"),
                    rs["duration_us"].as_f64().unwrap() / 1000.0,
                );
                add(format!("restore, {n} files (command)"), whole);
                run(&["restore", mp.to_str().unwrap(), &id, "--force"]);
                prev = id;
            }
            run(&["unmount", mp.to_str().unwrap()]);
        }
        let _ = fs::remove_dir_all(&tree);
    }

    let med = |v: &Vec<f64>| {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\n| operation (ms, median of {}) | {} |",
        args.reps,
        backends.join(" | ")
    );
    println!("|---|{}", "---|".repeat(backends.len()));
    let mut ops: Vec<String> = b.results.keys().map(|(op, _)| op.clone()).collect();
    ops.dedup();
    for op in &ops {
        let floor = b
            .results
            .get(&(op.clone(), "kernel-overlay-userns".into()))
            .map(med);
        let mut row = format!("| {op} |");
        for be in &backends {
            match b.results.get(&(op.clone(), be.to_string())) {
                Some(v) => {
                    let m = med(v);
                    let k = floor.map(|f| m / f).unwrap_or(f64::NAN);
                    row.push_str(&format!(" {m:.0} ({k:.2}x) |"));
                }
                None => row.push_str(" - |"),
            }
        }
        println!("{row}");
    }
    println!("(ratios to the kernel's overlayfs in the user namespace, the floor)");
    let mut cops: Vec<String> = ckpt.keys().map(|(op, _)| op.clone()).collect();
    cops.dedup();
    for op in &cops {
        let cell = |be: &str| {
            ckpt.get(&(op.clone(), be.to_string()))
                .map(|v| format!("{:.1}", med(v)))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "| {op} | {} | {} | {} |",
            cell("casfs-rootless"),
            cell("casfs-fuse"),
            cell("casfs-overlay (root)")
        );
    }
    for f in &b.failed {
        println!("failed: {f}");
        res.note(format!("failed: {f}"));
    }
    for ((op, be), runs) in b.results.iter().chain(ckpt.iter()) {
        res.values(serde_json::json!({"op": op, "backend": be}), "ms", runs);
    }
    res.param("backends", &backends);
    res.finish();
    let _ = Command::new("pkill")
        .args(["-u", &name, "-f", "casfs namespace-holder"])
        .status();
    drop(b);
    drop(inputs);
    drop(lfs);
}
