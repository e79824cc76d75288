//! Directory handles: every read, write, stat, chmod or listing casfs makes inside a tree
//! that a less trusted party can change (a sandbox's workspace, an overlay's upper, a
//! plain directory captured or restored into) goes through a handle of a directory
//! (`rustix`'s `openat2`), never through a path.
//!
//! Beneath a handle (this module): one name at a time, or a relative path resolved with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`, so no symlink is
//! ever followed and nothing outside the handle's directory is ever reached, whatever
//! the tree's other users rename meanwhile. An entry is opened (`O_PATH | O_NOFOLLOW`)
//! before anything of it is read: its metadata is the `fstat` of that descriptor (the
//! descriptor is the truth, not the listing), its content is read only from a reopening
//! of that very descriptor, and only if it is a regular file (a FIFO or a device node
//! is never opened for reading); a symlink's target is read from the descriptor
//! (`readlinkat(fd, "")`); xattrs through an open file, or for a symlink or a special
//! file by name in the pinned directory (`getxattrat`, or `/proc/self/fd/<dir>/<name>`
//! with the `l*` calls on older kernels), checked to be of the entry opened. Changes go
//! through the handle too: `mkdirat`, `O_CREAT | O_EXCL | O_NOFOLLOW`, `renameat`,
//! `unlinkat`, and chmod, chown and times on the opened descriptor.
//!
//! Inside a root ([`root`]): paths resolved with `RESOLVE_IN_ROOT`, as a container
//! runtime resolves paths in a rootfs: links are followed, but an absolute one or a `..`
//! never leaves the root, and magic links are refused.

pub mod root;

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, Timespec, Timestamps};

/// How a path beneath a handle is resolved: never through a symlink (nor a magic link),
/// never out of the handle's directory.
pub const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

pub fn child(path: &Path, name: &[u8]) -> std::path::PathBuf {
    path.join(OsStr::from_bytes(name))
}

fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// What a handle's entry is, from `fstat` (or `fstatat` without following).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub dev: u64,
    pub ino: u64,
    /// Type and permission bits (`st_mode`).
    pub mode: u32,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl Meta {
    // The field types of `struct stat` differ between architectures.
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    pub fn of(st: &rustix::fs::Stat) -> Meta {
        Meta {
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            mode: st.st_mode as u32,
            nlink: st.st_nlink as u64,
            uid: st.st_uid as u32,
            gid: st.st_gid as u32,
            rdev: st.st_rdev as u64,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime as i64 * 1_000_000_000 + st.st_mtime_nsec as i64,
            ctime_ns: st.st_ctime as i64 * 1_000_000_000 + st.st_ctime_nsec as i64,
        }
    }

    /// The type bits (`S_IFREG`, `S_IFDIR`, ...).
    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }

    /// The permission bits, set-id and sticky bits included.
    pub fn perm(&self) -> u32 {
        self.mode & 0o7777
    }

    pub fn is_dir(&self) -> bool {
        self.kind() == libc::S_IFDIR
    }

    pub fn is_file(&self) -> bool {
        self.kind() == libc::S_IFREG
    }

    pub fn is_symlink(&self) -> bool {
        self.kind() == libc::S_IFLNK
    }

    /// Whether `other` is the same file (device, inode and type).
    pub fn same_file(&self, other: &Meta) -> bool {
        self.dev == other.dev && self.ino == other.ino && self.kind() == other.kind()
    }
}

/// An entry that is no longer the one that was listed or opened.
#[derive(Debug, thiserror::Error)]
#[error("replaced by another file while it was being read")]
pub struct Replaced;

/// The error of an entry that is no longer the one that was listed or opened.
pub fn replaced() -> io::Error {
    io::Error::other(Replaced)
}

/// Whether `e` says an entry was removed, renamed or replaced while it was looked at.
pub fn vanished(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR))
        || e.get_ref().is_some_and(|x| x.is::<Replaced>())
}

/// A single name of a directory: not empty, no `/`, not `.` or `..`.
fn check_name(name: &CStr) -> io::Result<()> {
    let b = name.to_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(invalid("not a single name in a directory"));
    }
    Ok(())
}

