//! Inputs the overlay benches share: the page cache dropped, a tmpfs for the inputs, the
//! small tar, the C project, the npm project and trees of small files.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{have, q, sh};

pub fn drop_caches() {
    let _ = sh("sync; echo 3 > /proc/sys/vm/drop_caches", &[]);
}

/// Waits until the machine is quiet before the next tool's turn: written data synced,
/// then the CPUs at least 90% idle over 100 ms (at most 5 s), so that work one tool
/// left running behind it (an engine's cleanup, deferred teardown) is not charged to
/// the next one. Returns how long it waited.
pub fn settle() -> std::time::Duration {
    let start = std::time::Instant::now();
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    // (busy, total) jiffies of all CPUs, from /proc/stat's first line.
    let sample = || -> Option<(u64, u64)> {
        let stat = fs::read_to_string("/proc/stat").ok()?;
        let v: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let total: u64 = v.iter().sum();
        // idle and iowait
        let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
        Some((total - idle, total))
    };
    while start.elapsed() < std::time::Duration::from_secs(5) {
        let Some((b0, t0)) = sample() else { break };
        std::thread::sleep(std::time::Duration::from_millis(100));
        let Some((b1, t1)) = sample() else { break };
        if t1 > t0 && (b1 - b0) * 10 <= t1 - t0 {
            break;
        }
    }
    start.elapsed()
}

/// A tmpfs mounted for the bench's inputs, unmounted when dropped.
pub struct Tmpfs {
    _t: tempfile::TempDir,
    pub dir: PathBuf,
}

impl Tmpfs {
    pub fn new(gib: u64) -> Tmpfs {
        let t = tempfile::Builder::new()
            .prefix("casfs-ovb-in")
            .tempdir()
            .unwrap();
        let dir = t.path().join("in");
        fs::create_dir(&dir).unwrap();
        sh(
            &format!("mount -t tmpfs -o size={gib}g tmpfs {}", q(&dir)),
            &[],
        );
        Tmpfs { _t: t, dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// The inputs of the workload steps, on a tmpfs of their own (reading them costs every
/// backend the same, and nothing of them is written back to the filesystem measured):
/// the small tar, a tar of the base tree, a bare clone of `repo` and the C project.
pub struct Inputs {
    pub tmpfs: Tmpfs,
    pub small: PathBuf,
    pub real: PathBuf,
    pub bare: PathBuf,
    pub cproj: PathBuf,
}

impl Inputs {
    pub fn new(gib: u64, base: &Path, repo: &Path) -> Inputs {
        let tmpfs = Tmpfs::new(gib);
        let tars = tmpfs.dir.join("tars");
        fs::create_dir_all(&tars).unwrap();
        let small = small_tar(&tars);
        let real = tars.join("real.tar");
        sh(&format!("tar -C {} -cf {} .", q(base), q(&real)), &[]);
        let bare = tmpfs.dir.join("repo.git");
        sh(
            &format!(
                "git clone -q --bare --no-hardlinks {} {}",
                q(repo),
                q(&bare)
            ),
            &[],
        );
        let cproj = tmpfs.dir.join("cproj");
        c_project(&cproj, 120);
        Inputs {
            tmpfs,
            small,
            real,
            bare,
            cproj,
        }
    }
}

/// 30,000 files of 100 B in 300 directories, as a tar file.
pub fn small_tar(dir: &Path) -> PathBuf {
    let src = dir.join("small-src");
    for d in 0..300 {
        let dd = src.join(format!("d{d:03}"));
        fs::create_dir_all(&dd).unwrap();
        for f in 0..100 {
            fs::write(
                dd.join(format!("f{f:03}.txt")),
                [b'a' + (f % 26) as u8; 100],
            )
            .unwrap();
        }
    }
    let tar = dir.join("small.tar");
    sh(&format!("tar -C {} -cf {} .", q(&src), q(&tar)), &[]);
    fs::remove_dir_all(&src).unwrap();
    tar
}

/// A C project of `n` files and its Makefile.
pub fn c_project(dir: &Path, n: usize) {
    fs::create_dir_all(dir).unwrap();
    let mut objs = Vec::new();
    for i in 0..n {
        fs::write(
            dir.join(format!("u{i}.c")),
            format!(
                "#include <stdio.h>\n#include <string.h>\nint f{i}(int x) {{ char b[64]; \
                 snprintf(b, sizeof b, \"%d\", x * {i}); return (int)strlen(b) + x; }}\n"
            ),
        )
        .unwrap();
        objs.push(format!("u{i}.o"));
    }
    let calls: String = (0..n).map(|i| format!("s += f{i}(s);")).collect();
    let decls: String = (0..n).map(|i| format!("int f{i}(int);")).collect();
    fs::write(
        dir.join("main.c"),
        format!("{decls}\nint main(void) {{ int s = 1; {calls} return s == 0; }}\n"),
    )
    .unwrap();
    fs::write(
        dir.join("Makefile"),
        format!(
            "prog: main.o {o}\n\tcc -o $@ $^\n%.o: %.c\n\tcc -O1 -c $< -o $@\n",
            o = objs.join(" ")
        ),
    )
    .unwrap();
}

/// Makes `n` small files under `dir`, 100 per directory `dNNN`.
pub fn make_files(dir: &Path, n: usize) {
    for i in 0..n {
        let d = dir.join(format!("d{:03}", i / 100));
        if i % 100 == 0 {
            fs::create_dir_all(&d).unwrap();
        }
        fs::write(
            d.join(format!("f{i}.txt")),
            format!("file {i}\n").repeat(10),
        )
        .unwrap();
    }
}

/// A node project (eslint, webpack and jest: about 10k files in node_modules) with its
/// lock file and a warm npm cache beside it, so that `npm ci --offline` installs it with
/// no network; None (and the step skipped) without npm or the registry.
pub fn npm_project(root: &Path) -> Option<PathBuf> {
    if !have("npm") {
        eprintln!("npm: not installed, npm ci skipped");
        return None;
    }
    let d = root.join("npm");
    fs::create_dir_all(&d).unwrap();
    fs::write(
        d.join("package.json"),
        r#"{"name":"bench","version":"1.0.0","private":true,
"dependencies":{"eslint":"8.57.0","webpack":"5.94.0","jest":"29.7.0"}}"#,
    )
    .unwrap();
    let out = Command::new("sh")
        .arg("-c")
        // The install caches what it fetched; `npm ci` looks packages up in the forms it
        // asks for itself (the lock file here names no download addresses), which one
        // `npm ci --prefer-offline` caches; the timed runs are then `--offline`.
        .arg(
            "npm install --no-audit --no-fund --ignore-scripts --loglevel=error > /dev/null && \
             npm ci --prefer-offline --no-audit --no-fund --ignore-scripts --loglevel=error \
             > /dev/null",
        )
        .current_dir(&d)
        .env("npm_config_cache", d.join("cache"))
        .output()
        .unwrap();
    if !out.status.success() {
        eprintln!(
            "npm install failed, npm ci skipped: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let count = Command::new("sh")
        .arg("-c")
        .arg(format!("find {} | wc -l", q(&d.join("node_modules"))))
        .output()
        .unwrap();
    eprintln!(
        "npm project: {} entries in node_modules",
        String::from_utf8_lossy(&count.stdout).trim()
    );
    fs::remove_dir_all(d.join("node_modules")).unwrap();
    Some(d)
}
