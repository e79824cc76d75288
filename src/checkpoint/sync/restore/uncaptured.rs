//! The directory cache's look for uncaptured work: what a restore over a directory
//! would lose.

use std::ffi::CStr;
use std::fs;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use super::context::join_rel;
use crate::cas::file::hash_reader;
use crate::cas::{EntryContent, TreeEntry};
use crate::checkpoint::ids::{CheckpointError, CheckpointResult};
use crate::checkpoint::store::Store;
use crate::checkpoint::sync::dircache::DirCacheSet;
use crate::checkpoint::sync::{cstr, open_dir};
use crate::sys::dirfd::{
    child, file_type, is_dir, list_dir, lstat_at, open_dir_at, readlink_at, Entry, Fingerprint,
    Meta,
};

/// Paths under `dir` whose current state no capture or restore of `dir` recorded:
/// restoring over them would lose work. New entries, and entries whose content or
/// metadata changed, count; entries that were deleted do not (a restore brings them
/// back). At most `limit` paths are returned; a missing `dir` has none.
pub fn uncaptured_changes(
    store: &Store,
    dir: &Path,
    limit: usize,
) -> CheckpointResult<Vec<String>> {
    let dir = match fs::canonicalize(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(dir, e)),
    };
    let fd = open_dir(&dir)?;
    let cache = DirCacheSet::new(store, &dir, true);
    let mut out = Vec::new();
    find_changes(&cache, fd.as_fd(), &dir, b"", limit, &mut out)?;
    Ok(out)
}

fn find_changes(
    cache: &DirCacheSet<'_>,
    fd: BorrowedFd<'_>,
    path: &Path,
    rel: &[u8],
    limit: usize,
    out: &mut Vec<String>,
) -> CheckpointResult<()> {
    let cached = cache.get(rel)?;
    for name in list_dir(fd).map_err(|e| CheckpointError::io(path, e))? {
        if out.len() >= limit {
            return Ok(());
        }
        let p = child(path, &name);
        let cname = cstr(&name, &p)?;
        let Some(st) = lstat_at(fd, &cname).map_err(|e| CheckpointError::io(&p, e))? else {
            continue;
        };
        let rel_name = join_rel(rel, &name);
        let shown = || {
            let mut s = String::from_utf8_lossy(&rel_name).into_owned();
            if is_dir(&st) {
                s.push('/');
            }
            s
        };
        let Some((_, e, fp)) = cached.as_ref().and_then(|c| c.find(&name)) else {
            out.push(shown());
            continue;
        };
        if is_dir(&st) {
            if e.tree_id().is_none() {
                out.push(shown());
                continue;
            }
            let sub = open_dir_at(fd, &cname).map_err(|err| CheckpointError::io(&p, err))?;
            find_changes(cache, sub.as_fd(), &p, &rel_name, limit, out)?;
        } else if fp != Some(Fingerprint::of(&st)) && !same_file(fd, &cname, &p, &st, e)? {
            out.push(shown());
        }
    }
    Ok(())
}

/// For an entry without a trusted fingerprint: whether what is on disk still has the
/// recorded content (files are read and hashed, nothing stored; symlinks compared by
/// target; fifos and devices by kind).
fn same_file(
    dir: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
    st: &Meta,
    e: &TreeEntry,
) -> CheckpointResult<bool> {
    let kind = file_type(st);
    let want = match &e.content {
        EntryContent::File(_) => e.file_ref().expect("a file"),
        EntryContent::Symlink(target) => {
            return Ok(kind == libc::S_IFLNK && readlink_at(dir, name).is_ok_and(|t| &t == target));
        }
        EntryContent::Fifo => return Ok(kind == libc::S_IFIFO),
        EntryContent::CharDevice { rdev } => return Ok(kind == libc::S_IFCHR && st.rdev == *rdev),
        EntryContent::BlockDevice { rdev } => return Ok(kind == libc::S_IFBLK && st.rdev == *rdev),
        EntryContent::Dir(_) => return Ok(false),
    };
    if kind != libc::S_IFREG || st.size != want.size || st.perm() != e.mode {
        return Ok(false);
    }
    // The entry opened, read only if it is still the regular file listed.
    let entry = Entry::open(dir, name).map_err(|err| CheckpointError::io(path, err))?;
    if !entry.meta.same_file(st) {
        return Ok(false);
    }
    let mut f = entry
        .open_read()
        .map_err(|err| CheckpointError::io(path, err))?;
    let got = hash_reader(&mut f).map_err(|err| CheckpointError::io(path, err))?;
    Ok(got == want)
}
