//! Listing a directory without touching its access time.
//!
//! casfs lists directories of its own accord: the overlay backend's watch lists each
//! directory made in the upper, a checkpoint lists the upper's changed directories, a
//! plain directory's watch lists a new directory to announce what it holds. With
//! `relatime`, a listing updates the directory's access time whenever it is not newer
//! than its modification time, which a user's `utimensat` can leave behind it
//! (pjdfstest's `utimensat::changes_timestamps::dir` sets atime before mtime and saw
//! casfs's listing replace its atime when the watch came late). These listings open
//! the directory with `O_NOATIME` (the owner's or `CAP_FOWNER`'s right; without it the
//! listing goes on with the access time as the kernel keeps it).

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// One entry of a listing: its name and whether it is a directory (from the
/// directory's own record where the filesystem keeps the type there, else `lstat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: Vec<u8>,
    pub is_dir: bool,
}

/// The entries of directory `dir` (`.` and `..` left out), in the order the filesystem
/// gives them, read without updating its access time where the caller may ask that.
pub fn list_dir_noatime(dir: &Path) -> io::Result<Vec<Listed>> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in a path"))?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: a NUL-terminated path; the descriptor is owned below.
    let mut fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_NOATIME) };
    if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) {
        // Not the owner and without CAP_FOWNER: list it as anyone would.
        // SAFETY: as above.
        fd = unsafe { libc::open(c.as_ptr(), flags) };
    }
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    for (name, d_type) in read_dir_fd(fd)? {
        let is_dir = match d_type {
            libc::DT_DIR => true,
            libc::DT_UNKNOWN => {
                std::fs::symlink_metadata(dir.join(std::ffi::OsStr::from_bytes(&name)))
                    .is_ok_and(|m| m.is_dir())
            }
            _ => false,
        };
        out.push(Listed { name, is_dir });
    }
    Ok(out)
}

/// The entries of the open directory `fd` (which this takes and closes), from its
/// start, `.` and `..` left out: each name with the type the directory records
/// (`DT_DIR`, ..., `DT_UNKNOWN` where the filesystem keeps none), in the filesystem's
/// order. `fd` shares its offset with any descriptor it was duplicated from.
pub fn read_dir_fd(fd: RawFd) -> io::Result<Vec<(Vec<u8>, u8)>> {
    // SAFETY: `fd` is an open directory; on success the stream owns it.
    let stream = unsafe { libc::fdopendir(fd) };
    if stream.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `fd` is still ours to close.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    // SAFETY: a valid stream; a duplicated descriptor may be past the start.
    unsafe { libc::rewinddir(stream) };
    let mut out = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; cleared to tell the end from an error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: a stream from fdopendir, not yet closed.
        let ent = unsafe { libc::readdir64(stream) };
        if ent.is_null() {
            let e = io::Error::last_os_error();
            break match e.raw_os_error() {
                Some(0) | None => Ok(()),
                Some(_) => Err(e),
            };
        }
        // SAFETY: readdir64 returned a valid entry with a NUL-terminated name, valid
        // until the next call on this stream.
        let (name, d_type) = unsafe {
            (
                CStr::from_ptr((*ent).d_name.as_ptr()).to_bytes(),
                (*ent).d_type,
            )
        };
        if name != b"." && name != b".." {
            out.push((name.to_vec(), d_type));
        }
    };
    // SAFETY: the stream (and its descriptor) closed once.
    unsafe { libc::closedir(stream) };
    result.map(|()| out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_listing_names_every_entry_and_leaves_the_access_time() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("d");
        std::fs::create_dir(&d).unwrap();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("f"), b"x").unwrap();
        std::os::unix::fs::symlink("sub", d.join("link")).unwrap();
        std::fs::write(d.join("n\u{e9}e \\ \"q\""), b"").unwrap();
        // An access time older than the modification time: relatime would update it.
        let c = std::ffi::CString::new(d.as_os_str().as_bytes()).unwrap();
        let times = [
            libc::timespec {
                tv_sec: 1_000_000_000,
                tv_nsec: 0,
            },
            libc::timespec {
                tv_sec: 1_500_000_000,
                tv_nsec: 0,
            },
        ];
        // SAFETY: a NUL-terminated path and two timespecs.
        assert_eq!(
            unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) },
            0
        );
        let mut got = list_dir_noatime(&d).unwrap();
        got.sort_by(|a, b| a.name.cmp(&b.name));
        let names: Vec<(&[u8], bool)> = got.iter().map(|l| (l.name.as_slice(), l.is_dir)).collect();
        assert_eq!(
            names,
            [
                (&b"f"[..], false),
                (&b"link"[..], false),
                ("n\u{e9}e \\ \"q\"".as_bytes(), false),
                (&b"sub"[..], true),
            ]
        );
        assert_eq!(std::fs::metadata(&d).unwrap().atime(), 1_000_000_000);
        // A plain listing does update it where the filesystem keeps access times (so
        // the check above tells something).
        // SAFETY: zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
        let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut sv) }, 0);
        let _ = std::fs::read_dir(&d).unwrap().count();
        let after = std::fs::metadata(&d).unwrap().atime();
        if sv.f_flag & (libc::ST_NOATIME | libc::ST_NODIRATIME) == 0 {
            assert_ne!(after, 1_000_000_000, "a plain listing left the access time");
        }
        let e = list_dir_noatime(&t.path().join("missing")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let e = list_dir_noatime(&d.join("f")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR));
    }
}
