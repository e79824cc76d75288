//! Users and groups: the system's databases (`getpwnam_r`, `getpwuid_r`,
//! `getgrnam_r`: `/etc/passwd` and `/etc/group`, or whatever the host's NSS asks), and
//! the file system ids a thread acts with.

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

/// The uid and primary gid of the user `name` in the system's user database
/// (`getpwnam_r`: `/etc/passwd`, or whatever NSS is set up to ask); `None` if there is
/// no such user.
pub fn lookup(name: &CStr) -> io::Result<Option<(u32, u32)>> {
    // SAFETY: an all-zero passwd (null pointers, zero ids) is a valid value of this
    // plain C struct; it is only an out-parameter.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 << 10];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: a NUL-terminated name, an out-parameter, a buffer of the length given and
    // a result pointer, all outliving the call; the strings the entry points to live
    // in `buf`, of which nothing is kept.
    let r = unsafe {
        libc::getpwnam_r(
            name.as_ptr(),
            &mut pw,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok((!found.is_null()).then_some((pw.pw_uid, pw.pw_gid)))
}

/// Sets the calling thread's file system gid, then uid (`setfsgid`, `setfsuid`: the
/// ids files are opened, made and checked with; the thread's own, no other thread's),
/// and answers the ids in effect afterwards: the calls report no failure, so the caller
/// compares them with what it asked for. A change of the file system uid from 0 also
/// drops the capabilities that bypass file permissions.
pub fn set_thread_fs_ids(uid: u32, gid: u32) -> (u32, u32) {
    // SAFETY: plain system calls on integers that change only this thread's
    // credentials; an id of -1 changes nothing and answers the current one.
    unsafe {
        libc::setfsgid(gid);
        libc::setfsuid(uid);
        (
            libc::setfsuid(u32::MAX) as u32,
            libc::setfsgid(u32::MAX) as u32,
        )
    }
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

    #[test]
    fn root_is_in_the_user_database_and_a_made_up_name_is_not() {
        assert_eq!(lookup(c"root").unwrap(), Some((0, 0)));
        assert_eq!(lookup(c"casfs-no-such-user-3f9a").unwrap(), None);
    }
}
