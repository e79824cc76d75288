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
//! Files that the stat cache shows unchanged are not rewritten.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use serde::Serialize;

use super::capture::{StatCache, StatEntry};
use super::{xattr, CheckpointError, CheckpointResult, Store};
use crate::cas::file::{file_objects, write_file_to};
use crate::cas::{load_tree, CasError, EntryContent, ObjectId, Tree, TreeEntry, TreeId};

#[derive(Debug, Default)]
pub struct RestoreProgress {
    pub files: AtomicU64,
    pub bytes_written: AtomicU64,
}

#[derive(Default)]
pub struct RestoreOptions<'a> {
    pub no_stat_cache: bool,
    pub progress: Option<&'a RestoreProgress>,
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
}

#[derive(Default)]
struct Counters {
    files_written: AtomicU64,
    files_unchanged: AtomicU64,
    bytes_written: AtomicU64,
    dirs: AtomicU64,
    symlinks: AtomicU64,
    special: AtomicU64,
    removed: AtomicU64,
}

struct Ctx<'a> {
    store: &'a Store,
    trees: HashMap<TreeId, Tree>,
    cache: StatCache,
    fresh_before_ns: i64,
    progress: Option<&'a RestoreProgress>,
    n: Counters,
    tmp_counter: AtomicU64,
}

/// Restores the tree `root` into `dest` (created if missing).
pub fn restore_tree(
    store: &Store,
    root: TreeId,
    dest: &Path,
    opts: &RestoreOptions<'_>,
) -> CheckpointResult<RestoreStats> {
    let start = Instant::now();
    let trees = preflight(store, root)?;
    fs::create_dir_all(dest).map_err(|e| CheckpointError::io(dest, e))?;
    let dest = fs::canonicalize(dest).map_err(|e| CheckpointError::io(dest, e))?;
    let c = cstr(dest.as_os_str().as_bytes(), &dest)?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(CheckpointError::io(&dest, io::Error::last_os_error()));
    }
    // SAFETY: fd was just opened and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let now_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i64;
    let ctx = Ctx {
        store,
        cache: StatCache::load(store, &dest, !opts.no_stat_cache)?,
        trees,
        fresh_before_ns: now_ns - Duration::from_secs(2).as_nanos() as i64,
        progress: opts.progress,
        n: Counters::default(),
        tmp_counter: AtomicU64::new(0),
    };
    let tree = &ctx.trees[&root];
    restore_dir(&ctx, fd.as_raw_fd(), &dest, b"", tree)?;
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
    };
    ctx.cache.save(store, true)?;
    Ok(stats)
}

/// Loads every tree under `root` and checks that every object the restore needs exists,
/// so that a missing or undecodable object stops the restore before anything changes.
fn preflight(store: &Store, root: TreeId) -> CheckpointResult<HashMap<TreeId, Tree>> {
    let mut trees = HashMap::new();
    let mut level = vec![root];
    while !level.is_empty() {
        let loaded: Vec<(TreeId, Tree)> = level
            .par_iter()
            .map(|id| Ok((*id, load_tree(store.objects(), id)?)))
            .collect::<CheckpointResult<_>>()?;
        let mut next = Vec::new();
        let mut files = Vec::new();
        for (id, tree) in loaded {
            for e in tree.entries() {
                match &e.content {
                    EntryContent::Dir(t) if !trees.contains_key(t) => next.push(*t),
                    EntryContent::File(_) => files.push(e.file_ref().expect("file")),
                    _ => {}
                }
            }
            trees.insert(id, tree);
        }
        files.sort_by_key(|f| f.id);
        files.dedup();
        files.par_iter().try_for_each(|f| -> CheckpointResult<()> {
            for id in file_objects(store.objects(), f)? {
                if !store.objects().contains(&id)? {
                    return Err(CasError::NotFound {
                        what: "chunk",
                        id: id.0,
                    }
                    .into());
                }
            }
            Ok(())
        })?;
        next.sort();
        next.dedup();
        level = next;
    }
    Ok(trees)
}

fn cstr(b: &[u8], path: &Path) -> CheckpointResult<CString> {
    CString::new(b).map_err(|_| CheckpointError::path(path, "name contains NUL"))
}

fn last_err(path: &Path) -> CheckpointError {
    CheckpointError::io(path, io::Error::last_os_error())
}