/// `openat2(dir, path, flags, mode, BENEATH)`, with `O_CLOEXEC | O_NOFOLLOW | O_NOCTTY`
/// always, tried again while the kernel says a rename raced the lookup (`EAGAIN`).
fn openat_beneath(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: OFlags,
    mode: u32,
) -> io::Result<OwnedFd> {
    // openat2 refuses with O_PATH any flag but these (and a mode without O_CREAT).
    let flags = if flags.contains(OFlags::PATH) {
        flags | OFlags::CLOEXEC | OFlags::NOFOLLOW
    } else {
        flags | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NOCTTY
    };
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(dir, path, flags, Mode::from_raw_mode(mode), BENEATH) {
            Ok(fd) => return Ok(fd),
            Err(rustix::io::Errno::AGAIN) if tries < 16 => tries += 1,
            Err(e) => return Err(errno(e)),
        }
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; `None` if the entry does not exist.
pub fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<Meta>> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(Meta::of(&st))),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(errno(e)),
    }
}

/// The metadata of an open file.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<Meta> {
    rustix::fs::fstat(fd).map(|st| Meta::of(&st)).map_err(errno)
}

/// Opens the directory `name` in `dir`, refusing a symlink (or anything else) in its
/// place.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    check_name(name)?;
    openat_beneath(dir, name, OFlags::RDONLY | OFlags::DIRECTORY, 0)
}

/// [`open_dir_at`] without updating the directory's access time where the caller may
/// ask that (`O_NOATIME`: the owner's or `CAP_FOWNER`'s right), for the listings casfs
/// makes of its own accord.
pub fn open_dir_noatime_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    check_name(name)?;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY;
    match openat_beneath(dir, name, flags | OFlags::NOATIME, 0) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => openat_beneath(dir, name, flags, 0),
        other => other,
    }
}

/// Opens `rel` (`/`-separated, relative) beneath `dir` with `flags`: no component may
/// be a symlink, and none may lead out of `dir`. An empty `rel` is `dir` itself.
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &[u8], flags: OFlags) -> io::Result<OwnedFd> {
    let rel = if rel.is_empty() { &b"."[..] } else { rel };
    let c = CString::new(rel).map_err(|_| invalid("a NUL in a path"))?;
    openat_beneath(dir, &c, flags, 0)
}

/// The directory `rel` beneath `dir` (see [`open_beneath`]), for reading, without
/// updating its access time where that is allowed.
pub fn open_dir_beneath(dir: BorrowedFd<'_>, rel: &[u8]) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY;
    match open_beneath(dir, rel, flags | OFlags::NOATIME) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => open_beneath(dir, rel, flags),
        other => other,
    }
}

/// [`open_dir`] as an `io::Result`.
pub fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno)
}

/// [`open_dir_path`] without updating the directory's access time where that is
/// allowed (see [`open_dir_noatime_at`]).
pub fn open_dir_path_noatime(path: &Path) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    match rustix::fs::open(path, flags | OFlags::NOATIME, Mode::empty()) {
        Err(rustix::io::Errno::PERM) => rustix::fs::open(path, flags, Mode::empty()),
        other => other,
    }
    .map_err(errno)
}

/// Creates the regular file `name` in `dir` for writing (`O_CREAT | O_EXCL`, so never
/// an existing entry, nor through a symlink).
pub fn create_at(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<OwnedFd> {
    check_name(name)?;
    openat_beneath(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
        mode,
    )
}

/// Makes the directory `name` in `dir`.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    check_name(name)?;
    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode)).map_err(errno)
}

/// Makes the symlink `name` in `dir`, pointing at `target`.
pub fn symlink_at(dir: BorrowedFd<'_>, target: &CStr, name: &CStr) -> io::Result<()> {
    check_name(name)?;
    rustix::fs::symlinkat(target, dir, name).map_err(errno)
}

/// Makes the FIFO or device node `name` in `dir` (`kind`: `S_IFIFO`, `S_IFCHR`,
/// `S_IFBLK`), readable and writable by its owner only until its mode is set.
pub fn mknod_at(dir: BorrowedFd<'_>, name: &CStr, kind: u32, rdev: u64) -> io::Result<()> {
    check_name(name)?;
    let kind = rustix::fs::FileType::from_raw_mode(kind);
    rustix::fs::mknodat(dir, name, kind, Mode::from_raw_mode(0o600), rdev).map_err(errno)
}

/// Renames `from` over `to`, both in `dir` (the entries themselves: links not followed).
pub fn rename_at(dir: BorrowedFd<'_>, from: &CStr, to: &CStr) -> io::Result<()> {
    check_name(from)?;
    check_name(to)?;
    rustix::fs::renameat(dir, from, dir, to).map_err(errno)
}

/// Removes the entry `name` of `dir` that is not a directory (`unlinkat`).
pub fn unlink_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    check_name(name)?;
    rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(errno)
}

