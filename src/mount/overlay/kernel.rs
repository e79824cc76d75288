//! The kernel's side of an overlay mount: a generation's overlay mounted over its
//! lowers, mounts detached (quickly where users hold them), a workspace's overlay
//! directory and the generations it keeps.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::checkpoint::{mount_dir, Store};
use crate::fs::mount_identity;

/// `<store>/mounts/<key>/overlay`, absolute (overlayfs keeps the paths it was given;
/// the store's path may be relative).
pub(super) fn overlay_dir(store: &Store, mountpoint: &Path) -> PathBuf {
    let root = std::fs::canonicalize(store.root()).unwrap_or_else(|_| store.root().to_path_buf());
    mount_dir(&root, mountpoint).join("overlay")
}

/// Whether the upper of generation `g` holds anything.
pub(super) fn upper_is_empty(dir: &Path, g: u64) -> bool {
    std::fs::read_dir(dir.join(g.to_string()).join("upper"))
        .map(|mut r| r.next().is_none())
        .unwrap_or(true)
}

/// `p` for a system call (`InvalidInput` if it holds a NUL).
pub(crate) fn cstr(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path"))
}

/// Detaches whatever is mounted at `path` (lazily: users keep what they hold).
pub(super) fn detach(path: &Path) {
    let _ = crate::fs::detach(path);
}

/// Detaches the overlay (`identity` `id`) at `path` and returns once the path no longer
/// shows it. The detach itself runs on a thread of its own: when the last reference to
/// an overlay goes, the kernel syncs its upper filesystem (overlayfs's sync_fs), which
/// with a large file freshly written takes tens of milliseconds that a restore need not
/// wait for (the new overlay does not depend on it).
pub(super) fn detach_quickly(path: &Path, id: (u64, u64)) {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("casfs-detach".into())
        .spawn(move || {
            detach(&p);
            let _ = tx.send(());
        });
    if spawned.is_err() {
        return detach(path);
    }
    let start = std::time::Instant::now();
    while mount_identity(path) == id && start.elapsed() < std::time::Duration::from_secs(2) {
        if rx.try_recv().is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    if mount_identity(path) == id {
        let _ = rx.recv();
    }
}

/// A descriptor of the root of the overlay (`identity` `id`) at `path`: it keeps the
/// overlay alive once detached (none if another mount is there by now).
pub(super) fn hold(path: &Path, id: (u64, u64)) -> Option<std::os::fd::OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(path)
        .ok()?;
    (crate::fs::fd_identity(&f) == id).then(|| f.into())
}

/// An overlayfs mount option's path: `\`, `,` and `:` escaped (the kernel splits
/// options at `,` and lower layers at `:`).
pub(super) fn escape(p: &Path) -> String {
    let s = p.to_string_lossy();
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '\\' | ',' | ':') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Detaches the lower layers of a generation's directory `g`.
pub(super) fn detach_lowers(g: &Path) {
    detach(&g.join("meta"));
    detach(&g.join("lower"));
}

/// Mounts overlayfs at `target` over `lowerdir` (an option value, escaped), nosuid and
/// nodev (the workspace's set-id bits and devices are data, never in effect); with
/// `userxattr`, as a user namespace allows it.
pub(super) fn mount_overlay(
    lowerdir: &str,
    upper: &Path,
    work: &Path,
    target: &Path,
    userxattr: bool,
) -> std::io::Result<()> {
    // redirect_dir: a directory of the lower can be renamed (a redirect in the upper,
    // read back by the checkpoint); xino: inode numbers unique and stable across
    // copy-up; index off. metacopy is needed by an image's data-only layer (`::`); a
    // file of it whose metadata changes is then a metacopy file in the upper (read back
    // by the checkpoint); without an image a changed file is a whole file in the upper.
    // In a user namespace overlayfs keeps its attributes as `user.overlay.*` and allows
    // neither redirects nor metacopy: renaming a directory of the lower fails with EXDEV
    // there (`mv` then copies it), and there is no image.
    let metacopy = if lowerdir.contains("::") { "on" } else { "off" };
    let features = if userxattr {
        "userxattr".to_string()
    } else {
        format!("redirect_dir=on,metacopy={metacopy}")
    };
    let opts = format!(
        "lowerdir={lowerdir},upperdir={},workdir={},{features},xino=auto,index=off",
        escape(upper),
        escape(work)
    );
    let (src, fstype, target, data) = (
        CString::new("casfs").expect("no NUL"),
        CString::new("overlay").expect("no NUL"),
        cstr(target)?,
        CString::new(opts).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?,
    );
    rustix::mount::mount(
        src.as_c_str(),
        target.as_c_str(),
        fstype.as_c_str(),
        rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
        data.as_c_str(),
    )?;
    Ok(())
}

/// Removes the generations of `dir` other than `keep` (left by a daemon that is gone),
/// detaching any mount left in them first.
pub(super) fn remove_generations(dir: &Path, keep: Option<u64>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let old: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) != keep)
        .map(|e| e.path())
        .collect();
    if old.is_empty() {
        return;
    }
    for g in old {
        detach_lowers(&g);
        if let Err(e) = crate::sys::dirfd::remove_path(&g) {
            tracing::warn!("removing {}: {e}", g.display());
        }
    }
}
