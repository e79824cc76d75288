//! What a checkpoint reports as changed (`stats.changed_paths`, `removed_paths`,
//! `changed_files`) is what differs from the checkpoint before it, on either backend:
//! not what the mount happened to keep dirty.

use std::fs;
use std::io::Write;

use crate::workspace::mount;

/// The checkpoint's changed and removed paths, each sorted.
fn changes(cp: &serde_json::Value) -> (Vec<String>, Vec<String>) {
    let list = |k: &str| {
        let mut v: Vec<String> = cp["stats"][k]
            .as_array()
            .unwrap_or_else(|| panic!("no {k} in {cp}"))
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    (list("changed_paths"), list("removed_paths"))
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_checkpoint_reports_what_differs_from_its_parent() {
    let ws = mount("changes", &[]);
    fs::create_dir(ws.p("a")).unwrap();
    fs::write(ws.p("a/x"), "x").unwrap();
    fs::write(ws.p("a/y"), "y").unwrap();
    fs::write(ws.p("odd name\n'\\"), "odd").unwrap();
    // Open for writing across the checkpoint: the mount keeps it dirty, since a writer
    // may still change it.
    let mut held = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(ws.p("held"))
        .unwrap();
    held.write_all(b"written before the checkpoint").unwrap();
    held.flush().unwrap();
    let first = ws.checkpoint();
    assert_eq!(
        changes(&first),
        (strings(&["a/x", "a/y", "held", "odd name\n'\\"]), vec![]),
        "{first}"
    );
    assert_eq!(first["changed_files"], 4, "{first}");

    // Closed without another write: nothing differs from the first checkpoint.
    drop(held);
    let second = ws.checkpoint();
    assert_eq!(changes(&second), (vec![], vec![]), "{second}");
    assert_eq!(second["changed_files"], 0, "{second}");

    // A moved directory: its files are changes at their new paths, the old name is gone.
    fs::rename(ws.p("a"), ws.p("b")).unwrap();
    let third = ws.checkpoint();
    assert_eq!(
        changes(&third),
        (strings(&["b/x", "b/y"]), strings(&["a"])),
        "{third}"
    );
    assert_eq!(third["changed_files"], 3, "{third}");

    // A file replaced by a directory of the same name, and a symlink.
    fs::remove_file(ws.p("held")).unwrap();
    fs::create_dir(ws.p("held")).unwrap();
    fs::write(ws.p("held/z"), "z").unwrap();
    std::os::unix::fs::symlink("b/x", ws.p("link")).unwrap();
    let fourth = ws.checkpoint();
    assert_eq!(
        changes(&fourth),
        (strings(&["held/z", "link"]), strings(&["held"])),
        "{fourth}"
    );

    // A file rewritten with what it held, its time set back: no change either.
    let mtime = fs::metadata(ws.p("b/x")).unwrap().modified().unwrap();
    fs::write(ws.p("b/x"), "x").unwrap();
    fs::File::options()
        .write(true)
        .open(ws.p("b/x"))
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let fifth = ws.checkpoint();
    assert_eq!(changes(&fifth), (vec![], vec![]), "{fifth}");
    drop(ws.guard);
}

/// The content of `path` in checkpoint `id`, as `casfs cat` gives it.
fn cat(ws: &crate::workspace::Ws, id: &str, path: &str) -> Vec<u8> {
    let out = std::process::Command::new(crate::common::casfs_bin())
        .arg("--store")
        .arg(&ws.store)
        .args(["cat", id, path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn writes_not_yet_closed_are_in_every_checkpoint() {
    let ws = mount("writers", &[]);
    fs::write(ws.p("mapped"), vec![b'a'; 4096]).unwrap();
    ws.checkpoint();
    // A writer that keeps its file open, checkpointed twice between its writes.
    let mut log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ws.p("log"))
        .unwrap();
    log.write_all(b"one\n").unwrap();
    let first = ws.checkpoint();
    let id = first["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(cat(&ws, &id, "log"), b"one\n", "{first}");
    log.write_all(b"two\n").unwrap();
    let second = ws.checkpoint();
    let id = second["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(cat(&ws, &id, "log"), b"one\ntwo\n", "{second}");
    assert!(changes(&second).0.contains(&"log".to_string()), "{second}");
    drop(log);
    // A write through a shared mapping whose descriptor is closed already.
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(ws.p("mapped"))
        .unwrap();
    // SAFETY: a fresh shared mapping of 4096 bytes of an open file, unmapped below.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(m, libc::MAP_FAILED);
    drop(f);
    // SAFETY: within the mapping made above.
    unsafe { std::ptr::write_bytes(m.cast::<u8>(), b'm', 8) };
    // SAFETY: the mapping made above.
    unsafe { libc::msync(m, 4096, libc::MS_SYNC) };
    let third = ws.checkpoint();
    let id = third["checkpoint"].as_str().unwrap().to_string();
    let got = cat(&ws, &id, "mapped");
    // SAFETY: the mapping made above, not used after.
    unsafe { libc::munmap(m, 4096) };
    assert_eq!(&got[..9], b"mmmmmmmma", "{third}");
}
