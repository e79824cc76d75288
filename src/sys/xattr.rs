//! Extended attributes: of an open file, or of an entry by name in a directory handle
//! (never following it). Never by path.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

fn cname(name: &[u8]) -> io::Result<CString> {
    CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "xattr name contains NUL"))
}

/// Calls `f` with a growing buffer until the result fits; `f` returns what the
/// `*listxattr`/`*getxattr` call returned.
fn with_buffer(start: usize, mut f: impl FnMut(&mut [u8]) -> isize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; start];
    loop {
        let n = f(&mut buf);
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && buf.len() < (1 << 24) {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        return Err(e);
    }
}

/// Lists names with `list`, then reads each value with `get`; sorted by name. A
/// filesystem without xattr support gives none; an attribute removed in between is
/// skipped.
fn collect(
    list: impl FnMut(&mut [u8]) -> isize,
    mut get: impl FnMut(&CStr, &mut [u8]) -> isize,
) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let names = match with_buffer(1024, list) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let c = cname(name)?;
        match with_buffer(256, |buf| get(&c, buf)) {
            Ok(value) => out.push((name.to_vec(), value)),
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort();
    Ok(out)
}

/// `getxattrat(2)` and `listxattrat(2)` (Linux 6.13): the same number on every
/// architecture casfs builds for.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_GETXATTRAT: libc::c_long = 464;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_LISTXATTRAT: libc::c_long = 465;

/// `struct xattr_args` of `getxattrat(2)`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[repr(C)]
struct XattrArgs {
    value: u64,
    size: u32,
    flags: u32,
}

/// Whether the kernel has the `*xattrat` calls (learnt from the first call).
static AT_CALLS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// The xattrs of the entry `name` of the directory `dir` (a symlink's own, not its
/// target's), read by name in that directory: `listxattrat`/`getxattrat` where the
/// kernel has them, else `/proc/self/fd/<dir>/<name>` with the `l*` calls (the
/// descriptor pins the directory; only the last name is looked up, and not followed).
/// For what cannot be opened to read them from (a symlink, a FIFO, a device node); what
/// can be opened is read with [`flist`]. The entry must still be `expect` afterwards
/// (else [`super::dirfd::replaced`]): nothing of another file is taken for it.
pub fn list_at(
    dir: BorrowedFd<'_>,
    name: &CStr,
    expect: &super::dirfd::Meta,
) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let x = list_named(dir, name)?;
    match super::dirfd::lstat_at(dir, name)? {
        Some(m) if m.same_file(expect) => Ok(x),
        _ => Err(super::dirfd::replaced()),
    }
}

fn list_named(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    use std::sync::atomic::Ordering;
    let d = dir.as_raw_fd();
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if AT_CALLS.load(Ordering::Relaxed) {
        let nofollow = libc::AT_SYMLINK_NOFOLLOW as libc::c_uint;
        let got = collect(
            // SAFETY: valid dirfd, NUL-terminated name and a buffer of the given length.
            |buf| unsafe {
                libc::syscall(
                    SYS_LISTXATTRAT,
                    d,
                    name.as_ptr(),
                    nofollow,
                    buf.as_mut_ptr(),
                    buf.len(),
                ) as isize
            },
            |xname, buf| {
                let mut args = XattrArgs {
                    value: buf.as_mut_ptr() as u64,
                    size: buf.len() as u32,
                    flags: 0,
                };
                // SAFETY: valid dirfd, names and an args struct of the size given.
                unsafe {
                    libc::syscall(
                        SYS_GETXATTRAT,
                        d,
                        name.as_ptr(),
                        nofollow,
                        xname.as_ptr(),
                        &mut args as *mut XattrArgs,
                        std::mem::size_of::<XattrArgs>(),
                    ) as isize
                }
            },
        );
        match got {
            // Not in this kernel, or refused by a filter that predates them (systemd's
            // SystemCallFilter= with SystemCallErrorNumber=EPERM, a container's
            // seccomp profile): the /proc way from now on, which answers a real
            // permission error the same way.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EPERM)) => {
                AT_CALLS.store(false, Ordering::Relaxed)
            }
            other => return other,
        }
    }
    let _ = &AT_CALLS;
    list_proc(dir, name)
}

