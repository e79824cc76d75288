//! Fleet benchmark: PostgreSQL + S3-compatible storage (moto on loopback, from
//! `source scripts/services.sh`), two hosts with their own local caches.
//!
//! On a generated source-like tree (default 10k files):
//! - host A's first checkpoint: time, objects and bytes uploaded;
//! - host A's checkpoints after 10 changed files (median of `--reps`): bytes uploaded;
//! - host B (an empty cache): restore-to-first-read, i.e. mounting the thread's head and
//!   reading one file, against a full plain restore of the head on host C (also empty).
//!
//! Needs root and /dev/fuse. Run:
//! `source scripts/services.sh && cargo bench --bench fleet -- [--sizes 10k] [--reps 5]`

use std::path::Path;
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        eprintln!("{name} is not set: `source scripts/services.sh` first");
        std::process::exit(2)
    })
}

struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

fn open(dir: &Path, b: &Backends) -> Store {
    Store::open_with(dir, OpenMode::Create, Duration::from_secs(5), b).unwrap()
}

fn append(t: &ThreadId) -> AppendOptions {
    AppendOptions {
        thread: t.clone(),
        reason: "bench".into(),
        expected: ExpectedHead::Current,
        holder: casfs::checkpoint::holder_name("bench"),
        lease_ttl: Duration::from_secs(60),
    }
}

fn main() {
    let args = parse_bench_args(5);
    let tag = format!("bench-{}", std::process::id());
    let backends = Backends {
        checkpoints: Some(format!(
            "{}?schema={}",
            env("CASFS_TEST_PG"),
            tag.replace('-', "_")
        )),
        objects: Some(format!("{}/{tag}", env("CASFS_TEST_S3"))),
    };
    println!(
        "fleet: PostgreSQL + S3 (moto) on loopback, medians of {} reps",
        args.reps
    );
    println!(
        "{:>8} {:>12} {:>12} {:>14} {:>16} {:>14} {:>14} {:>14}",
        "files",
        "first ckpt",
        "uploaded",
        "10-file ckpt",
        "10-file upload",
        "B: mount",
        "B: 1st read",
        "C: restore"
    );
    for &n in &args.sizes {
        let t = tempfile::tempdir().unwrap();
        let tree = t.path().join("tree");
        let (files, _) = generate(&tree, n);
        let th = ThreadId::new(&format!("fleet-{n}")).unwrap();
        let a = open(&t.path().join("host-a"), &backends);
        let start = Instant::now();
        capture_to_thread(&a, &tree, &CaptureOptions::default(), &append(&th)).unwrap();
        let first = start.elapsed();
        let up = a.remote().unwrap().stats();

        let mut ckpt = Vec::new();
        let mut upload = Vec::new();
        let mut rng = Rng(n as u64);
        for r in 0..args.reps {
            for i in 0..10 {
                let f = &files[(rng.next() as usize + i) % files.len()];
                let len = rng.file_size();
                std::fs::write(f, text(&mut rng, len)).unwrap();
            }
            let before = a.remote().unwrap().stats().uploaded_bytes;
            let s = Instant::now();
            capture_to_thread(&a, &tree, &CaptureOptions::default(), &append(&th)).unwrap();
            ckpt.push(s.elapsed());
            upload.push(a.remote().unwrap().stats().uploaded_bytes - before);
            let _ = r;
        }
        upload.sort_unstable();
        let upload_median = upload[upload.len() / 2];

        // Host B: mount the head with an empty cache and read one file.
        let mut mount_t = Vec::new();
        let mut read_t = Vec::new();
        let mut restore_t = Vec::new();
        let probe = files[files.len() / 2]
            .strip_prefix(&tree)
            .unwrap()
            .to_path_buf();
        for r in 0..args.reps {
            let b = Arc::new(open(&t.path().join(format!("host-b-{r}")), &backends));
            let mp = t.path().join(format!("mnt-{r}"));
            std::fs::create_dir(&mp).unwrap();
            let _u = Unmount(mp.clone());
            let s = Instant::now();
            let m = MountedThread::mount(
                b.clone(),
                &std::fs::canonicalize(&mp).unwrap(),
                th.clone(),
                None,
                &WorkspaceOptions::default(),
            )
            .unwrap();
            let mounted = s.elapsed();
            let data = std::fs::read(mp.join(&probe)).unwrap();
            let first_read = s.elapsed();
            assert_eq!(data, std::fs::read(tree.join(&probe)).unwrap());
            mount_t.push(mounted);
            read_t.push(first_read);
            m.unmount().unwrap();

            let c = open(&t.path().join(format!("host-c-{r}")), &backends);
            let head = c.checkpoints().head(&th).unwrap().unwrap();
            let root = c.checkpoints().get(&head).unwrap().body.root;
            let s = Instant::now();
            restore_tree(
                &c,
                root,
                &t.path().join(format!("out-{r}")),
                &RestoreOptions::default(),
            )
            .unwrap();
            restore_t.push(s.elapsed());
        }
        println!(
            "{:>8} {:>10.0}ms {:>6} {:>5.1}MB {:>12.1}ms {:>13.1}KiB {:>12.1}ms {:>12.1}ms {:>12.0}ms",
            n,
            ms(first),
            up.uploaded_objects,
            up.uploaded_bytes as f64 / 1e6,
            ms(median(ckpt)),
            upload_median as f64 / 1024.0,
            ms(median(mount_t)),
            ms(median(read_t)),
            ms(median(restore_t)),
        );
    }
}
