//! `casfs serve` over many runs, CI-sized (the 10,000-run soak is `cargo bench --bench
//! soak`): what each run allocates is given back, abandoned runs are ended, idle
//! sandboxes go, limits answer 429, and a client that falls behind on events is told
//! what it lost. (A server killed mid-run and restarted: `trust.rs`.)

use std::time::Duration;

use serde_json::json;

use crate::serve::{call, refused, start};
use crate::soak_driver::{descriptors, mounts_under, process_usage_apart, Soak, ALL_ENDS};
use crate::{wait_for, MountGuard};

#[test]
fn two_hundred_runs_give_back_every_descriptor_and_mount() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let threads = 20;
    let _guards: Vec<MountGuard> = (0..threads)
        .map(|i| MountGuard::new(&sb.join(format!("thread-{i}"))))
        .collect();
    let s = start(
        &store,
        &sb,
        &["--run-idle-timeout", "1", "--sandbox-idle-timeout", "0.5"],
        &[],
    );
    let pid = s.child.id();
    // The server at rest: one run's worth of warm-up (thread pools, the store's caches).
    call(&s, "GET", "/v1/health", None);
    std::thread::sleep(Duration::from_millis(300));
    let db = store.join("db");
    let (fds0, _) = process_usage_apart(pid, Some(&db));
    let held0 = descriptors(pid);
    let soak = Soak {
        socket: s.socket.clone(),
        server_pid: pid,
        sandboxes: sb.clone(),
        runs: 200,
        clients: 4,
        threads,
        block: 100,
        ends: ALL_ENDS.to_vec(),
        db_dir: Some(db.clone()),
        settle: Duration::from_secs(20),
    };
    soak.run(|b| {
        assert_eq!(b.mounts, 0, "mounts left after {} runs: {b:?}", b.runs);
        assert!(
            b.fds <= fds0,
            "descriptors {} after {} runs, {fds0} at rest: {:#?}, at rest {held0:#?}",
            b.fds,
            b.runs,
            descriptors(pid),
        );
        for (what, n) in &b.refused {
            assert_eq!(what, "409 lease_held", "{n} unexpected refusals: {b:?}");
        }
    });
    assert_eq!(mounts_under(&sb), 0);
}

#[test]
fn limits_answer_429_and_idle_sandboxes_make_room() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g: Vec<MountGuard> = ["a", "b", "c"]
        .iter()
        .map(|n| MountGuard::new(&sb.join(n)))
        .collect();
    let s = start(
        &store,
        &sb,
        &["--max-runs", "2", "--max-sandboxes", "2"],
        &[],
    );
    let run = |thread: &str, id: &str| {
        call(
            &s,
            "POST",
            "/v1/runs",
            Some(&json!({"thread": thread, "run_id": id})),
        )
    };
    assert_eq!(run("a", "r1").0, 200);
    assert_eq!(run("b", "r2").0, 200);
    // Two runs going: a third is refused, whatever its thread.
    let m = refused(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "c", "run_id": "r3"})),
        429,
        "too_many_runs",
    );
    assert!(m.contains('2'), "{m}");
    // r1 ends, its sandbox stays live but idle; r2 still holds b.
    assert_eq!(call(&s, "POST", "/v1/runs/r1/finish", None).0, 200);
    // A third sandbox (c) takes the place of the idle one (a).
    let (st, v) = run("c", "r4");
    assert_eq!(st, 200, "{v}");
    assert!(wait_for(Duration::from_secs(5), || {
        !casfs::fs::is_fuse_mount(&sb.join("a").join("workspace"))
    }));
    // With both sandboxes in use, a new one is refused until one is let go.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/runs/r4/abort",
        Some(&json!({"cancelled": false})),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = run("a", "r5");
    assert_eq!(st, 200, "the detached c made room: {v}");
    refused(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "c", "run_id": "r6"})),
        429,
        "too_many_runs",
    );
    for r in ["r2", "r5"] {
        let (st, v) = call(&s, "POST", &format!("/v1/runs/{r}/finish"), None);
        assert_eq!(st, 200, "{v}");
    }
}

#[test]
fn an_abandoned_run_is_ended_and_a_slow_reader_is_told_what_it_lost() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("t").join("workspace"));
    let s = start(
        &store,
        &sb,
        &["--run-idle-timeout", "1", "--max-events", "3"],
        &[],
    );
    let root = crate::trust::start_run(&s, "t", "r1");
    for i in 0..4 {
        // Written by a process of its own: a file this test process held open would be
        // inherited, for a moment, by any child another test thread spawns, and its
        // close at that child's exec is one more flush: one more modify event.
        let f = root.join(format!("f{i}"));
        // (Not a shell's `>`: it dups the descriptor and closes the first, a flush too.)
        let st = std::process::Command::new("python3")
            .args(["-c", "import sys; open(sys.argv[1], 'w').write('x')"])
            .arg(&f)
            .status()
            .unwrap();
        assert!(st.success(), "writing {}", f.display());
        // A read keeps the run alive (idle timeout 1 s). CI failed this test once
        // below, most likely because on a loaded machine the writes took longer than
        // that and the run ended before its events were read.
        call(&s, "GET", "/v1/runs/r1/events", None);
    }
    // 4 creates and 4 modifies; the run keeps the last 3.
    let mut ev = serde_json::Value::Null;
    assert!(
        wait_for(Duration::from_secs(5), || {
            ev = call(&s, "GET", "/v1/runs/r1/events", None).1;
            ev.as_array()
                .is_some_and(|a| a.last().is_some_and(|e| e["seq"] == 8))
        }),
        "{ev}"
    );
    let ev = ev.as_array().unwrap();
    assert_eq!(ev.len(), 4, "{ev:?}");
    assert_eq!(
        (
            ev[0]["kind"].as_str(),
            ev[0]["seq"].as_u64(),
            ev[0]["count"].as_u64()
        ),
        (Some("lost"), Some(1), Some(5))
    );
    assert!(
        ev[0]["message"].as_str().unwrap().contains("from seq 1"),
        "{ev:?}"
    );
    let seqs: Vec<u64> = ev[1..].iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [6, 7, 8]);
    // Reading from where it is: no loss.
    let (_, v) = call(&s, "GET", "/v1/runs/r1/events?after=7", None);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");

    // The client goes away without a word: after the idle timeout the run is ended
    // as a disconnect (nothing published, the thread free for the next run).
    let mut v = serde_json::Value::Null;
    assert!(
        wait_for(Duration::from_secs(10), || {
            let (st, x) = call(
                &s,
                "POST",
                "/v1/runs",
                Some(&json!({"thread": "t", "run_id": "r2"})),
            );
            v = x;
            st == 200
        }),
        "the thread was not freed: {v}"
    );
    assert_eq!(call(&s, "GET", "/v1/runs/r1/events", None).0, 404);
    let (st, v) = call(&s, "POST", "/v1/runs/r2/finish", None);
    assert_eq!(st, 200, "{v}");
    // The abandoned run's files were left in the live sandbox (a disconnect detaches),
    // so r2 published them: what r1 never did.
    let (_, log) = call(&s, "GET", "/v1/threads/t/checkpoints", None);
    assert_eq!(log.as_array().unwrap().len(), 1, "{log}");
    assert_eq!(log[0]["source_run_id"], "r2");
}
