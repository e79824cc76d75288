//! Paths inside a root, as a container runtime resolves them inside a rootfs: every
//! lookup is `openat2` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS` from the root's
//! handle, so a symlink is followed, but an absolute one (or an absolute path) starts at
//! the root, a `..` stops there, and a magic link (`/proc/<pid>/fd/*`,
//! `/proc/<pid>/root`, ...) is refused. What a sandbox's client asks of its workspace
//! (read, write, list, make, rename, remove a path) is done here, whatever links the
//! workspace holds: nothing outside the root is ever read or written.
//!
//! An operation on the entry a path names itself (`lstat`, `mkdir`, `rename`,
//! `remove`, a create) resolves the path's directory inside the root and then acts on
//! the last name in it without following it; one that reads or writes a file's content
//! follows a last link too (inside the root), opens only a regular file, and reads and
//! writes through the descriptor it checked.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, ResolveFlags};

use super::{errno, invalid, list_dir_typed, lstat_at, Entry, Meta};

/// How a path inside a root is resolved.
pub const IN_ROOT: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);

/// A directory whose paths resolve inside it ([`IN_ROOT`]).
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
}

/// A path split into its directory and its last name (which is a plain name: not
/// empty, not `.` or `..`).
struct Split {
    dir: Vec<u8>,
    name: CString,
}

