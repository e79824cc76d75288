//! Plain-directory sync: a directory that no mount serves, captured into trees
//! ([`capture`]) and restored from them ([`restore`]), with the directory cache that
//! lets a re-capture skip what did not change ([`dircache`]) and the inotify watcher
//! that tells it which directories did ([`watch`]). Everything read or written inside
//! the directory goes through `sys::dirfd`'s handles; the helpers below name the path
//! in the checkpoint layer's errors.

pub mod capture;
pub mod dircache;
pub mod restore;
pub mod watch;

use std::ffi::{CStr, CString};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use crate::checkpoint::ids::{CheckpointError, CheckpointResult};
use crate::sys::dirfd;

/// A name as the C calls take it; one with a NUL byte is refused, naming `path`.
pub fn cstr(b: &[u8], path: &Path) -> CheckpointResult<CString> {
    CString::new(b).map_err(|_| CheckpointError::path(path, "name contains NUL"))
}

/// Opens a directory by path, following symlinks: a path the caller chose (a store's
/// own directory, a sandbox's root, a directory named on the command line), never a
/// path inside a tree another party changes.
pub fn open_dir(path: &Path) -> CheckpointResult<OwnedFd> {
    dirfd::open_dir_path(path).map_err(|e| CheckpointError::io(path, e))
}

/// Removes `name` in `dir`, recursively for directories, never following symlinks.
pub fn remove_at(dir: BorrowedFd<'_>, name: &CStr, path: &Path) -> CheckpointResult<()> {
    dirfd::remove_entry(dir, name).map_err(|e| CheckpointError::io(path, e))
}