fn lstat_at(dir: RawFd, name: &CStr) -> io::Result<Option<libc::stat>> {
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid dirfd, NUL-terminated name, valid out pointer.
    let rc = unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if rc == 0 {
        return Ok(Some(st));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(e)
    }
}

fn open_dir_at(dir: RawFd, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: valid dirfd and name; O_NOFOLLOW refuses a symlink in place of a directory.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by the caller.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The names in an open directory (without `.` and `..`).
fn list_dir(dir: RawFd) -> io::Result<Vec<Vec<u8>>> {
    // SAFETY: dup of a valid fd; fdopendir takes ownership of the duplicate.
    let dup = unsafe { libc::fcntl(dir, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: dup is a valid directory fd we own.
    let d = unsafe { libc::fdopendir(dup) };
    if d.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: closing the fd fdopendir did not take.
        unsafe { libc::close(dup) };
        return Err(e);
    }
    // SAFETY: rewind in case the fd was read before.
    unsafe { libc::rewinddir(d) };
    let mut names = Vec::new();
    loop {
        // SAFETY: d is a valid DIR*; errno is reset to tell end from error.
        unsafe { *libc::__errno_location() = 0 };
        let ent = unsafe { libc::readdir64(d) };
        if ent.is_null() {
            let errno = unsafe { *libc::__errno_location() };
            // SAFETY: d is valid and closed once.
            unsafe { libc::closedir(d) };
            if errno != 0 {
                return Err(io::Error::from_raw_os_error(errno));
            }
            return Ok(names);
        }
        // SAFETY: d_name is NUL-terminated within the entry.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// Removes `name` in `dir`, recursively for directories, never following symlinks.
fn remove_at(dir: RawFd, name: &CStr, path: &Path) -> CheckpointResult<()> {
    let Some(st) = lstat_at(dir, name).map_err(|e| CheckpointError::io(path, e))? else {
        return Ok(());
    };
    if is_dir(&st) {
        let sub = open_dir_at(dir, name).map_err(|e| CheckpointError::io(path, e))?;
        for child in list_dir(sub.as_raw_fd()).map_err(|e| CheckpointError::io(path, e))? {
            let cpath = path.join(std::ffi::OsStr::from_bytes(&child));
            remove_at(sub.as_raw_fd(), &cstr(&child, &cpath)?, &cpath)?;
        }
        // SAFETY: valid dirfd and name.
        if unsafe { libc::unlinkat(dir, name.as_ptr(), libc::AT_REMOVEDIR) } != 0 {
            return Err(last_err(path));
        }
    } else if unsafe { libc::unlinkat(dir, name.as_ptr(), 0) } != 0 {
        // SAFETY (above): valid dirfd and name.
        return Err(last_err(path));
    }
    Ok(())
}

fn timespec(ns: i64) -> libc::timespec {
    libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    }
}

fn set_mtime_at(dir: RawFd, name: &CStr, mtime_ns: i64, path: &Path) -> CheckpointResult<()> {
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        timespec(mtime_ns),
    ];
    // SAFETY: valid dirfd, name and a two-element times array.
    let rc = unsafe {
        libc::utimensat(
            dir,
            name.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(last_err(path));
    }
    Ok(())
}

fn set_fd_meta(fd: RawFd, e: &TreeEntry, path: &Path) -> CheckpointResult<()> {
    // SAFETY: valid fd.
    if unsafe { libc::fchmod(fd, e.mode) } != 0 {
        return Err(last_err(path));
    }
    xattr::fsync_all(fd, &e.xattrs).map_err(|err| CheckpointError::io(path, err))?;
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        timespec(e.mtime_ns),
    ];
    // SAFETY: valid fd and a two-element times array.
    if unsafe { libc::futimens(fd, times.as_ptr()) } != 0 {
        return Err(last_err(path));
    }
    Ok(())
}

impl Ctx<'_> {
    fn tmp_name(&self) -> Vec<u8> {
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        format!(".casfs-restore-{}-{n}", std::process::id()).into_bytes()
    }
}

fn restore_dir(
    ctx: &Ctx<'_>,
    fd: RawFd,
    path: &Path,
    rel: &[u8],
    tree: &Tree,
) -> CheckpointResult<()> {
    // Remove what the tree does not have.
    let names = list_dir(fd).map_err(|e| CheckpointError::io(path, e))?;
    for name in names {
        if tree.get(&name).is_none() {
            let p = path.join(std::ffi::OsStr::from_bytes(&name));
            remove_at(fd, &cstr(&name, &p)?, &p)?;
            ctx.n.removed.fetch_add(1, Ordering::Relaxed);
        }
    }
    tree.entries().par_iter().try_for_each(|e| {
        let p = path.join(std::ffi::OsStr::from_bytes(&e.name));
        let mut child_rel = rel.to_vec();
        if !child_rel.is_empty() {
            child_rel.push(b'/');
        }
        child_rel.extend_from_slice(&e.name);
        restore_entry(ctx, fd, &p, &child_rel, e)
    })
}

fn restore_entry(
    ctx: &Ctx<'_>,
    dir: RawFd,
    path: &Path,
    rel: &[u8],
    e: &TreeEntry,
) -> CheckpointResult<()> {
    let name = cstr(&e.name, path)?;
    let existing = lstat_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?;
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
                    // SAFETY: valid dirfd and name.
                    if unsafe { libc::mkdirat(dir, name.as_ptr(), 0o700) } != 0 {
                        return Err(last_err(path));
                    }
                    open_dir_at(dir, &name).map_err(|err| CheckpointError::io(path, err))?
                }
            };
            let tree = ctx
                .trees
                .get(id)
                .ok_or_else(|| CheckpointError::path(path, format!("tree {id} not loaded")))?;
            restore_dir(ctx, sub.as_raw_fd(), path, rel, tree)?;
            set_fd_meta(sub.as_raw_fd(), e, path)?;
            ctx.n.dirs.fetch_add(1, Ordering::Relaxed);
        }
        EntryContent::File(id) => {
            let unchanged = existing.is_some_and(|st| {
                st.st_mode & libc::S_IFMT == libc::S_IFREG && {
                    // The cache decides on the same stat fields the capture uses.
                    let m = fs::symlink_metadata(path).ok();
                    m.is_some_and(|m| ctx.cache.lookup(rel, &m) == Some(*id))
                }
            });
            if unchanged {
                let f = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags_nofollow()
                    .open(path)
                    .map_err(|err| CheckpointError::io(path, err))?;
                let before = f.metadata().map_err(|err| CheckpointError::io(path, err))?;
                set_fd_meta(f.as_raw_fd(), e, path)?;
                let after = f.metadata().map_err(|err| CheckpointError::io(path, err))?;
                if !StatEntry::of(&before, *id).matches(&after) {
                    record(ctx, rel, &after, e);
                }
                ctx.n.files_unchanged.fetch_add(1, Ordering::Relaxed);
            } else {
                write_file(ctx, dir, &name, path, rel, e, existing)?;
            }
            if let Some(p) = ctx.progress {
                p.files.fetch_add(1, Ordering::Relaxed);
            }
        }
        EntryContent::Symlink(target) => {
            let same = existing.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK)
                && fs::read_link(path).is_ok_and(|t| t.as_os_str().as_bytes() == target.as_slice());
            if !same {
                let tmp = cstr(&ctx.tmp_name(), path)?;
                let t = cstr(target, path)?;
                // SAFETY: valid strings and dirfd.
                if unsafe { libc::symlinkat(t.as_ptr(), dir, tmp.as_ptr()) } != 0 {
                    return Err(last_err(path));
                }
                replace(dir, &tmp, &name, path, existing)?;
            }
            set_mtime_at(dir, &name, e.mtime_ns, path)?;
            ctx.n.symlinks.fetch_add(1, Ordering::Relaxed);
        }
        EntryContent::Fifo | EntryContent::CharDevice { .. } | EntryContent::BlockDevice { .. } => {
            let (kind, rdev) = match e.content {
                EntryContent::Fifo => (libc::S_IFIFO, 0),
                EntryContent::CharDevice { rdev } => (libc::S_IFCHR, rdev),
                EntryContent::BlockDevice { rdev } => (libc::S_IFBLK, rdev),
                _ => unreachable!(),
            };
            let same =
                existing.is_some_and(|st| st.st_mode & libc::S_IFMT == kind && st.st_rdev == rdev);
            if !same {
                let tmp = cstr(&ctx.tmp_name(), path)?;
                // SAFETY: valid dirfd and name.
                if unsafe { libc::mknodat(dir, tmp.as_ptr(), kind | 0o600, rdev) } != 0 {
                    return Err(last_err(path));
                }
                replace(dir, &tmp, &name, path, existing)?;
            }
            // SAFETY: valid dirfd and name; fifos and devices are not symlinks.
            if unsafe { libc::fchmodat(dir, name.as_ptr(), e.mode, 0) } != 0 {
                return Err(last_err(path));
            }
            set_mtime_at(dir, &name, e.mtime_ns, path)?;
            ctx.n.special.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

trait NoFollow {
    fn custom_flags_nofollow(&mut self) -> &mut Self;
}

impl NoFollow for fs::OpenOptions {
    fn custom_flags_nofollow(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY)
    }
}

