//! Reliability: retention and garbage collection (also while a mount writes,
//! checkpoints and restores), SIGKILL at named crash points and at random moments, a
//! full store filesystem, and many processes racing for one thread.
//!
//! Long variants: `CASFS_STRESS_SECS` (default 6) sets how long the concurrency stress
//! runs; `CASFS_CRASH_RANDOM` (default 4) how many captures are killed at a random
//! moment.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use casfs::checkpoint::maintenance::{fsck, gc, prune, Retention};
use casfs::checkpoint::{restore_tree, CheckpointId, OpenMode, RestoreOptions, Store, ThreadId};
use casfs::fs::WorkspaceOptions;
use casfs::mount::MountedThread;

use crate::common::{casfs, casfs_bin, fails, json, ok, pattern, snapshot};
use crate::{wait_for, MountGuard};

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `casfs fsck --json` (through a live mount's daemon when one holds the store):
/// asserts it found no error and returns the report.
fn fsck_clean(store: &Path) -> serde_json::Value {
    let out = casfs(store, &["--json", "fsck"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "fsck printed no report: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        out.status.success() && v["errors"].as_array().unwrap().is_empty(),
        "fsck found errors: {v:#}"
    );
    v
}

/// Restores checkpoint `id` into a fresh directory and returns its snapshot.
fn restored(store: &Path, id: &str, scratch: &Path) -> BTreeMap<PathBuf, crate::common::Node> {
    let out = scratch.join(format!("r-{}", &id[..12]));
    let _ = fs::remove_dir_all(&out);
    ok(store, &["restore", s(&out), "--at", id]);
    let snap = snapshot(&out);
    fs::remove_dir_all(&out).unwrap();
    snap
}

fn head(store: &Path, thread: &str) -> Option<String> {
    let v = json(store, &["threads"]);
    v.as_array()
        .unwrap()
        .iter()
        .find(|t| t["thread"] == thread)
        .map(|t| t["head"].as_str().unwrap().to_string())
}

fn random_bytes(len: usize) -> Vec<u8> {
    use std::io::Read;
    let mut v = vec![0u8; len];
    fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut v)
        .unwrap();
    v
}

fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

/// Prune and gc remove exactly what nothing needs: kept checkpoints restore byte for
/// byte, a live mount (with uncaptured changes, based on a fork of a pruned checkpoint)
/// reads everything, the space comes back, and fsck is clean.
#[test]
fn prune_and_gc_free_only_what_nothing_needs() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    for i in 0..30 {
        fs::write(src.join(format!("f{i}")), pattern(500 + i * 37, i as u64)).unwrap();
    }
    let mut ids = Vec::new();
    let mut snaps = Vec::new();
    for round in 0..5u64 {
        // A unique 3 MiB file per checkpoint (chunked, incompressible) and a few edits.
        fs::write(src.join("big"), random_bytes(3 << 20)).unwrap();
        for i in 0..3 {
            fs::write(src.join(format!("f{i}")), pattern(800, round * 10 + i)).unwrap();
        }
        let v = json(&store, &["capture", s(&src), "-t", "p"]);
        ids.push(v["checkpoint"]["id"].as_str().unwrap().to_string());
        snaps.push(snapshot(&src));
    }
    // Everything is still referenced.
    let dry = json(&store, &["gc", "--dry-run"]);
    assert_eq!(dry["sweep"]["objects_freed"], 0, "{dry:#}");

    // A mount on a fork of the first checkpoint, with uncaptured changes.
    ok(&store, &["fork", "m", "--from", &ids[0]]);
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    ok(&store, &["mount", s(&mp), "-t", "m"]);
    fs::write(mp.join("uncaptured.txt"), b"not yet checkpointed").unwrap();
    fs::rename(mp.join("f7"), mp.join("f7-renamed")).unwrap();
    let before = snapshot(&mp);

    // The store is held by the mount's daemon: prune and gc run there.
    let pd = json(
        &store,
        &["prune", "--keep-last", "2", "-t", "p", "--dry-run"],
    );
    assert_eq!(pd["prune"]["pruned"], 3, "{pd:#}");
    let v = json(&store, &["prune", "--keep-last", "2", "-t", "p", "--gc"]);
    assert_eq!(v["prune"]["pruned"], 3, "{v:#}");
    let g = &v["gc"];
    // The big files of checkpoints 2 and 3 were only theirs (the first one's lives on
    // in the fork).
    let freed = g["sweep"]["bytes_freed"].as_u64().unwrap();
    assert!(freed >= 2 * (3 << 20), "{g:#}");
    let (b, a) = (
        g["disk_bytes_before"].as_u64().unwrap(),
        g["disk_bytes_after"].as_u64().unwrap(),
    );
    assert!(a + (4 << 20) < b, "space not given back: {b} -> {a}");

    // The mount reads everything from the store again (not from the page cache).
    drop_caches();
    assert_eq!(snapshot(&mp), before);
    let cp = json(&store, &["checkpoint", s(&mp)]);
    ok(&store, &["unmount", s(&mp)]);
    assert!(wait_for(Duration::from_secs(10), || casfs(
        &store,
        &["fsck"]
    )
    .status
    .success()));
    let report = fsck_clean(&store);
    assert_eq!(report["unreachable_objects"], 0, "{report:#}");

    // Kept checkpoints restore exactly; pruned ones are gone by name; logs stop there.
    for i in 3..5 {
        assert_eq!(restored(&store, &ids[i], t.path()), snaps[i]);
    }
    for id in &ids[..3] {
        let err = fails(&store, &["show", id]);
        assert!(err.contains("not found"), "{err}");
    }
    let log = json(&store, &["log", "-t", "p"]);
    assert_eq!(log.as_array().unwrap().len(), 2, "{log:#}");
    let mlog = json(&store, &["log", "-t", "m"]);
    assert_eq!(mlog.as_array().unwrap().len(), 2, "{mlog:#}");
    let m_snap = restored(&store, cp["checkpoint"].as_str().unwrap(), t.path());
    assert_eq!(m_snap, before);
    // Nothing left to free.
    let again = json(&store, &["gc"]);
    assert_eq!(again["sweep"]["objects_freed"], 0, "{again:#}");
}

