//! The counters casfs prints and records for a mount's checkpoint are what happened:
//! how many entries changed and were removed, how many files were hashed and how many
//! bytes read, checked against what the test itself wrote, on both backends, for the
//! ordinary paths and for the work a killed (or stopped) daemon left.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use crate::common::*;
use crate::wait_for;
use crate::workspace::{mount, Ws};

/// What a checkpoint said of itself, from its printed lines or its JSON.
#[derive(Debug, PartialEq, Eq)]
struct Counts {
    changed: u64,
    removed: u64,
    hashed: u64,
}

/// Writes `n` files of distinct sizes under `dir` (in four subdirectories), each
/// fsync'd; returns their total size.
fn write_files(root: &Path, dir: &str, n: usize, seed: u64) -> u64 {
    let mut total = 0;
    for i in 0..n {
        let d = root.join(dir).join(format!("d{}", i % 4));
        fs::create_dir_all(&d).unwrap();
        let data = pattern(1 + (i * 997) % 9000, seed + i as u64);
        let mut f = fs::File::create(d.join(format!("f{i}"))).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        total += data.len() as u64;
    }
    total
}

/// A checkpoint through `--json`: its counts and bytes hashed, checked against what
/// the same checkpoint's record says (`casfs show`) and what `casfs log` lists.
fn checkpoint_json(ws: &Ws, thread: &str) -> (Counts, u64) {
    let c = ws.checkpoint();
    assert_eq!(c["ok"], true, "{c}");
    let s = &c["stats"];
    let counts = Counts {
        changed: s["changed_paths"].as_array().unwrap().len() as u64,
        removed: s["removed_paths"].as_array().unwrap().len() as u64,
        hashed: s["files_hashed"].as_u64().unwrap(),
    };
    assert_eq!(
        c["changed_files"].as_u64().unwrap(),
        counts.changed + counts.removed,
        "{c}"
    );
    let id = c["checkpoint"].as_str().unwrap();
    check_record(ws, thread, id, &counts, s["bytes_hashed"].as_u64().unwrap());
    (counts, s["bytes_hashed"].as_u64().unwrap())
}

/// The checkpoint's record holds the counts, and the log's line for it says them.
fn check_record(ws: &Ws, thread: &str, id: &str, counts: &Counts, bytes: u64) {
    let rec = json(&ws.store, &["show", id]);
    let st = &rec["stats"];
    assert_eq!(st["changed"].as_u64(), Some(counts.changed), "{rec}");
    assert_eq!(st["removed"].as_u64(), Some(counts.removed), "{rec}");
    assert_eq!(st["files_hashed"].as_u64(), Some(counts.hashed), "{rec}");
    assert_eq!(st["bytes_hashed"].as_u64(), Some(bytes), "{rec}");
    let log = ok(&ws.store, &["log", "-t", thread]);
    let line = log
        .lines()
        .find(|l| id.starts_with(l.split_whitespace().next().unwrap()))
        .unwrap_or_else(|| panic!("{id} not in the log: {log}"));
    let want = format!(" {} changed, {} removed ", counts.changed, counts.removed);
    assert!(line.contains(&want), "{line:?} should say {want:?}");
}

/// A checkpoint through the printed output: parses its second line, "  C changed (R
/// removed; H files hashed, B), ...", and checks the record (exact bytes from it).
fn checkpoint_printed(ws: &Ws, thread: &str) -> (Counts, u64, String) {
    let out = ok(&ws.store, &["checkpoint", ws.mp.to_str().unwrap()]);
    let mut lines = out.lines();
    let id = lines.next().unwrap().trim().to_string();
    let line = lines.next().unwrap_or_default().to_string();
    let num = |after: &str, word: &str| -> u64 {
        let at = line
            .find(word)
            .unwrap_or_else(|| panic!("{line:?}: no {word:?}"));
        let head = &line[..at];
        let start = match after {
            "" => 0,
            a => head.rfind(a).map_or(0, |i| i + a.len()),
        };
        head[start..]
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line:?} at {word:?}: {e}"))
    };
    let total = num("", " changed (");
    let removed = num("(", " removed;");
    let hashed = num(";", " files hashed");
    let counts = Counts {
        changed: total - removed,
        removed,
        hashed,
    };
    let rec = json(&ws.store, &["show", &id]);
    let bytes = rec["stats"]["bytes_hashed"].as_u64().unwrap();
    check_record(ws, thread, &id, &counts, bytes);
    (counts, bytes, line)
}

fn kill_daemon(ws: &Ws) {
    let pid = ws.status()["pid"].as_u64().unwrap() as i32;
    // SAFETY: killing the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // SAFETY: probing whether the process still exists.
    assert!(wait_for(Duration::from_secs(10), || unsafe {
        libc::kill(pid, 0) != 0
    }));
    if !crate::overlay() {
        // A dead FUSE mount stays until unmounted (an overlay outlives its daemon).
        ok(&ws.store, &["unmount", "--lazy", ws.mp.to_str().unwrap()]);
    }
}

