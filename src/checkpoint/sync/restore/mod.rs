//! Restore of a checkpoint's tree into a plain directory.
//!
//! The destination is made to match the tree exactly: extra entries are removed, files,
//! symlinks, fifos and directories are created or replaced, and modes, mtimes and xattrs
//! set. Every operation below the destination goes through directory file descriptors
//! (`openat`, `mkdirat`, `renameat`, ... with `O_NOFOLLOW`), so nothing is ever written
//! outside it, whatever symlinks the destination holds; stored names cannot contain `/`,
//! `..` or NUL (the tree decoder refuses them). Files are written to a temporary name
//! and renamed into place only after every object they are made of has been verified.
//! Before anything is touched, every tree is loaded and every object checked to exist.
//! Entries that the directory cache shows unchanged since the last capture or restore
//! are not touched. From a remote store, the contents of the files to write are fetched
//! a group of neighbouring entries at a time (`ObjectStore::stage`) into memory and
//! written from there, while other groups are fetched or written.

mod context;
mod preflight;
mod uncaptured;

pub use context::RestoreProgress;

use context::{join_rel, seen_on_disk, Counters, Ctx, Reading};
use preflight::{preflight, weight_of, Preflight};
pub use uncaptured::uncaptured_changes;

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs::{self, File};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use serde::Serialize;

use super::dircache::{DirCache, DirCacheSet};
use super::{cstr, open_dir, remove_at};
use crate::cas::file::write_file_to;
use crate::cas::{EntryContent, ObjectId, ObjectStore, StagedReader, Tree, TreeEntry, TreeId};
use crate::checkpoint::ids::{CheckpointError, CheckpointResult};
use crate::checkpoint::record::RootMeta;
use crate::checkpoint::store::Store;
use crate::sys::dirfd::{
    child, create_at, fchmod, file_type, fstat, is_dir, list_dir, lstat_at, mkdir_at, mknod_at,
    open_dir_at, readlink_at, rename_at, set_fd_mtime, symlink_at, unlink_at, Entry, Fingerprint,
    Meta,
};
use crate::sys::xattr;

/// From a remote store, a restore reads file contents ahead in groups of entries of at
/// most this many bytes (decoded), kept in memory only until they are written; about
/// one group per thread is in memory at a time (a thread waiting inside a group may take
/// up another). 64 MiB took 3.4 s and 45 requests to
/// restore 100k files (688 MB) on 2 cores in `cargo bench --bench fleet`, 32 MiB 3.8 s
/// and 73.
pub const STAGE_BYTES: u64 = 64 << 20;

/// With many threads, groups are smaller: together they hold at most about this much.
const STAGED_TOTAL: u64 = 256 << 20;

/// The default group size for this process's thread pool: [`STAGE_BYTES`], less where
/// many threads would hold more than [`STAGED_TOTAL`] together (at least 1 MiB).
fn default_stage_bytes() -> u64 {
    let threads = rayon::current_num_threads().max(1) as u64;
    STAGE_BYTES.min(STAGED_TOTAL / threads).max(1 << 20)
}

#[derive(Default)]
pub struct RestoreOptions<'a> {
    pub no_stat_cache: bool,
    pub progress: Option<&'a RestoreProgress>,
    /// The directory's own mode and mtime, set last (after its entries, whose changes
    /// move its mtime). When it is a mountpoint, they are those of the mounted root.
    pub root_meta: Option<RootMeta>,
    /// From a remote store: the bytes of file contents read ahead at once (about one
    /// such group per thread is in memory); when not set, [`STAGE_BYTES`], or less with
    /// more than 4 threads (256 MiB in all).
    pub stage_bytes: Option<u64>,
    /// Whose (uid, gid) every entry the restore writes is: set on each before its mode,
    /// so no file of the process's own user (root's, in `casfs serve`) with a set-id bit
    /// ever stands in a directory another user controls. None: the process's own.
    pub owner: Option<(u32, u32)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RestoreStats {
    pub files_written: u64,
    pub files_unchanged: u64,
    pub bytes_written: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub special: u64,
    /// Entries removed because the checkpoint does not have them.
    pub removed: u64,
    pub duration_ms: u64,
    /// Of which: loading the trees and making sure every object is present (fetched,
    /// from a remote object store) before the first write.
    pub preflight_ms: u64,
}