/// The components of `path` (leading `/` and `.` components dropped).
fn components(path: &[u8]) -> Vec<&[u8]> {
    path.split(|b| *b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .collect()
}

fn split(path: &[u8]) -> io::Result<Split> {
    if path.contains(&0) {
        return Err(invalid("a NUL in a path"));
    }
    let mut c = components(path);
    let Some(last) = c.pop() else {
        return Err(invalid("the root itself has no name to act on"));
    };
    if last == b".." {
        return Err(invalid("a path ending in `..` names no entry to act on"));
    }
    Ok(Split {
        dir: c.join(&b'/'),
        name: CString::new(last).map_err(|_| invalid("a NUL in a path"))?,
    })
}

impl Root {
    /// The root at `path`, a directory the caller chose (a sandbox's workspace root):
    /// the path itself is followed, nothing below it.
    pub fn open(path: &Path) -> io::Result<Root> {
        Ok(Root {
            fd: super::open_dir_path(path)?,
        })
    }

    /// The root of an open directory.
    pub fn from_fd(fd: OwnedFd) -> Root {
        Root { fd }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `openat2(root, path, flags, mode, IN_ROOT)` with `O_CLOEXEC | O_NOCTTY`.
    fn resolve(&self, path: &[u8], flags: OFlags, mode: u32) -> io::Result<OwnedFd> {
        let rel = components(path).join(&b'/');
        let rel = if rel.is_empty() { b".".to_vec() } else { rel };
        let c = CString::new(rel).map_err(|_| invalid("a NUL in a path"))?;
        // openat2 refuses with O_PATH any flag but a few.
        let flags = if flags.contains(OFlags::PATH) {
            flags | OFlags::CLOEXEC
        } else {
            flags | OFlags::CLOEXEC | OFlags::NOCTTY
        };
        let mut tries = 0;
        loop {
            match rustix::fs::openat2(&self.fd, &c, flags, Mode::from_raw_mode(mode), IN_ROOT) {
                Ok(fd) => return Ok(fd),
                Err(rustix::io::Errno::AGAIN) if tries < 16 => tries += 1,
                Err(e) => return Err(errno(e)),
            }
        }
    }

    /// The directory `path` names, for reading (links followed inside the root).
    pub fn open_dir(&self, path: &[u8]) -> io::Result<OwnedFd> {
        self.resolve(path, OFlags::RDONLY | OFlags::DIRECTORY, 0)
    }

    /// The directory of `path`'s last name, and that name.
    fn parent(&self, path: &[u8]) -> io::Result<(OwnedFd, CString)> {
        let s = split(path)?;
        Ok((self.open_dir(&s.dir)?, s.name))
    }

    /// What `path` names, links followed (inside the root), opened as itself.
    pub fn entry(&self, path: &[u8]) -> io::Result<Entry> {
        Entry::from_fd(self.resolve(path, OFlags::PATH, 0)?)
    }

    /// `stat`: the metadata of what `path` leads to (links followed inside the root).
    pub fn stat(&self, path: &[u8]) -> io::Result<Meta> {
        Ok(self.entry(path)?.meta)
    }

    /// `lstat`: the metadata of the entry `path` names (a last link not followed).
    pub fn lstat(&self, path: &[u8]) -> io::Result<Meta> {
        if components(path).is_empty() {
            return super::fstat(self.fd());
        }
        let (dir, name) = self.parent(path)?;
        lstat_at(dir.as_fd(), &name)?.ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    /// The target of the symlink `path` names.
    pub fn readlink(&self, path: &[u8]) -> io::Result<Vec<u8>> {
        let (dir, name) = self.parent(path)?;
        super::readlink_at(dir.as_fd(), &name)
    }

    /// The regular file `path` leads to, opened for reading (never a FIFO or a device).
    pub fn open_read(&self, path: &[u8]) -> io::Result<(File, Meta)> {
        let e = self.entry(path)?;
        let f = e.open_read()?;
        Ok((f, e.meta))
    }

    /// The content of the regular file `path` leads to, at most `limit` bytes (more is an
    /// error naming the limit).
    pub fn read(&self, path: &[u8], limit: u64) -> io::Result<Vec<u8>> {
        let (f, m) = self.open_read(path)?;
        if m.size > limit {
            return Err(too_large(limit));
        }
        let mut out = Vec::with_capacity(m.size as usize);
        f.take(limit + 1).read_to_end(&mut out)?;
        if out.len() as u64 > limit {
            return Err(too_large(limit));
        }
        Ok(out)
    }

    /// The regular file `path` leads to, opened for writing and emptied; made (with
    /// `mode`, less the umask) where nothing stands. A last link is followed inside the
    /// root where it leads to a file; a link that leads nowhere is refused (what it would
    /// make is not asked for by name).
    pub fn open_write(&self, path: &[u8], mode: u32) -> io::Result<File> {
        for _ in 0..8 {
            match self.entry(path) {
                Ok(e) => {
                    let f = e.open_rw()?;
                    f.set_len(0)?;
                    return Ok(f);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
            let (dir, name) = self.parent(path)?;
            match super::create_at(dir.as_fd(), &name, mode) {
                Ok(fd) => return Ok(File::from(fd)),
                // Made meanwhile, or a link leading nowhere: looked at again.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    if lstat_at(dir.as_fd(), &name)?.is_some_and(|m| m.is_symlink())
                        && self.entry(path).is_err()
                    {
                        return Err(io::Error::new(
                            io::ErrorKind::NotFound,
                            "a symlink that leads to nothing: not written through",
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::from_raw_os_error(libc::EAGAIN))
    }

    /// Writes `data` as the whole content of `path` (see [`Root::open_write`]).
    pub fn write(&self, path: &[u8], data: &[u8], mode: u32) -> io::Result<()> {
        let mut f = self.open_write(path, mode)?;
        f.write_all(data)
    }

    /// Makes the directory `path` (its parent must exist).
    pub fn mkdir(&self, path: &[u8], mode: u32) -> io::Result<()> {
        let (dir, name) = self.parent(path)?;
        super::mkdir_at(dir.as_fd(), &name, mode)
    }

    /// Makes the directory `path` and every missing one above it.
    pub fn mkdir_all(&self, path: &[u8], mode: u32) -> io::Result<()> {
        let c = components(path);
        for i in 1..=c.len() {
            let p = c[..i].join(&b'/');
            match self.mkdir(&p, mode) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    if !self.stat(&p)?.is_dir() {
                        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Renames the entry `from` names to `to` (the entries themselves: last links are
    /// not followed).
    pub fn rename(&self, from: &[u8], to: &[u8]) -> io::Result<()> {
        let (fd, fname) = self.parent(from)?;
        let (td, tname) = self.parent(to)?;
        rustix::fs::renameat(&fd, &fname, &td, &tname).map_err(errno)
    }

    /// Removes the entry `path` names: a file or a link (not what it leads to), or an
    /// empty directory.
    pub fn remove(&self, path: &[u8]) -> io::Result<()> {
        let (dir, name) = self.parent(path)?;
        let is_dir = lstat_at(dir.as_fd(), &name)?
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?
            .is_dir();
        let flags = if is_dir {
            rustix::fs::AtFlags::REMOVEDIR
        } else {
            rustix::fs::AtFlags::empty()
        };
        rustix::fs::unlinkat(&dir, &name, flags).map_err(errno)
    }

    /// Removes the entry `path` names and, for a directory, everything in it (no link
    /// followed).
    pub fn remove_all(&self, path: &[u8]) -> io::Result<()> {
        let (dir, name) = self.parent(path)?;
        if lstat_at(dir.as_fd(), &name)?.is_none() {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        super::remove_entry(dir.as_fd(), &name)
    }

    /// The entries of the directory `path` leads to, sorted by name, each with its own
    /// metadata (links not followed).
    pub fn list(&self, path: &[u8]) -> io::Result<Vec<(Vec<u8>, Meta)>> {
        let dir = self.open_dir(path)?;
        let mut out = Vec::new();
        for (name, _) in list_dir_typed(dir.as_fd())? {
            let c = CString::new(name.clone()).map_err(|_| invalid("a NUL in a name"))?;
            if let Some(m) = lstat_at(dir.as_fd(), &c)? {
                out.push((name, m));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

fn too_large(limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("over the limit of {limit} bytes"),
    )
}
