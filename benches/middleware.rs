//! Middleware benchmark: what the lifecycle middleware adds per run on top of the
//! mount's own checkpoint and restore, in one process on one store.
//!
//! On a generated source-like tree (default 10k files):
//! - a run on a live sandbox (resumed): `setup`, 10 files changed, `on_finish` (lease,
//!   conversation, one artifact, policy, secret scrubbing, append), against a bare
//!   `MountedThread::checkpoint` of 10 changed files on the same mount;
//! - a run on a new sandbox: `setup` (mount, restore of the head, conversation and
//!   artifacts into an empty host store) against a bare mount plus restore of the head;
//! - a cancelled run: `on_abort` destroys the sandbox, discarding its uncaptured work
//!   and (secrets being set) purging the store's files of its records.
//!
//! Medians of `--reps` runs (default 15). Needs root and /dev/fuse.
//!
//! Run: `cargo bench --bench middleware -- [--sizes 10k] [--reps 15] [--out FILE]`
//! (`--out`: every run as a result file, docs/results/README.md)

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use casfs::checkpoint::{OpenMode, Store, ThreadId};
use casfs::fs::WorkspaceOptions;
use casfs::middleware::{
    ArtifactMeta, CasfsProvider, MessageStore, Middleware, MiddlewareConfig, Persistence,
    RunContext, SandboxProvider, Secrets, SnapshotConfig, SnapshotPolicy, StorePersistence,
};
use casfs::mount::MountedThread;

