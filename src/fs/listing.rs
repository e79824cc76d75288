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

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{Dir, FileType};

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
    if dir.as_os_str().as_bytes().contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL in a path",
        ));
    }
    // O_NOATIME, or (not the owner and without CAP_FOWNER) as anyone would list it.
    let fd = crate::sys::dirfd::open_dir_path_noatime(dir)?;
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
pub fn read_dir_fd(fd: OwnedFd) -> io::Result<Vec<(Vec<u8>, u8)>> {
    let mut stream = Dir::new(fd)?;
    // A duplicated descriptor may be past the start.
    stream.rewind();
    let mut out = Vec::new();
    while let Some(ent) = stream.read() {
        let ent = ent?;
        let name = ent.file_name().to_bytes();
        if name != b"." && name != b".." {
            out.push((name.to_vec(), d_type(ent.file_type())));
        }
    }
    Ok(out)
}

/// The `DT_*` value of a type a directory records.
fn d_type(t: FileType) -> u8 {
    match t {
        FileType::RegularFile => libc::DT_REG,
        FileType::Directory => libc::DT_DIR,
        FileType::Symlink => libc::DT_LNK,
        FileType::Fifo => libc::DT_FIFO,
        FileType::Socket => libc::DT_SOCK,
        FileType::CharacterDevice => libc::DT_CHR,
        FileType::BlockDevice => libc::DT_BLK,
        _ => libc::DT_UNKNOWN,
    }
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
        let times = rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: 1_000_000_000,
                tv_nsec: 0,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: 1_500_000_000,
                tv_nsec: 0,
            },
        };
        rustix::fs::utimensat(rustix::fs::CWD, &d, &times, rustix::fs::AtFlags::empty()).unwrap();
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
        let sv = rustix::fs::statvfs(&d).unwrap();
        let _ = std::fs::read_dir(&d).unwrap().count();
        let after = std::fs::metadata(&d).unwrap().atime();
        use rustix::fs::StatVfsMountFlags as F;
        if !sv.f_flag.intersects(F::NOATIME | F::NODIRATIME) {
            assert_ne!(after, 1_000_000_000, "a plain listing left the access time");
        }
        let e = list_dir_noatime(&t.path().join("missing")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let e = list_dir_noatime(&d.join("f")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR));
    }
}
