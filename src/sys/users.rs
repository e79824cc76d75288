//! The user and group databases (`getpwuid_r`, `getgrnam_r`: `/etc/passwd` and
//! `/etc/group`, or whatever the host's NSS asks).

use std::ffi::{CStr, OsString};
use std::io;
use std::os::unix::ffi::OsStringExt;

/// The name of user `uid`; `None` if the database has no such user (or no name for
/// it); an error when the database cannot say.
pub fn user_name(uid: u32) -> io::Result<Option<OsString>> {
    // SAFETY: a plain C struct, all zeroes a valid value (filled by the call).
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 << 10];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: valid pointers to a passwd record, a buffer of the length given and the
    // result slot, all alive for the call.
    let r =
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    // ENOENT and the like say "no such user" on some systems; anything else is an
    // error of the database.
    if r != 0 && !matches!(r, libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM) {
        return Err(io::Error::from_raw_os_error(r));
    }
    if r != 0 || found.is_null() || pw.pw_name.is_null() {
        return Ok(None);
    }
    // SAFETY: the name the call filled in, NUL-terminated inside `buf`.
    let name = unsafe { CStr::from_ptr(pw.pw_name) };
    Ok(Some(OsString::from_vec(name.to_bytes().to_vec())))
}

/// The id of group `name`; `None` if the database has no such group; an error when
/// the database cannot say.
pub fn group_id(name: &CStr) -> io::Result<Option<u32>> {
    // SAFETY: a plain C struct, all zeroes a valid value (filled by the call).
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 << 10];
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: valid pointers to a group record, a buffer of the length given and the
    // result slot, all alive for the call.
    let r = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    if found.is_null() {
        return Ok(None);
    }
    Ok(Some(grp.gr_gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_named_and_its_group_found() {
        assert_eq!(user_name(0).unwrap(), Some(OsString::from("root")));
        assert_eq!(group_id(c"root").unwrap(), Some(0));
        assert_eq!(group_id(c"no-such-group-of-casfs").unwrap(), None);
    }
}