/// Per-writer model: file name -> content.
type Model = BTreeMap<String, Vec<u8>>;

/// A tiny deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Writers create, overwrite, rename and delete inside a mount while checkpoints,
/// restores (of a second mount, to the first one's checkpoints), retention and gc run
/// in a loop: no deadlock (bounded time), no lost write (the mount and its last
/// checkpoint equal the writers' model), restores equal their checkpoints, fsck clean.
#[test]
fn gc_and_prune_run_while_a_mount_writes_checkpoints_and_restores() {
    let secs = env_num("CASFS_STRESS_SECS", 6);
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::open(
            &t.path().join("s"),
            OpenMode::Create,
            Duration::from_secs(5),
        )
        .unwrap(),
    );
    let mp1 = t.path().join("m1");
    let mp2 = t.path().join("m2");
    fs::create_dir(&mp1).unwrap();
    fs::create_dir(&mp2).unwrap();
    let _g1 = MountGuard::new(&mp1);
    let _g2 = MountGuard::new(&mp2);
    let mp1 = fs::canonicalize(&mp1).unwrap();
    let mp2 = fs::canonicalize(&mp2).unwrap();
    let opts = WorkspaceOptions::default();
    let m1 = Arc::new(
        MountedThread::mount(
            store.clone(),
            &mp1,
            ThreadId::new("w").unwrap(),
            None,
            &opts,
        )
        .unwrap(),
    );
    let m2 = Arc::new(
        MountedThread::mount(
            store.clone(),
            &mp2,
            ThreadId::new("r").unwrap(),
            None,
            &opts,
        )
        .unwrap(),
    );

    // A watchdog: a deadlock fails the test instead of hanging CI.
    let done = Arc::new(AtomicBool::new(false));
    {
        let done = done.clone();
        let limit = Duration::from_secs(secs + 120);
        std::thread::spawn(move || {
            let start = Instant::now();
            while !done.load(Ordering::SeqCst) {
                if start.elapsed() > limit {
                    eprintln!("stress: no progress after {limit:?}: deadlock");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    }

    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..3u64)
        .map(|k| {
            let (stop, ops, mp) = (stop.clone(), ops.clone(), mp1.clone());
            std::thread::spawn(move || -> Model {
                let dir = mp.join(format!("w{k}"));
                fs::create_dir(&dir).unwrap();
                let mut model = Model::new();
                let mut rng = Rng(0x9E37_79B9 + k);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let names: Vec<String> = model.keys().cloned().collect();
                    match rng.below(10) {
                        0..=4 => {
                            let name = format!("f{}", rng.below(60));
                            let len = if rng.below(40) == 0 {
                                (1 << 20) + 4096
                            } else {
                                rng.below(20_000) as usize
                            };
                            let data = pattern(len, k << 40 | n);
                            fs::write(dir.join(&name), &data).unwrap();
                            model.insert(name, data);
                        }
                        5..=7 if !names.is_empty() => {
                            let from = &names[rng.below(names.len() as u64) as usize];
                            let to = format!("f{}", rng.below(60));
                            fs::rename(dir.join(from), dir.join(&to)).unwrap();
                            let data = model.remove(from).unwrap();
                            model.insert(to, data);
                        }
                        8 | 9 if !names.is_empty() => {
                            let name = &names[rng.below(names.len() as u64) as usize];
                            fs::remove_file(dir.join(name)).unwrap();
                            model.remove(name);
                        }
                        _ => continue,
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                model
            })
        })
        .collect();

    let ids: Arc<Mutex<Vec<CheckpointId>>> = Arc::new(Mutex::new(Vec::new()));
    let checkpointer = {
        let (stop, m1, ids) = (stop.clone(), m1.clone(), ids.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let c = m1.checkpoint("stress").expect("checkpoint during stress");
                ids.lock().unwrap().push(c.checkpoint);
                n += 1;
                std::thread::sleep(Duration::from_millis(15));
            }
            n
        })
    };
    let collector = {
        let (stop, store) = (stop.clone(), store.clone());
        std::thread::spawn(move || {
            let keep = Retention {
                keep_last: Some(3),
                keep_within: None,
                thread: Some(ThreadId::new("w").unwrap()),
            };
            let (mut runs, mut freed) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                prune(&store, &keep, false).expect("prune during stress");
                let g = gc(&store, false).expect("gc during stress");
                freed += g.sweep.objects_freed;
                runs += 1;
                std::thread::sleep(Duration::from_millis(30));
            }
            (runs, freed)
        })
    };
    let restorer = {
        let (stop, store, m2, ids) = (stop.clone(), store.clone(), m2.clone(), ids.clone());
        let scratch = t.path().join("scratch");
        let mp2 = mp2.clone();
        std::thread::spawn(move || {
            let (mut restores, mut gone) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let Some(id) = ids.lock().unwrap().last().copied() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let Ok(cp) = store.checkpoints().get(&id) else {
                    gone += 1;
                    continue;
                };
                match m2.restore(id, None, true) {
                    Ok(_) => {}
                    // Pruned between the two calls.
                    Err(casfs::checkpoint::CheckpointError::NotFound(_)) => {
                        gone += 1;
                        continue;
                    }
                    Err(e) => panic!("restore during stress: {e}"),
                }
                // The mount is based on it now, so its objects stay whatever retention
                // does to the record.
                let _ = fs::remove_dir_all(&scratch);
                restore_tree(&store, cp.body.root, &scratch, &RestoreOptions::default())
                    .expect("restore_tree during stress");
                assert_eq!(snapshot(&mp2), snapshot(&scratch), "restore of {id}");
                restores += 1;
            }
            (restores, gone)
        })
    };

    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::SeqCst);
    let models: Vec<Model> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let checkpoints = checkpointer.join().unwrap();
    let (gc_runs, freed) = collector.join().unwrap();
    let (restores, gone) = restorer.join().unwrap();

    // No lost write: the mount, and its last checkpoint, equal the model.
    let last = m1.checkpoint("final").unwrap();
    let out = t.path().join("final");
    let root = store.checkpoints().get(&last.checkpoint).unwrap().body.root;
    restore_tree(&store, root, &out, &RestoreOptions::default()).unwrap();
    for (k, model) in models.iter().enumerate() {
        for base in [&mp1, &out] {
            let dir = base.join(format!("w{k}"));
            let names: HashSet<String> = fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            let want: HashSet<String> = model.keys().cloned().collect();
            assert_eq!(names, want, "{}", dir.display());
            for (name, data) in model {
                assert_eq!(&fs::read(dir.join(name)).unwrap(), data, "{name}");
            }
        }
    }
    let live: HashSet<[u8; 8]> = [casfs::fs::mount_key(&mp1), casfs::fs::mount_key(&mp2)]
        .into_iter()
        .collect();
    let report = fsck(&store, false, &live).unwrap();
    assert!(report.errors.is_empty(), "{:#?}", report.errors);
    done.store(true, Ordering::SeqCst);
    eprintln!(
        "stress: {secs} s, {} file operations, {checkpoints} checkpoints, {gc_runs} prune+gc runs \
         ({freed} objects freed), {restores} restores verified ({gone} targets pruned first), \
         nothing lost",
        ops.load(Ordering::Relaxed)
    );
    assert!(checkpoints > 3 && gc_runs > 3 && restores > 0);
    Arc::try_unwrap(m1).ok().unwrap().unmount().unwrap();
    Arc::try_unwrap(m2).ok().unwrap().unmount().unwrap();
}

