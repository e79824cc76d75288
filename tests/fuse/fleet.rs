//! Fleet backends with mounts: a second host mounting a thread's head fetches, before
//! anything reads them, the files the last run on the first host read. Needs the
//! services of `scripts/services.sh` (scripts/test.sh sources it).

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use casfs::cas::{Hash, ObjectId, ObjectStore};
use casfs::checkpoint::{
    capture_to_thread, AppendOptions, Backends, CaptureOptions, ExpectedHead, OpenMode, Store,
    ThreadId,
};
use casfs::fs::WorkspaceOptions;
use casfs::mount::MountedThread;

use crate::common::pattern;
use crate::{wait_for, MountGuard};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests through scripts/test.sh, or source scripts/services.sh first")
    })
}

/// A PostgreSQL schema and an S3 prefix of their own for one test (`kind` tells the
/// tests apart).
fn fleet(kind: &str) -> Backends {
    let tag = Hash::of(format!("{:?}-{kind}", std::time::SystemTime::now()).as_bytes()).to_hex()
        [..12]
        .to_string();
    Backends {
        checkpoints: Some(format!("{}?schema={kind}_{tag}", env("CASFS_TEST_PG"))),
        objects: Some(format!("{}/{kind}-{tag}", env("CASFS_TEST_S3"))),
    }
}

/// A host: a store of its own under `dir` on the shared backends.
fn host(dir: &std::path::Path, b: &Backends) -> Arc<Store> {
    Arc::new(Store::open_with(dir, OpenMode::Create, Duration::from_secs(5), b).unwrap())
}

/// Captures `src` as the first checkpoint of thread `th`.
fn import(store: &Store, src: &std::path::Path, th: &ThreadId) {
    capture_to_thread(
        store,
        src,
        &CaptureOptions::default(),
        &AppendOptions {
            thread: th.clone(),
            reason: "import".into(),
            expected: ExpectedHead::Current,
            holder: casfs::checkpoint::holder_name("test"),
            lease_ttl: Duration::from_secs(30),
        },
    )
    .unwrap();
}

#[test]
fn a_second_host_prefetches_what_the_last_run_read() {
    let b = fleet("m");
    let t = tempfile::tempdir().unwrap();
    let open = |name: &str| host(&t.path().join(name), &b);
    let th = ThreadId::new("agent").unwrap();
    // Host A: a workspace of 60 files, checkpointed.
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    for i in 0..60u64 {
        let len = if i == 7 {
            (2 << 20) + 5
        } else {
            3000 + i as usize
        };
        fs::write(src.join(format!("f{i}")), pattern(len, i)).unwrap();
    }
    let a = open("host-a");
    import(&a, &src, &th);
    // A run on host A's mount reads four files (one of them chunked) and writes one.
    let mp_a = t.path().join("mnt-a");
    fs::create_dir(&mp_a).unwrap();
    let _ga = MountGuard::new(&mp_a);
    let mp_a = fs::canonicalize(&mp_a).unwrap();
    let opts = WorkspaceOptions::default();
    // On this run's backend: the overlay's lower notes what it serves.
    let ma = MountedThread::mount_mode(
        a.clone(),
        &mp_a,
        th.clone(),
        None,
        &opts,
        crate::mount_mode(),
    )
    .unwrap();
    let read = ["f3", "f7", "f11", "f42"];
    for name in read {
        fs::read(mp_a.join(name)).unwrap();
    }
    fs::write(mp_a.join("notes.md"), b"the run's output").unwrap();
    let cp = ma.checkpoint("run").unwrap();
    ma.unmount().unwrap();
    let rec = a.checkpoints().get(&cp.checkpoint).unwrap();
    assert!(
        rec.body.read_first.is_some(),
        "the run's reads are recorded"
    );

    // Host B: mounts the head with an empty cache; the four files arrive on their own.
    let hb = open("host-b");
    let mp_b = t.path().join("mnt-b");
    fs::create_dir(&mp_b).unwrap();
    let _gb = MountGuard::new(&mp_b);
    let mp_b = fs::canonicalize(&mp_b).unwrap();
    let mb = MountedThread::mount_mode(
        hb.clone(),
        &mp_b,
        th.clone(),
        None,
        &opts,
        crate::mount_mode(),
    )
    .unwrap();
    let id_of = |name: &str| {
        let data = fs::read(src.join(name)).unwrap();
        ObjectId(casfs::cas::file::file_id_of(&data).0)
    };
    let local = hb.local_objects();
    assert!(
        wait_for(Duration::from_secs(20), || read
            .iter()
            .all(|n| local.contains(&id_of(n)).unwrap())),
        "the files the run read were not prefetched"
    );
    // Only those: a file nobody read is not here until it is read.
    assert!(!local.contains(&id_of("f20")).unwrap());
    assert_eq!(
        fs::read(mp_b.join("f20")).unwrap(),
        fs::read(src.join("f20")).unwrap()
    );
    assert!(local.contains(&id_of("f20")).unwrap());
    assert_eq!(
        fs::read(mp_b.join("notes.md")).unwrap(),
        b"the run's output"
    );
    assert_eq!(
        fs::read(mp_b.join("f7")).unwrap(),
        fs::read(src.join("f7")).unwrap()
    );
    mb.unmount().unwrap();
}