/// The names in an open directory (without `.` and `..`), sorted bytewise.
pub fn list_dir(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut names: Vec<Vec<u8>> = list_dir_typed(dir)?.into_iter().map(|(n, _)| n).collect();
    names.sort_unstable();
    Ok(names)
}

/// The entries of an open directory (without `.` and `..`), in the filesystem's order,
/// each with whether the directory records it as a directory (`None`: the filesystem
/// keeps no type there; ask [`lstat_at`]).
pub fn list_dir_typed(dir: BorrowedFd<'_>) -> io::Result<Vec<(Vec<u8>, Option<bool>)>> {
    let mut d = rustix::fs::Dir::read_from(dir).map_err(errno)?;
    let mut out = Vec::new();
    while let Some(e) = d.read() {
        let e = e.map_err(errno)?;
        let name = e.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let t = e.file_type();
        let is_dir = if t == rustix::fs::FileType::Unknown {
            None
        } else {
            Some(t == rustix::fs::FileType::Directory)
        };
        out.push((name.to_vec(), is_dir));
    }
    Ok(out)
}

/// Whether the entry `name` of `dir` is a directory, from the listing's type or, where
/// the filesystem keeps none, `fstatat` (no link followed).
pub fn listed_dir(dir: BorrowedFd<'_>, name: &[u8], is_dir: Option<bool>) -> bool {
    match is_dir {
        Some(d) => d,
        None => CString::new(name)
            .ok()
            .and_then(|c| lstat_at(dir, &c).ok().flatten())
            .is_some_and(|m| m.is_dir()),
    }
}

pub fn file_type(st: &Meta) -> u32 {
    st.kind()
}

pub fn is_dir(st: &Meta) -> bool {
    st.is_dir()
}

pub fn mtime_ns(st: &Meta) -> i64 {
    st.mtime_ns
}

pub fn ctime_ns(st: &Meta) -> i64 {
    st.ctime_ns
}

/// The target of the symlink `name` in `dir`.
pub fn readlink_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    rustix::fs::readlinkat(dir, name, Vec::new())
        .map(|t| t.into_bytes())
        .map_err(errno)
}

/// How many entries one removal may take away or lift (see [`remove_entry`]) before it
/// gives up: a tree a program keeps filling while it is removed is not waited for
/// without end.
pub const MAX_REMOVALS: u64 = 1 << 26;

/// [`remove_at`] as an `io::Result`: removes `name` in `dir` and, for a directory,
/// everything in it, never following a symlink; what is gone meanwhile is passed over.
/// However deep the tree, it holds two directory descriptors and no stack: a directory
/// in a directory being emptied is lifted up into the one being emptied (renamed, no
/// data moved), so the walk never goes more than two levels down; no `..` is ever
/// opened, so nothing above `dir` is reached.
pub fn remove_entry(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    check_name(name)?;
    let gone = |e: rustix::io::Errno| -> io::Result<()> {
        if e == rustix::io::Errno::NOENT {
            Ok(())
        } else {
            Err(errno(e))
        }
    };
    let Some(st) = lstat_at(dir, name)? else {
        return Ok(());
    };
    if !st.is_dir() {
        return rustix::fs::unlinkat(dir, name, AtFlags::empty()).or_else(gone);
    }
    let top = match open_dir_at(dir, name) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    empty_dir(top.as_fd())?;
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).or_else(gone)
}

