//! The consistency check (`fsck`): every checkpoint record, head, lease and fencing
//! token; every object reachable from a record, a mount or the directory cache, read
//! and verified; every mount's dirty set and upper files; the overlay's images.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::live::{fence, stale_dircache, walk};
use crate::cas::remote_store::{RemoteGcOptions, RemoteGcReport};
use crate::checkpoint::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use crate::checkpoint::store::{key_hex, mount_dir_of_key, Store};
use crate::checkpoint::sync;
use crate::fs::dirty::{mount_keys, DirtyStore, Override};
use crate::fs::upper_rel;
use crate::sys::dirfd;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FsckReport {
    /// What is wrong: damaged or missing data something needs. Non-empty: exit non-zero.
    pub errors: Vec<String>,
    /// Harmless leftovers (a crashed mount's stray upper files, an undecodable cache
    /// entry): reported, removed by `--repair`.
    pub leftovers: Vec<String>,
    /// What `--repair` did.
    pub repaired: Vec<String>,
    pub checkpoints: usize,
    pub threads: usize,
    pub mounts: usize,
    pub objects_verified: u64,
    /// Objects in the store's RocksDB nothing live needs (with fleet objects, whose
    /// local cache also holds what is queued for upload: not looked for).
    pub unreachable_objects: u64,
    pub unreachable_bytes: u64,
    /// With fleet objects: what a collection of the remote's packs would do now (a
    /// dry run; `casfs gc` does it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteGcReport>,
    pub duration_ms: u64,
}

