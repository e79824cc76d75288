//! Runs the scenarios of `casfs bench`: casfs and its peers side by side, each figure
//! a command timed from outside.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use super::opts::{BenchOpts, PEERS, SCENARIOS};
use super::report::{ratios, slopes, Machine, Report, Sample, Settings, Skip, Workload};
use super::results::{shell_words, RunInfo};
use super::workload;

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Writes back what earlier steps left dirty (not timed), so that one tool's data does
/// not slow the next one down (on this machine a 100k-file restore after another took
/// several times as long without it).
fn settle() {
    rustix::fs::sync();
}

/// Runs `cmd` with `sh -c` and returns its wall time; its failure is an error naming it.
fn sh(cmd: &str, env: &[(&str, String)]) -> anyhow::Result<Duration> {
    settle();
    let t = Instant::now();
    let out = Command::new("sh")
        .args(["-c", cmd])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd}"))?;
    let d = t.elapsed();
    if !out.status.success() {
        bail!(
            "{cmd} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(d)
}

/// Stops a watcher the benchmark started, also when a step fails.
struct StopWatcher(String);

impl Drop for StopWatcher {
    fn drop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn q(p: &Path) -> String {
    let s = p.to_string_lossy();
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

const GIT_ID: &[(&str, &str)] = &[
    ("GIT_AUTHOR_NAME", "bench"),
    ("GIT_AUTHOR_EMAIL", "bench@example.invalid"),
    ("GIT_COMMITTER_NAME", "bench"),
    ("GIT_COMMITTER_EMAIL", "bench@example.invalid"),
];

fn git_env(git_dir: &Path, tree: &Path) -> Vec<(&'static str, String)> {
    let mut e: Vec<(&str, String)> = GIT_ID.iter().map(|(k, v)| (*k, v.to_string())).collect();
    e.push(("GIT_DIR", git_dir.to_string_lossy().into_owned()));
    e.push(("GIT_WORK_TREE", tree.to_string_lossy().into_owned()));
    e
}

fn restic_env() -> Vec<(&'static str, String)> {
    vec![("RESTIC_PASSWORD", "bench".into())]
}

/// The benchmark run: collects samples and notes.
struct Bench<'a> {
    opts: &'a BenchOpts,
    casfs: PathBuf,
    tmp: PathBuf,
    samples: Vec<Sample>,
    skipped: Vec<Skip>,
    bar: indicatif::ProgressBar,
}

impl Bench<'_> {
    fn peer(&self, tool: &str) -> bool {
        self.opts.peers.iter().any(|p| p == tool)
    }

    fn scenario(&self, s: &str) -> bool {
        self.opts.scenarios.iter().any(|x| x == s)
    }

    fn record(&mut self, scenario: &str, op: &str, files: u64, tool: &str, runs: Vec<f64>) {
        self.samples.push(Sample {
            scenario: scenario.into(),
            op: op.into(),
            files,
            tool: tool.into(),
            unit: "ms".into(),
            median_ms: median(&runs),
            runs_ms: runs,
        });
    }

    fn skip(&mut self, scenario: &str, tool: &str, why: impl Into<String>) {
        let why = why.into();
        if !self
            .skipped
            .iter()
            .any(|s| s.scenario == scenario && s.tool == tool && s.why == why)
        {
            self.skipped.push(Skip {
                scenario: scenario.into(),
                tool: tool.into(),
                why,
            });
        }
    }

    fn step(&self, what: String) {
        self.bar.set_message(what);
        self.bar.inc(1);
    }

    fn casfs_cmd(&self, store: &Path, args: &str) -> String {
        format!("{} --store {} {args}", q(&self.casfs), q(store))
    }

    /// Available tools among the peers asked for, noting the missing ones.
    fn tools(&mut self, scenario: &str, candidates: &[(&str, &str)]) -> Vec<String> {
        let mut out = vec!["casfs".to_string()];
        for (tool, cmd) in candidates {
            if !self.peer(tool) {
                continue;
            }
            if cmd.split(',').all(have) {
                out.push(tool.to_string());
            } else {
                self.skip(scenario, tool, format!("{cmd} is not installed"));
            }
        }
        out
    }

    /// Initial capture, re-capture after `changes` files, restore into an empty
    /// directory, and the run-like loop, on workload `w` (a directory this run owns).
    fn plain(&mut self, w: &Path, files: &[PathBuf], n: u64) -> anyhow::Result<()> {
        let d = self.tmp.join(format!("plain-{n}"));
        fs::create_dir_all(&d)?;
        let tools = self.tools(
            "capture",
            &[
                ("git", "git"),
                ("restic", "restic"),
                ("tar+zstd", "tar,zstd"),
                ("rsync", "rsync"),
            ],
        );
        let reps = self.opts.reps;
        // Initial capture: a new store / repository / archive each time.
        if self.scenario("capture") {
            for tool in &tools {
                let mut runs = Vec::new();
                for r in 0..reps {
                    self.step(format!("capture {n} files: {tool} ({}/{reps})", r + 1));
                    runs.push(ms(self.initial(tool, w, &d, r)?));
                }
                self.record("capture", "initial", n, tool, runs);
            }
        } else {
            for tool in &tools {
                self.initial(tool, w, &d, 0)?;
            }
        }
        // Re-capture after `changes` files changed: on the first of those.
        let mut round = 0usize;
        let mut snaps = 0usize;
        if self.scenario("recapture") {
            let mut runs: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            // casfs with `casfs watch` running: its own store (the plain casfs runs
            // must not see the watcher), captured once and once more with the watcher
            // (which records its token), untimed.
            let wstore = d.join("casfs-watched");
            let watch = self.casfs_cmd(&wstore, &format!("watch {}", q(w)));
            let wcapture = self.casfs_cmd(&wstore, &format!("capture {} -t bench", q(w)));
            sh(&wcapture, &[])?;
            sh(&watch, &[])?;
            let _stop = StopWatcher(format!("{watch} --stop"));
            sh(&wcapture, &[])?;
            let mut all = tools.clone();
            all.insert(1, "casfs+watch".into());
            for r in 0..reps {
                round += 1;
                change(files, self.opts.changes, round)?;
                for tool in &all {
                    self.step(format!("re-capture {n} files: {tool} ({}/{reps})", r + 1));
                    let t = if tool == "casfs+watch" {
                        sh(&wcapture, &[])?
                    } else {
                        self.again(tool, w, &d, &mut snaps)?
                    };
                    runs.entry(tool.clone()).or_default().push(ms(t));
                }
            }
            for (tool, v) in runs {
                self.record(
                    "recapture",
                    &format!("{} changed", self.opts.changes),
                    n,
                    &tool,
                    v,
                );
            }
        }
        if self.scenario("restore") {
            for tool in &tools {
                let mut runs = Vec::new();
                for r in 0..reps {
                    self.step(format!("restore {n} files: {tool} ({}/{reps})", r + 1));
                    let target = d.join(format!("restored-{r}"));
                    runs.push(ms(self.restore(tool, &d, &target, snaps)?));
                    fs::remove_dir_all(&target)?;
                }
                self.record("restore", "into empty dir", n, tool, runs);
            }
        }
        if self.scenario("loop") {
            self.run_loop(w, files, n, &d, &tools, &mut round, &mut snaps)?;
        }
        if self.opts.keep.is_none() {
            let _ = fs::remove_dir_all(&d);
        }
        Ok(())
    }

    fn initial(&self, tool: &str, w: &Path, d: &Path, r: usize) -> anyhow::Result<Duration> {
        let git = d.join(format!("git-{r}"));
        let store = d.join(format!("casfs-{r}"));
        let repo = d.join(format!("restic-{r}"));
        match tool {
            "casfs" => sh(
                &self.casfs_cmd(&store, &format!("capture {} -t bench -r initial", q(w))),
                &[],
            ),
            "git" => {
                sh("git init -q", &git_env(&git, w))?;
                sh("git add -A && git commit -q -m initial", &git_env(&git, w))
            }
            "restic" => {
                sh(&format!("restic init -q -r {}", q(&repo)), &restic_env())?;
                sh(
                    &format!("restic backup -q -r {} {}", q(&repo), q(w)),
                    &restic_env(),
                )
            }
            "tar+zstd" => sh(
                &format!(
                    "tar -C {} -cf - . | zstd -q -T0 -3 -f -o {}",
                    q(w),
                    q(&d.join(format!("a-{r}.tar.zst")))
                ),
                &[],
            ),
            "rsync" => {
                fs::create_dir_all(d.join(format!("rsync-{r}")))?;
                sh(
                    &format!(
                        "rsync -a {}/ {}/",
                        q(w),
                        q(&d.join(format!("rsync-{r}/snap0")))
                    ),
                    &[],
                )
            }
            other => Err(anyhow!("unknown tool {other}")),
        }
    }

    /// One more capture of `w` by `tool`, on top of its first one.
    fn again(&self, tool: &str, w: &Path, d: &Path, snaps: &mut usize) -> anyhow::Result<Duration> {
        match tool {
            "casfs" => sh(
                &self.casfs_cmd(&d.join("casfs-0"), &format!("capture {} -t bench", q(w))),
                &[],
            ),
            "git" => sh(
                "git add -A && git commit -q -m again",
                &git_env(&d.join("git-0"), w),
            ),
            "restic" => sh(
                &format!("restic backup -q -r {} {}", q(&d.join("restic-0")), q(w)),
                &restic_env(),
            ),
            "tar+zstd" => sh(
                &format!(
                    "tar -C {} -cf - . | zstd -q -T0 -3 -f -o {}",
                    q(w),
                    q(&d.join("a-0.tar.zst"))
                ),
                &[],
            ),
            "rsync" => {
                let prev = d.join(format!("rsync-0/snap{snaps}"));
                *snaps += 1;
                let next = d.join(format!("rsync-0/snap{snaps}"));
                sh(
                    &format!("rsync -a --link-dest={} {}/ {}/", q(&prev), q(w), q(&next)),
                    &[],
                )
            }
            other => Err(anyhow!("unknown tool {other}")),
        }
    }

    /// The latest capture by `tool`, into the empty directory `target`.
    fn restore(
        &self,
        tool: &str,
        d: &Path,
        target: &Path,
        snaps: usize,
    ) -> anyhow::Result<Duration> {
        fs::create_dir_all(target)?;
        match tool {
            "casfs" => sh(
                &self.casfs_cmd(
                    &d.join("casfs-0"),
                    &format!("restore {} -t bench", q(target)),
                ),
                &[],
            ),
            "git" => {
                let mut env = git_env(&d.join("git-0"), target);
                env.push((
                    "GIT_INDEX_FILE",
                    d.join("restore.index").to_string_lossy().into_owned(),
                ));
                let t = sh("git checkout -q -f HEAD -- .", &env);
                let _ = fs::remove_file(d.join("restore.index"));
                t
            }
            "restic" => sh(
                &format!(
                    "restic restore -q -r {} latest --target {}",
                    q(&d.join("restic-0")),
                    q(target)
                ),
                &restic_env(),
            ),
            "tar+zstd" => sh(
                &format!(
                    "zstd -q -dc {} | tar -xf - -C {}",
                    q(&d.join("a-0.tar.zst")),
                    q(target)
                ),
                &[],
            ),
            "rsync" => sh(
                &format!(
                    "rsync -a {}/ {}/",
                    q(&d.join(format!("rsync-0/snap{snaps}"))),
                    q(target)
                ),
                &[],
            ),
            other => Err(anyhow!("unknown tool {other}")),
        }
    }

    /// A run-like loop: change `changes` files, checkpoint, `runs` times. casfs works in
    /// a mount of the workload's thread (checkpoint through the control socket); peers
    /// capture the plain directory again.
    #[allow(clippy::too_many_arguments)]
    fn run_loop(
        &mut self,
        w: &Path,
        files: &[PathBuf],
        n: u64,
        d: &Path,
        tools: &[String],
        round: &mut usize,
        snaps: &mut usize,
    ) -> anyhow::Result<()> {
        let runs = self.opts.runs;
        let store = d.join("casfs-0");
        let mp = d.join("mnt");
        fs::create_dir_all(&mp)?;
        let mounted = sh(
            &self.casfs_cmd(&store, &format!("mount {} -t bench", q(&mp))),
            &[],
        );
        if let Err(e) = mounted {
            self.skip("loop", "casfs", format!("mount failed: {e}"));
        }
        let guard = Unmount(mp.clone());
        let in_mount: Vec<PathBuf> = files
            .iter()
            .map(|f| mp.join(f.strip_prefix(w).unwrap_or(f)))
            .collect();
        let mut times: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in 0..runs {
            *round += 1;
            for tool in tools {
                self.step(format!("run loop {n} files: {tool} ({}/{runs})", r + 1));
                let t = if tool == "casfs" {
                    if !casfs::fs::is_fuse_mount(&mp) && !casfs::fs::is_overlay_mount(&mp) {
                        continue;
                    }
                    change(&in_mount, self.opts.changes, *round)?;
                    sh(
                        &self.casfs_cmd(&store, &format!("checkpoint {}", q(&mp))),
                        &[],
                    )?
                } else {
                    change(files, self.opts.changes, *round + 1000)?;
                    self.again(tool, w, d, snaps)?
                };
                times.entry(tool.clone()).or_default().push(ms(t));
            }
        }
        drop(guard);
        for (tool, v) in times {
            self.record(
                "loop",
                &format!("{} changed + checkpoint", self.opts.changes),
                n,
                &tool,
                v,
            );
        }
        Ok(())
    }

    /// Large-file write and read, untar of the workload, `find` and `git status` on it:
    /// through a casfs mount, on ext4 (the directory this runs in) and through
    /// fuse-overlayfs.
    fn io(&mut self, w: &Path, n: u64) -> anyhow::Result<()> {
        let d = self.tmp.join(format!("io-{n}"));
        fs::create_dir_all(&d)?;
        let tarball = d.join("workload.tar");
        sh(&format!("tar -C {} -cf {} .", q(w), q(&tarball)), &[])?;
        let mut targets: Vec<(String, PathBuf)> = Vec::new();
        let mut guards = Vec::new();
        // casfs
        let mp = d.join("casfs");
        fs::create_dir_all(&mp)?;
        match sh(
            &self.casfs_cmd(&d.join("store"), &format!("mount {} -t io", q(&mp))),
            &[],
        ) {
            Ok(_) => {
                guards.push(Unmount(mp.clone()));
                targets.push(("casfs".into(), mp));
            }
            Err(e) => self.skip("io", "casfs", format!("mount failed: {e}")),
        }
        if self.peer("ext4") {
            let e = d.join("native");
            fs::create_dir_all(&e)?;
            targets.push(("ext4".into(), e));
        }
        if self.peer("fuse-overlayfs") {
            if have("fuse-overlayfs") {
                let (lower, upper, work, m) = (
                    d.join("ov-lower"),
                    d.join("ov-upper"),
                    d.join("ov-work"),
                    d.join("overlay"),
                );
                for p in [&lower, &upper, &work, &m] {
                    fs::create_dir_all(p)?;
                }
                let cmd = format!(
                    "fuse-overlayfs -o lowerdir={},upperdir={},workdir={} {}",
                    lower.display(),
                    upper.display(),
                    work.display(),
                    q(&m)
                );
                match sh(&cmd, &[]) {
                    Ok(_) => {
                        guards.push(Unmount(m.clone()));
                        targets.push(("fuse-overlayfs".into(), m));
                    }
                    Err(e) => self.skip("io", "fuse-overlayfs", format!("mount failed: {e}")),
                }
            } else {
                self.skip("io", "fuse-overlayfs", "fuse-overlayfs is not installed");
            }
        }
        let reps = self.opts.reps;
        let mb = self.opts.io_mb;
        let add = |b: &mut Self, op: &str, tool: &str, v: Vec<f64>| b.record("io", op, n, tool, v);
        for (tool, t) in &targets {
            let big = t.join("big.bin");
            let tree = t.join("tree");
            let mut write = Vec::new();
            let mut read = Vec::new();
            for r in 0..reps {
                self.step(format!(
                    "io {n} files: {tool} write/read {mb} MiB ({}/{reps})",
                    r + 1
                ));
                write.push(ms(sh(
                    &format!(
                        "dd if=/dev/zero of={} bs=1M count={mb} status=none",
                        q(&big)
                    ),
                    &[],
                )?));
                read.push(ms(sh(&format!("cat {} > /dev/null", q(&big)), &[])?));
                fs::remove_file(&big)?;
            }
            add(self, &format!("write {mb} MiB"), tool, write);
            add(self, &format!("read {mb} MiB"), tool, read);
            self.step(format!("io {n} files: {tool} untar"));
            fs::create_dir_all(&tree)?;
            let untar = ms(sh(
                &format!("tar -xf {} -C {}", q(&tarball), q(&tree)),
                &[],
            )?);
            add(self, "untar", tool, vec![untar]);
            let find = format!("find {} | wc -l", q(&tree));
            let mut f = Vec::new();
            for _ in 0..reps {
                self.step(format!("io {n} files: {tool} find"));
                f.push(ms(sh(&find, &[])?));
            }
            add(self, "find", tool, f);
            if self.peer("git") && have("git") {
                let g = t.join("tree-git");
                sh(
                    "git init -q && git add -A && git commit -q -m io",
                    &git_env(&g, &tree),
                )?;
                let mut s = Vec::new();
                for _ in 0..reps {
                    self.step(format!("io {n} files: {tool} git status"));
                    s.push(ms(sh(
                        "git status --porcelain > /dev/null",
                        &git_env(&g, &tree),
                    )?));
                }
                add(self, "git status", tool, s);
            }
        }
        drop(guards);
        if self.opts.keep.is_none() {
            let _ = fs::remove_dir_all(&d);
        }
        Ok(())
    }
}

/// Lazily unmounts a benchmark's mount when dropped, also on error.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .stderr(Stdio::null())
            .status();
        // A casfs daemon lets its store go after the unmount.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Appends a line to the first `k` files (a different line each round).
fn change(files: &[PathBuf], k: usize, round: usize) -> anyhow::Result<()> {
    use std::io::Write;
    for f in files.iter().take(k) {
        let mut h = fs::OpenOptions::new()
            .append(true)
            .open(f)
            .with_context(|| format!("changing {}", f.display()))?;
        writeln!(h, "// change {round}")?;
    }
    Ok(())
}

/// Every regular file below `dir`, sorted (the files a --from workload changes).
fn list_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Runs the benchmark.
pub fn run(opts: &BenchOpts) -> anyhow::Result<Report> {
    let start = Instant::now();
    for s in &opts.scenarios {
        if !SCENARIOS.contains(&s.as_str()) {
            bail!(
                "--scenarios: unknown scenario {s:?} (known: {})",
                SCENARIOS.join(", ")
            );
        }
    }
    for p in &opts.peers {
        if !PEERS.contains(&p.as_str()) {
            bail!("--peers: unknown peer {p:?} (known: {})", PEERS.join(", "));
        }
    }
    if opts.reps == 0 || opts.runs == 0 {
        bail!("--reps and --runs must be at least 1");
    }
    if opts.shape.depth == 0 || opts.shape.depth > 12 || opts.shape.files_per_dir == 0 {
        bail!("--depth must be 1 to 12 and --files-per-dir at least 1");
    }
    let base = match &opts.keep {
        Some(k) => {
            fs::create_dir_all(k).with_context(|| format!("creating {}", k.display()))?;
            k.clone()
        }
        None => std::env::temp_dir().join(format!("casfs-bench-{}", std::process::id())),
    };
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let casfs = std::env::current_exe().context("finding the casfs executable")?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let run_info = RunInfo::now("casfs bench", format!("casfs {}", shell_words(&argv)));
    // Before the work directory is removed.
    let machine = Machine::probe(&base);
    let mut workloads = Vec::new();
    let plan: Vec<(PathBuf, String)> = match &opts.from {
        Some(dir) => {
            if !dir.is_dir() {
                bail!("--from {}: not a directory", dir.display());
            }
            vec![(dir.clone(), format!("dir:{}", dir.display()))]
        }
        None => opts
            .sizes
            .iter()
            .map(|n| (PathBuf::new(), format!("generated:{n}")))
            .collect(),
    };
    // Steps for the progress bar: a rough count, refined as it goes.
    let per = opts.reps * 15 + opts.runs * 5 + opts.reps * 12;
    let bar = indicatif::ProgressBar::new((plan.len() * per) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let mut b = Bench {
        opts,
        casfs,
        tmp: base.clone(),
        samples: Vec::new(),
        skipped: Vec::new(),
        bar,
    };
    let result = (|| -> anyhow::Result<()> {
        for (i, (src, label)) in plan.iter().enumerate() {
            let w = base.join(format!("workload-{i}"));
            let _ = fs::remove_dir_all(&w);
            let (files, bytes) = if opts.from.is_some() {
                b.bar.set_message(format!("copying {}", src.display()));
                sh(&format!("cp -a {}/. {}", q(src), q(&w)), &[])
                    .with_context(|| format!("copying --from {}", src.display()))?;
                let f = list_files(&w)?;
                let bytes = f
                    .iter()
                    .filter_map(|p| p.metadata().ok())
                    .map(|m| m.len())
                    .sum();
                (f, bytes)
            } else {
                let n: usize = label["generated:".len()..].parse().expect("a size");
                b.bar.set_message(format!("generating {n} files"));
                workload::try_generate(&w, n, opts.shape)
                    .with_context(|| format!("generating {}", w.display()))?
            };
            let n = files.len() as u64;
            workloads.push(Workload {
                files: n,
                bytes,
                source: label.clone(),
                shape: opts.from.is_none().then_some([
                    opts.shape.depth,
                    opts.shape.files_per_dir,
                    opts.shape.median_bytes,
                ]),
            });
            if ["capture", "recapture", "restore", "loop"]
                .iter()
                .any(|s| b.scenario(s))
            {
                b.plain(&w, &files, n)?;
            }
            // Mounted I/O once, on the largest workload (its cost is per file, not the
            // claim the sizes test).
            if b.scenario("io") && i + 1 == plan.len() {
                b.io(&w, n)?;
            }
            if opts.keep.is_none() {
                let _ = fs::remove_dir_all(&w);
            }
        }
        Ok(())
    })();
    b.bar.finish_and_clear();
    if opts.keep.is_none() {
        let _ = fs::remove_dir_all(&base);
    }
    result?;
    let samples = b.samples;
    let ratios = ratios(&samples);
    let slopes = slopes(&samples);
    Ok(Report {
        run: run_info,
        casfs_version: env!("CARGO_PKG_VERSION").into(),
        machine,
        settings: Settings {
            changes: opts.changes,
            reps: opts.reps,
            runs: opts.runs,
            io_mb: opts.io_mb,
        },
        workloads,
        results: samples,
        ratios,
        slopes,
        skipped: b.skipped,
        total_seconds: (start.elapsed().as_secs_f64() * 10.0).round() / 10.0,
    })
}
