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

#[test]
fn a_second_host_prefetches_what_the_last_run_read() {
    let tag = Hash::of(format!("{:?}", std::time::SystemTime::now()).as_bytes()).to_hex()[..12]
        .to_string();
    let b = Backends {
        checkpoints: Some(format!("{}?schema=m_{tag}", env("CASFS_TEST_PG"))),
        objects: Some(format!("{}/m-{tag}", env("CASFS_TEST_S3"))),
    };
    let t = tempfile::tempdir().unwrap();
    let open = |name: &str| {
        Arc::new(
            Store::open_with(
                &t.path().join(name),
                OpenMode::Create,
                Duration::from_secs(5),
                &b,
            )
            .unwrap(),
        )
    };
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
    capture_to_thread(
        &a,
        &src,
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
    // A run on host A's mount reads four files (one of them chunked) and writes one.
    let mp_a = t.path().join("mnt-a");
    fs::create_dir(&mp_a).unwrap();
    let _ga = MountGuard::new(&mp_a);
    let mp_a = fs::canonicalize(&mp_a).unwrap();
    let opts = WorkspaceOptions::default();
    let ma = MountedThread::mount(a.clone(), &mp_a, th.clone(), None, &opts).unwrap();
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
    let mb = MountedThread::mount(hb.clone(), &mp_b, th.clone(), None, &opts).unwrap();
    let id_of = |name: &str| {
        let data = fs::read(src.join(name)).unwrap();
        ObjectId(casfs::cas::file::file_id_of(&data).0)
    };
    let local = hb.rocks_objects();
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