/// Checks the whole store: every checkpoint record, head, lease and fencing token;
/// every object reachable from a record, a mount or the directory cache (read and
/// verified); every mount's dirty set and upper files. `live` names mounts being served
/// now (their upper directories may hold copies the dirty set does not name).
///
/// `repair` only removes what is provably unneeded or rebuilds what is derivable: the
/// directory cache, undecodable lease records (fencing tokens are kept, and raised to
/// any lease's token), stray upper files of mounts not being served, and unreachable
/// objects (only when nothing live was unreadable).
pub fn fsck(store: &Store, repair: bool, live: &HashSet<[u8; 8]>) -> CheckpointResult<FsckReport> {
    let start = Instant::now();
    let mut rep = FsckReport::default();
    // The fence holds this host's captures off while the local store is marked and
    // swept. With fleet objects nothing local is swept (the cache also holds what is
    // queued for upload), so captures go on while the objects are read from S3.
    let collecting = match store.remote() {
        Some(_) => None,
        None => Some(fence(store)?),
    };
    let cps = store.checkpoints();
    let db = store.database();

    // Records, parents, heads.
    let records = cps.all_records()?;
    // Each readable record's thread, by id (heads and parents are looked up in it).
    let mut present: std::collections::HashMap<CheckpointId, ThreadId> =
        std::collections::HashMap::new();
    for (id, rec) in &records {
        match rec {
            Ok(cp) => {
                present.insert(*id, cp.body.thread_id.clone());
            }
            Err(e) => rep.errors.push(format!("checkpoint record {id}: {e}")),
        }
    }
    for (id, rec) in &records {
        if let Ok(cp) = rec {
            if let Some(p) = cp.body.parent_id {
                if !present.contains_key(&p) && !cps.is_pruned(&p)? {
                    rep.errors.push(format!(
                        "checkpoint {id}: parent {p} is missing (and was not pruned)"
                    ));
                }
            }
        }
    }
    rep.checkpoints = present.len();
    // Heads, leases and fencing tokens, as the checkpoint store keeps them.
    let stored: HashSet<CheckpointId> = records.iter().map(|(id, _)| *id).collect();
    let book = cps.bookkeeping(repair)?;
    rep.threads = book.heads.len();
    for (name, head) in &book.heads {
        match head {
            Err(e) => rep.errors.push(format!("head of thread {name:?}: {e}")),
            Ok(id) => match present.get(id) {
                // Not among the records read: looked up again, since with fleet
                // checkpoints another host may have appended meanwhile.
                None if !stored.contains(id) && cps.get(id).is_err() => rep.errors.push(format!(
                    "head of thread {name:?}: checkpoint {id} is missing"
                )),
                // A record that does not decode (reported above), or one appended since.
                None => {}
                Some(t) if t.as_str() != name => rep.errors.push(format!(
                    "head of thread {name:?}: checkpoint {id} belongs to thread {:?}",
                    t.as_str()
                )),
                Some(_) => {}
            },
        }
    }
    rep.errors.extend(book.errors);
    rep.leftovers.extend(book.leftovers);
    rep.repaired.extend(book.repaired);

    // Objects.
    let w = walk(store, true)?;
    rep.mounts = w.mounts;
    rep.objects_verified = w.marker.objects_read;
    rep.errors.extend(w.problems.iter().map(|p| p.to_string()));
    // Dirty sets and upper files.
    let keys = mount_keys(db)?;
    for key in &keys {
        check_mount(store, key, live.contains(key), repair, &mut rep)?;
    }
    // Mount directories with nothing in the database: left by a mount whose record was
    // cleared (their files are nothing's).
    let known: HashSet<String> = keys.iter().chain(live).map(key_hex).collect();
    let mounts_dir = store.root().join("mounts");
    if let Ok(rd) = std::fs::read_dir(&mounts_dir) {
        for e in rd.flatten() {
            if known.contains(e.file_name().to_string_lossy().as_ref()) {
                continue;
            }
            let upper = e.path().join("upper");
            let mut stray = Vec::new();
            collect_files(&upper, &mut stray);
            if !stray.is_empty() {
                rep.leftovers.push(format!(
                    "{}: {} upper file(s) of a mount with no dirty set",
                    upper.display(),
                    stray.len()
                ));
                if repair {
                    remove_files(&upper, &stray)?;
                    rep.repaired.push(format!(
                        "removed {} stray file(s) in {}",
                        stray.len(),
                        upper.display()
                    ));
                }
            }
        }
    }

    check_images(store, repair, &mut rep);

    // Unreachable objects: counted; swept by a repair when nothing live was unreadable.
    // With fleet objects the local store is a cache that also holds what is queued for
    // upload (named by nothing yet): it is not swept, nor counted.
    let fleet_objects = store.remote().is_some();
    let dry = !(repair && w.problems.is_empty()) || fleet_objects;
    let marked = w.marker.into_marked();
    if let Some(remote) = store.remote() {
        let o = RemoteGcOptions {
            dry_run: true,
            ..RemoteGcOptions::default()
        };
        rep.remote = Some(remote.collect(&marked, &o)?);
    }
    let (_, stale, example) = stale_dircache(store, &marked, !dry)?;
    if stale > 0 {
        rep.leftovers.push(format!(
            "directory cache: {stale} cached director(y/ies) name objects nothing live keeps \
             (for example {}); derivable, dropped by gc",
            example.unwrap_or_default()
        ));
        if !dry {
            rep.repaired
                .push(format!("dropped {stale} stale directory cache entr(y/ies)"));
        }
    }
    let sweep = match &collecting {
        Some(fence) => store.local_objects().sweep(&marked, fence, dry)?,
        None => crate::cas::SweepReport::default(),
    };
    rep.unreachable_objects = sweep.objects_freed;
    rep.unreachable_bytes = sweep.bytes_freed;
    if !dry && sweep.objects_freed > 0 {
        rep.repaired.push(format!(
            "deleted {} unreachable object(s) ({} bytes)",
            sweep.objects_freed, sweep.bytes_freed
        ));
    }
    drop(collecting);
    if !dry && sweep.objects_freed > 0 {
        store.local_objects().reclaim()?;
    }
    rep.duration_ms = start.elapsed().as_millis() as u64;
    Ok(rep)
}

/// The overlay's EROFS images: each must be, byte for byte, its tree's (an image damaged
/// on disk would show wrong names, sizes or contents). A damaged one is an error that
/// `--repair` removes (the next mount rebuilds it); one whose tree is gone is a leftover.
fn check_images(store: &Store, repair: bool, rep: &mut FsckReport) {
    let Ok(rd) = std::fs::read_dir(crate::checkpoint::store::images_dir(store.root())) else {
        return;
    };
    for e in rd.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        // Images only (`store::image_name`): markers and a build's temporary files are
        // the mount's.
        let Some(tree) = name
            .strip_suffix(".erofs")
            .and_then(crate::checkpoint::store::image_tree)
        else {
            continue;
        };
        if crate::cas::load_tree(store.objects(), &tree).is_err() {
            rep.leftovers.push(format!(
                "{}: the image of a tree the store no longer holds",
                path.display()
            ));
            if repair && std::fs::remove_file(&path).is_ok() {
                rep.repaired.push(format!("removed {}", path.display()));
            }
            continue;
        }
        match crate::fs::erofs::image_matches(store.objects(), &tree, &path) {
            Ok(true) => {}
            Ok(false) => {
                rep.errors.push(format!(
                    "{}: the image differs from its tree (damaged); --repair removes it, the \
                     next mount rebuilds it",
                    path.display()
                ));
                if repair && std::fs::remove_file(&path).is_ok() {
                    rep.repaired
                        .push(format!("removed the damaged image {}", path.display()));
                }
            }
            Err(err) => rep.errors.push(format!("{}: {err}", path.display())),
        }
    }
}

