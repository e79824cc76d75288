//! A bound on a mount's uncaptured work: its directory in the store (an overlay's
//! generations with their uppers, a FUSE workspace's upper files) made a file system of
//! its own, ext4 on a loop device over a sparse image beside it (`mounts/<key>.disk`),
//! `nosuid,nodev`. A write past the bound fails with `ENOSPC` inside the mount, and
//! nothing else of the host fills: the image never grows past its size. This is how
//! container engines without file system quotas bound a container's layer (Docker's
//! `devicemapper`, Kubernetes' `LocalStorageCapacityIsolationFSQuotaMonitoring` off);
//! the kernels casfs runs on need not have `CONFIG_QFMT_V2` or XFS quotas.
//!
//! Making one costs a sparse file, `mkfs.ext4` (e2fsprogs, with lazy inode tables:
//! about 15 ms), a loop device and a mount (about 10 ms more); all of it is done ahead
//! (four spares per size under `mounts/.spare`: an image `<name>.disk`, its file system
//! mounted at `<name>.root`), so that a sandbox's creation pays for a rename and a bind
//! mount of the spare's file system at its directory. The loop device clears itself
//! when the file system's last mount goes (`LO_FLAGS_AUTOCLEAR`). Root only: ext4
//! cannot be mounted in a user namespace.

use crate::sys::Locked;
use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::overlay::cstr;
use rustix::mount::MountFlags;
use std::sync::Mutex;

/// The smallest bound: room for ext4's own structures and a journal.
pub const MIN_BYTES: u64 = 16 << 20;

/// A root server's bound when none is given: a sparse image takes only what is
/// written.
pub const DEFAULT_BYTES: u64 = 8 << 30;

/// Where e2fsprogs puts `mkfs.ext4` (`/sbin` on a system without a merged `/usr`).
const MKFS: [&str; 2] = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"];

fn mkfs_path() -> io::Result<&'static str> {
    MKFS.into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "mkfs.ext4 is not installed (e2fsprogs)".to_string(),
            )
        })
}

/// Whether bounded disks can be made in the store at `store_root`: one is made (of
/// [`MIN_BYTES`]) and removed again, so that a host where loop devices, `mkfs.ext4` or
/// ext4 do not work says so before a sandbox needs one. `Err` says what failed.
pub fn usable(store_root: &Path) -> io::Result<()> {
    let dir = store_root.join("mounts").join(".disk-probe");
    let _ = remove(&dir);
    let _ = std::fs::remove_dir(&dir);
    let made = bound_with(&dir, MIN_BYTES, false);
    let removed = remove(&dir).and_then(|()| std::fs::remove_dir(&dir));
    made.map(|_| ())?;
    removed
}

/// Formatted images kept ready, per size: a disk is then an attach and a mount, and
/// `mkfs.ext4` (most of a disk's cost) is paid while no one waits (four: a fork and a
/// restore make a sandbox each, and a burst of them should not wait).
const SPARES: usize = 4;

/// Where the spare images for mount directory `dir` are kept (`mounts/.spare`).
fn spares_of(dir: &Path) -> PathBuf {
    dir.parent().unwrap_or(Path::new("/")).join(".spare")
}

/// How spare images of `bytes` are named: by how they were made (a change of
/// [`mkfs`]'s options or of how a spare is kept is a new version) and their size.
fn spare_prefix(bytes: u64) -> String {
    format!("ext4v2-{bytes}-")
}

/// A spare taken for a mount directory.
enum Taken {
    /// Its file system is mounted at the directory.
    Mounted,
    /// Only its image was moved into place (its mount was gone): it is to be mounted.
    Image,
}