/// A checkpoint of a mount, on this run's backend, names only what is already in the
/// bucket: a host that never saw the mount restores it whole (large files included,
/// which the local store writes without its log).
#[test]
fn a_mount_checkpoint_is_in_the_bucket_before_it_is_published() {
    let b = fleet("k");
    let t = tempfile::tempdir().unwrap();
    let th = ThreadId::new("run").unwrap();
    let empty = t.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let a = host(&t.path().join("host-a"), &b);
    import(&a, &empty, &th);
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    let mp = fs::canonicalize(&mp).unwrap();
    let opts = WorkspaceOptions::default();
    let m = MountedThread::mount_mode(a.clone(), &mp, th.clone(), None, &opts, crate::mount_mode())
        .unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..6u64)
        .map(|i| {
            (
                format!("out/f{i}"),
                pattern(if i < 3 { 3 << 20 } else { 900 }, 40 + i),
            )
        })
        .collect();
    fs::create_dir(mp.join("out")).unwrap();
    for (name, data) in &files {
        fs::write(mp.join(name), data).unwrap();
    }
    let cp = m.checkpoint("run").unwrap();
    // Host B reads it from PostgreSQL and the bucket alone.
    let hb = host(&t.path().join("host-b"), &b);
    let rec = hb.checkpoints().get(&cp.checkpoint).unwrap();
    let out = t.path().join("restored");
    casfs::checkpoint::restore_tree(&hb, rec.body.root, &out, &Default::default()).unwrap();
    for (name, data) in &files {
        assert_eq!(&fs::read(out.join(name)).unwrap(), data, "{name}");
    }
    m.unmount().unwrap();
}