/// Removes `files` (found by [`collect_files`] below `upper`), each through a handle of
/// its directory opened beneath `upper`: no link followed, nothing outside it removed.
fn remove_files(upper: &Path, files: &[PathBuf]) -> CheckpointResult<()> {
    use std::os::fd::AsFd;
    use std::os::unix::ffi::OsStrExt;
    let top = sync::open_dir(upper)?;
    for p in files {
        let io = |e| CheckpointError::io(p, e);
        let rel = p
            .strip_prefix(upper)
            .map_err(|_| CheckpointError::path(p, "not below the upper directory"))?;
        let (Some(name), parent) = (rel.file_name(), rel.parent()) else {
            continue;
        };
        let parent = parent.map(|d| d.as_os_str().as_bytes()).unwrap_or_default();
        let dir = dirfd::open_dir_beneath(top.as_fd(), parent).map_err(io)?;
        let name = sync::cstr(name.as_bytes(), p)?;
        match dirfd::unlink_at(dir.as_fd(), &name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// Checks one mount's dirty set against itself and its upper directory.
fn check_mount(
    store: &Store,
    key: &[u8; 8],
    live: bool,
    repair: bool,
    rep: &mut FsckReport,
) -> CheckpointResult<()> {
    let d = DirtyStore::new(store.database().clone(), *key);
    let dir = mount_dir_of_key(store.root(), key);
    let hex = key_hex(key);
    let nodes = match d.nodes() {
        Ok(n) => n,
        // Reported by the walk.
        Err(_) => return Ok(()),
    };
    let inodes: HashSet<u64> = nodes.iter().map(|(i, _)| *i).collect();
    match d.all_entries() {
        Ok(entries) => {
            for (parent, name, o) in entries {
                if let Override::Node(ino) = o {
                    if !inodes.contains(&ino) {
                        rep.errors.push(format!(
                            "mount {hex}: entry {:?} of directory inode {parent} names inode {ino}, which has no record",
                            String::from_utf8_lossy(&name)
                        ));
                    }
                }
            }
        }
        Err(e) => rep.errors.push(format!("mount {hex}: {e}")),
    }
    let upper = dir.join("upper");
    let mut wanted: HashSet<PathBuf> = HashSet::new();
    for (ino, n) in &nodes {
        if n.upper {
            let p = upper.join(upper_rel(*ino));
            if !p.is_file() {
                rep.errors.push(format!(
                    "mount {hex}: the upper file of inode {ino} ({}) is missing: its uncaptured content is lost",
                    p.display()
                ));
            }
            wanted.insert(p);
        }
    }
    if live {
        // A served mount keeps local copies of clean files and files still open after
        // an unlink: its upper directory is its own business until it stops.
        return Ok(());
    }
    let mut stray = Vec::new();
    collect_files(&upper, &mut stray);
    stray.retain(|p| !wanted.contains(p));
    if !stray.is_empty() {
        rep.leftovers.push(format!(
            "mount {hex}: {} upper file(s) no record needs (local copies of clean files, or left by a crash; the next mount removes them), for example {}",
            stray.len(),
            stray[0].display()
        ));
        if repair {
            remove_files(&upper, &stray)?;
            rep.repaired.push(format!(
                "mount {hex}: removed {} stray upper file(s)",
                stray.len()
            ));
        }
    }
    Ok(())
}

/// The files below `dir`, walked through directory handles (no link followed, nothing
/// outside `dir` listed).
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    use std::os::fd::AsFd;
    let Ok(top) = dirfd::open_dir_path(dir) else {
        return;
    };
    collect_files_at(top.as_fd(), dir, out);
}

fn collect_files_at(fd: std::os::fd::BorrowedFd<'_>, path: &Path, out: &mut Vec<PathBuf>) {
    use std::os::fd::AsFd;
    let Ok(names) = dirfd::list_dir(fd) else {
        return;
    };
    for name in names {
        let p = dirfd::child(path, &name);
        let Ok(c) = sync::cstr(&name, &p) else {
            continue;
        };
        match dirfd::lstat_at(fd, &c) {
            Ok(Some(m)) if m.is_dir() => {
                if let Ok(sub) = dirfd::open_dir_at(fd, &c) {
                    collect_files_at(sub.as_fd(), &p, out);
                }
            }
            Ok(Some(_)) => out.push(p),
            _ => {}
        }
    }
}