/// Restores the tree `root` into `dest` (created if missing).
pub fn restore_tree(
    store: &Store,
    root: TreeId,
    dest: &Path,
    opts: &RestoreOptions<'_>,
) -> CheckpointResult<RestoreStats> {
    let start = Instant::now();
    // Garbage collection waits until this restore is done with the checkpoint's objects.
    let _session = crate::cas::write_session(store.objects());
    // From a remote store, file contents are fetched while files are written, in groups
    // (`stage`), straight into the files; a local store's are read where they are.
    let staging = store.remote().is_some();
    let Preflight { trees, chunks } = preflight(store, root, staging)?;
    let mut weights = HashMap::new();
    if staging {
        weight_of(&trees, root, &mut weights);
    }
    let preflight_ms = start.elapsed().as_millis() as u64;
    fs::create_dir_all(dest).map_err(|e| CheckpointError::io(dest, e))?;
    let dest = fs::canonicalize(dest).map_err(|e| CheckpointError::io(dest, e))?;
    let fd = open_dir(&dest)?;
    let now_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i64;
    let ctx = Ctx {
        cache: DirCacheSet::new(store, &dest, !opts.no_stat_cache),
        trees,
        chunks,
        weights,
        stage_bytes: opts.stage_bytes.unwrap_or_else(default_stage_bytes).max(1),
        fresh_before_ns: now_ns - Duration::from_secs(2).as_nanos() as i64,
        progress: opts.progress,
        n: Counters::default(),
        tmp_counter: AtomicU64::new(0),
        owner: opts.owner,
    };
    let rd = Reading {
        objects: store.objects(),
        stage: staging,
    };
    crate::on_deep_pool(|| restore_dir(&ctx, rd, fd.as_fd(), &dest, b"", root))?;
    if let Some(m) = opts.root_meta {
        let io = |e| CheckpointError::io(&dest, e);
        fchmod(fd.as_fd(), m.mode).map_err(io)?;
        set_fd_mtime(fd.as_fd(), m.mtime_ns).map_err(io)?;
    }
    let n = &ctx.n;
    let stats = RestoreStats {
        files_written: n.files_written.load(Ordering::Relaxed),
        files_unchanged: n.files_unchanged.load(Ordering::Relaxed),
        bytes_written: n.bytes_written.load(Ordering::Relaxed),
        dirs: n.dirs.load(Ordering::Relaxed),
        symlinks: n.symlinks.load(Ordering::Relaxed),
        special: n.special.load(Ordering::Relaxed),
        removed: n.removed.load(Ordering::Relaxed),
        duration_ms: start.elapsed().as_millis() as u64,
        preflight_ms,
    };
    ctx.cache.save()?;
    Ok(stats)
}

fn set_fd_meta(
    fd: BorrowedFd<'_>,
    e: &TreeEntry,
    path: &Path,
    owner: Option<(u32, u32)>,
) -> CheckpointResult<()> {
    let io = |err| CheckpointError::io(path, err);
    // The owner first: a mode with set-id bits is given to a file already theirs.
    if let Some((uid, gid)) = owner {
        rustix::fs::fchown(
            fd,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )
        .map_err(|e| io(std::io::Error::from(e)))?;
    }
    fchmod(fd, e.mode).map_err(io)?;
    xattr::fsync_all(fd.as_raw_fd(), &e.xattrs).map_err(io)?;
    set_fd_mtime(fd, e.mtime_ns).map_err(io)
}

/// Sets the mode (but of a symlink) and mtime of the entry `name` of `dir` this restore
/// just made: through the entry opened, checked to be of `kind` (and `rdev`), so that
/// nothing another file renamed over the name meanwhile is changed (`chmod` by name
/// would follow a symlink put there).
fn set_entry_meta(
    dir: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
    e: &TreeEntry,
    kind: u32,
    rdev: u64,
    owner: Option<(u32, u32)>,
) -> CheckpointResult<Meta> {
    let io = |err| CheckpointError::io(path, err);
    let entry = Entry::open(dir, name).map_err(io)?;
    if entry.meta.kind() != kind || (kind != libc::S_IFLNK && entry.meta.rdev != rdev) {
        return Err(CheckpointError::path(
            path,
            "replaced by another file while it was being restored",
        ));
    }
    if let Some((uid, gid)) = owner {
        entry.chown(uid, gid).map_err(io)?;
    }
    if kind != libc::S_IFLNK {
        entry.chmod(e.mode).map_err(io)?;
    }
    entry.set_mtime(e.mtime_ns).map_err(io)?;
    fstat(entry.fd()).map_err(io)
}