/// Takes a spare of `bytes` for mount directory `dir`: its image moved into place as
/// `image` (never over a file there), and its file system, mounted ahead at the
/// spare's root, bound at `dir` (a bind mount keeps the spare's `nosuid,nodev`); the
/// spare's own mount then goes. `None` if there was no spare.
fn take_spare(spares: &Path, bytes: u64, image: &Path, dir: &Path) -> Option<Taken> {
    let rd = std::fs::read_dir(spares).ok()?;
    // Only this process's: another's are being removed ([`make_spares`]).
    let mine = own_prefix(bytes);
    for e in rd.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Some(stem) = name.strip_suffix(".disk").filter(|n| n.starts_with(&mine)) else {
            continue;
        };
        // Whoever renames the image has the spare.
        if rename_new(&e.path(), image).is_err() {
            continue;
        }
        let root = spares.join(format!("{stem}.root"));
        let dev = std::fs::symlink_metadata(&root).map(|m| m.dev()).ok();
        let bound = mounted_at(&root)
            && bind(&root, dir).is_ok()
            && (std::fs::symlink_metadata(dir).map(|m| m.dev()).ok() == dev || {
                // Not the spare's file system after all: not used.
                let _ = crate::fs::detach(dir);
                false
            });
        unmount_dir(&root);
        return Some(if bound { Taken::Mounted } else { Taken::Image });
    }
    None
}

/// The names of this process's spares of `bytes`: its pid and a number drawn at its
/// start (a process with a dead one's pid does not take that one's spares for its own).
fn own_prefix(bytes: u64) -> String {
    static NONCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let nonce = NONCE.get_or_init(|| crate::checkpoint::secret_hex()[..8].to_string());
    format!("{}{}.{nonce}-", spare_prefix(bytes), std::process::id())
}

/// Detaches what is mounted at directory `dir`, if anything, and removes it.
fn unmount_dir(dir: &Path) {
    if mounted_at(dir) {
        let _ = crate::fs::detach(dir);
    }
    let _ = std::fs::remove_dir(dir);
}