/// With fleet backends, a run's secret reaches neither the bucket (raw bytes, nor any
/// object decoded) nor PostgreSQL (any row of the store's schema), nor any byte under
/// the local store.
#[test]
fn a_secret_reaches_neither_the_bucket_nor_postgresql() {
    use casfs::middleware::{
        ArtifactMeta, ArtifactStore, BlobStore, CasfsProvider, MessageStore, Middleware,
        MiddlewareConfig, Persistence, RunContext, Secrets, SnapshotConfig, StorePersistence,
    };
    let b = fleet("s");
    let schema = b
        .checkpoints
        .as_deref()
        .unwrap()
        .rsplit("schema=")
        .next()
        .unwrap()
        .to_string();
    let prefix = b
        .objects
        .as_deref()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let secret = "sk-\"fleet\"\\value-7a6b5c";
    let escaped = serde_json::to_string(secret).unwrap();
    let escaped = escaped.trim_matches('"').to_string();
    let t = tempfile::tempdir().unwrap();
    let store_dir = t.path().join("store");
    let store = Arc::new(
        Store::open_with_families(
            &store_dir,
            OpenMode::Create,
            Duration::from_secs(5),
            &b,
            casfs::middleware::COLUMN_FAMILIES,
        )
        .unwrap(),
    );
    let secrets = std::collections::BTreeMap::from([("API_KEY".to_string(), secret.to_string())]);
    let sp = Arc::new(
        StorePersistence::new(store.database().clone())
            .unwrap()
            .with_secrets(Secrets::new(secrets.clone()).unwrap()),
    );
    let persistence = Persistence::on_store(sp.clone());
    let sb = t.path().join("sb");
    let provider = Arc::new(CasfsProvider::new(
        store.clone(),
        &sb,
        WorkspaceOptions::default(),
    ));
    let mut snap = SnapshotConfig::new(persistence.clone());
    snap.secrets = secrets;
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
    let _g = MountGuard::new(&sb.join("conv").join("workspace"));
    let th = ThreadId::new("conv").unwrap();
    let run = mw
        .setup(RunContext::new(th.clone(), "r1"), Some(&persistence))
        .unwrap();
    let root = run.sandbox().unwrap().root;
    fs::write(root.join(".env"), format!("API_KEY={secret}\n")).unwrap();
    fs::write(root.join("main.py"), "print('hi')\n").unwrap();
    sp.save_thread(
        &th,
        &[serde_json::json!({"role": "user", "content": format!("use {secret}")})],
    )
    .unwrap();
    BlobStore::put(&*sp, "report", format!("report {secret}").as_bytes()).unwrap();
    ArtifactStore::put(
        &*sp,
        &ArtifactMeta {
            artifact_id: "a1".into(),
            run_id: "r1".into(),
            thread: th.clone(),
            blob_key: Some("report".into()),
            name: "report.txt".into(),
            mime_type: "text/plain".into(),
            size: 0,
            created_at_ms: 1,
        },
    )
    .unwrap();
    let out = run.on_finish().unwrap();
    assert_eq!(out.secret_files, 1);
    drop(run);
    mw.destroy_all_sandboxes().unwrap();
    let needles: Vec<&[u8]> = vec![secret.as_bytes(), escaped.as_bytes()];
    let holds = |b: &[u8]| needles.iter().any(|n| b.windows(n.len()).any(|w| w == *n));

    // The bucket: every object under the prefix, raw and decoded.
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_url(b.objects.as_ref().unwrap())
        .build()
        .unwrap();
    let objects = tokio::runtime::Runtime::new().unwrap().block_on(async {
        use futures::TryStreamExt;
        use object_store::ObjectStore as _;
        let p = object_store::path::Path::from(prefix.as_str());
        let metas: Vec<_> = s3.list(Some(&p)).try_collect().await.unwrap();
        let mut out = Vec::new();
        for m in metas {
            let bytes = s3.get(&m.location).await.unwrap().bytes().await.unwrap();
            out.push((m.location.to_string(), bytes.to_vec()));
        }
        out
    });
    // Every key raw; every object, out of its pack by the indexes, decoded.
    let mut decoded = 0;
    let packs: std::collections::HashMap<String, &Vec<u8>> = objects
        .iter()
        .filter(|(k, _)| k.contains("/packs/"))
        .map(|(k, v)| (k.rsplit('/').next().unwrap().to_string(), v))
        .collect();
    for (key, raw) in &objects {
        assert!(!holds(raw), "{key} holds the secret");
        let hex = key.rsplit('/').next().unwrap();
        if key.contains("/index/") {
            let idx = casfs::cas::pack::PackIndex::decode(key, raw).unwrap();
            for (h, l) in idx.iter() {
                let pack = packs[&l.pack.to_hex()];
                let stored = &pack[l.offset as usize..(l.offset + l.len) as usize];
                let data = casfs::cas::object::decode_stored(&h, stored).unwrap();
                assert!(
                    !holds(&data),
                    "object {h} of {key} decoded holds the secret"
                );
                decoded += 1;
            }
        } else if let (false, Some(h)) = (key.contains("/packs/"), Hash::from_hex(hex)) {
            let data = casfs::cas::object::decode_stored(&h, raw).unwrap();
            assert!(!holds(&data), "{key} decoded holds the secret");
            decoded += 1;
        }
    }
    assert!(
        decoded > 3,
        "the run's objects are in the bucket: {:?}",
        objects.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    // PostgreSQL: every row of every table of the store's schema, as text.
    let mut pg = postgres::Client::connect(
        &format!(
            "{} password={}",
            pg_conninfo(&env("CASFS_TEST_PG")),
            env("PGPASSWORD")
        ),
        postgres::NoTls,
    )
    .unwrap();
    for table in [
        "casfs_meta",
        "casfs_checkpoints",
        "casfs_heads",
        "casfs_leases",
        "casfs_fencing",
    ] {
        let q = format!("SELECT row_to_json(t)::text FROM {schema}.{table} t");
        for row in pg.query(&q, &[]).unwrap() {
            let text: String = row.get(0);
            assert!(!holds(text.as_bytes()), "{table}: {text}");
        }
    }
    let rows = pg
        .query(&format!("SELECT body FROM {schema}.casfs_checkpoints"), &[])
        .unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        let body: Vec<u8> = row.get(0);
        assert!(!holds(&body));
    }
    drop(mw);
    drop(provider);
    drop(store);
    crate::trust::assert_nowhere(&store_dir, &needles);
}

