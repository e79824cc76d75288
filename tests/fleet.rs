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
}

#[test]
fn postgresql_and_s3_meet_the_contracts() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let store = open(&t.path().join("s"), &b);
    checkpoint_store_contract(store.checkpoints());
    object_store_contract(store.objects());
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
    let (cp1, _) = capture_to_thread(
        &host_a,
        &work_a,
        &CaptureOptions::default(),
        &append_opts(&th, ExpectedHead::Current),
    )
    .unwrap();
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
    capture_to_thread(
        &host_a,
        &work_a,
        &CaptureOptions::default(),
        &append_opts(&th, ExpectedHead::Current),
    )
    .unwrap();
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

/// A damaged object in S3 is an integrity error on the host that fetches it, naming
/// the hash, and nothing wrong is kept in its cache.
#[test]
fn a_damaged_remote_object_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let b = fleet();
    let a = open(&t.path().join("a"), &b);
    let data = pattern(50_000, 3);
    let id = a.objects().put(&data).unwrap().id;
    a.objects().sync().unwrap();
    // Overwrite the remote copy with another object's stored bytes.
    let other = casfs::cas::object::encode_stored(&pattern(50_000, 4));
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_url(b.objects.as_ref().unwrap())
        .build()
        .unwrap();
    let key = object_store::path::Path::from(format!(
        "{}/{}/{}",
        url::Url::parse(b.objects.as_ref().unwrap())
            .unwrap()
            .path()
            .trim_matches('/'),
        &id.to_hex()[..2],
        id.to_hex()
    ));
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        use object_store::ObjectStore as _;
        s3.put(&key, other.into()).await.unwrap();
    });
    let host_b = open(&t.path().join("b"), &b);
    let err = host_b.objects().get(&id, "blob").unwrap_err();
    assert!(err.is_integrity(), "{err}");
    assert!(err.to_string().contains(&id.to_hex()), "{err}");
    assert!(!host_b.rocks_objects().contains(&id).unwrap());
}
