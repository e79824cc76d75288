//! Writer leases, fencing and compare-and-swap on heads: in one process through the
//! library, and between processes through the CLI.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use casfs::cas::{Hash, TreeId};
use casfs::checkpoint::{CheckpointError, NewCheckpoint, OpenMode, Store, ThreadId};
use common::*;

fn open(dir: &std::path::Path) -> Store {
    Store::open(dir, OpenMode::Create, Duration::from_secs(5)).unwrap()
}

fn new_cp(thread: &ThreadId, n: u8) -> NewCheckpoint {
    NewCheckpoint::new(thread.clone(), TreeId(Hash::of(&[n])), format!("cp {n}"))
}

#[test]
fn lease_is_exclusive_and_tokens_only_grow() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let cps = store.checkpoints();
    let th = ThreadId::new("main").unwrap();
    let a = cps
        .acquire_writer(&th, "a", Duration::from_secs(30))
        .unwrap();
    match cps.acquire_writer(&th, "b", Duration::from_secs(30)) {
        Err(CheckpointError::LeaseHeld { holder, .. }) => assert_eq!(holder, "a"),
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    let a2 = cps.renew(&a).unwrap();
    assert_eq!(a2.token, a.token);
    assert!(a2.expires_at_ms >= a.expires_at_ms);
    cps.release(&a2).unwrap();
    let b = cps
        .acquire_writer(&th, "b", Duration::from_secs(30))
        .unwrap();
    assert!(b.token > a.token, "fencing tokens grow");
    // The old holder cannot release or renew what it no longer holds.
    assert!(matches!(
        cps.renew(&a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    assert!(matches!(
        cps.release(&a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    assert!(matches!(
        cps.append(new_cp(&th, 1), None, &a),
        Err(CheckpointError::LeaseLost { .. })
    ));
    cps.append(new_cp(&th, 1), None, &b).unwrap();
}

#[test]
fn expired_writer_cannot_append_and_head_moves_only_by_cas() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let cps = store.checkpoints();
    let th = ThreadId::new("main").unwrap();
    let lease = cps
        .acquire_writer(&th, "slow", Duration::from_millis(200))
        .unwrap();
    let first = cps.append(new_cp(&th, 1), None, &lease).unwrap();
    assert_eq!(cps.head(&th).unwrap(), Some(first.id));

    // A head that moved is refused, naming both ids.
    match cps.append(new_cp(&th, 2), None, &lease) {
        Err(CheckpointError::HeadMismatch {
            expected, actual, ..
        }) => {
            assert_eq!(expected, None);
            assert_eq!(actual, Some(first.id));
        }
        other => panic!("expected HeadMismatch, got {other:?}"),
    }

    std::thread::sleep(Duration::from_millis(300));
    match cps.append(new_cp(&th, 2), Some(first.id), &lease) {
        Err(CheckpointError::LeaseExpired { .. }) => {}
        other => panic!("expected LeaseExpired, got {other:?}"),
    }
    assert!(
        cps.renew(&lease).is_err(),
        "an expired lease cannot be renewed"
    );

    // Another writer takes over; the stale one is fenced off for good.
    let next = cps
        .acquire_writer(&th, "next", Duration::from_secs(30))
        .unwrap();
    assert!(next.token > lease.token);
    assert!(matches!(
        cps.append(new_cp(&th, 3), Some(first.id), &lease),
        Err(CheckpointError::LeaseLost { .. })
    ));
    let second = cps.append(new_cp(&th, 3), Some(first.id), &next).unwrap();
    assert_eq!(second.body.parent_id, Some(first.id));
    assert_eq!(cps.log(&th, 10).unwrap().len(), 2);
}

#[test]
fn many_threads_racing_on_one_head_produce_exactly_one_winner_per_head() {
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(open(t.path()));
    let th = ThreadId::new("race").unwrap();
    // Each round: 8 writers read the same head and try to append after it.
    for round in 0..5u8 {
        let head = store.checkpoints().head(&th).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8u8)
                .map(|w| {
                    let store = &store;
                    let th = &th;
                    s.spawn(move || loop {
                        match store.checkpoints().acquire_writer(
                            th,
                            &format!("w{w}"),
                            Duration::from_secs(30),
                        ) {
                            Ok(lease) => {
                                let r = store.checkpoints().append(
                                    new_cp(th, round * 10 + w),
                                    head,
                                    &lease,
                                );
                                store.checkpoints().release(&lease).unwrap();
                                return r;
                            }
                            Err(CheckpointError::LeaseHeld { .. }) => {
                                std::thread::sleep(Duration::from_millis(1))
                            }
                            Err(e) => return Err(e),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let winners: Vec<_> = results.iter().filter(|r| r.is_ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}");
        for r in &results {
            if let Err(e) = r {
                assert!(matches!(e, CheckpointError::HeadMismatch { .. }), "{e}");
            }
        }
    }
    assert_eq!(store.checkpoints().log(&th, 100).unwrap().len(), 5);
}

#[test]
fn two_processes_racing_to_append_on_one_head() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let (wa, wb) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir(&wa).unwrap();
    std::fs::create_dir(&wb).unwrap();
    std::fs::write(wa.join("f"), b"from a").unwrap();
    std::fs::write(wb.join("f"), b"from b").unwrap();
    let base = json(&store, &["capture", wa.to_str().unwrap(), "-t", "main"]);
    let base_id = base["checkpoint"]["id"].as_str().unwrap().to_string();

    for _ in 0..3 {
        let head = json(&store, &["show", "@main"])["id"]
            .as_str()
            .unwrap()
            .to_string();
        let spawn = |dir: &std::path::Path| {
            Command::new(casfs_bin())
                .args(["--store", store.to_str().unwrap(), "capture"])
                .arg(dir)
                .args(["-t", "main", "--expected-head", &head])
                .output()
                .unwrap()
        };
        let (ra, rb) = std::thread::scope(|s| {
            let a = s.spawn(|| spawn(&wa));
            let b = s.spawn(|| spawn(&wb));
            (a.join().unwrap(), b.join().unwrap())
        });
        let ok_count = [&ra, &rb].iter().filter(|r| r.status.success()).count();
        assert_eq!(ok_count, 1, "exactly one process lands per head");
        let loser = if ra.status.success() { &rb } else { &ra };
        let err = String::from_utf8_lossy(&loser.stderr);
        assert!(
            err.contains("head of thread \"main\" moved") || err.contains("is held by writer"),
            "{err}"
        );
    }
    let log = json(&store, &["log", "-t", "main"]);
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 4);
    assert_eq!(log[3]["id"], base_id);
    for w in log.windows(2) {
        assert_eq!(w[0]["parent_id"], w[1]["id"]);
    }
}