/// Entries of one directory restored together: one on its own (a directory whose files
/// are too many bytes to stage at once, which groups its own entries, or a file that
/// large), or a group whose contents are staged at once.
#[derive(Debug, PartialEq, Eq)]
enum Unit {
    One(usize),
    Group(Vec<usize>),
}

/// Splits `entries` into units of at most `limit` bytes of content (`weight`),
/// neighbours together (a capture packs a directory's files near each other).
fn units(entries: &[TreeEntry], weight: impl Fn(&TreeEntry) -> u64, limit: u64) -> Vec<Unit> {
    let mut out = Vec::new();
    let (mut group, mut bytes) = (Vec::new(), 0);
    for (i, e) in entries.iter().enumerate() {
        let w = weight(e);
        if w > limit {
            out.push(Unit::One(i));
            continue;
        }
        if bytes + w > limit && !group.is_empty() {
            out.push(Unit::Group(std::mem::take(&mut group)));
            bytes = 0;
        }
        group.push(i);
        bytes += w;
    }
    if !group.is_empty() {
        out.push(Unit::Group(group));
    }
    out
}

/// Restores the entries of `tree`, in parallel, each with the fingerprint to remember
/// for it, in the tree's order. Unless contents are staged already, they are staged
/// a unit at a time, so the fetch of one unit runs while another is written.
fn restore_entries(
    ctx: &Ctx<'_>,
    rd: Reading<'_>,
    fd: BorrowedFd<'_>,
    path: &Path,
    rel: &[u8],
    tree: &Tree,
    cached: Option<&DirCache>,
) -> CheckpointResult<Vec<Option<Fingerprint>>> {
    let entries = tree.entries();
    let one = |rd: Reading<'_>, i: usize| {
        let e = &entries[i];
        let p = child(path, &e.name);
        restore_entry(ctx, rd, fd, &p, &join_rel(rel, &e.name), e, cached)
    };
    // The objects the restore of these entries will read (sorted, once each).
    let needed = |idx: &[usize]| -> CheckpointResult<Vec<ObjectId>> {
        let mut ids = Vec::new();
        for e in idx.iter().map(|&i| &entries[i]) {
            let (p, r) = (child(path, &e.name), join_rel(rel, &e.name));
            ctx.needed(Some(fd), &p, &r, e, cached, &mut ids)?;
        }
        ids.sort_by_key(|id| id.0);
        ids.dedup();
        Ok(ids)
    };
    if !rd.stage {
        return entries
            .par_iter()
            .enumerate()
            .with_min_len(4)
            .map(|(i, _)| one(rd, i))
            .collect();
    }
    let done = units(entries, |e| ctx.weight(e), ctx.stage_bytes)
        .into_par_iter()
        .map(
            |unit| -> CheckpointResult<Vec<(usize, Option<Fingerprint>)>> {
                match unit {
                    Unit::One(i) => {
                        if let EntryContent::File(_) = entries[i].content {
                            // A file too large to stage: its chunks go to the local store.
                            rd.objects.prefetch(&needed(&[i])?);
                        }
                        Ok(vec![(i, one(rd, i)?)])
                    }
                    Unit::Group(idx) => {
                        // Only what will be written is fetched.
                        let staged = rd.objects.stage(&needed(&idx)?);
                        let reader = StagedReader::new(&staged, rd.objects);
                        let rd = Reading {
                            objects: &reader,
                            stage: false,
                        };
                        idx.into_par_iter()
                            .with_min_len(4)
                            .map(|i| Ok((i, one(rd, i)?)))
                            .collect()
                    }
                }
            },
        )
        .collect::<CheckpointResult<Vec<_>>>()?;
    let mut fingerprints = vec![None; entries.len()];
    for (i, fp) in done.into_iter().flatten() {
        fingerprints[i] = fp;
    }
    Ok(fingerprints)
}

