//! Fleet backends: the same CheckpointStore and ObjectStore contract tests on the
//! embedded RocksDB store and on PostgreSQL + S3 (moto), and two hosts (two stores with
//! their own local caches) sharing PostgreSQL and S3.
//!
//! Needs the services `scripts/services.sh` starts (scripts/test.sh sources it):
//! `CASFS_TEST_PG`, `CASFS_TEST_S3` and the AWS_* variables.

#[path = "common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use casfs::cas::{Hash, ObjectId, ObjectStore, TreeId};
use casfs::checkpoint::{
    capture_to_thread, restore_tree, AppendOptions, Backends, CaptureOptions, CheckpointError,
    CheckpointStore, ExpectedHead, NewCheckpoint, OpenMode, RestoreOptions, Store, ThreadId,
};

use casfs::middleware::portable::PortableStores;
use common::{pattern, snapshot};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests through scripts/test.sh, or source scripts/services.sh first")
    })
}

/// A fresh namespace per call: a PostgreSQL schema and an S3 prefix of their own.
fn fleet() -> Backends {
    let tag =
        Hash::of(format!("{:?}-{}", std::time::SystemTime::now(), std::process::id()).as_bytes())
            .to_hex()[..12]
            .to_string();
    Backends {
        checkpoints: Some(format!("{}?schema=t_{tag}", env("CASFS_TEST_PG"))),
        objects: Some(format!("{}/t-{tag}", env("CASFS_TEST_S3"))),
    }
}

fn open(dir: &Path, b: &Backends) -> Store {
    Store::open_with(dir, OpenMode::Create, Duration::from_secs(5), b).unwrap()
}

fn thread(name: &str) -> ThreadId {
    ThreadId::new(name).unwrap()
}

fn new_cp(t: &ThreadId, n: u8) -> NewCheckpoint {
    NewCheckpoint::new(t.clone(), TreeId(Hash::of(&[n])), format!("cp {n}"))
}

/// A portable checkpoint record of the framework's shape.
fn portable_cp(id: &str, parent: Option<&str>, n: u8) -> serde_json::Value {
    serde_json::json!({
        "id": id, "threadId": "t", "parentCheckpointId": parent, "createdAt": n,
        "reason": "automatic",
        "files": [{"path": format!("f{n}"), "kind": "file",
                   "blobKey": format!("sandbox-files/sha256/{}", Hash::of(&[n]).to_hex()), "size": 1}],
        "conversation": [{"role": "user", "content": format!("m{n}")}], "artifacts": [],
    })
}

/// The portable stores' rules, run on every backend: compare-and-swap, the check order,
/// fences, takeover by an injected clock, forks, names kept apart.
fn portable_store_contract(st: &casfs::middleware::portable::PortableStores) {
    use casfs::middleware::portable::{Clock, PortableError as P, StoreOptions, Writer};
    let opts = StoreOptions {
        lease_duration_ms: 1000.0,
        renew_after_ms: 300.0,
        clock: Clock::Client,
    };
    assert!(matches!(
        st.open("s1", Some(opts), false),
        Err(P::Invalid(_))
    ));
    st.open("s1", Some(opts), true).unwrap();
    assert!(matches!(st.open("s1", None, true), Ok(o) if o == opts));
    let other = StoreOptions {
        clock: Clock::Server,
        ..opts
    };
    assert!(matches!(
        st.open("s1", Some(other), true),
        Err(P::StoreExists(_))
    ));
    let g = st.acquire("s1", "t", Some(1000.0)).unwrap();
    assert_eq!((g.fence, g.expires_at), (1, 2000.0));
    assert!(matches!(
        st.acquire("s1", "t", Some(1999.0)),
        Err(P::WriterConflict(_))
    ));
    assert!(matches!(st.acquire("s1", "t", None), Err(P::Invalid(_))));
    let w = Writer {
        thread_id: "t".into(),
        owner_token: g.owner_token.clone(),
        fence: g.fence,
    };
    let root = portable_cp("root", None, 1);
    assert_eq!(
        st.append("s1", &root, None, &w, Some(1500.0)).unwrap(),
        "root"
    );
    assert!(matches!(
        st.append(
            "s1",
            &portable_cp("root", Some("x"), 2),
            Some("x"),
            &w,
            Some(1500.0)
        ),
        Err(P::DuplicateId(_))
    ));
    assert!(matches!(
        st.append("s1", &portable_cp("b", None, 2), None, &w, Some(1500.0)),
        Err(P::StaleHead(_))
    ));
    assert!(matches!(
        st.append(
            "s1",
            &portable_cp("b", None, 2),
            Some("root"),
            &w,
            Some(1500.0)
        ),
        Err(P::ParentMismatch(_))
    ));
    let forged = Writer {
        owner_token: "0".repeat(64),
        ..w.clone()
    };
    assert!(matches!(
        st.append(
            "s1",
            &portable_cp("b", Some("root"), 2),
            Some("root"),
            &forged,
            Some(1500.0)
        ),
        Err(P::WriterLost(_))
    ));
    // Expired by the stated clock: a takeover, and the old writer is lost.
    let g2 = st.acquire("s1", "t", Some(2001.0)).unwrap();
    assert!(g2.fence > g.fence);
    assert!(matches!(
        st.append(
            "s1",
            &portable_cp("b", Some("root"), 2),
            Some("root"),
            &w,
            Some(2001.0)
        ),
        Err(P::WriterLost(_))
    ));
    st.release("s1", &w).unwrap();
    assert!(matches!(
        st.acquire("s1", "t", Some(2002.0)),
        Err(P::WriterConflict(_))
    ));
    assert_eq!(st.head("s1", "t").unwrap().as_deref(), Some("root"));
    assert_eq!(st.get("s1", "root").unwrap().unwrap(), root);
    assert_eq!(st.blob_references("s1").unwrap().len(), 1);
    // Another name shares nothing.
    st.open("s2", None, false).unwrap();
    assert_eq!(st.head("s2", "t").unwrap(), None);
    assert!(st.blob_references("s2").unwrap().is_empty());
    assert!(matches!(st.head("nope", "t"), Err(P::NoStore(_))));
    // A fork: the root of another thread with the checkpoint's transcript.
    let dg = st.acquire("s1", "dest", Some(2002.0)).unwrap();
    let fork: casfs::middleware::portable::ForkInput = serde_json::from_value(serde_json::json!({
        "source_thread_id": "t", "source_checkpoint_id": "root", "destination_thread_id": "dest",
        "destination_checkpoint_id": "fork-root", "created_at": 9,
        "writer": {"thread_id": "dest", "owner_token": dg.owner_token, "fence": dg.fence},
    }))
    .unwrap();
    let f = st.fork("s1", &fork, Some(2003.0)).unwrap();
    assert_eq!(f["reason"], "fork-root");
    assert_eq!(
        st.messages("s1", "dest").unwrap().unwrap(),
        root["conversation"]
    );
    assert!(matches!(
        st.fork("s1", &fork, Some(2003.0)),
        Err(P::ForkDestinationNotEmpty(_))
    ));
    assert_eq!(st.blob_references("s1").unwrap()[0].1, 2);
}