/// Empties the open directory `x` (see [`remove_entry`]).
fn empty_dir(x: BorrowedFd<'_>) -> io::Result<()> {
    let gone = |e: rustix::io::Errno| -> io::Result<()> {
        match e {
            rustix::io::Errno::NOENT => Ok(()),
            e => Err(errno(e)),
        }
    };
    let mut done: u64 = 0;
    let mut lifted: u64 = 0;
    loop {
        let names = list_dir(x)?;
        if names.is_empty() {
            return Ok(());
        }
        for n in names {
            done += 1;
            if done > MAX_REMOVALS {
                return Err(io::Error::other(format!(
                    "still not empty after {MAX_REMOVALS} entries removed: something keeps \
                     filling it"
                )));
            }
            let c = CString::new(n).map_err(|_| invalid("a NUL in a name"))?;
            match lstat_at(x, &c)? {
                None => {}
                Some(st) if st.is_dir() => {
                    let sub = match open_dir_at(x, &c) {
                        Ok(fd) => fd,
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                        Err(e) => return Err(e),
                    };
                    for m in list_dir(sub.as_fd())? {
                        let g = CString::new(m).map_err(|_| invalid("a NUL in a name"))?;
                        match lstat_at(sub.as_fd(), &g)? {
                            None => {}
                            Some(st) if st.is_dir() => loop {
                                // Up into `x`, under a name nothing else has.
                                lifted += 1;
                                let to = CString::new(format!(".casfs-removing-{lifted}"))
                                    .expect("no NUL");
                                match rustix::fs::renameat_with(
                                    sub.as_fd(),
                                    &g,
                                    x,
                                    &to,
                                    rustix::fs::RenameFlags::NOREPLACE,
                                ) {
                                    Ok(()) => break,
                                    Err(rustix::io::Errno::EXIST) => continue,
                                    Err(e) => {
                                        gone(e)?;
                                        break;
                                    }
                                }
                            },
                            Some(_) => rustix::fs::unlinkat(sub.as_fd(), &g, AtFlags::empty())
                                .or_else(gone)?,
                        }
                    }
                    // Filled again meanwhile: emptied at the next pass.
                    match rustix::fs::unlinkat(x, &c, AtFlags::REMOVEDIR) {
                        Ok(())
                        | Err(rustix::io::Errno::NOENT)
                        | Err(rustix::io::Errno::NOTEMPTY) => {}
                        Err(e) => return Err(errno(e)),
                    }
                }
                Some(_) => rustix::fs::unlinkat(x, &c, AtFlags::empty()).or_else(gone)?,
            }
        }
    }
}

/// Removes the directory (or file) at `path`, which the process's own directories hold
/// (a mount's generation under the store): the path to it is followed, nothing in it
/// is (see [`remove_entry`]).
pub fn remove_path(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(invalid("a path with no parent or no name"));
    };
    let dir = open_dir_path(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    })?;
    let c = CString::new(name.as_bytes()).map_err(|_| invalid("a NUL in a path"))?;
    match lstat_at(dir.as_fd(), &c)? {
        None => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        Some(_) => remove_entry(dir.as_fd(), &c),
    }
}

/// Opens what this module keeps for the life of the process (its handle of `/proc`)
/// now rather than at its first use: a long-lived server calls it as it starts, so the
/// descriptors it holds at rest are the same before and after its first capture.
pub fn prepare() -> io::Result<()> {
    proc_root().map(|_| ())
}

/// `/proc`, checked to be procfs: where an opened descriptor is reopened (its
/// `self/fd/<n>`) for reading or a chmod.
fn proc_root() -> io::Result<BorrowedFd<'static>> {
    static PROC: OnceLock<Result<OwnedFd, i32>> = OnceLock::new();
    let r = PROC.get_or_init(|| {
        let fd = rustix::fs::open(
            "/proc",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| e.raw_os_error())?;
        let fs = rustix::fs::fstatfs(&fd).map_err(|e| e.raw_os_error())?;
        if fs.f_type != rustix::fs::PROC_SUPER_MAGIC {
            return Err(libc::ENODEV);
        }
        Ok(fd)
    });
    match r {
        Ok(fd) => Ok(fd.as_fd()),
        Err(e) => Err(io::Error::new(
            io::Error::from_raw_os_error(*e).kind(),
            format!(
                "/proc is not procfs ({}): casfs needs it to reopen files it opened",
                io::Error::from_raw_os_error(*e)
            ),
        )),
    }
}

/// `self/fd/<n>` under [`proc_root`].
fn proc_fd_name(fd: BorrowedFd<'_>) -> CString {
    CString::new(format!("self/fd/{}", fd.as_raw_fd())).expect("no NUL in a number")
}

/// One entry of a directory, opened without following it (`O_PATH | O_NOFOLLOW`):
/// whatever is renamed over its name later, this is the file that was there.
#[derive(Debug)]
pub struct Entry {
    fd: OwnedFd,
    /// Its metadata, from `fstat` of the descriptor.
    pub meta: Meta,
}