/// [`list_at`]'s way on a kernel without `listxattrat`: `/proc/self/fd/<dir>/<name>`
/// with the `l*` calls.
pub(crate) fn list_proc(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let d = dir.as_raw_fd();
    let mut p = format!("/proc/self/fd/{d}/").into_bytes();
    p.extend_from_slice(name.to_bytes());
    let c = CString::new(p).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL"))?;
    collect(
        // SAFETY: valid path and a buffer of the given length.
        |buf| unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) },
        // SAFETY: valid path, name and a buffer of the given length.
        |xname, buf| unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                xname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        },
    )
}

/// All extended attributes of an open file descriptor, sorted by name.
pub fn flist(fd: i32) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    collect(
        // SAFETY: valid fd and a buffer of the given length.
        |buf| unsafe { libc::flistxattr(fd, buf.as_mut_ptr().cast(), buf.len()) },
        // SAFETY: valid fd, name and a buffer of the given length.
        |name, buf| unsafe {
            libc::fgetxattr(fd, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        },
    )
}

/// Sets one extended attribute on an open file descriptor.
pub fn fset(fd: i32, name: &[u8], value: &[u8]) -> io::Result<()> {
    let c = cname(name)?;
    // SAFETY: valid fd, NUL-terminated name and a value buffer of the given length.
    let rc = unsafe { libc::fsetxattr(fd, c.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Removes one extended attribute from an open file descriptor.
pub fn fremove(fd: i32, name: &[u8]) -> io::Result<()> {
    let c = cname(name)?;
    // SAFETY: valid fd and NUL-terminated name.
    if unsafe { libc::fremovexattr(fd, c.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes the xattrs of `fd` exactly `want` (sorted by name).
pub fn fsync_all(fd: i32, want: &[(Vec<u8>, Vec<u8>)]) -> io::Result<()> {
    let have = flist(fd)?;
    if have == want {
        return Ok(());
    }
    for (name, _) in &have {
        if !want.iter().any(|(n, _)| n == name) {
            fremove(fd, name)?;
        }
    }
    for (name, value) in want {
        if !have.iter().any(|(n, v)| n == name && v == value) {
            fset(fd, name, value)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod refused_tests {
    use super::*;
    use std::os::fd::AsFd;

    /// Under a filter that refuses `listxattrat`/`getxattrat` with EPERM (the Debian
    /// unit's, on systemd releases that predate them), a symlink's xattrs are still
    /// read, through /proc.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn refused_xattrat_calls_fall_back_to_proc() {
        let t = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("nowhere", t.path().join("link")).unwrap();
        let dir = std::fs::File::open(t.path()).unwrap();
        let expect = crate::sys::dirfd::lstat_at(dir.as_fd(), c"link")
            .unwrap()
            .unwrap();
        let got = std::thread::spawn(move || {
            use std::collections::BTreeMap;
            let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
                [(SYS_GETXATTRAT, Vec::new()), (SYS_LISTXATTRAT, Vec::new())].into();
            let filter = seccompiler::SeccompFilter::new(
                rules,
                seccompiler::SeccompAction::Allow,
                seccompiler::SeccompAction::Errno(libc::EPERM as u32),
                seccompiler::TargetArch::x86_64,
            )
            .unwrap();
            let prog: seccompiler::BpfProgram = filter.try_into().unwrap();
            // SAFETY: prctl with integer arguments, on this thread only.
            assert_eq!(
                unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) },
                0
            );
            // This thread only (no TSYNC): the test process's others keep every call.
            seccompiler::apply_filter(&prog).unwrap();
            list_at(dir.as_fd(), c"link", &expect)
        })
        .join()
        .unwrap();
        assert_eq!(got.unwrap(), Vec::new());
    }
}
