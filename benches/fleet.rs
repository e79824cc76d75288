//! Fleet benchmark: casfs (PostgreSQL + S3, objects in packs) beside restic (its s3
//! backend) on the same S3-compatible server on loopback (moto, from
//! `source scripts/services.sh`), in one run.
//!
//! Per generated source-like tree (`--sizes`, default 1k,10k,100k):
//! - first upload: `casfs` capture of the tree on host A (hashing, packing, uploading,
//!   appending) vs `restic backup`;
//! - upload after 10 changed files (median of `--reps`), the same files changed for both;
//! - full restore on a fresh host (an empty cache): a plain restore of the head vs
//!   `restic restore latest` with a new cache;
//! - restore-to-first-read on a fresh host: mounting the head and reading one file vs
//!   `restic dump latest FILE` with a new cache (restic has no lazy restore);
//! - requests per operation, counted from the server's own log (both tools, the same
//!   way: PUT, GET, LIST, HEAD, DELETE, POST) and, for casfs, its own counters (which
//!   tell ranged GETs apart).
//!
//! Needs root and /dev/fuse (the mount), restic on PATH, and the moto log
//! (`CASFS_MOTO_LOG`, default /tmp/casfs-moto.log, where scripts/services.sh writes it).
//! Run: `source scripts/services.sh && cargo bench --bench fleet -- [--sizes 1k,10k,100k]
//! [--reps 3] [--pack-mib 16] [--out FILE]`. `--out` writes every run as a result file
//! (docs/results/README.md).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use casfs::checkpoint::{
    capture_to_thread, restore_tree, AppendOptions, Backends, CaptureOptions, ExpectedHead,
    OpenMode, RestoreOptions, Store, ThreadId,
};
use casfs::fs::WorkspaceOptions;
use casfs::mount::MountedThread;

#[path = "common/mod.rs"]
mod common;
use common::*;

/// CPU time this process used so far (user + system), in milliseconds.
fn cpu_ms() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 * 1e3 + v.tv_usec as f64 / 1e3;
    t(u.ru_utime) + t(u.ru_stime)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        eprintln!("{name} is not set: `source scripts/services.sh` first");
        std::process::exit(2)
    })
}

struct Unmount(PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

fn open(dir: &Path, b: &Backends, pack_mib: usize) -> Store {
    let s = Store::open_with(dir, OpenMode::Create, Duration::from_secs(5), b).unwrap();
    s.remote().unwrap().set_pack_size(pack_mib << 20).unwrap();
    s
}

fn append(t: &ThreadId) -> AppendOptions {
    AppendOptions {
        thread: t.clone(),
        reason: "bench".into(),
        expected: ExpectedHead::Current,
        holder: casfs::checkpoint::holder_name("bench"),
        lease_ttl: Duration::from_secs(600),
    }
}

/// Requests as the server logged them.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
struct Logged {
    put: u64,
    get: u64,
    list: u64,
    head: u64,
    delete: u64,
    post: u64,
}

impl Logged {
    fn total(&self) -> u64 {
        self.put + self.get + self.list + self.head + self.delete + self.post
    }

    fn show(&self) -> String {
        let mut parts = Vec::new();
        for (n, k) in [
            (self.put, "PUT"),
            (self.get, "GET"),
            (self.list, "LIST"),
            (self.head, "HEAD"),
            (self.delete, "DELETE"),
            (self.post, "POST"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {k}"));
            }
        }
        format!("{} ({})", self.total(), parts.join(", "))
    }
}

/// Reads what the server logged since the last call.
struct ServerLog {
    path: PathBuf,
    offset: u64,
}

impl ServerLog {
    fn new(path: PathBuf) -> ServerLog {
        let offset = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        ServerLog { path, offset }
    }

    fn since(&mut self) -> Logged {
        // The server writes its line after it answers: let the last ones land.
        std::thread::sleep(Duration::from_millis(200));
        let mut out = Logged::default();
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return out;
        };
        let _ = f.seek(SeekFrom::Start(self.offset));
        let mut text = String::new();
        let _ = f.read_to_string(&mut text);
        self.offset += text.len() as u64;
        for line in text.lines() {
            let Some(req) = line.split('"').nth(1) else {
                continue;
            };
            let mut it = req.split(' ');
            let (Some(method), Some(path)) = (it.next(), it.next()) else {
                continue;
            };
            match method {
                "PUT" => out.put += 1,
                "GET" if path.contains("list-type=") || path.contains("prefix=") => out.list += 1,
                "GET" => out.get += 1,
                "HEAD" => out.head += 1,
                "DELETE" => out.delete += 1,
                "POST" => out.post += 1,
                _ => {}
            }
        }
        out
    }
}

