//! Extended attributes of a path, without following symlinks.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTSUP) | Some(libc::ENODATA))
}

/// All extended attributes of `path` (not following a final symlink), sorted by name.
/// A filesystem without xattr support gives none.
pub fn list(path: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = cpath(path)?;
    let mut names = vec![0u8; 1024];
    let len = loop {
        // SAFETY: the buffer is valid for names.len() bytes.
        let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) {
            names.resize(names.len() * 4, 0);
            continue;
        }
        if unsupported(&e) {
            return Ok(Vec::new());
        }
        return Err(e);
    };
    let mut out = Vec::new();
    for name in names[..len].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name).expect("split on NUL");
        let mut value = vec![0u8; 256];
        loop {
            // SAFETY: the buffer is valid for value.len() bytes.
            let n = unsafe {
                libc::lgetxattr(
                    c.as_ptr(),
                    cname.as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            if n >= 0 {
                value.truncate(n as usize);
                out.push((name.to_vec(), value));
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) if value.len() < (1 << 20) => value.resize(value.len() * 4, 0),
                // Removed between list and get.
                Some(libc::ENODATA) => break,
                _ => return Err(e),
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Sets one extended attribute on an open file descriptor.
pub fn fset(fd: i32, name: &[u8], value: &[u8]) -> io::Result<()> {
    let cname = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "xattr name contains NUL"))?;
    // SAFETY: valid fd, NUL-terminated name and a value buffer of the given length.
    let rc = unsafe { libc::fsetxattr(fd, cname.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Names of the extended attributes on an open file descriptor.
pub fn flist_names(fd: i32) -> io::Result<Vec<Vec<u8>>> {
    let mut names = vec![0u8; 1024];
    let len = loop {
        // SAFETY: the buffer is valid for names.len() bytes.
        let n = unsafe { libc::flistxattr(fd, names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) {
            names.resize(names.len() * 4, 0);
            continue;
        }
        if unsupported(&e) {
            return Ok(Vec::new());
        }
        return Err(e);
    };
    Ok(names[..len]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| n.to_vec())
        .collect())
}

/// Removes one extended attribute from an open file descriptor.
pub fn fremove(fd: i32, name: &[u8]) -> io::Result<()> {
    let cname = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "xattr name contains NUL"))?;
    // SAFETY: valid fd and NUL-terminated name.
    let rc = unsafe { libc::fremovexattr(fd, cname.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// All extended attributes of an open file descriptor, sorted by name.
pub fn flist(fd: i32) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    for name in flist_names(fd)? {
        let cname = CString::new(name.clone()).expect("split on NUL");
        let mut value = vec![0u8; 256];
        loop {
            // SAFETY: the buffer is valid for value.len() bytes.
            let n = unsafe {
                libc::fgetxattr(fd, cname.as_ptr(), value.as_mut_ptr().cast(), value.len())
            };
            if n >= 0 {
                value.truncate(n as usize);
                out.push((name, value));
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) if value.len() < (1 << 20) => value.resize(value.len() * 4, 0),
                Some(libc::ENODATA) => break,
                _ => return Err(e),
            }
        }
    }
    out.sort();
    Ok(out)
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