/// `postgres://user@host:port/db` as a libpq conninfo string.
fn pg_conninfo(url: &str) -> String {
    let u = url::Url::parse(url).unwrap();
    format!(
        "host={} port={} user={} dbname={}",
        u.host_str().unwrap(),
        u.port().unwrap_or(5432),
        u.username(),
        u.path().trim_start_matches('/')
    )
}

/// Retention on one host of a fleet keeps the checkpoint a mount on another host is
/// based on (the mount pinned it in PostgreSQL before reading it), so a `gc` after it
/// leaves that mount's lazily read files in the bucket; a restore of a checkpoint
/// retention removed is refused by name; once the mount is discarded, its checkpoint
/// goes at the next prune.
#[test]
fn retention_keeps_what_a_mount_on_another_host_reads() {
    use casfs::checkpoint::maintenance::{gc_with, prune, Retention};
    let b = fleet("p");
    let t = tempfile::tempdir().unwrap();
    let th = ThreadId::new("kept").unwrap();
    let a = host(&t.path().join("host-a"), &b);
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    let mut ids = Vec::new();
    for v in 0..4u64 {
        for i in 0..30u64 {
            fs::write(
                src.join(format!("f{i}")),
                pattern(3000 + i as usize, v * 100 + i),
            )
            .unwrap();
        }
        import(&a, &src, &th);
        ids.push(a.checkpoints().head(&th).unwrap().unwrap());
    }

    // Host B mounts the oldest checkpoint and reads nothing yet.
    let hb = host(&t.path().join("host-b"), &b);
    let mp = t.path().join("mnt-b");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    let mp = fs::canonicalize(&mp).unwrap();
    let opts = WorkspaceOptions::default();
    let mb = MountedThread::mount_mode(
        hb.clone(),
        &mp,
        th.clone(),
        Some(ids[0]),
        &opts,
        crate::mount_mode(),
    )
    .unwrap();
    let pins = a.checkpoints().pins().unwrap();
    assert!(
        pins.iter().any(|(_, id)| *id == ids[0]),
        "the mount pinned its base: {pins:?}"
    );

    // Host A keeps the newest: the head stays, the mount's base stays, the rest goes,
    // and a collection of the bucket's packs after it (twice, no grace: marked, then
    // deleted) removes their objects.
    let keep_one = Retention {
        keep_last: Some(1),
        ..Retention::default()
    };
    let r = prune(&a, &keep_one, false).unwrap();
    let mut gone = r.pruned_ids.clone();
    gone.sort();
    let mut want = vec![ids[1], ids[2]];
    want.sort();
    assert_eq!(gone, want, "{r:?}");
    let o = casfs::cas::remote_store::RemoteGcOptions {
        grace: Duration::ZERO,
        max_unused: 0.1,
        dry_run: false,
    };
    gc_with(&a, &o).unwrap();
    let second = gc_with(&a, &o).unwrap().remote.unwrap();
    assert!(
        second.packs_deleted + second.objects_copied as usize > 0,
        "the removed checkpoints' objects were collected: {second:?}"
    );

    // Every file of the mount still reads, byte-exact, fetched from the bucket now.
    for i in 0..30u64 {
        assert_eq!(
            fs::read(mp.join(format!("f{i}"))).unwrap(),
            pattern(3000 + i as usize, i),
            "f{i}"
        );
    }
    // A checkpoint retention removed: a restore says so, and the mount stays as it was.
    let e = mb.restore(ids[1], None, false).unwrap_err().to_string();
    assert!(
        e.contains(&ids[1].to_string()) && e.contains("removed by retention"),
        "{e}"
    );
    assert_eq!(fs::read(mp.join("f3")).unwrap(), pattern(3003, 3));

    // Discarded, the mount pins nothing, and its base goes at the next prune.
    assert!(mb.discard(false).unwrap());
    assert!(a.checkpoints().pins().unwrap().is_empty());
    let r = prune(&a, &keep_one, false).unwrap();
    assert_eq!(r.pruned_ids, vec![ids[0]], "{r:?}");
    assert_eq!(a.checkpoints().log(&th, 10).unwrap().len(), 1);
}
