//! Directory-relative file system calls (`openat`, `fstatat`, `readlinkat`, ...) used by
//! capture and restore: no path is resolved twice, and no symlink is ever followed
//! below the directory being worked on.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{CheckpointError, CheckpointResult};

pub fn cstr(b: &[u8], path: &Path) -> CheckpointResult<CString> {
    CString::new(b).map_err(|_| CheckpointError::path(path, "name contains NUL"))
}

pub fn last_err(path: &Path) -> CheckpointError {
    CheckpointError::io(path, io::Error::last_os_error())
}

pub fn child(path: &Path, name: &[u8]) -> std::path::PathBuf {
    path.join(OsStr::from_bytes(name))
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; `None` if the entry does not exist.
pub fn lstat_at(dir: RawFd, name: &CStr) -> io::Result<Option<libc::stat>> {
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

pub fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens `name` in `dir` with `flags | O_NOFOLLOW | O_CLOEXEC`.
pub fn open_at(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: valid dirfd and name; the result is checked.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by the caller.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a directory below `dir`, refusing a symlink in its place.
pub fn open_dir_at(dir: RawFd, name: &CStr) -> io::Result<OwnedFd> {
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

/// Opens a directory by path (following symlinks: this is the user's own choice).
pub fn open_dir(path: &Path) -> CheckpointResult<OwnedFd> {
    let c = cstr(path.as_os_str().as_bytes(), path)?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(last_err(path));
    }
    // SAFETY: fd was just opened and is owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The names in an open directory (without `.` and `..`), sorted bytewise.
pub fn list_dir(dir: RawFd) -> io::Result<Vec<Vec<u8>>> {
    // SAFETY: dup of a valid fd; `read_dir_fd` takes the duplicate.
    let dup = unsafe { libc::fcntl(dir, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut names: Vec<Vec<u8>> = crate::fs::read_dir_fd(dup)?
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    names.sort_unstable();
    Ok(names)
}

pub fn file_type(st: &libc::stat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

pub fn is_dir(st: &libc::stat) -> bool {
    file_type(st) == libc::S_IFDIR
}

pub fn mtime_ns(st: &libc::stat) -> i64 {
    st.st_mtime * 1_000_000_000 + st.st_mtime_nsec
}

pub fn ctime_ns(st: &libc::stat) -> i64 {
    st.st_ctime * 1_000_000_000 + st.st_ctime_nsec
}

/// The target of the symlink `name` in `dir`.
pub fn readlink_at(dir: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: valid dirfd, name and buffer.
        let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if (n as usize) < buf.len() {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        buf.resize(buf.len() * 2, 0);
    }
}

/// Removes `name` in `dir`, recursively for directories, never following symlinks.
pub fn remove_at(dir: RawFd, name: &CStr, path: &Path) -> CheckpointResult<()> {
    use std::os::fd::AsRawFd;
    let Some(st) = lstat_at(dir, name).map_err(|e| CheckpointError::io(path, e))? else {
        return Ok(());
    };
    if is_dir(&st) {
        let sub = open_dir_at(dir, name).map_err(|e| CheckpointError::io(path, e))?;
        for c in list_dir(sub.as_raw_fd()).map_err(|e| CheckpointError::io(path, e))? {
            let cpath = child(path, &c);
            remove_at(sub.as_raw_fd(), &cstr(&c, &cpath)?, &cpath)?;
        }
        // SAFETY: valid dirfd and name.
        if unsafe { libc::unlinkat(dir, name.as_ptr(), libc::AT_REMOVEDIR) } != 0 {
            return Err(last_err(path));
        }
    // SAFETY: valid dirfd and name.
    } else if unsafe { libc::unlinkat(dir, name.as_ptr(), 0) } != 0 {
        return Err(last_err(path));
    }
    Ok(())
}

/// What identifies an unchanged file without reading it: if any of these differ, the
/// entry changed. ctime cannot be set by users and changes with every write, chmod,
/// xattr change or rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl Fingerprint {
    pub const LEN: usize = 44;

    pub fn of(st: &libc::stat) -> Fingerprint {
        Fingerprint {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mode: st.st_mode,
            mtime_ns: mtime_ns(st),
            ctime_ns: ctime_ns(st),
        }
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.dev.to_le_bytes());
        out.extend_from_slice(&self.ino.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.mtime_ns.to_le_bytes());
        out.extend_from_slice(&self.ctime_ns.to_le_bytes());
        out.extend_from_slice(&self.mode.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Option<Fingerprint> {
        if b.len() != Self::LEN {
            return None;
        }
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Fingerprint {
            dev: u(0),
            ino: u(8),
            size: u(16),
            mtime_ns: u(24) as i64,
            ctime_ns: u(32) as i64,
            mode: u32::from_le_bytes(b[40..44].try_into().expect("4 bytes")),
        })
    }
}