/// Removes the spares' directory's entries that `keep` does not keep: images, and
/// roots with what is mounted there.
fn clear_spares(spares: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(rd) = std::fs::read_dir(spares) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if keep(&name.to_string_lossy()) {
            continue;
        }
        match e.file_type() {
            Ok(t) if t.is_dir() => unmount_dir(&e.path()),
            _ => {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Renames `from` to `to` unless `to` exists (`RENAME_NOREPLACE`).
fn rename_new(from: &Path, to: &Path) -> io::Result<()> {
    Ok(rustix::fs::renameat_with(
        rustix::fs::CWD,
        from,
        rustix::fs::CWD,
        to,
        rustix::fs::RenameFlags::NOREPLACE,
    )?)
}

/// The spare images of `bytes` in `spares`.
fn spare_count(spares: &Path, bytes: u64) -> usize {
    let prefix = spare_prefix(bytes);
    std::fs::read_dir(spares).map_or(0, |rd| {
        rd.flatten()
            .filter(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with(&prefix) && n.ends_with(".disk")
            })
            .count()
    })
}

/// Spares kept for the store at a root while this lives ([`warm`], then [`forget`]).
pub struct Spares(PathBuf);

impl Spares {
    pub fn warm(store_root: &Path, bytes: u64) -> Spares {
        warm(store_root, bytes);
        Spares(store_root.to_path_buf())
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        forget(&self.0);
    }
}

/// Makes spare images of `bytes` for the mount directories under the store at
/// `store_root`, ahead of the first disk.
pub fn warm(store_root: &Path, bytes: u64) {
    let spares = store_root.join("mounts").join(".spare");
    lock(&STOPPED).remove(&spares);
    refill(spares, bytes);
}

/// Stops making spare images for the store at `store_root` and removes those there
/// (a server that stops leaves none behind).
pub fn forget(store_root: &Path) {
    let spares = store_root.join("mounts").join(".spare");
    lock(&STOPPED).insert(spares.clone());
    // A spare being made is finished (one mkfs.ext4) before its maker sees the stop.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lock(&RUNNING).contains(&spares) && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    clear_spares(&spares, |_| false);
    let _ = std::fs::remove_dir(&spares);
}

/// Directories whose spares are being made, and those no more are to be made in.
static RUNNING: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
static STOPPED: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

fn lock(m: &Mutex<BTreeSet<PathBuf>>) -> std::sync::MutexGuard<'_, BTreeSet<PathBuf>> {
    m.locked()
}

/// Makes spare images of `bytes` in `spares` until there are [`SPARES`], on a thread
/// of its own (one per directory at a time), unless [`forget`] stopped it; what else is
/// there (other sizes, what a process that stopped left) goes.
fn refill(spares: PathBuf, bytes: u64) {
    if lock(&STOPPED).contains(&spares) || !lock(&RUNNING).insert(spares.clone()) {
        return;
    }
    let dir = spares.clone();
    let spawned = std::thread::Builder::new()
        .name("casfs-disk-spares".into())
        .spawn(move || {
            // Below the work that is waited for; mkfs.ext4 inherits it.
            // Of this thread only (nice is per thread on Linux).
            let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
            loop {
                if let Err(e) = make_spares(&dir, bytes) {
                    tracing::warn!("making spare disks in {}: {e}", dir.display());
                    lock(&RUNNING).remove(&dir);
                    return;
                }
                // Checked again under the lock: a disk taken meanwhile is made again.
                let mut r = lock(&RUNNING);
                if spare_count(&dir, bytes) >= SPARES || lock(&STOPPED).contains(&dir) {
                    r.remove(&dir);
                    return;
                }
            }
        });
    if spawned.is_err() {
        lock(&RUNNING).remove(&spares);
    }
}

fn make_spares(spares: &Path, bytes: u64) -> io::Result<()> {
    // Numbers no other spare of this process had (taken ones' included).
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    match std::fs::DirBuilder::new().mode(0o700).create(spares) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    // This process's spares stay (one may be being taken); no other process makes
    // spares here (the store's lock), so theirs are what one that stopped left.
    let mine = own_prefix(bytes);
    clear_spares(spares, |n| n.starts_with(&mine));
    while spare_count(spares, bytes) < SPARES && !lock(&STOPPED).contains(spares) {
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{mine}{n}");
        let tmp = spares.join(format!("{name}.tmp"));
        let root = spares.join(format!("{name}.root"));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        // Formatted and mounted, then published under its `.disk` name.
        let made = f
            .set_len(bytes)
            .and_then(|()| mkfs(&tmp))
            .and_then(|()| std::fs::DirBuilder::new().mode(0o700).create(&root))
            .and_then(|()| attach(&f))
            .and_then(|(dev, path)| {
                mount(&path, &root)?;
                drop(dev);
                prepare_root(&root)
            })
            .and_then(|()| rename_new(&tmp, &spares.join(format!("{name}.disk"))));
        drop(f);
        if let Err(e) = made {
            unmount_dir(&root);
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    Ok(())
}

/// A new file system's root made the mount directory it stands for: the store's own
/// (0700), without `lost+found`.
fn prepare_root(root: &Path) -> io::Result<()> {
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?;
    match std::fs::remove_dir(root.join("lost+found")) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Binds the file system mounted at `from` at `to` (its mount's flags kept).
fn bind(from: &Path, to: &Path) -> io::Result<()> {
    let (src, target) = (cstr(from)?, cstr(to)?);
    rustix::mount::mount_bind(src.as_c_str(), target.as_c_str())?;
    Ok(())
}

/// The image of the mount directory `dir`.
fn image_of(dir: &Path) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push(".disk");
    PathBuf::from(s)
}

/// Whether `dir` is the root of a file system other than its parent's.
fn mounted_at(dir: &Path) -> bool {
    let (Ok(d), Some(Ok(p))) = (
        std::fs::symlink_metadata(dir),
        dir.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    d.is_dir() && d.dev() != p.dev()
}

/// Makes the mount directory `dir` a file system of `bytes` (see the module's
/// comment), or keeps the one it is already: mounted by an earlier server that was
/// killed, or an image such a server left, mounted again with what it holds. A
/// directory that already holds work made without a bound is refused (mounting over
/// it would hide that work). Returns whether the disk was made now (empty). A new
/// disk is a spare image made ahead where there is one (and another is made).
pub fn bound(dir: &Path, bytes: u64) -> io::Result<bool> {
    bound_with(dir, bytes, true)
}

fn bound_with(dir: &Path, bytes: u64, spares: bool) -> io::Result<bool> {
    if bytes < MIN_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a disk bound of {bytes} bytes: give at least {MIN_BYTES}"),
        ));
    }
    if mounted_at(dir) {
        return Ok(false);
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if std::fs::read_dir(dir)?.next().is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{} holds uncaptured work made without a disk bound; discard or \
                         checkpoint it first",
                        dir.display()
                    ),
                ));
            }
        }
        Err(e) => return Err(e),
    }
    let image = image_of(dir);
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&image)
    };
    // (the image, whether it is new, whether it still needs a file system)
    let (file, fresh, unformatted) = match open() {
        Ok(f) => (f, false, false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let taken = if spares {
                let from = spares_of(dir);
                let taken = take_spare(&from, bytes, &image, dir);
                refill(from, bytes);
                taken
            } else {
                None
            };
            if let Some(Taken::Mounted) = taken {
                return Ok(true);
            }
            if taken.is_some() {
                match open() {
                    Ok(f) => (f, true, false),
                    Err(e) => {
                        // Not to be found again as a disk with work in it.
                        let _ = std::fs::remove_file(&image);
                        return Err(e);
                    }
                }
            } else {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&image)?;
                // Sparse: blocks are taken as the file system writes them, never more.
                f.set_len(bytes)?;
                (f, true, true)
            }
        }
        Err(e) => return Err(e),
    };
    let made = attach(&file).and_then(|(dev, path)| {
        if unformatted {
            mkfs(&path)?;
        }
        mount(&path, dir)?;
        drop(dev);
        Ok(())
    });
    if let Err(e) = made {
        if fresh {
            let _ = std::fs::remove_file(&image);
        }
        return Err(io::Error::new(
            e.kind(),
            format!("a disk of {bytes} bytes for {}: {e}", dir.display()),
        ));
    }
    if fresh {
        prepare_root(dir)?;
    } else {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(fresh)
}