/// Renames `tmp` over `name`, first removing a directory that stands there.
fn replace(
    dir: RawFd,
    tmp: &CStr,
    name: &CStr,
    path: &Path,
    existing: Option<libc::stat>,
) -> CheckpointResult<()> {
    if existing.is_some_and(|st| is_dir(&st)) {
        remove_at(dir, name, path)?;
    }
    // SAFETY: valid dirfd and names.
    if unsafe { libc::renameat(dir, tmp.as_ptr(), dir, name.as_ptr()) } != 0 {
        let err = last_err(path);
        // SAFETY: as above.
        unsafe { libc::unlinkat(dir, tmp.as_ptr(), 0) };
        return Err(err);
    }
    Ok(())
}

fn record(ctx: &Ctx<'_>, rel: &[u8], m: &fs::Metadata, e: &TreeEntry) {
    // A file whose restored mtime is recent could be changed again within the same
    // timestamp tick without notice; leave it for the next capture to read.
    if let EntryContent::File(id) = e.content {
        if e.mtime_ns < ctx.fresh_before_ns {
            ctx.cache.record(rel, StatEntry::of(m, id));
        }
    }
}

fn write_file(
    ctx: &Ctx<'_>,
    dir: RawFd,
    name: &CStr,
    path: &Path,
    rel: &[u8],
    e: &TreeEntry,
    existing: Option<libc::stat>,
) -> CheckpointResult<()> {
    let fref = e.file_ref().expect("a file entry");
    let tmp = loop {
        let tmp = cstr(&ctx.tmp_name(), path)?;
        // SAFETY: valid dirfd and name; O_EXCL|O_NOFOLLOW never opens an existing entry.
        let fd = unsafe {
            libc::openat(
                dir,
                tmp.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd >= 0 {
            // SAFETY: fd was just opened and is owned here.
            break (tmp, unsafe { File::from_raw_fd(fd) });
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(CheckpointError::io(path, err));
        }
    };
    let (tmp_name, mut file) = tmp;
    let result = (|| -> CheckpointResult<fs::Metadata> {
        write_file_to(ctx.store.objects(), &fref, &mut file, path)?;
        set_fd_meta(file.as_raw_fd(), e, path)?;
        file.metadata()
            .map_err(|err| CheckpointError::io(path, err))
    })();
    drop(file);
    match result {
        Ok(_) => {}
        Err(err) => {
            // SAFETY: valid dirfd and name.
            unsafe { libc::unlinkat(dir, tmp_name.as_ptr(), 0) };
            return Err(err);
        }
    };
    replace(dir, &tmp_name, name, path, existing)?;
    // The rename changed the inode's ctime: take the stat the next capture will see.
    if let Ok(meta) = fs::symlink_metadata(path) {
        record(ctx, rel, &meta, e);
    }
    ctx.n.files_written.fetch_add(1, Ordering::Relaxed);
    ctx.n.bytes_written.fetch_add(fref.size, Ordering::Relaxed);
    if let Some(p) = ctx.progress {
        p.bytes_written.fetch_add(fref.size, Ordering::Relaxed);
    }
    Ok(())
}

/// The checkpoint's files that a restore would need, as object ids (for tests and fsck).
pub fn objects_of_tree(store: &Store, root: TreeId) -> CheckpointResult<Vec<ObjectId>> {
    let trees = preflight(store, root)?;
    let mut out: Vec<ObjectId> = trees.keys().map(|t| ObjectId(t.0)).collect();
    for t in trees.values() {
        for e in t.entries() {
            if let Some(f) = e.file_ref() {
                out.extend(file_objects(store.objects(), &f)?);
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}