#[path = "common/mod.rs"]
mod common;
use common::*;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn unmount_lazy(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

fn change(root: &Path, files: &[std::path::PathBuf], src: &Path, round: usize) {
    for (i, f) in files.iter().take(10).enumerate() {
        let rel = f.strip_prefix(src).unwrap();
        fs::write(root.join(rel), format!("round {round} file {i}\n")).unwrap();
    }
}

fn main() {
    let args = parse_bench_args(15);
    let asked = std::env::args().any(|a| a == "--sizes");
    let n = if asked { args.sizes[0] } else { 10_000 };
    let reps = args.reps;
    let mut res = Results::cargo_bench("middleware");
    res.param("files", n);
    res.param("reps", reps);
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    let (files, bytes) = generate(&src, n);
    let store = Arc::new(
        Store::open_with_families(
            &t.path().join("store"),
            OpenMode::Create,
            Duration::from_secs(5),
            &Default::default(),
            casfs::middleware::COLUMN_FAMILIES,
        )
        .unwrap(),
    );
    let sp = Arc::new(StorePersistence::new(store.database().clone()).unwrap());
    let persistence = Persistence::on_store(sp.clone());
    let provider = Arc::new(CasfsProvider::new(
        store.clone(),
        &t.path().join("sandboxes"),
        WorkspaceOptions::default(),
    ));
    let mut snap = SnapshotConfig::new(persistence.clone());
    snap.workspace = serde_json::json!({"image": "bench"});
    snap.policy = SnapshotPolicy {
        exclude: vec!["node_modules".into(), "*.log".into()],
        max_file_size: Some(64 << 20),
        ..Default::default()
    };
    snap.secrets = BTreeMap::from([("TOKEN".to_string(), "tok-0123456789abcdef".to_string())]);
    let mw = Arc::new(
        Middleware::new(
            store.clone(),
            provider.clone(),
            MiddlewareConfig {
                snapshots: Some(snap),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let thread = ThreadId::new("bench").unwrap();
    let ctx = |run: &str| RunContext::new(thread.clone(), run);
    let mp = provider.mountpoint("bench");
    let persist = |run: &str| {
        use casfs::middleware::{ArtifactStore, BlobStore};
        let mut m = sp.load_thread(&thread).unwrap();
        m.push(serde_json::json!({"role": "assistant", "content": format!("run {run}")}));
        sp.save_thread(&thread, &m).unwrap();
        BlobStore::put(&*sp, &format!("blob-{run}"), b"artifact bytes").unwrap();
        ArtifactStore::put(
            &*sp,
            &ArtifactMeta {
                artifact_id: format!("a-{run}"),
                run_id: run.into(),
                thread: thread.clone(),
                blob_key: Some(format!("blob-{run}")),
                name: "report.txt".into(),
                mime_type: "text/plain".into(),
                size: 14,
                created_at_ms: 0,
            },
        )
        .unwrap();
    };

    // The first run fills the workspace.
    eprintln!(
        "filling a {n}-file workspace ({:.0} MB) through the mount",
        bytes as f64 / 1e6
    );
    let run = mw.setup(ctx("fill"), Some(&persistence)).unwrap();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(&mp)
        .status()
        .unwrap();
    assert!(status.success());
    persist("fill");
    run.on_finish().unwrap();
    drop(run);

    // Runs on the live sandbox against bare checkpoints of the same mount.
    let (mut setups, mut finishes, mut bare) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        let id = format!("r{r}");
        let s = Instant::now();
        let run = mw.setup(ctx(&id), Some(&persistence)).unwrap();
        setups.push(s.elapsed());
        change(&mp, &files, &src, r);
        persist(&id);
        let s = Instant::now();
        let out = run.on_finish().unwrap();
        finishes.push(s.elapsed());
        assert_eq!(out.changed_files, 10);
        let h = run.sandbox().unwrap();
        drop(run);
        change(&mp, &files, &src, r + 1000);
        let s = Instant::now();
        let cp = h.mount().unwrap().checkpoint("bare").unwrap();
        bare.push(s.elapsed());
        assert_eq!(cp.changed_files, 10);
    }

    // Runs on a new sandbox (the head restored) against a bare mount + restore.
    let (mut fresh, mut bare_fresh, mut cancels) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        provider.destroy("bench", &Secrets::default()).unwrap();
        sp.save_thread(&thread, &[]).unwrap();
        let id = format!("f{r}");
        let s = Instant::now();
        let run = mw.setup(ctx(&id), Some(&persistence)).unwrap();
        fresh.push(s.elapsed());
        change(&mp, &files, &src, r + 2000);
        let s = Instant::now();
        run.on_abort(casfs::middleware::AbortInfo { cancelled: true })
            .unwrap();
        cancels.push(s.elapsed());
        drop(run);
        let head = store.checkpoints().head(&thread).unwrap().unwrap();
        let bare_mp = t.path().join("bare");
        fs::create_dir_all(&bare_mp).unwrap();
        let s = Instant::now();
        let m = MountedThread::mount(
            store.clone(),
            &fs::canonicalize(&bare_mp).unwrap(),
            thread.clone(),
            None,
            &WorkspaceOptions::default(),
        )
        .unwrap();
        m.restore(head, None, true).unwrap();
        bare_fresh.push(s.elapsed());
        m.unmount().unwrap();
    }
    unmount_lazy(&mp);

    let at = |step: &str, tool: &str| serde_json::json!({"step": step, "tool": tool, "files": n});
    res.value(at("workload", "generated"), "B", bytes as f64);
    let (su, fi, ba) = (
        res.times(at("live sandbox: setup", "middleware"), &setups),
        res.times(
            at("live sandbox: finish (10 changed files)", "middleware"),
            &finishes,
        ),
        res.times(
            at("live sandbox: checkpoint (10 changed files)", "bare mount"),
            &bare,
        ),
    );
    let (fr, bf, ca) = (
        res.times(at("new sandbox: setup", "middleware"), &fresh),
        res.times(
            at("new sandbox: mount + restore", "bare mount"),
            &bare_fresh,
        ),
        res.times(at("cancelled run: abort", "middleware"), &cancels),
    );
    println!("middleware overhead per run, {n}-file workspace, medians of {reps}:");
    println!("| step | middleware | bare mount | added |");
    println!("|---|---|---|---|");
    println!(
        "| live sandbox: setup + finish (10 changed files) | {:.1} + {:.1} ms | checkpoint {:.1} ms | {:.1} ms |",
        ms(su),
        ms(fi),
        ms(ba),
        ms(su + fi) - ms(ba)
    );
    println!(
        "| new sandbox: setup (mount, restore head, conversation, artifact) | {:.1} ms | mount + restore {:.1} ms | {:.1} ms |",
        ms(fr),
        ms(bf),
        ms(fr) - ms(bf)
    );
    println!(
        "| cancelled run (10 changed files): abort = unmount, discard, purge (secrets set) | {:.1} ms | | |",
        ms(ca)
    );
    res.finish();
}