/// A daemon SIGKILLed after many fsync'd files were written (and a base file changed,
/// two removed): the next mount picks the work up, and its checkpoint counts every file
/// written as changed and hashed, its bytes as read, in the printed line, the record
/// and the log. So does a clean unmount that leaves uncaptured work.
#[test]
fn counters_after_a_killed_daemon_say_what_was_written() {
    let thread = "count-crash";
    let ws = mount(thread, &[]);
    let base = write_files(&ws.mp, "base", 12, 1);
    let (c, bytes) = checkpoint_json(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: 12,
            removed: 0,
            hashed: 12
        }
    );
    assert_eq!(bytes, base);

    const N: usize = 600;
    let written = write_files(&ws.mp, "new", N, 100);
    let changed = b"rewritten before the crash";
    fs::write(ws.p("base/d0/f0"), changed).unwrap();
    fs::remove_file(ws.p("base/d1/f1")).unwrap();
    fs::remove_file(ws.p("base/d2/f2")).unwrap();
    kill_daemon(&ws);
    ok(&ws.store, &["mount", ws.mp.to_str().unwrap(), "-t", thread]);
    assert!(crate::is_mounted(&ws.mp));
    // Only what differs from the base counts (not the base's files still in an upper).
    let st = ws.status();
    assert_eq!(st["dirty_files"].as_u64(), Some(N as u64 + 1), "{st}");
    assert_eq!(
        st["dirty_bytes"].as_u64(),
        Some(written + changed.len() as u64),
        "{st}"
    );

    let (c, bytes, line) = checkpoint_printed(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: N as u64 + 1,
            removed: 2,
            hashed: N as u64 + 1
        }
    );
    assert_eq!(bytes, written + changed.len() as u64);
    // An overlay mount read them when it took the upper over (to tell it from its
    // base), and the line says so; a FUSE mount's dirty set needed no reading.
    let ahead = format!("{} of them read ahead by the mount", N + 1);
    assert_eq!(line.contains(&ahead), crate::overlay(), "{line}");
    // Nothing left: the next checkpoint changes and reads nothing.
    let (c, bytes) = checkpoint_json(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: 0,
            removed: 0,
            hashed: 0
        }
    );
    assert_eq!(bytes, 0);

    // Uncaptured work across a clean unmount and a mount.
    let more = write_files(&ws.mp, "more", 9, 7000);
    ws.unmount();
    ok(&ws.store, &["mount", ws.mp.to_str().unwrap(), "-t", thread]);
    let (c, bytes, _) = checkpoint_printed(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: 9,
            removed: 0,
            hashed: 9
        }
    );
    assert_eq!(bytes, more);
    drop(ws.guard);
}

/// The ordinary paths: new files, a file rewritten, files and a directory removed, a
/// directory renamed (its files change paths, their content is not read again), a
/// metadata change, nothing at all, and a `status` before the checkpoint.
#[test]
fn counters_of_ordinary_checkpoints() {
    let thread = "count-plain";
    let ws = mount(thread, &[]);
    let base = write_files(&ws.mp, "a", 20, 1) + write_files(&ws.mp, "b", 8, 50);
    fs::create_dir_all(ws.p("gone/deep")).unwrap();
    fs::write(ws.p("gone/deep/x"), b"x").unwrap();
    fs::write(ws.p("gone/y"), b"yy").unwrap();
    let (c, bytes) = checkpoint_json(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: 30,
            removed: 0,
            hashed: 30
        }
    );
    assert_eq!(bytes, base + 3);

    // Nothing changed.
    let (c, bytes) = checkpoint_json(&ws, thread);
    assert_eq!(
        c,
        Counts {
            changed: 0,
            removed: 0,
            hashed: 0
        }
    );
    assert_eq!(bytes, 0);

    // Two rewritten, one new, one removed, a directory removed, one renamed (its 2
    // files at new paths, the old directory gone), one chmod.
    fs::write(ws.p("a/d0/f0"), b"one").unwrap();
    fs::write(ws.p("a/d1/f1"), b"two!").unwrap();
    fs::write(ws.p("a/new"), b"new file").unwrap();
    fs::remove_file(ws.p("a/d2/f2")).unwrap();
    fs::remove_dir_all(ws.p("gone")).unwrap();
    fs::rename(ws.p("b/d3"), ws.p("b/d3-moved")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(ws.p("a/d3/f3"), fs::Permissions::from_mode(0o600)).unwrap();
    // `status` on the way does not change what the checkpoint counts.
    let st = ws.status();
    assert!(st["dirty_files"].as_u64().unwrap() >= 3, "{st}");
    let (c, bytes) = checkpoint_json(&ws, thread);
    // Changed: f0, f1, new, f3 (its mode), the two moved files. Removed: f2, gone/,
    // b/d3/. Hashed: the three written, and f3: its local file (written in this mount,
    // the upper's on either backend) is read again when its node changes.
    assert_eq!(
        c,
        Counts {
            changed: 6,
            removed: 3,
            hashed: 4
        }
    );
    let f3 = fs::metadata(ws.p("a/d3/f3")).unwrap().len();
    assert_eq!(bytes, 3 + 4 + 8 + f3);

    // A chmod of a file the mount has never written (served from the base): nothing is
    // read on FUSE; overlayfs copies it up whole, and the checkpoint reads that copy.
    ws.unmount();
    ok(&ws.store, &["mount", ws.mp.to_str().unwrap(), "-t", thread]);
    fs::set_permissions(ws.p("a/d0/f4"), fs::Permissions::from_mode(0o600)).unwrap();
    let (c, bytes) = checkpoint_json(&ws, thread);
    let copied = u64::from(crate::overlay());
    assert_eq!(
        c,
        Counts {
            changed: 1,
            removed: 0,
            hashed: copied
        }
    );
    let f4 = fs::metadata(ws.p("a/d0/f4")).unwrap().len();
    assert_eq!(bytes, copied * f4);
    drop(ws.guard);
}