impl Entry {
    /// Opens the entry `name` of `dir` (a symlink is opened as itself).
    pub fn open(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Entry> {
        check_name(name)?;
        Entry::from_fd(openat_beneath(dir, name, OFlags::PATH, 0)?)
    }

    /// Opens the entry `rel` beneath `dir` (see [`open_beneath`]); the last component
    /// is opened as itself, a symlink included.
    pub fn open_beneath(dir: BorrowedFd<'_>, rel: &[u8]) -> io::Result<Entry> {
        Entry::from_fd(open_beneath(dir, rel, OFlags::PATH)?)
    }

    /// An entry of a descriptor opened with `O_PATH`.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Entry> {
        let meta = fstat(fd.as_fd())?;
        Ok(Entry { fd, meta })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Reopens this very file with `flags` (through `/proc/self/fd`), checking that the
    /// reopened file is it.
    fn reopen(&self, flags: OFlags) -> io::Result<File> {
        let flags = flags | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
        let fd = rustix::fs::openat(proc_root()?, proc_fd_name(self.fd()), flags, Mode::empty())
            .map_err(errno)?;
        let m = fstat(fd.as_fd())?;
        if !m.same_file(&self.meta) {
            return Err(replaced());
        }
        // Reads and writes block as usual from here on (O_NONBLOCK kept an open of a
        // file that is not regular from waiting; none gets here).
        let fl = rustix::fs::fcntl_getfl(&fd).map_err(errno)?;
        rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK).map_err(errno)?;
        Ok(File::from(fd))
    }

    /// The file's content for reading: only a regular file is ever opened (a FIFO or a
    /// device node would block or act).
    pub fn open_read(&self) -> io::Result<File> {
        if !self.meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        self.reopen(OFlags::RDONLY)
    }

    /// The file for reading and writing: only a regular file.
    pub fn open_rw(&self) -> io::Result<File> {
        if !self.meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        self.reopen(OFlags::RDWR)
    }

    /// The directory for listing and for opening what is in it: only a directory.
    pub fn open_dir(&self) -> io::Result<OwnedFd> {
        if !self.meta.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        self.reopen(OFlags::RDONLY | OFlags::DIRECTORY)
            .map(OwnedFd::from)
    }

    /// [`Entry::open_dir`] without updating the directory's access time where that is
    /// allowed (see [`open_dir_noatime_at`]).
    pub fn open_dir_noatime(&self) -> io::Result<OwnedFd> {
        if !self.meta.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY;
        match self.reopen(flags | OFlags::NOATIME) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => self.reopen(flags),
            other => other,
        }
        .map(OwnedFd::from)
    }

    /// A symlink's target.
    pub fn readlink(&self) -> io::Result<Vec<u8>> {
        rustix::fs::readlinkat(self.fd(), c"", Vec::new())
            .map(|t| t.into_bytes())
            .map_err(errno)
    }

    /// Sets the permission bits (a symlink has none to set: nothing is done).
    pub fn chmod(&self, mode: u32) -> io::Result<()> {
        if self.meta.is_symlink() {
            return Ok(());
        }
        // The magic link leads to this very inode, which is not a symlink.
        rustix::fs::chmodat(
            proc_root()?,
            proc_fd_name(self.fd()),
            Mode::from_raw_mode(mode),
            AtFlags::empty(),
        )
        .map_err(errno)
    }

    /// Gives the file (a symlink itself, not its target) to `uid`:`gid`.
    pub fn chown(&self, uid: u32, gid: u32) -> io::Result<()> {
        let (u, g) = (
            rustix::fs::Uid::from_raw(uid),
            rustix::fs::Gid::from_raw(gid),
        );
        rustix::fs::chownat(self.fd(), c"", Some(u), Some(g), AtFlags::EMPTY_PATH).map_err(errno)
    }

    /// Sets the modification time (the access time left as it is).
    pub fn set_mtime(&self, mtime_ns: i64) -> io::Result<()> {
        rustix::fs::utimensat(self.fd(), c"", &times(mtime_ns), AtFlags::EMPTY_PATH).map_err(errno)
    }
}

/// Timestamps that set the modification time to `mtime_ns` and leave the access time.
pub fn times(mtime_ns: i64) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        last_modification: Timespec {
            tv_sec: mtime_ns.div_euclid(1_000_000_000),
            tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
        },
    }
}

/// Sets the modification time of an open file.
pub fn set_fd_mtime(fd: BorrowedFd<'_>, mtime_ns: i64) -> io::Result<()> {
    rustix::fs::futimens(fd, &times(mtime_ns)).map_err(errno)
}

/// Sets the permission bits of an open file.
pub fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    rustix::fs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(errno)
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

    pub fn of(st: &Meta) -> Fingerprint {
        Fingerprint {
            dev: st.dev,
            ino: st.ino,
            size: st.size,
            mode: st.mode,
            mtime_ns: st.mtime_ns,
            ctime_ns: st.ctime_ns,
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

#[cfg(test)]
mod tests;