fn restore_dir(
    ctx: &Ctx<'_>,
    rd: Reading<'_>,
    fd: BorrowedFd<'_>,
    path: &Path,
    rel: &[u8],
    tree_id: TreeId,
) -> CheckpointResult<()> {
    let tree = ctx
        .trees
        .get(&tree_id)
        .ok_or_else(|| CheckpointError::path(path, format!("tree {tree_id} not loaded")))?;
    let cached = ctx.cache.get(rel)?;
    // Remove what the tree does not have.
    for name in list_dir(fd).map_err(|e| CheckpointError::io(path, e))? {
        if tree.get(&name).is_none() {
            let p = child(path, &name);
            remove_at(fd, &cstr(&name, &p)?, &p)?;
            ctx.n.removed.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Some(c) = &cached {
        for e in c.tree.entries() {
            if e.tree_id().is_some() && tree.get(&e.name).and_then(|n| n.tree_id()).is_none() {
                ctx.cache.forget_subtree(&join_rel(rel, &e.name));
            }
        }
    }
    let fingerprints = restore_entries(ctx, rd, fd, path, rel, tree, cached.as_ref())?;
    ctx.cache.put(
        rel,
        &DirCache {
            tree_id,
            tree: tree.clone(),
            fingerprints,
        },
    );
    Ok(())
}

/// Makes one entry match `e`; returns the fingerprint to remember for it.
fn restore_entry(
    ctx: &Ctx<'_>,
    rd: Reading<'_>,
    dir: BorrowedFd<'_>,
    path: &Path,
    rel: &[u8],
    e: &TreeEntry,
    cached: Option<&DirCache>,
) -> CheckpointResult<Option<Fingerprint>> {
    let name = cstr(&e.name, path)?;
    let existing = lstat_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?;
    // The cached entry, if the thing on disk is still exactly what the cache saw.
    let seen = existing.and_then(|st| seen_on_disk(cached, &e.name, &st));
    match &e.content {
        EntryContent::Dir(id) => {
            let sub = match existing {
                Some(st) if is_dir(&st) => {
                    open_dir_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?
                }
                other => {
                    if other.is_some() {
                        remove_at(dir, &name, path)?;
                    }
                    mkdir_at(dir, &name, 0o700).map_err(|err| CheckpointError::io(path, err))?;
                    open_dir_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?
                }
            };
            restore_dir(ctx, rd, sub.as_fd(), path, rel, *id)?;
            set_fd_meta(sub.as_fd(), e, path, ctx.owner)?;
            ctx.n.dirs.fetch_add(1, Ordering::Relaxed);
            let st = fstat(sub.as_fd()).map_err(|err| CheckpointError::io(path, err))?;
            Ok(ctx.trusted(e, &st))
        }
        EntryContent::File(_) => {
            if let Some(p) = ctx.progress {
                p.files.fetch_add(1, Ordering::Relaxed);
            }
            match seen {
                Some((c, fp)) if c == e => {
                    ctx.n.files_unchanged.fetch_add(1, Ordering::Relaxed);
                    Ok(Some(fp))
                }
                Some((c, _)) if c.content == e.content && c.size == e.size => {
                    // Same content, other metadata: fix it in place, on the file opened
                    // (still the one the cache saw: never what was renamed over it).
                    let io = |err| CheckpointError::io(path, err);
                    let entry = Entry::open(dir, &name).map_err(io)?;
                    if !existing.is_some_and(|st| st.same_file(&entry.meta)) {
                        return write_file(ctx, rd.objects, dir, &name, path, e, existing);
                    }
                    let f = entry.open_read().map_err(io)?;
                    set_fd_meta(f.as_fd(), e, path, ctx.owner)?;
                    let st = fstat(f.as_fd()).map_err(io)?;
                    ctx.n.files_unchanged.fetch_add(1, Ordering::Relaxed);
                    Ok(ctx.trusted(e, &st))
                }
                _ => write_file(ctx, rd.objects, dir, &name, path, e, existing),
            }
        }
        EntryContent::Symlink(target) => {
            ctx.n.symlinks.fetch_add(1, Ordering::Relaxed);
            if let Some((c, fp)) = seen {
                if c == e {
                    return Ok(Some(fp));
                }
            }
            let same = existing.is_some_and(|st| file_type(&st) == libc::S_IFLNK)
                && readlink_at(dir, &name).is_ok_and(|t| &t == target);
            if !same {
                let tmp = cstr(&ctx.tmp_name(), path)?;
                let t = cstr(target, path)?;
                symlink_at(dir, &t, &tmp).map_err(|err| CheckpointError::io(path, err))?;
                replace(dir, &tmp, &name, path, existing)?;
            }
            let st = set_entry_meta(dir, &name, path, e, libc::S_IFLNK, 0, ctx.owner)?;
            Ok(ctx.trusted(e, &st))
        }
        EntryContent::Fifo | EntryContent::CharDevice { .. } | EntryContent::BlockDevice { .. } => {
            ctx.n.special.fetch_add(1, Ordering::Relaxed);
            if let Some((c, fp)) = seen {
                if c == e {
                    return Ok(Some(fp));
                }
            }
            let (kind, rdev) = match e.content {
                EntryContent::Fifo => (libc::S_IFIFO, 0),
                EntryContent::CharDevice { rdev } => (libc::S_IFCHR, rdev),
                EntryContent::BlockDevice { rdev } => (libc::S_IFBLK, rdev),
                _ => unreachable!("matched above"),
            };
            let same = existing.is_some_and(|st| file_type(&st) == kind && st.rdev == rdev);
            if !same {
                let tmp = cstr(&ctx.tmp_name(), path)?;
                mknod_at(dir, &tmp, kind, rdev).map_err(|err| CheckpointError::io(path, err))?;
                replace(dir, &tmp, &name, path, existing)?;
            }
            let st = set_entry_meta(dir, &name, path, e, kind, rdev, ctx.owner)?;
            Ok(ctx.trusted(e, &st))
        }
    }
}

/// Writes a file where nothing stands (a fresh restore's every file): created under its
/// own name, with no temporary name to rename and look up again afterwards. A
/// restore that dies halfway leaves a partial file that no restore recorded, which the
/// next restore rewrites (and, without `--force`, names as an uncaptured change).
fn write_new_file(
    ctx: &Ctx<'_>,
    objects: &dyn ObjectStore,
    dir: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
    e: &TreeEntry,
) -> CheckpointResult<Option<Fingerprint>> {
    let fref = e.file_ref().expect("a file entry");
    let fd = create_at(dir, name, 0o600).map_err(|err| CheckpointError::io(path, err))?;
    let mut file = File::from(fd);
    let result = (|| -> CheckpointResult<Meta> {
        write_file_to(objects, &fref, &mut file, path)?;
        let fd = file.as_fd();
        // Attributes listed, not only set: a directory's default ACL gives a new file
        // attributes the checkpoint may not have.
        set_fd_meta(fd, e, path, ctx.owner)?;
        fstat(fd).map_err(|err| CheckpointError::io(path, err))
    })();
    drop(file);
    let st = match result {
        Ok(st) => st,
        Err(err) => {
            // The file this call made.
            let _ = unlink_at(dir, name);
            return Err(err);
        }
    };
    ctx.wrote(fref.size);
    Ok(ctx.trusted(e, &st))
}

/// Renames `tmp` over `name`, first removing a directory that stands there.
fn replace(
    dir: BorrowedFd<'_>,
    tmp: &CStr,
    name: &CStr,
    path: &Path,
    existing: Option<Meta>,
) -> CheckpointResult<()> {
    if existing.is_some_and(|st| is_dir(&st)) {
        remove_at(dir, name, path)?;
    }
    if let Err(err) = rename_at(dir, tmp, name) {
        let _ = unlink_at(dir, tmp);
        return Err(CheckpointError::io(path, err));
    }
    Ok(())
}

fn write_file(
    ctx: &Ctx<'_>,
    objects: &dyn ObjectStore,
    dir: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
    e: &TreeEntry,
    existing: Option<Meta>,
) -> CheckpointResult<Option<Fingerprint>> {
    let fref = e.file_ref().expect("a file entry");
    if existing.is_none() {
        return write_new_file(ctx, objects, dir, name, path, e);
    }
    let (tmp, fd) = loop {
        let tmp = cstr(&ctx.tmp_name(), path)?;
        // O_EXCL never opens an existing entry.
        match create_at(dir, &tmp, 0o600) {
            Ok(fd) => break (tmp, fd),
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(err) => return Err(CheckpointError::io(path, err)),
        }
    };
    let mut file = File::from(fd);
    let result = (|| -> CheckpointResult<()> {
        write_file_to(objects, &fref, &mut file, path)?;
        set_fd_meta(file.as_fd(), e, path, ctx.owner)
    })();
    if let Err(err) = result {
        drop(file);
        let _ = unlink_at(dir, &tmp);
        return Err(err);
    }
    replace(dir, &tmp, name, path, existing)?;
    ctx.wrote(fref.size);
    // The rename changed the inode's ctime: take the stat the next capture will see, of
    // the file written (whatever is renamed over its name since).
    let st = fstat(file.as_fd()).map_err(|err| CheckpointError::io(path, err))?;
    Ok(ctx.trusted(e, &st))
}

#[cfg(test)]
mod tests;