fn restic(repo: &str, cache: &Path, args: &[&str]) -> Duration {
    let t = Instant::now();
    let out = Command::new("restic")
        .arg("-r")
        .arg(repo)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .env("RESTIC_PASSWORD", "bench")
        .output()
        .expect("restic runs");
    let d = t.elapsed();
    assert!(
        out.status.success(),
        "restic {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    d
}

fn files_under(dir: &Path) -> usize {
    walk_files(dir).len()
}

fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[derive(serde::Serialize)]
struct Row {
    files: usize,
    bytes: u64,
    casfs: Tool,
    restic: Tool,
}

#[derive(serde::Serialize, Default)]
struct Tool {
    first_upload_ms: f64,
    first_upload_requests: Logged,
    change_upload_ms: f64,
    change_upload_requests: Logged,
    full_restore_ms: f64,
    full_restore_requests: Logged,
    first_read_ms: f64,
    first_read_requests: Logged,
    /// casfs only: its own counters of the first upload and the first read.
    own_first_upload: Option<casfs::cas::remote_index::RemoteRequests>,
    own_first_read: Option<casfs::cas::remote_index::RemoteRequests>,
    own_full_restore: Option<casfs::cas::remote_index::RemoteRequests>,
    uploaded_bytes: u64,
}

fn main() {
    let args = parse_bench_args(3);
    let mut res = Results::cargo_bench("fleet");
    res.param("sizes", &args.sizes);
    res.param("reps", args.reps);
    let pack_mib: usize = args
        .flags
        .iter()
        .position(|f| f == "--pack-mib")
        .and_then(|i| args.flags.get(i + 1))
        .map(|v| v.parse().expect("--pack-mib N"))
        .unwrap_or(16);
    let sizes = args.sizes.clone();
    let tag = format!("bench-{}", std::process::id());
    // Each size gets its own prefix, so a fresh host of one size reads only its indexes.
    let backends_for = |n: usize| Backends {
        checkpoints: Some(format!(
            "{}?schema={}",
            env("CASFS_TEST_PG"),
            tag.replace('-', "_")
        )),
        objects: Some(format!("{}/{tag}-{n}", env("CASFS_TEST_S3"))),
    };
    let bucket = env("CASFS_TEST_S3").trim_start_matches("s3://").to_string();
    let endpoint = env("AWS_ENDPOINT_URL");
    let mut log = ServerLog::new(PathBuf::from(
        std::env::var("CASFS_MOTO_LOG").unwrap_or_else(|_| "/tmp/casfs-moto.log".into()),
    ));
    println!(
        "fleet: casfs (PostgreSQL + S3, {pack_mib} MiB packs) and restic {} on one S3 server \
         (moto) on loopback; medians of {} reps; requests as the server logged them",
        String::from_utf8_lossy(
            &Command::new("restic")
                .arg("version")
                .output()
                .expect("restic on PATH")
                .stdout
        )
        .split_whitespace()
        .nth(1)
        .unwrap_or("?"),
        args.reps
    );
    res.param("pack_mib", pack_mib);
    let mut rows = Vec::new();
    for &n in &sizes {
        // Trees, stores and restores on a fresh journaled ext4 loop filesystem per size:
        // this VM's root ext4 has no journal, and its create times swing tenfold after
        // the mass deletes of a size before (both tools would pay them).
        let lfs = LoopFs::new(16);
        res.bench_dir(&lfs.mnt);
        let t = tempfile::tempdir_in(&lfs.mnt).unwrap();
        let tree = t.path().join("tree");
        let (files, bytes) = generate(&tree, n);
        // The tree's pages reach the disk before anything is timed: otherwise their
        // writeback runs during the first tool's upload, not the second's.
        sh("sync", &[]);
        let backends = backends_for(n);
        eprintln!("{n} files, {} MB", bytes / 1_000_000);
        let th = ThreadId::new(&format!("fleet-{n}")).unwrap();
        let repo = format!("s3:{endpoint}/{bucket}/{tag}-restic-{n}");
        let mut c = Tool::default();
        let mut r = Tool::default();

        // First upload.
        let a = open(&t.path().join("host-a"), &backends, pack_mib);
        let _ = log.since();
        let own = a.remote().unwrap().stats();
        let s = Instant::now();
        capture_to_thread(&a, &tree, &CaptureOptions::default(), &append(&th)).unwrap();
        c.first_upload_ms = ms(s.elapsed());
        c.first_upload_requests = log.since();
        let up = a.remote().unwrap().stats().since(&own);
        c.own_first_upload = Some(up.requests);
        c.uploaded_bytes = up.uploaded_bytes;
        let cache_a = t.path().join("restic-cache-a");
        restic(&repo, &cache_a, &["init"]);
        sh("sync", &[]);
        let _ = log.since();
        r.first_upload_ms = ms(restic(
            &repo,
            &cache_a,
            &["backup", "--quiet", tree.to_str().unwrap()],
        ));
        r.first_upload_requests = log.since();
        eprintln!(
            "  first upload: casfs {:.0} ms, restic {:.0} ms",
            c.first_upload_ms, r.first_upload_ms
        );

        // Uploads after 10 changed files, the same changes for both.
        let mut rng = Rng(n as u64);
        let (mut ct, mut rt) = (Vec::new(), Vec::new());
        for _ in 0..args.reps {
            for i in 0..10 {
                let f = &files[(rng.next() as usize + i) % files.len()];
                let len = rng.file_size();
                std::fs::write(f, text(&mut rng, len)).unwrap();
            }
            let _ = log.since();
            let s = Instant::now();
            capture_to_thread(&a, &tree, &CaptureOptions::default(), &append(&th)).unwrap();
            ct.push(s.elapsed());
            c.change_upload_requests = log.since();
            rt.push(restic(
                &repo,
                &cache_a,
                &["backup", "--quiet", tree.to_str().unwrap()],
            ));
            r.change_upload_requests = log.since();
        }
        let at = |op: &str, tool: &str| serde_json::json!({"op": op, "tool": tool, "files": n});
        res.value(at("workload", "generated"), "B", bytes as f64);
        res.value(at("first upload", "casfs"), "ms", c.first_upload_ms);
        res.value(at("first upload", "restic"), "ms", r.first_upload_ms);
        c.change_upload_ms = ms(res.times(at("upload after 10 changes", "casfs"), &ct));
        r.change_upload_ms = ms(res.times(at("upload after 10 changes", "restic"), &rt));

        // Fresh hosts: full restore, and restore-to-first-read.
        let probe = files[files.len() / 2]
            .strip_prefix(&tree)
            .unwrap()
            .to_path_buf();
        let want = std::fs::read(tree.join(&probe)).unwrap();
        let (mut cf, mut rf, mut cr, mut rr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..args.reps {
            let host = open(&t.path().join(format!("host-c-{rep}")), &backends, pack_mib);
            let head = host.checkpoints().head(&th).unwrap().unwrap();
            let root = host.checkpoints().get(&head).unwrap().body.root;
            let out = t.path().join(format!("out-c-{rep}"));
            let _ = log.since();
            let own = host.remote().unwrap().stats();
            let s = Instant::now();
            let cpu0 = cpu_ms();
            let st = restore_tree(&host, root, &out, &RestoreOptions::default()).unwrap();
            cf.push(s.elapsed());
            println!(
                "  casfs full restore: {} ms, of which {} ms fetching before the first write; {:.0} ms of CPU",
                st.duration_ms, st.preflight_ms, cpu_ms() - cpu0
            );
            c.full_restore_requests = log.since();
            c.own_full_restore = Some(host.remote().unwrap().stats().since(&own).requests);
            assert_eq!(files_under(&out), files.len());
            let _ = std::fs::remove_dir_all(&out);
            drop(host);

            let out = t.path().join(format!("out-r-{rep}"));
            let cache = t.path().join(format!("restic-cache-{rep}"));
            rf.push(restic(
                &repo,
                &cache,
                &["restore", "latest", "--target", out.to_str().unwrap()],
            ));
            r.full_restore_requests = log.since();
            assert_eq!(files_under(&out), files.len());
            let _ = std::fs::remove_dir_all(&out);

            let host = Arc::new(open(
                &t.path().join(format!("host-b-{rep}")),
                &backends,
                pack_mib,
            ));
            let mp = t.path().join(format!("mnt-{rep}"));
            std::fs::create_dir(&mp).unwrap();
            let _u = Unmount(mp.clone());
            let _ = log.since();
            let own = host.remote().unwrap().stats();
            let s = Instant::now();
            let m = MountedThread::mount(
                host.clone(),
                &std::fs::canonicalize(&mp).unwrap(),
                th.clone(),
                None,
                &WorkspaceOptions::default(),
            )
            .unwrap();
            let data = std::fs::read(mp.join(&probe)).unwrap();
            cr.push(s.elapsed());
            c.first_read_requests = log.since();
            c.own_first_read = Some(host.remote().unwrap().stats().since(&own).requests);
            assert_eq!(data, want);
            m.unmount().unwrap();

            let cache = t.path().join(format!("restic-cache-dump-{rep}"));
            let s = Instant::now();
            let out = Command::new("restic")
                .args(["-r", &repo, "--cache-dir"])
                .arg(&cache)
                .args(["dump", "latest"])
                .arg(tree.join(&probe))
                .env("RESTIC_PASSWORD", "bench")
                .output()
                .unwrap();
            rr.push(s.elapsed());
            r.first_read_requests = log.since();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(out.stdout, want);
        }
        c.full_restore_ms = ms(res.times(at("full restore on a fresh host", "casfs"), &cf));
        r.full_restore_ms = ms(res.times(at("full restore on a fresh host", "restic"), &rf));
        c.first_read_ms = ms(res.times(at("first read on a fresh host", "casfs"), &cr));
        r.first_read_ms = ms(res.times(at("first read on a fresh host", "restic"), &rr));
        res.value(
            at("first upload, bytes stored", "casfs"),
            "B",
            c.uploaded_bytes as f64,
        );
        for (tool, t) in [("casfs", &c), ("restic", &r)] {
            for (op, l) in [
                ("first upload", &t.first_upload_requests),
                ("upload after 10 changes", &t.change_upload_requests),
                ("full restore on a fresh host", &t.full_restore_requests),
                ("first read on a fresh host", &t.first_read_requests),
            ] {
                let labels = serde_json::json!({"op": op, "tool": tool, "files": n,
                    "breakdown": l.show()});
                res.value(labels, "requests", l.total() as f64);
            }
        }
        rows.push(Row {
            files: n,
            bytes,
            casfs: c,
            restic: r,
        });
    }

    println!();
    println!(
        "{:>8} {:>7} | {:>22} | {:>22} | {:>22} | {:>22}",
        "files",
        "MB",
        "first upload",
        "after 10 changes",
        "full restore (fresh)",
        "first read (fresh)"
    );
    for row in &rows {
        for (name, t) in [("casfs", &row.casfs), ("restic", &row.restic)] {
            println!(
                "{:>8} {:>7} | {:>12.0} ms {:>6} | {:>12.0} ms {:>6} | {:>12.0} ms {:>6} | {:>12.1} ms {:>6}  {name}",
                row.files,
                row.bytes / 1_000_000,
                t.first_upload_ms,
                t.first_upload_requests.total(),
                t.change_upload_ms,
                t.change_upload_requests.total(),
                t.full_restore_ms,
                t.full_restore_requests.total(),
                t.first_read_ms,
                t.first_read_requests.total(),
            );
        }
        println!(
            "{:>8} ratios restic / casfs: first upload {:.1}x, after 10 changes {:.1}x, full restore {:.1}x, first read {:.1}x",
            "",
            row.restic.first_upload_ms / row.casfs.first_upload_ms,
            row.restic.change_upload_ms / row.casfs.change_upload_ms,
            row.restic.full_restore_ms / row.casfs.full_restore_ms,
            row.restic.first_read_ms / row.casfs.first_read_ms,
        );
        println!(
            "{:>8} requests, casfs: first upload {} ({} MB stored, so {:.2} requests per 4 MiB), \
             after 10 changes {}, full restore {}, first read {}",
            "",
            row.casfs.first_upload_requests.show(),
            row.casfs.uploaded_bytes / 1_000_000,
            row.casfs.first_upload_requests.total() as f64
                / (row.casfs.uploaded_bytes as f64 / (4u64 << 20) as f64).max(1.0),
            row.casfs.change_upload_requests.show(),
            row.casfs.full_restore_requests.show(),
            row.casfs.first_read_requests.show(),
        );
        println!(
            "{:>8} requests, restic: first upload {}, after 10 changes {}, full restore {}, first read {}",
            "",
            row.restic.first_upload_requests.show(),
            row.restic.change_upload_requests.show(),
            row.restic.full_restore_requests.show(),
            row.restic.first_read_requests.show(),
        );
        if let (Some(u), Some(f), Some(r)) = (
            row.casfs.own_first_upload,
            row.casfs.own_full_restore,
            row.casfs.own_first_read,
        ) {
            println!(
                "{:>8} casfs's own counters: first upload {u:?}; full restore {f:?}; first read {r:?}",
                ""
            );
        }
    }
    res.finish();
}