/// The CheckpointStore contract, run on every backend.
fn checkpoint_store_contract(cps: &dyn CheckpointStore) {
    let t = thread("contract");
    let ttl = Duration::from_secs(30);
    // Leases: exclusive, tokens only grow, release lets the next writer in.
    let a = cps.acquire_writer(&t, "a", ttl).unwrap();
    match cps.acquire_writer(&t, "b", ttl) {
        Err(CheckpointError::LeaseHeld { holder, .. }) => assert_eq!(holder, "a"),
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    let a = cps.renew(&a).unwrap();
    // Appends: the head moves by compare-and-swap.
    let c1 = cps.append(new_cp(&t, 1), None, &a).unwrap();
    assert_eq!(cps.head(&t).unwrap(), Some(c1.id));
    match cps.append(new_cp(&t, 2), None, &a) {
        Err(CheckpointError::HeadMismatch {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (None, Some(c1.id))),
        other => panic!("expected HeadMismatch, got {other:?}"),
    }
    let c2 = cps.append(new_cp(&t, 2), Some(c1.id), &a).unwrap();
    assert_eq!(c2.body.parent_id, Some(c1.id));
    cps.release(&a).unwrap();
    let b = cps.acquire_writer(&t, "b", ttl).unwrap();
    assert!(b.token > a.token);
    // The released lease cannot append or renew: another writer has the thread.
    assert!(matches!(
        cps.append(new_cp(&t, 3), Some(c2.id), &a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    assert!(matches!(
        cps.renew(&a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    cps.release(&b).unwrap();
    // An expired lease cannot append, and another writer may take the thread.
    let short = cps
        .acquire_writer(&t, "short", Duration::from_millis(300))
        .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert!(matches!(
        cps.append(new_cp(&t, 4), Some(c2.id), &short),
        Err(CheckpointError::LeaseExpired { .. })
    ));
    let c = cps.acquire_writer(&t, "c", ttl).unwrap();
    assert!(c.token > short.token);
    let c3 = cps.append(new_cp(&t, 5), Some(c2.id), &c).unwrap();
    cps.release(&c).unwrap();
    // Reads: get, log, threads, prefixes, fork.
    assert_eq!(cps.get(&c3.id).unwrap(), c3);
    let log: Vec<_> = cps.log(&t, 10).unwrap().iter().map(|c| c.id).collect();
    assert_eq!(log, vec![c3.id, c2.id, c1.id]);
    assert_eq!(cps.resolve_prefix(&c3.id.to_hex()[..10]).unwrap(), c3.id);
    assert!(matches!(
        cps.get(&casfs::checkpoint::CheckpointId(Hash::of(b"none"))),
        Err(CheckpointError::NotFound(_))
    ));
    let f = cps.fork(&thread("contract-fork"), &c2.id).unwrap();
    assert_eq!((f.body.parent_id, f.body.root), (Some(c2.id), c2.body.root));
    assert!(matches!(
        cps.fork(&thread("contract-fork"), &c2.id),
        Err(CheckpointError::ThreadExists(_))
    ));
    let threads = cps.threads().unwrap();
    assert!(threads.contains(&(t.clone(), c3.id)));
    assert!(threads.contains(&(thread("contract-fork"), f.id)));
}

/// The ObjectStore contract, run on every backend.
fn object_store_contract(objects: &dyn ObjectStore) {
    let data = pattern(100_000, 7);
    let a = objects.put(&data).unwrap();
    assert!(a.new);
    assert!(!objects.put(&data).unwrap().new, "deduplicated");
    objects.sync().unwrap();
    assert_eq!(objects.get(&a.id, "blob").unwrap(), data);
    assert!(objects.contains(&a.id).unwrap());
    let missing = ObjectId(Hash::of(b"missing"));
    assert!(!objects.contains(&missing).unwrap());
    assert!(matches!(
        objects.get(&missing, "blob"),
        Err(casfs::cas::CasError::NotFound { .. })
    ));
}

#[test]
fn the_embedded_store_meets_the_contracts() {
    let t = tempfile::tempdir().unwrap();
    let store = open(&t.path().join("s"), &Backends::default());
    checkpoint_store_contract(store.checkpoints());
    object_store_contract(store.objects());
    portable_store_contract(&PortableStores::of(&store));
    // What a portable store holds outlives the process that wrote it.
    drop(store);
    let again = open(&t.path().join("s"), &Backends::default());
    assert_eq!(
        PortableStores::of(&again)
            .head("s1", "t")
            .unwrap()
            .as_deref(),
        Some("root")
    );
}

#[test]
fn postgresql_and_s3_meet_the_contracts() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let store = open(&t.path().join("s"), &b);
    checkpoint_store_contract(store.checkpoints());
    object_store_contract(store.objects());
    portable_store_contract(&PortableStores::of(&store));
    // Two hosts race for one portable thread: one lease, one append.
    let hosts = [
        PortableStores::of(&store),
        PortableStores::of(&open(&t.path().join("racer"), &b)),
    ];
    hosts[0].open("race", None, false).unwrap();
    let won: Vec<bool> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let st = hosts[i % 2].clone();
                sc.spawn(move || st.acquire("race", "t", None).is_ok())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
    // A second host (its own empty cache) reads the object from S3, verified.
    let other = open(&t.path().join("other"), &b);
    let data = pattern(100_000, 7);
    let id = ObjectId(Hash::of(&data));
    assert_eq!(other.objects().get(&id, "blob").unwrap(), data);
    assert_eq!(other.remote().unwrap().stats().fetched_objects, 1);
}

fn write_tree(dir: &Path, seed: u64) {
    std::fs::create_dir_all(dir.join("src/deep")).unwrap();
    for i in 0..40u64 {
        std::fs::write(
            dir.join(format!("src/f{i}.rs")),
            pattern(200 + i as usize * 31, seed * 1000 + i),
        )
        .unwrap();
    }
    std::fs::write(dir.join("src/deep/big.bin"), pattern(3 << 20, seed)).unwrap();
    std::os::unix::fs::symlink("deep/big.bin", dir.join("src/link")).unwrap_or(());
}

fn append_opts(t: &ThreadId, expected: ExpectedHead) -> AppendOptions {
    AppendOptions {
        thread: t.clone(),
        reason: "run".into(),
        expected,
        holder: casfs::checkpoint::holder_name("test"),
        lease_ttl: Duration::from_secs(30),
    }
}

/// Captures `dir` on `store` and appends it to thread `th` on its current head.
fn capture_on_head(store: &Store, dir: &Path, th: &ThreadId) -> casfs::checkpoint::Checkpoint {
    let opts = append_opts(th, ExpectedHead::Current);
    capture_to_thread(store, dir, &CaptureOptions::default(), &opts)
        .unwrap()
        .0
}

/// Host A runs, checkpoints and releases; host B (its own cache) restores the head and
/// sees every byte; both race to append on one thread and exactly one wins each round;
/// a host paused past its lease's TTL is refused by fencing when it wakes.
#[test]
fn two_hosts_share_postgresql_and_s3() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let host_a = Arc::new(open(&t.path().join("host-a"), &b));
    let host_b = Arc::new(open(&t.path().join("host-b"), &b));
    let th = thread("shared");
    let work_a = t.path().join("work-a");
    write_tree(&work_a, 1);

    // A: capture and append (lease taken and released by capture_to_thread).
    let cp1 = capture_on_head(&host_a, &work_a, &th);
    let up1 = host_a.remote().unwrap().stats();
    assert!(up1.uploaded_objects > 40, "{up1:?}");

    // B: restores the head it reads from PostgreSQL, objects from S3.
    let head = host_b.checkpoints().head(&th).unwrap().unwrap();
    assert_eq!(head, cp1.id);
    let root = host_b.checkpoints().get(&head).unwrap().body.root;
    let out_b = t.path().join("restored-b");
    restore_tree(&host_b, root, &out_b, &RestoreOptions::default()).unwrap();
    assert_eq!(snapshot(&out_b), snapshot(&work_a));
    assert!(host_b.remote().unwrap().stats().fetched_objects > 40);

    // A second checkpoint of one changed file uploads only what changed.
    std::fs::write(work_a.join("src/f3.rs"), b"changed\n").unwrap();
    capture_on_head(&host_a, &work_a, &th);
    let up2 = host_a.remote().unwrap().stats();
    let objects = up2.uploaded_objects - up1.uploaded_objects;
    let bytes = up2.uploaded_bytes - up1.uploaded_bytes;
    // The file, its directory's tree and the root tree.
    assert_eq!(objects, 3, "{up1:?} -> {up2:?}");
    assert!(
        bytes < 8 << 10,
        "{bytes} bytes uploaded for one changed file"
    );

    // Both race to append on the head they read: exactly one wins each round.
    for round in 0..4u64 {
        let head = host_a.checkpoints().head(&th).unwrap();
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = [host_a.clone(), host_b.clone()]
            .into_iter()
            .enumerate()
            .map(|(i, host)| {
                let (barrier, th) = (barrier.clone(), th.clone());
                let dir = t.path().join(format!("race-{round}-{i}"));
                write_tree(&dir, 100 + round * 2 + i as u64);
                std::thread::spawn(move || {
                    barrier.wait();
                    capture_to_thread(
                        &host,
                        &dir,
                        &CaptureOptions::default(),
                        &append_opts(&th, ExpectedHead::Exactly(head)),
                    )
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let wins = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "round {round}: {results:?}");
        for r in &results {
            if let Err(e) = r {
                assert!(
                    matches!(
                        e,
                        CheckpointError::LeaseHeld { .. } | CheckpointError::HeadMismatch { .. }
                    ),
                    "the loser is told why: {e}"
                );
            }
        }
    }

    // A takes the lease and is paused past its TTL; B takes over and appends; A wakes
    // and is refused by fencing.
    let cps_a = host_a.checkpoints();
    let cps_b = host_b.checkpoints();
    let lease_a = cps_a
        .acquire_writer(&th, "host-a", Duration::from_millis(500))
        .unwrap();
    let head = cps_a.head(&th).unwrap();
    std::thread::sleep(Duration::from_millis(900));
    let lease_b = cps_b
        .acquire_writer(&th, "host-b", Duration::from_secs(30))
        .unwrap();
    assert!(lease_b.token > lease_a.token);
    let root = cps_b.get(&head.unwrap()).unwrap().body.root;
    let mut new = NewCheckpoint::new(th.clone(), root, "b after takeover");
    new.source_run_id = Some("b".into());
    let cp_b = cps_b.append(new, head, &lease_b).unwrap();
    let late = cps_a.append(
        NewCheckpoint::new(th.clone(), root, "a, late"),
        head,
        &lease_a,
    );
    assert!(
        matches!(late, Err(CheckpointError::LeaseLost { .. })),
        "{late:?}"
    );
    assert!(matches!(
        cps_a.renew(&lease_a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    cps_b.release(&lease_b).unwrap();
    assert_eq!(cps_a.head(&th).unwrap(), Some(cp_b.id));
}

/// The bucket itself, for tests that look at or damage what casfs wrote, and the
/// prefix of the store in it.
fn bucket(b: &Backends) -> (object_store::aws::AmazonS3, String) {
    let url = b.objects.as_ref().unwrap();
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_url(url)
        .build()
        .unwrap();
    let prefix = url::Url::parse(url)
        .unwrap()
        .path()
        .trim_matches('/')
        .to_string();
    (s3, prefix)
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// The keys under `<prefix>/<dir>/`.
fn keys(b: &Backends, dir: &str) -> Vec<object_store::path::Path> {
    use futures::TryStreamExt;
    use object_store::ObjectStore as _;
    let (s3, prefix) = bucket(b);
    let at = object_store::path::Path::from(format!("{prefix}/{dir}"));
    block_on(async {
        s3.list(Some(&at))
            .map_ok(|m| m.location)
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
    })
}

/// A fresh host restores a tree from S3 with its contents staged in groups (a group of
/// 1 MiB here): directories larger than a group are split into groups of their own
/// entries, a file larger than a group is read on its own, content two files share
/// comes once; every byte, mode and link comes back, staged contents are written
/// straight into the files (the host's local store does not keep them), and the reads
/// go by the pack, neighbours together.
#[test]
fn a_restore_from_s3_stages_contents_in_groups() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    let work = t.path().join("work");
    for (dir, n) in [("a", 30u64), ("b/x", 20), ("b/y", 20), ("c", 3)] {
        std::fs::create_dir_all(work.join(dir)).unwrap();
        for i in 0..n {
            let p = work.join(dir).join(format!("f{i}"));
            std::fs::write(&p, pattern(40_000 + i as usize, n * 100 + i)).unwrap();
        }
    }
    // The same content in two groups, an empty file, a large file, a link, a mode.
    std::fs::copy(work.join("a/f3"), work.join("b/y/same")).unwrap();
    std::fs::write(work.join("c/empty"), b"").unwrap();
    std::fs::write(work.join("big.bin"), pattern(3 << 20, 5)).unwrap();
    std::os::unix::fs::symlink("a/f1", work.join("link")).unwrap();
    std::fs::set_permissions(
        work.join("c/f1"),
        std::os::unix::fs::PermissionsExt::from_mode(0o751),
    )
    .unwrap();
    // Old mtimes, so that the second restore below can trust what the first wrote.
    let old = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    for (p, _) in snapshot(&work) {
        let p = work.join(p);
        if std::fs::symlink_metadata(&p).unwrap().is_file() {
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(old)
                .unwrap();
        }
    }
    let th = thread("staged");
    let cp = capture_on_head(&a, &work, &th);

    let fresh = open(&t.path().join("fresh"), &b);
    let out = t.path().join("out");
    let opts = RestoreOptions {
        stage_bytes: Some(1 << 20),
        ..Default::default()
    };
    let st = restore_tree(&fresh, cp.body.root, &out, &opts).unwrap();
    assert_eq!(snapshot(&out), snapshot(&work));
    assert_eq!(st.files_written, 30 + 20 + 21 + 4 + 1, "{st:?}");
    let small = ObjectId(Hash::of(&std::fs::read(work.join("b/x/f7")).unwrap()));
    assert!(!fresh.local_objects().contains(&small).unwrap());
    let r = fresh.remote().unwrap().stats();
    // One listing, one index, trees in one or two reads, contents in a few per group.
    assert_eq!((r.requests.list, r.requests.get), (1, 1), "{r:?}");
    assert!(r.requests.ranged_get <= 16, "{r:?}");
    // The same restore again over what it wrote: nothing to fetch, nothing written.
    let before = fresh.remote().unwrap().stats();
    let again = restore_tree(&fresh, cp.body.root, &out, &opts).unwrap();
    assert_eq!(again.files_written, 0, "{again:?}");
    assert_eq!(snapshot(&out), snapshot(&work));
    let r = fresh.remote().unwrap().stats().since(&before);
    assert_eq!(r.fetched_objects, 0, "{r:?}");
    // One file gone, one changed: only their contents are fetched.
    std::fs::remove_file(out.join("b/x/f7")).unwrap();
    std::fs::write(out.join("a/f2"), b"changed").unwrap();
    let before = fresh.remote().unwrap().stats();
    let st = restore_tree(&fresh, cp.body.root, &out, &opts).unwrap();
    assert_eq!(st.files_written, 2, "{st:?}");
    assert_eq!(snapshot(&out), snapshot(&work));
    let r = fresh.remote().unwrap().stats().since(&before);
    assert_eq!(r.fetched_objects, 2, "{r:?}");
}

/// A restore whose staged group meets a damaged object stops with an integrity error
/// naming the object and the pack; no file holds anything but its checkpoint's bytes.
#[test]
fn a_damaged_pack_stops_a_staged_restore_by_name() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    let work = t.path().join("work");
    std::fs::create_dir_all(work.join("a")).unwrap();
    for i in 0..10u64 {
        std::fs::write(
            work.join(format!("a/f{i}")),
            pattern(40_000 + i as usize, 70 + i),
        )
        .unwrap();
    }
    let th = thread("damaged");
    let cp = capture_on_head(&a, &work, &th);
    let (s3, _) = bucket(&b);
    let packs = keys(&b, "packs");
    let sized: Vec<(object_store::path::Path, Vec<u8>)> = block_on(async {
        use object_store::ObjectStore as _;
        let mut out = Vec::new();
        for k in &packs {
            out.push((
                k.clone(),
                s3.get(k).await.unwrap().bytes().await.unwrap().to_vec(),
            ));
        }
        out
    });
    let (data_pack, mut bytes) = sized.into_iter().max_by_key(|(_, b)| b.len()).unwrap();
    bytes[100] ^= 0x40;
    block_on(async {
        use object_store::ObjectStore as _;
        s3.put(&data_pack, bytes.into()).await.unwrap();
    });
    let fresh = open(&t.path().join("fresh"), &b);
    let out = t.path().join("out");
    let err = restore_tree(&fresh, cp.body.root, &out, &RestoreOptions::default()).unwrap_err();
    let msg = err.to_string();
    // It names the file whose object starts the pack (the byte flipped is in it).
    let damaged = (0..10)
        .find(|i| {
            let id = Hash::of(&std::fs::read(work.join(format!("a/f{i}"))).unwrap());
            msg.contains(&id.to_hex())
        })
        .unwrap_or_else(|| panic!("names a file's object: {msg}"));
    assert!(
        msg.contains(data_pack.filename().unwrap()),
        "names the pack: {msg}"
    );
    for i in 0..10 {
        let got = out.join(format!("a/f{i}"));
        if got.exists() {
            assert_eq!(
                std::fs::read(&got).unwrap(),
                std::fs::read(work.join(format!("a/f{i}"))).unwrap(),
                "a/f{i}"
            );
        }
    }
    assert!(!out.join(format!("a/f{damaged}")).exists());
}

/// A damaged pack in S3 is an integrity error on the host that reads from it, naming
/// the object and the pack, and nothing wrong is kept in its cache; the objects of the
/// pack that are intact still read.
#[test]
fn a_damaged_pack_is_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    let first = pattern(50_000, 3);
    let second = pattern(70_000, 4);
    let id1 = a.objects().put(&first).unwrap().id;
    let id2 = a.objects().put(&second).unwrap().id;
    a.objects().sync().unwrap();
    let packs = keys(&b, "packs");
    assert_eq!(packs.len(), 1, "both objects in one pack: {packs:?}");
    assert_eq!(keys(&b, "index").len(), 1);
    // Flip one byte of the first object (it was put first: it starts the pack).
    let (s3, _) = bucket(&b);
    block_on(async {
        use object_store::ObjectStore as _;
        let mut bytes = s3
            .get(&packs[0])
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        bytes[100] ^= 0x40;
        s3.put(&packs[0], bytes.into()).await.unwrap();
    });
    let host_b = open(&t.path().join("b"), &b);
    let err = host_b.objects().get(&id1, "blob").unwrap_err();
    assert!(err.is_integrity(), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&id1.to_hex()), "names the object: {msg}");
    let pack_name = packs[0].filename().unwrap();
    assert!(msg.contains(pack_name), "names the pack: {msg}");
    assert!(!host_b.local_objects().contains(&id1).unwrap());
    // A restore's staging leaves the damaged object out (its read names it) and stages
    // the intact neighbour, in memory only.
    let staged = host_b.objects().stage(&[id1, id2]);
    assert_eq!(staged.len(), 1);
    let reader = casfs::cas::StagedReader::new(&staged, host_b.objects());
    assert_eq!(reader.get(&id2, "blob").unwrap(), second);
    assert!(reader.get(&id1, "blob").unwrap_err().is_integrity());
    assert!(!host_b.local_objects().contains(&id2).unwrap());
    // A prefetch keeps nothing damaged either, and the intact neighbour reads.
    host_b.objects().prefetch(&[id1, id2]);
    assert!(!host_b.local_objects().contains(&id1).unwrap());
    assert_eq!(host_b.objects().get(&id2, "blob").unwrap(), second);
    // A damaged index is refused by name too.
    let idx = keys(&b, "index");
    block_on(async {
        use object_store::ObjectStore as _;
        s3.put(&idx[0], b"casfsidx\x01garbage".to_vec().into())
            .await
            .unwrap();
    });
    let host_c = open(&t.path().join("c"), &b);
    let err = host_c.objects().get(&id2, "blob").unwrap_err().to_string();
    assert!(err.contains(idx[0].filename().unwrap()), "{err}");
}

/// A first upload makes one request per pack plus a constant; a host that never saw
/// the store learns where everything is from one listing and one index.
#[test]
fn uploads_and_reads_go_by_the_pack() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    a.remote().unwrap().set_pack_size(1 << 20).unwrap();
    let mut ids = Vec::new();
    // 600 objects of 5-15 KB (about 3.6 MB stored): packs of 1 MiB.
    for i in 0..600u64 {
        let data = pattern(5_000 + (i as usize % 11) * 1_000, 9_000 + i);
        ids.push((a.objects().put(&data).unwrap().id, data));
    }
    let before = a.remote().unwrap().stats();
    a.objects().sync().unwrap();
    let up = a.remote().unwrap().stats().since(&before);
    assert_eq!(up.uploaded_objects, 600, "{up:?}");
    // Each pack but the last holds at least 1 MiB.
    assert!(up.uploaded_packs >= 3, "{up:?}");
    assert!(
        up.uploaded_packs <= up.uploaded_bytes.div_ceil(1 << 20),
        "{up:?}"
    );
    // One listing, the packs, one index.
    assert_eq!(up.requests.list, 1, "{up:?}");
    assert_eq!(up.requests.put, up.uploaded_packs + 1, "{up:?}");
    assert_eq!(up.requests.head + up.requests.get, 0, "{up:?}");
    // Nothing new: the sync lists the indexes (gc may have marked a pack since) and
    // uploads nothing.
    let before = a.remote().unwrap().stats();
    a.objects().put(&ids[0].1).unwrap();
    a.objects().sync().unwrap();
    let again = a.remote().unwrap().stats().since(&before).requests;
    assert_eq!((again.list, again.total()), (1, 1), "{again:?}");

    // A fresh host: a prefetch of everything is one listing, one index and a few
    // ranged reads, and every object verifies.
    let c = open(&t.path().join("c"), &b);
    let all: Vec<casfs::cas::ObjectId> = ids.iter().map(|(id, _)| *id).collect();
    c.objects().prefetch(&all);
    let r = c.remote().unwrap().stats();
    assert_eq!(r.fetched_objects, 600, "{r:?}");
    assert_eq!((r.requests.list, r.requests.get), (1, 1), "{r:?}");
    assert!(r.requests.ranged_get <= 12, "{r:?}");
    for (id, data) in &ids {
        assert_eq!(&c.local_objects().get(id, "blob").unwrap(), data);
    }
    // One lazy read on another fresh host: one listing, one index, one ranged GET.
    let d = open(&t.path().join("d"), &b);
    assert_eq!(d.objects().get(&ids[321].0, "blob").unwrap(), ids[321].1);
    let r = d.remote().unwrap().stats().requests;
    assert_eq!((r.list, r.get, r.ranged_get), (1, 1, 1), "{r:?}");
    // Its indexes are kept: a restart lists again but reads no index.
    drop(d);
    let d = open(&t.path().join("d"), &b);
    assert_eq!(d.objects().get(&ids[17].0, "blob").unwrap(), ids[17].1);
    let r = d.remote().unwrap().stats().requests;
    assert_eq!((r.list, r.get, r.ranged_get), (1, 0, 1), "{r:?}");
}

/// File contents are packed as they are put; a pack holding an object the remote has
/// already is not sent as it is: its other objects are read back and packed anew, and
/// nothing is uploaded twice or lost.
#[test]
fn packs_filled_at_put_time_leave_out_what_the_remote_has() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let obj = |i: u64| pattern(6_000 + (i as usize % 7) * 500, 77_000 + i);
    let a = open(&t.path().join("a"), &b);
    a.remote().unwrap().set_pack_size(256 << 10).unwrap();
    // Host A uploads every third object.
    for i in (0..300u64).step_by(3) {
        a.objects().put(&obj(i)).unwrap();
    }
    a.objects().sync().unwrap();
    // Host B puts all of them: some packs hold objects A uploaded, some do not.
    let host_b = open(&t.path().join("b"), &b);
    host_b.remote().unwrap().set_pack_size(256 << 10).unwrap();
    let mut ids = Vec::new();
    for i in 0..300u64 {
        ids.push(host_b.objects().put(&obj(i)).unwrap().id);
    }
    // And a run of objects only B has, filling packs of their own.
    for i in 1_000..1_150u64 {
        ids.push(host_b.objects().put(&obj(i)).unwrap().id);
    }
    host_b.objects().sync().unwrap();
    let up = host_b.remote().unwrap().stats();
    assert_eq!(up.uploaded_objects, 200 + 150, "{up:?}");
    // A fresh host reads every object.
    let c = open(&t.path().join("c"), &b);
    for (n, id) in ids.iter().enumerate() {
        let i = if n < 300 { n as u64 } else { 700 + n as u64 };
        assert_eq!(c.objects().get(id, "blob").unwrap(), obj(i), "object {n}");
    }
    assert_eq!(c.remote().unwrap().stats().fetched_objects, 450);
}

fn gc(store: &Store, grace: Duration) -> casfs::cas::remote_store::RemoteGcReport {
    let o = casfs::cas::remote_store::RemoteGcOptions {
        grace,
        max_unused: 0.1,
        dry_run: false,
    };
    casfs::checkpoint::maintenance::gc_with(store, &o)
        .unwrap()
        .remote
        .unwrap()
}

/// Packs only garbage is in are marked and, a grace period later, deleted; a pack with
/// mostly garbage has its live objects copied out first; young packs are left alone;
/// what every checkpoint needs still restores on a fresh host, and the garbage is gone.
#[test]
fn gc_deletes_dead_packs_and_copies_live_objects_out_of_wasteful_ones() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    let th = thread("gc");
    // Garbage on its own (one pack), then garbage in the same pack as a checkpoint's
    // files (the capture's sync uploads both).
    let mut garbage = Vec::new();
    for i in 0..30u64 {
        garbage.push(a.objects().put(&pattern(20_000, 50_000 + i)).unwrap().id);
    }
    a.objects().sync().unwrap();
    for i in 30..60u64 {
        garbage.push(a.objects().put(&pattern(20_000, 50_000 + i)).unwrap().id);
    }
    let work = t.path().join("work");
    write_tree(&work, 7);
    let cp = capture_on_head(&a, &work, &th);
    // The garbage's pack, the capture's files with the rest of the garbage, and the
    // capture's trees in a metadata pack of their own.
    let packs_before = keys(&b, "packs");
    assert_eq!(packs_before.len(), 3, "{packs_before:?}");

    // Within the grace period nothing is touched.
    let r = gc(&a, Duration::from_secs(3600));
    assert_eq!(
        (r.packs, r.packs_marked, r.packs_deleted, r.objects_copied),
        (3, 0, 0, 0),
        "{r:?}"
    );
    assert_eq!(keys(&b, "packs").len(), 3);

    // Grace over: the two packs with garbage are marked; the mixed one's live objects
    // are copied out; the trees' pack, all live, stays as it is.
    let r = gc(&a, Duration::ZERO);
    assert_eq!((r.packs_marked, r.packs_deleted), (2, 0), "{r:?}");
    assert!(r.objects_copied > 30, "{r:?}");
    assert_eq!(r.packs_written, 1, "{r:?}");
    assert_eq!(keys(&b, "packs").len(), 4);
    assert_eq!(keys(&b, "index").len(), 1, "one index replaces the two");
    // The next run deletes the marked packs.
    let r = gc(&a, Duration::ZERO);
    assert_eq!((r.packs_deleted, r.packs_kept), (2, 2), "{r:?}");
    assert_eq!(keys(&b, "packs").len(), 2);
    // Nothing left to do.
    let r = gc(&a, Duration::ZERO);
    assert_eq!(
        (
            r.packs_marked,
            r.packs_deleted,
            r.objects_copied,
            r.bytes_unused
        ),
        (0, 0, 0, 0),
        "{r:?}"
    );

    // A fresh host restores the checkpoint exactly; the garbage is gone for good.
    let c = open(&t.path().join("c"), &b);
    let out = t.path().join("restored");
    restore_tree(&c, cp.body.root, &out, &RestoreOptions::default()).unwrap();
    assert_eq!(snapshot(&out), snapshot(&work));
    for g in &garbage {
        assert!(matches!(
            c.objects().get(g, "blob"),
            Err(casfs::cas::CasError::NotFound { .. })
        ));
    }
    // Uploading the garbage again brings it back (the marks made no upload skip it).
    for i in 0..60u64 {
        a.objects().put(&pattern(20_000, 50_000 + i)).unwrap();
    }
    a.objects().sync().unwrap();
    let d = open(&t.path().join("d"), &b);
    assert_eq!(
        d.objects().get(&garbage[5], "blob").unwrap(),
        pattern(20_000, 50_005)
    );
}

/// Host A collects garbage over and over while host B uploads checkpoints whose files
/// are partly content that B uploaded before as garbage (so B's uploads leave out
/// objects in packs A is about to mark): every checkpoint restores exactly afterwards.
#[test]
fn gc_on_one_host_while_another_uploads_loses_nothing() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let host_a = Arc::new(open(&t.path().join("a"), &b));
    let host_b = open(&t.path().join("b"), &b);
    let th = thread("busy");
    let grace = Duration::from_millis(1500);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let collector = {
        let (a, stop) = (host_a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut total = casfs::cas::remote_store::RemoteGcReport::default();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = gc(&a, grace);
                total.packs_marked += r.packs_marked;
                total.packs_deleted += r.packs_deleted;
                total.objects_copied += r.objects_copied;
                std::thread::sleep(Duration::from_millis(100));
            }
            total
        })
    };
    let mut expected = Vec::new();
    for round in 0..12u64 {
        // Garbage: uploaded, never in a checkpoint (until the next round's tree uses it).
        for i in 0..20u64 {
            host_b
                .objects()
                .put(&pattern(8_000, round * 100 + i))
                .unwrap();
        }
        host_b.objects().sync().unwrap();
        let dir = t.path().join(format!("w{round}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..20u64 {
            // Half this round's files are last round's garbage.
            let seed = if i % 2 == 0 && round > 0 {
                (round - 1) * 100 + i
            } else {
                10_000 + round * 100 + i
            };
            std::fs::write(dir.join(format!("f{i}")), pattern(8_000, seed)).unwrap();
        }
        let cp = capture_on_head(&host_b, &dir, &th);
        expected.push((cp, dir));
        std::thread::sleep(Duration::from_millis(400));
    }
    // Long enough for marks to ripen, then stop.
    std::thread::sleep(grace * 2);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let total = collector.join().unwrap();
    assert!(total.packs_deleted > 0, "gc deleted nothing: {total:?}");
    let last = gc(&host_a, grace);
    assert_eq!(
        last.packs_waiting + last.packs_marked,
        last.packs_marked + last.packs_waiting
    );
    for (i, (cp, dir)) in expected.iter().enumerate() {
        let fresh = open(&t.path().join(format!("fresh{i}")), &b);
        let out = t.path().join(format!("out{i}"));
        restore_tree(&fresh, cp.body.root, &out, &RestoreOptions::default())
            .unwrap_or_else(|e| panic!("checkpoint {i} after gc ({total:?}): {e}"));
        assert_eq!(snapshot(&out), snapshot(dir), "checkpoint {i}");
    }
}

/// A connection to the fleet's PostgreSQL schema, for tests that look at or damage what
/// casfs keeps there.
fn pg(b: &Backends) -> postgres::Client {
    let url = url::Url::parse(b.checkpoints.as_ref().unwrap()).unwrap();
    let schema = url
        .query_pairs()
        .find(|(k, _)| k == "schema")
        .unwrap()
        .1
        .into_owned();
    let mut cfg: postgres::Config = env("CASFS_TEST_PG").parse().unwrap();
    cfg.password(env("PGPASSWORD"));
    let mut c = cfg.connect(postgres::NoTls).unwrap();
    c.batch_execute(&format!("SET search_path TO {schema}"))
        .unwrap();
    c
}

/// Retention and the consistency check on PostgreSQL + S3: `prune` keeps heads, the
/// newest and what another host's mount pins (the removal itself keeps a head or a
/// pinned record), and leaves tombstones every host's log stops at; `fsck` on a host with an empty cache
/// verifies every live object from S3, tells a pruned parent from a lost one, finds a
/// lease beyond its fencing token (and `--repair` raises the token), a head naming a
/// missing checkpoint and a damaged pack, and says what a `gc` of the packs would do.
#[test]
fn fsck_and_the_removal_of_records_work_on_a_fleet_store() {
    use casfs::checkpoint::maintenance::{fsck, prune, Retention};
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let host_a = open(&t.path().join("host-a"), &b);
    let th = thread("kept");
    let work = t.path().join("work");
    write_tree(&work, 7);
    let mut ids = Vec::new();
    for i in 0..4 {
        std::fs::write(work.join("src/f1.rs"), format!("version {i}\n")).unwrap();
        ids.push(capture_on_head(&host_a, &work, &th).id);
    }
    let live = std::collections::HashSet::new();

    // A clean store: nothing wrong, every object read back from S3 by a host that has
    // none of them.
    let host_b = open(&t.path().join("host-b"), &b);
    let r = fsck(&host_b, false, &live).unwrap();
    assert!(r.errors.is_empty() && r.leftovers.is_empty(), "{r:?}");
    assert_eq!((r.checkpoints, r.threads), (4, 1), "{r:?}");
    assert!(r.objects_verified > 40, "{r:?}");
    let fetched = host_b.remote().unwrap().stats();
    assert!(fetched.fetched_objects > 40, "{fetched:?}");
    // Fetched ahead by the pack, a directory at a time: a ranged read for a few objects
    // (16 for 56 here), not one each.
    assert!(
        fetched.requests.ranged_get * 3 <= fetched.fetched_objects,
        "{fetched:?}"
    );
    let packs = r.remote.as_ref().expect("a dry run of the packs' gc").packs;
    assert!(packs >= 1, "{r:?}");

    // Retention: the head and the newest two stay, and a checkpoint some host's mount
    // pins; the removal itself keeps a head or a pinned record whatever the caller
    // asked, and leaves tombstones every host's log stops at.
    let keep_two = Retention {
        keep_last: Some(2),
        ..Retention::default()
    };
    let cps_b = host_b.checkpoints();
    cps_b.pin("host-b/mount", &[ids[0]], false).unwrap();
    let r = prune(&host_a, &keep_two, false).unwrap();
    assert_eq!(r.pruned_ids, vec![ids[1]], "{r:?}");
    let doomed: Vec<_> = [ids[0], ids[3]]
        .iter()
        .map(|id| (*id, th.clone()))
        .collect();
    assert_eq!(host_a.checkpoints().remove_records(&doomed).unwrap(), 0);
    cps_b.unpin("host-b/mount").unwrap();
    assert_eq!(host_a.checkpoints().remove_records(&doomed).unwrap(), 1);
    // A pin after the removal does not bring the record back: the read says it is gone.
    cps_b.pin("host-b/late", &[ids[0]], true).unwrap();
    assert!(matches!(
        cps_b.get(&ids[0]),
        Err(CheckpointError::NotFound(_))
    ));
    assert!(cps_b.is_pruned(&ids[0]).unwrap());
    cps_b.unpin("host-b/late").unwrap();
    let log: Vec<_> = host_b
        .checkpoints()
        .log(&th, 10)
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(log, vec![ids[3], ids[2]]);
    assert!(host_b.checkpoints().is_pruned(&ids[1]).unwrap());
    assert!(!host_b.checkpoints().is_pruned(&ids[2]).unwrap());
    let r = fsck(&host_b, false, &live).unwrap();
    assert!(r.errors.is_empty(), "a pruned parent is not lost: {r:?}");
    assert_eq!(r.checkpoints, 2);

    // A lease beyond its thread's fencing token: found, and repaired by raising it.
    let lease = host_a
        .checkpoints()
        .acquire_writer(&th, "host-a", Duration::from_secs(60))
        .unwrap();
    let mut db = pg(&b);
    db.execute(
        "UPDATE casfs_fencing SET token = 0 WHERE thread = 'kept'",
        &[],
    )
    .unwrap();
    let r = fsck(&host_b, false, &live).unwrap();
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert!(r.errors[0].contains("beyond the fencing token"), "{r:?}");
    let r = fsck(&host_b, true, &live).unwrap();
    assert!(r.errors.is_empty(), "{r:?}");
    assert!(
        r.repaired[0].contains(&format!(
            "raised the fencing token of thread \"kept\" to {}",
            lease.token
        )),
        "{r:?}"
    );
    let token: i64 = db
        .query_one("SELECT token FROM casfs_fencing WHERE thread = 'kept'", &[])
        .unwrap()
        .get(0);
    assert_eq!(token as u64, lease.token);
    host_a.checkpoints().release(&lease).unwrap();
    assert!(fsck(&host_b, false, &live).unwrap().errors.is_empty());

    // A head naming a checkpoint no record holds.
    let gone = Hash::of(b"no such checkpoint");
    db.execute(
        "INSERT INTO casfs_heads VALUES ('lost', $1)",
        &[&gone.as_bytes().as_slice()],
    )
    .unwrap();
    let r = fsck(&host_b, false, &live).unwrap();
    assert_eq!(r.threads, 2);
    assert!(
        r.errors.len() == 1 && r.errors[0].contains(&gone.to_hex()),
        "{r:?}"
    );
    db.execute("DELETE FROM casfs_heads WHERE thread = 'lost'", &[])
        .unwrap();

    // A damaged pack: a host with an empty cache finds it, naming the pack.
    let packs = keys(&b, "packs");
    let (s3, _) = bucket(&b);
    block_on(async {
        use object_store::ObjectStore as _;
        for p in &packs {
            let mut bytes = s3.get(p).await.unwrap().bytes().await.unwrap().to_vec();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            s3.put(p, bytes.into()).await.unwrap();
        }
    });
    let host_c = open(&t.path().join("host-c"), &b);
    let r = fsck(&host_c, false, &live).unwrap();
    assert!(!r.errors.is_empty(), "{r:?}");
    assert!(
        r.errors
            .iter()
            .any(|e| packs.iter().any(|p| e.contains(p.filename().unwrap()))),
        "names the pack: {r:?}"
    );
}
