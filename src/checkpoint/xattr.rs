//! Extended attributes, by path (never following a final symlink) or by open file.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

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

/// All extended attributes of `path` (not following a final symlink), sorted by name.
pub fn list(path: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    collect(
        // SAFETY: valid path and a buffer of the given length.
        |buf| unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) },
        // SAFETY: valid path, name and a buffer of the given length.
        |name, buf| unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                name.as_ptr(),
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
