//! Users: the system's user database, and the file system ids a thread acts with.

use std::ffi::CStr;
use std::io;

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
    fn root_is_in_the_user_database_and_a_made_up_name_is_not() {
        assert_eq!(lookup(c"root").unwrap(), Some((0, 0)));
        assert_eq!(lookup(c"casfs-no-such-user-3f9a").unwrap(), None);
    }
}