/// Unmounts the bounded file system of mount directory `dir`, if it is one, and
/// removes its image: what it held is gone. Lazily: a process still holding a file of
/// it keeps that file until it lets go (the loop device then clears itself).
pub fn remove(dir: &Path) -> io::Result<()> {
    if mounted_at(dir) {
        crate::fs::detach(dir)?;
    }
    // Emptied first: a mount namespace another process copied while the disk was
    // mounted (`unshare -m`) keeps the file system, and so the image, alive after it
    // is unlinked; truncated, it holds no blocks of the host whoever keeps it.
    let image = image_of(dir);
    match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&image)
    {
        Ok(f) => f.set_len(0)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    match std::fs::remove_file(&image) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A free loop device set up over `file`: the open device and its path.
fn attach(file: &File) -> io::Result<(File, PathBuf)> {
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")?;
    let mut last = None;
    // Another process may take the free device first: ask again.
    for _ in 0..16 {
        let n = crate::sys::loop_dev::free(ctl.as_fd())?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)?;
        let e = match crate::sys::loop_dev::configure(dev.as_fd(), file.as_fd()) {
            Ok(()) => return Ok((dev, path)),
            Err(e) => e,
        };
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
        last = Some(e);
    }
    Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::WouldBlock)))
}

/// An ext4 file system on device (or image file) `dev`: 1% of its blocks kept for root (the server:
/// an overlay's next generation is made there when a full sandbox is restored; a
/// sandbox's processes are never root), one inode per 8 KiB, inode tables and journal
/// zeroed later by the kernel.
fn mkfs(dev: &Path) -> io::Result<()> {
    let mkfs = mkfs_path()?;
    let out = std::process::Command::new(mkfs)
        .args([
            "-q",
            "-F",
            "-m",
            "1",
            "-i",
            "8192",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            "-L",
            "casfs-disk",
        ])
        .arg(dev)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("running {mkfs}: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{mkfs} {}: {}",
            dev.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn mount(dev: &Path, dir: &Path) -> io::Result<()> {
    let (src, target) = (cstr(dev)?, cstr(dir)?);
    let fstype = CString::new("ext4").expect("no NUL");
    // An error of the file system (its image emptied by `remove` while a mount made
    // elsewhere still holds it) makes it read-only, whatever its superblock says: never
    // a panic of the host.
    let data = CString::new("errors=remount-ro").expect("no NUL");
    rustix::mount::mount(
        src.as_c_str(),
        target.as_c_str(),
        fstype.as_c_str(),
        MountFlags::NOSUID | MountFlags::NODEV,
        data.as_c_str(),
    )?;
    Ok(())
}