/// Many processes race to append on one head, round after round: exactly one wins each
/// round, every loser is told why (head moved, or lease held).
#[test]
fn many_processes_race_for_one_thread() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    ok(&store, &["init"]);
    let procs = 6;
    let rounds = 4;
    let mut expected = "none".to_string();
    for round in 0..rounds {
        let children: Vec<_> = (0..procs)
            .map(|p| {
                let dir = t.path().join(format!("d{round}-{p}"));
                fs::create_dir(&dir).unwrap();
                fs::write(dir.join("who"), format!("{round}/{p}")).unwrap();
                Command::new(casfs_bin())
                    .args(["--store", s(&store), "--json", "capture", s(&dir)])
                    .args(["-t", "race", "--expected-head", &expected])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut winners = Vec::new();
        for c in children {
            let out = c.wait_with_output().unwrap();
            if out.status.success() {
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                winners.push(v["checkpoint"]["id"].as_str().unwrap().to_string());
            } else {
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    err.contains("head") || err.contains("lease") || err.contains("held"),
                    "a loser must say why: {err}"
                );
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        expected = winners.pop().unwrap();
        assert_eq!(head(&store, "race").as_deref(), Some(expected.as_str()));
    }
    let log = json(&store, &["log", "-t", "race"]);
    assert_eq!(log.as_array().unwrap().len(), rounds);
}

/// Runs casfs with `CASFS_CRASH_AT=point`; returns whether it was killed (SIGKILL) and
/// its stdout.
fn run_crashing(store: &Path, point: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(casfs_bin())
        .arg("--store")
        .arg(store)
        .args(args)
        .env("CASFS_CRASH_AT", point)
        .env_remove("CASFS_STORE")
        .output()
        .unwrap();
    let killed = out.status.signal() == Some(libc::SIGKILL);
    assert!(
        killed || out.status.success(),
        "casfs {args:?} at {point}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (killed, String::from_utf8_lossy(&out.stdout).into_owned())
}

fn change_tree(src: &Path, seed: u64) {
    for i in 0..5u64 {
        fs::write(
            src.join(format!("f{}", (seed * 7 + i) % 200)),
            pattern(300 + i as usize * 50, seed * 100 + i),
        )
        .unwrap();
    }
    fs::write(src.join("big"), pattern((2 << 20) + 12345, seed)).unwrap();
}

/// SIGKILL at every crash point of a capture, an append, a prune, a collection and a
/// mount daemon's dirty-set writes and checkpoints, and at random moments: afterwards
/// fsck is clean, every acknowledged checkpoint restores exactly, every write that
/// returned is there, and no checkpoint is half there.
#[test]
fn sigkill_at_every_crash_point_loses_nothing_acknowledged() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    for i in 0..200u64 {
        fs::write(src.join(format!("f{i}")), pattern(200 + i as usize, i)).unwrap();
    }
    ok(&store, &["init"]);
    let mut acked: Vec<(String, BTreeMap<PathBuf, crate::common::Node>)> = Vec::new();
    let mut kills = Vec::new();
    let capture_args = ["--json", "capture", s(&src), "-t", "c"];
    let check_all = |acked: &[(String, BTreeMap<PathBuf, crate::common::Node>)]| {
        fsck_clean(&store);
        // Every checkpoint on the thread is whole (fsck read all of it); every
        // acknowledged one restores to what was captured.
        let log = json(&store, &["log", "-t", "c", "-n", "1000"]);
        let on_log: HashSet<String> = log
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect();
        for (id, snap) in acked {
            assert!(on_log.contains(id), "acknowledged {id} missing");
            assert_eq!(&restored(&store, id, t.path()), snap, "{id}");
        }
    };

    let v = json(&store, &capture_args[1..]);
    acked.push((
        v["checkpoint"]["id"].as_str().unwrap().into(),
        snapshot(&src),
    ));

    let mut seed = 1;
    for point in [
        "objects.put:1",
        "objects.put:3",
        "capture.stored",
        "append.before",
        "append.after",
    ] {
        seed += 1;
        change_tree(&src, seed);
        let before = head(&store, "c");
        let (killed, out) = run_crashing(&store, point, &capture_args);
        if killed {
            kills.push(format!("capture at {point}"));
            let after = head(&store, "c");
            if point == "append.after" {
                // Landed but never acknowledged: it must be whole.
                let id = after.clone().unwrap();
                assert_ne!(after, before);
                assert_eq!(restored(&store, &id, t.path()), snapshot(&src));
            } else {
                assert_eq!(after, before, "nothing may land before the append");
            }
        } else {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            acked.push((
                v["checkpoint"]["id"].as_str().unwrap().into(),
                snapshot(&src),
            ));
        }
        check_all(&acked);
        // The next capture works.
        let v = json(&store, &capture_args[1..]);
        acked.push((
            v["checkpoint"]["id"].as_str().unwrap().into(),
            snapshot(&src),
        ));
    }

    // Random moments.
    for k in 0..env_num("CASFS_CRASH_RANDOM", 4) {
        seed += 1;
        change_tree(&src, seed);
        for i in 0..100u64 {
            fs::write(src.join(format!("g{i}")), pattern(4000, seed * 1000 + i)).unwrap();
        }
        let mut child = Command::new(casfs_bin())
            .arg("--store")
            .arg(&store)
            .args(capture_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(3 + (k * 13) % 50));
        let _ = child.kill();
        let st = child.wait().unwrap();
        if st.signal() == Some(libc::SIGKILL) {
            kills.push(format!("capture after {} ms", 3 + (k * 13) % 50));
        }
        check_all(&acked);
    }

    // Retention and collection.
    let (killed, _) = run_crashing(&store, "prune.before", &["prune", "--keep-last", "3"]);
    assert!(killed);
    kills.push("prune before its write".into());
    check_all(&acked);
    // Each collection starts with garbage to sweep: retention keeps one fewer first.
    for (keep, point) in [("3", "gc.marked"), ("3", "gc.swept:1"), ("2", "gc.compact")] {
        ok(&store, &["prune", "--keep-last", keep]);
        let kept: HashSet<String> = json(&store, &["log", "-t", "c", "-n", "1000"])
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect();
        acked.retain(|(id, _)| kept.contains(id));
        // Garbage for certain: a capture of content no checkpoint holds, killed after
        // storing its objects and before its append (the pruned checkpoint may share
        // every object with kept ones, and the gc before may have swept the rest; a gc
        // that frees nothing never compacts).
        fs::write(
            src.join(format!("orphan-{point}")),
            pattern(9000, seed + 77),
        )
        .unwrap();
        let (killed, _) = run_crashing(&store, "capture.stored", &capture_args);
        assert!(killed, "the capture did not reach capture.stored");
        fs::remove_file(src.join(format!("orphan-{point}"))).unwrap();
        let (killed, _) = run_crashing(&store, point, &["gc"]);
        assert!(killed, "gc did not reach {point}");
        kills.push(format!("gc at {point}"));
        check_all(&acked);
    }
    ok(&store, &["gc"]);
    let report = fsck_clean(&store);
    assert_eq!(report["unreachable_objects"], 0, "{report:#}");
    check_all(&acked);

    // The mount daemon: killed at its Nth dirty-set write while a writer works.
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    let mut written: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    // With the overlay backend no write passes through the daemon: it is killed by
    // hand after n writes, and the writes after it that return must be kept as well.
    for n in [3u64, 40, 200] {
        if crate::overlay() {
            mount_with_crash(&store, &mp, None);
        } else {
            mount_with_crash(&store, &mp, Some(&format!("dirty.commit:{n}")));
        }
        let daemon = json(&store, &["status", s(&mp)])["pid"].as_i64().unwrap() as i32;
        let dir = mp.join(format!("d{n}"));
        let mut i = 0u64;
        let died = loop {
            let rel = PathBuf::from(format!("d{n}/x{i}"));
            let data = pattern(100 + (i as usize * 97) % 70_000, n * 10_000 + i);
            let r = fs::create_dir_all(&dir).and_then(|()| fs::write(mp.join(&rel), &data));
            match r {
                Ok(()) => written.push((rel, data)),
                Err(_) => break true,
            }
            i += 1;
            if crate::overlay() && i == n {
                // SAFETY: killing the daemon this test started.
                unsafe { libc::kill(daemon, libc::SIGKILL) };
                wait_daemon_gone(&store);
            }
            if i > 3000 || (crate::overlay() && i >= n + 50) {
                // The overlay serves writes without its daemon.
                break crate::overlay();
            }
        };
        assert!(died, "the daemon outlived {n} dirty-set writes");
        kills.push(format!("mount daemon at dirty-set write {n}"));
        remount(&store, &mp);
        drop_caches();
        for (rel, data) in &written {
            assert_eq!(&fs::read(mp.join(rel)).unwrap(), data, "{}", rel.display());
        }
        fsck_clean(&store);
        ok(&store, &["unmount", s(&mp)]);
        wait_daemon_gone(&store);
    }

    // The mount daemon killed inside a checkpoint, before and after its append.
    for point in ["append.before", "append.after"] {
        mount_with_crash(&store, &mp, Some(point));
        let rel = PathBuf::from(format!("ck-{point}"));
        fs::write(mp.join(&rel), point.as_bytes()).unwrap();
        written.push((rel, point.as_bytes().to_vec()));
        let before = head(&store, "mnt");
        let out = casfs(&store, &["checkpoint", s(&mp)]);
        assert!(
            !out.status.success(),
            "the daemon was to die in the checkpoint"
        );
        kills.push(format!("mount daemon checkpoint at {point}"));
        remount(&store, &mp);
        let st = json(&store, &["status", s(&mp)]);
        let now = head(&store, "mnt");
        if point == "append.after" {
            // The checkpoint landed: the remount adopts it instead of offering the same
            // work again on a moved head.
            assert_ne!(now, before);
            assert_eq!(st["dirty_files"], 0, "{st:#}");
            assert_eq!(st["base"].as_str(), now.as_deref(), "{st:#}");
        } else {
            assert_eq!(now, before);
            assert!(st["dirty_files"].as_u64().unwrap() > 0, "{st:#}");
        }
        // Either way the next checkpoint works and has every write.
        fs::write(mp.join("after-crash"), point.as_bytes()).unwrap();
        let cp = json(&store, &["checkpoint", s(&mp)]);
        let id = cp["checkpoint"].as_str().unwrap().to_string();
        for (rel, data) in &written {
            let got = ok(&store, &["cat", &id, s(rel)]);
            assert_eq!(got.as_bytes(), &data[..], "{}", rel.display());
        }
        fsck_clean(&store);
        ok(&store, &["unmount", s(&mp)]);
        wait_daemon_gone(&store);
    }
    check_all(&acked);
    eprintln!(
        "crash harness: {} SIGKILLs, nothing acknowledged lost: {}",
        kills.len(),
        kills.join(", ")
    );
}

fn mount_with_crash(store: &Path, mp: &Path, point: Option<&str>) {
    let mut c = Command::new(casfs_bin());
    c.arg("--store")
        .arg(store)
        .args(["mount", s(mp), "-t", "mnt"])
        .env_remove("CASFS_STORE");
    if let Some(p) = point {
        c.env("CASFS_CRASH_AT", p);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "mount: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// After a daemon died: detach its dead mount, wait until it let the store go, mount
/// again without a crash point.
fn remount(store: &Path, mp: &Path) {
    let c = std::ffi::CString::new(s(mp)).unwrap();
    // SAFETY: a NUL-terminated path.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    wait_daemon_gone(store);
    mount_with_crash(store, mp, None);
}

fn wait_daemon_gone(store: &Path) {
    assert!(
        wait_for(Duration::from_secs(20), || {
            fs::read_dir(store.join("mounts")).map_or(true, |rd| {
                !rd.flatten().any(|d| {
                    fs::read_to_string(d.path().join("pid"))
                        .ok()
                        .and_then(|p| p.trim().parse::<i32>().ok())
                        // SAFETY: signal 0 only checks that the process exists.
                        .is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0)
                })
            })
        }),
        "a mount daemon of {} did not exit",
        store.display()
    );
}

/// Unmounts a tmpfs when dropped.
struct TmpfsGuard(PathBuf);
impl Drop for TmpfsGuard {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(s(&self.0)).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

fn free_bytes(p: &Path) -> u64 {
    let c = std::ffi::CString::new(s(p)).unwrap();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs buffer.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

/// With the store on a small filesystem: writes in the mount fail with ENOSPC, a
/// checkpoint and a plain capture fail cleanly (head unchanged), and once space is
/// freed everything works and nothing written before is lost or damaged.
#[test]
fn a_full_store_filesystem_refuses_writes_and_recovers() {
    let t = tempfile::tempdir().unwrap();
    let small = t.path().join("small");
    fs::create_dir(&small).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=48m", "tmpfs", s(&small)])
        .status()
        .unwrap();
    assert!(st.success(), "mounting a tmpfs");
    let _tmpfs = TmpfsGuard(small.clone());
    let store = small.join("store");
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    ok(&store, &["mount", s(&mp), "-t", "full"]);

    let mut kept: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..20u64 {
        let data = pattern(10_000 + i as usize, i);
        fs::write(mp.join(format!("a{i}")), &data).unwrap();
        kept.push((format!("a{i}"), data));
    }
    let first = json(&store, &["checkpoint", s(&mp)]);
    let first = first["checkpoint"].as_str().unwrap().to_string();

    // Fill the filesystem through the mount.
    let err = {
        use std::io::Write;
        let mut f = fs::File::create(mp.join("filler")).unwrap();
        let chunk = pattern(1 << 20, 7);
        let mut written = 0u64;
        loop {
            if let Err(e) = f.write_all(&chunk).and_then(|()| f.flush()) {
                break e;
            }
            written += 1;
            assert!(written < 100, "48 MiB filesystem took 100 MiB");
        }
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    // Small writes now: each either lands whole or fails with ENOSPC.
    for i in 0..5u64 {
        let data = pattern(64 << 10, 100 + i);
        match fs::write(mp.join(format!("late{i}")), &data) {
            Ok(()) => kept.push((format!("late{i}"), data)),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}"),
        }
    }
    // A checkpoint fails cleanly: the head stays.
    let err = fails(&store, &["checkpoint", s(&mp)]);
    assert!(err.contains("no space"), "{err}");
    assert_eq!(head(&store, "full").as_deref(), Some(first.as_str()));
    // So does a plain capture into the same store (through... the daemon holds it:
    // fsck runs there and must be clean).
    fsck_clean(&store);

    // Free the space: the files stay readable, the checkpoint goes through.
    fs::remove_file(mp.join("filler")).unwrap();
    assert!(wait_for(Duration::from_secs(10), || free_bytes(&small) > 30 << 20));
    fs::write(mp.join("after"), b"space again").unwrap();
    kept.push(("after".into(), b"space again".to_vec()));
    let cp = json(&store, &["checkpoint", s(&mp)]);
    let id = cp["checkpoint"].as_str().unwrap().to_string();
    ok(&store, &["unmount", s(&mp)]);
    wait_daemon_gone(&store);

    // A plain capture too big for the filesystem fails cleanly, then fits once the
    // checkpoints it competes with are pruned and collected.
    let big = t.path().join("big");
    fs::create_dir(&big).unwrap();
    for i in 0..6u64 {
        fs::write(big.join(format!("b{i}")), random_bytes(8 << 20)).unwrap();
    }
    let err = fails(&store, &["capture", s(&big), "-t", "plain"]);
    assert!(err.contains("no space"), "{err}");
    assert_eq!(head(&store, "plain"), None);
    fsck_clean(&store);
    fs::remove_file(big.join("b5")).unwrap();
    fs::remove_file(big.join("b4")).unwrap();
    ok(&store, &["gc"]);
    let v = json(&store, &["capture", s(&big), "-t", "plain"]);
    let plain = v["checkpoint"]["id"].as_str().unwrap().to_string();
    assert_eq!(restored(&store, &plain, t.path()), snapshot(&big));

    // Nothing lost: every write that returned is in the last checkpoint.
    for (name, data) in &kept {
        let got = casfs(&store, &["cat", &id, name]);
        assert!(got.status.success(), "{name}");
        assert_eq!(&got.stdout, data, "{name}");
    }
    let report = fsck_clean(&store);
    assert!(report["leftovers"].as_array().is_some());
}

fn upper_bytes(store: &Path) -> u64 {
    fn walk(d: &Path) -> u64 {
        fs::read_dir(d).map_or(0, |rd| {
            rd.flatten()
                .map(|e| {
                    let m = e.metadata().unwrap();
                    if m.is_dir() {
                        walk(&e.path())
                    } else {
                        m.len()
                    }
                })
                .sum()
        })
    }
    fs::read_dir(store.join("mounts"))
        .unwrap()
        .flatten()
        .map(|m| walk(&m.path().join("upper")))
        .sum()
}

/// Local copies of clean files (for passthrough reads, and left by checkpoints of
/// written files) stay within the mount's limit; evicted files read from the store.
#[test]
fn local_copies_stay_within_their_limit() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..8u64)
        .map(|i| (format!("r{i}"), pattern(400 << 10, i)))
        .collect();
    for (n, d) in &files {
        fs::write(src.join(n), d).unwrap();
    }
    ok(&store, &["capture", s(&src), "-t", "lc"]);
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    ok(
        &store,
        &["mount", s(&mp), "-t", "lc", "--max-local-copies", "1"],
    );
    let limit = 1 << 20;
    for (n, d) in &files {
        assert_eq!(&fs::read(mp.join(n)).unwrap(), d);
    }
    assert!(
        wait_for(Duration::from_secs(5), || upper_bytes(&store) <= limit),
        "{} bytes of local copies after reads",
        upper_bytes(&store)
    );
    // Written files: after the checkpoint their upper files are copies too.
    let written: Vec<(String, Vec<u8>)> = (0..6u64)
        .map(|i| (format!("w{i}"), pattern(300 << 10, 100 + i)))
        .collect();
    for (n, d) in &written {
        fs::write(mp.join(n), d).unwrap();
    }
    json(&store, &["checkpoint", s(&mp)]);
    assert!(
        wait_for(Duration::from_secs(5), || upper_bytes(&store) <= limit),
        "{} bytes of local copies after a checkpoint",
        upper_bytes(&store)
    );
    drop_caches();
    for (n, d) in files.iter().chain(&written) {
        assert_eq!(&fs::read(mp.join(n)).unwrap(), d, "{n}");
    }
    ok(&store, &["unmount", s(&mp)]);
}

/// fsck names what is wrong (a corrupt object with the path that needs it, a lost upper
/// file of uncaptured work) and exits non-zero; `--repair` removes leftovers (stray
/// upper files, unreachable objects) and never what a checkpoint or a dirty file needs.
#[test]
fn fsck_names_damage_and_repair_removes_only_leftovers() {
    use casfs::cas::kv::OBJECTS_CF;
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("s");
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("keep.txt"), pattern(5000, 1)).unwrap();
    fs::write(src.join("other.txt"), pattern(7000, 2)).unwrap();
    let v = json(&store, &["capture", s(&src), "-t", "f"]);
    let id = v["checkpoint"]["id"].as_str().unwrap().to_string();
    // A mount with uncaptured work, left unmounted (its dirty set stays).
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _guard = MountGuard::new(&mp);
    // The FUSE backend's dirty set and upper files (an overlay's upper is a plain
    // directory).
    ok(&store, &["mount", s(&mp), "-t", "f", "--mode", "fuse"]);
    fs::write(mp.join("dirty.txt"), b"uncaptured work").unwrap();
    ok(&store, &["unmount", s(&mp)]);
    wait_daemon_gone(&store);
    fsck_clean(&store);

    // Leftovers only: a stray upper file and an object nothing names.
    let mdir = fs::read_dir(store.join("mounts"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    fs::write(mdir.join("upper/tmp-999"), b"half a copy").unwrap();
    {
        let st = Store::open(&store, OpenMode::MustExist, Duration::from_secs(5)).unwrap();
        st.objects().put(b"an object nothing refers to").unwrap();
        st.objects().sync().unwrap();
    }
    let r = fsck_clean(&store);
    assert_eq!(r["unreachable_objects"], 1, "{r:#}");
    assert_eq!(r["leftovers"].as_array().unwrap().len(), 1, "{r:#}");
    let r = json(&store, &["fsck", "--repair"]);
    assert_eq!(r["repaired"].as_array().unwrap().len(), 2, "{r:#}");
    let r = fsck_clean(&store);
    assert_eq!(
        (r["unreachable_objects"].clone(), r["leftovers"].clone()),
        (serde_json::json!(0), serde_json::json!([])),
        "{r:#}"
    );
    assert!(!mdir.join("upper/tmp-999").exists());

    // Damage: a flipped byte in a checkpoint's file, a lost upper file.
    let keep_id = {
        let st = Store::open(&store, OpenMode::MustExist, Duration::from_secs(5)).unwrap();
        let cp = st.checkpoints().get(&id.parse().unwrap()).unwrap();
        let tree = casfs::cas::load_tree(st.objects(), &cp.body.root).unwrap();
        let e = tree.get(b"keep.txt").unwrap();
        let fid = e.file_ref().unwrap().id.0;
        let db = st.database();
        let col = db.column(OBJECTS_CF);
        let mut raw = col.get(fid.as_bytes()).unwrap().unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 0x20;
        col.put(fid.as_bytes(), &raw, true).unwrap();
        col.flush().unwrap();
        fid.to_hex()
    };
    let uppers: Vec<PathBuf> = {
        let mut v = Vec::new();
        for d in fs::read_dir(mdir.join("upper")).unwrap().flatten() {
            if d.path().is_dir() {
                v.extend(fs::read_dir(d.path()).unwrap().flatten().map(|f| f.path()));
            }
        }
        v
    };
    assert_eq!(uppers.len(), 1, "{uppers:?}");
    fs::remove_file(&uppers[0]).unwrap();
    let out = casfs(&store, &["--json", "fsck", "--repair"]);
    assert!(!out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let errors: Vec<String> = r["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains(&keep_id) && e.contains("keep.txt") && e.contains("integrity")),
        "{errors:#?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("upper file") && e.contains("missing")),
        "{errors:#?}"
    );
    // Nothing needed was deleted: the record, the other file, the dirty set.
    assert_eq!(
        ok(&store, &["cat", &id, "other.txt"]).as_bytes(),
        &pattern(7000, 2)[..]
    );
    let err = fails(&store, &["cat", &id, "keep.txt"]);
    assert!(err.contains(&keep_id), "{err}");
    let st = Store::open(&store, OpenMode::MustExist, Duration::from_secs(5)).unwrap();
    let key = fs::read_dir(store.join("mounts"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let key = casfs::cas::decode_hex(key.to_str().unwrap()).unwrap();
    let d = casfs::fs::dirty::DirtyStore::new(st.database().clone(), key.try_into().unwrap());
    assert!(d.nodes().unwrap().iter().any(|(_, n)| n.upper));
}
