//! A FUSE workspace's change announcements follow what the kernel sends: a writer's
//! close is announced by its flush, or, for a handle opened while nobody listened (the
//! daemon then asks the kernel for no flush: `FOPEN_NOFLUSH`), by its release.

use std::fs;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use casfs::checkpoint::{OpenMode, Store, ThreadId};
use casfs::fs::{FsEvent, FsEventKind, WorkspaceOptions};
use casfs::mount::MountedThread;

use crate::MountGuard;

/// Every event that arrives within `quiet` of the last (at most `limit` in all).
fn drain(
    rx: &std::sync::mpsc::Receiver<FsEvent>,
    quiet: Duration,
    limit: Duration,
) -> Vec<FsEvent> {
    let start = Instant::now();
    let mut out = Vec::new();
    while start.elapsed() < limit {
        match rx.recv_timeout(quiet) {
            Ok(e) => out.push(e),
            Err(_) => break,
        }
    }
    out
}

#[test]
fn a_writers_close_is_announced_whether_or_not_anyone_listened_at_its_open() {
    if crate::overlay() {
        eprintln!("skipped: the overlay backend announces changes by inotify");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::open(
            &t.path().join("store"),
            OpenMode::Create,
            Duration::from_secs(5),
        )
        .unwrap(),
    );
    let mp = t.path().join("mnt");
    fs::create_dir(&mp).unwrap();
    let _g = MountGuard::new(&mp);
    let mp = fs::canonicalize(&mp).unwrap();
    let m = MountedThread::mount_mode(
        store,
        &mp,
        ThreadId::new("e").unwrap(),
        None,
        &WorkspaceOptions::default(),
        casfs::mount::MountMode::Fuse,
    )
    .unwrap();
    let ws = m.workspace().expect("a FUSE mount has a workspace").clone();
    // The file to read, written while someone listens: its close is announced by its
    // flush, which close waits for. Written with nobody listening, its close would be
    // announced at its release, which the kernel sends after close returns, maybe
    // after the subscription below.
    let (pre, _) = ws.subscribe();
    fs::write(mp.join("read.txt"), "r\n").unwrap();
    drop(pre);
    // The next change announced drops the subscription gone: nobody listens from here.
    fs::create_dir(mp.join("settled")).unwrap();

    // Opened before anyone listens: no flush; its close comes with its release.
    let mut early = fs::File::create(mp.join("early.txt")).unwrap();
    let (rx, _) = ws.subscribe();
    // Opened while someone listens: its close is announced by its flush.
    let mut late = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(mp.join("late.txt"))
        .unwrap();
    early.write_all(b"early\n").unwrap();
    late.write_all(b"late\n").unwrap();
    // A reader's close is no change, with or without a flush.
    assert_eq!(fs::read_to_string(mp.join("read.txt")).unwrap(), "r\n");
    drop(early);
    drop(late);

    let events = drain(&rx, Duration::from_millis(500), Duration::from_secs(10));
    let modified = |p: &str| {
        events
            .iter()
            .filter(|e| e.kind == FsEventKind::Modify && e.path == p)
            .count()
    };
    // Announced at its release: once per open file description.
    assert_eq!(modified("early.txt"), 1, "{events:?}");
    // Announced at each close (flush); a child another test forks meanwhile closes a
    // copy too (at its exec), so at least once.
    assert!(modified("late.txt") >= 1, "{events:?}");
    assert!(
        events.iter().all(|e| e.path != "read.txt"),
        "a reader's close announced: {events:?}"
    );
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    drop(m);
}
