//! Who a mounted tree's files belong to. Trees record no owners (the same tree, the
//! same id on every host), so a mount presents one owner for every file it did not see
//! made: the process's own user by default, or the user a sandbox is made for
//! (`casfs serve` gives a workspace to the caller who asked for it). Files made in the
//! mount are its maker's, as anywhere.

/// A user and group id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// This process's (real) user and group.
    pub fn current() -> Owner {
        // SAFETY: getuid and getgid cannot fail.
        unsafe {
            Owner {
                uid: libc::getuid(),
                gid: libc::getgid(),
            }
        }
    }

    /// The user `name` (or a numeric uid) and their primary group, from the system's
    /// user database.
    pub fn of_user(name: &str) -> std::io::Result<Owner> {
        let not_found =
            || std::io::Error::new(std::io::ErrorKind::NotFound, format!("no user {name:?}"));
        let c = std::ffi::CString::new(name).map_err(|_| not_found())?;
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut buf = vec![0u8; 16 << 10];
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: getpwnam_r with a NUL-terminated name and buffers of the lengths given.
        let r = unsafe {
            libc::getpwnam_r(
                c.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        if r != 0 {
            return Err(std::io::Error::from_raw_os_error(r));
        }
        if !found.is_null() {
            return Ok(Owner {
                uid: pw.pw_uid,
                gid: pw.pw_gid,
            });
        }
        match name.parse::<u32>() {
            Ok(uid) => Ok(Owner { uid, gid: uid }),
            Err(_) => Err(not_found()),
        }
    }

    /// Whether this is someone other than the process itself: other users must be let
    /// into its mounts (`allow_other`; permissions still apply).
    pub fn is_other(&self) -> bool {
        *self != Owner::current()
    }

    /// Makes `path` (not following a symbolic link) this owner's.
    pub fn chown(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))
    }
}

impl Owner {
    /// Runs `f` on a thread of its own whose file system credentials are this owner's
    /// (`setfsuid`, `setfsgid`, and the owner's group alone as its supplementary
    /// groups): every file `f` opens, makes or changes is checked against the owner's
    /// permissions and is made theirs, as if they had done it, however privileged this
    /// process is (a change of the file system uid from 0 also drops the capabilities
    /// that bypass permissions). The thread's credentials end with it; no other thread's
    /// change. For this process's own user `f` runs here, as it is.
    pub fn run_as<T: Send>(
        &self,
        f: impl FnOnce() -> std::io::Result<T> + Send,
    ) -> std::io::Result<T> {
        if !self.is_other() {
            return f();
        }
        let (uid, gid) = (self.uid, self.gid);
        std::thread::scope(|s| {
            s.spawn(move || {
                // The raw system calls: glibc's setgroups changes every thread's.
                // SAFETY: one gid from a live array; per-thread credentials only.
                let r = unsafe { libc::syscall(libc::SYS_setgroups, 1, [gid].as_ptr()) };
                if r != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // setfsuid/setfsgid answer the previous id; success is seen by asking
                // again (an id of -1 changes nothing).
                // SAFETY: per-thread credential changes.
                unsafe {
                    libc::setfsgid(gid);
                    libc::setfsuid(uid);
                }
                // SAFETY: queries only.
                let now = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
                if now != (uid as i32, gid as i32) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("acting as user {uid}: the file system ids did not change"),
                    ));
                }
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

impl Default for Owner {
    fn default() -> Owner {
        Owner::current()
    }
}

/// A directory only its owner (the process's user) and `guest` may pass through: the
/// gate in front of a sandbox made for another user (`casfs serve`). Its mode is 0700
/// with a POSIX access ACL `user:<guest>:--x` (mask `--x`): the guest may reach the
/// names inside that they know, and nobody else may even do that; neither may list
/// it. Without a guest, any ACL it had is removed. `dir` is an open directory (the
/// caller made it, so no path is followed here).
pub fn gate_directory(dir: std::os::fd::BorrowedFd<'_>, guest: Option<u32>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = dir.as_raw_fd();
    // SAFETY: a valid descriptor; mode bits only.
    if unsafe { libc::fchmod(fd, 0o700) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let name = c"system.posix_acl_access";
    let Some(uid) = guest else {
        // SAFETY: a valid descriptor and a NUL-terminated name.
        if unsafe { libc::fremovexattr(fd, name.as_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            if !matches!(
                e.raw_os_error(),
                Some(libc::ENODATA) | Some(libc::EOPNOTSUPP)
            ) {
                return Err(e);
            }
        }
        return Ok(());
    };
    let acl = access_acl(uid);
    // SAFETY: a valid descriptor, a NUL-terminated name and a buffer of the length given.
    let r = unsafe { libc::fsetxattr(fd, name.as_ptr(), acl.as_ptr().cast(), acl.len(), 0) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!(
                "giving user {uid} passage through a directory (a POSIX ACL): {e}; the sandboxes \
                 directory must be on a file system with ACLs (ext4, xfs, btrfs, tmpfs)"
            ),
        ));
    }
    Ok(())
}

/// The kernel's encoding of a POSIX access ACL (`posix_acl_xattr_header` and its
/// entries, in tag order): owner rwx, user `uid` --x, group ---, mask --x, others ---.
fn access_acl(uid: u32) -> Vec<u8> {
    const VERSION: u32 = 2;
    const UNDEFINED: u32 = u32::MAX;
    // (tag, permissions, id): ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER.
    let entries: [(u16, u16, u32); 5] = [
        (0x01, 7, UNDEFINED),
        (0x02, 1, uid),
        (0x04, 0, UNDEFINED),
        (0x10, 1, UNDEFINED),
        (0x20, 0, UNDEFINED),
    ];
    let mut out = VERSION.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn work_done_as_another_user_is_theirs_and_held_to_their_rights() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let private = t.path().join("root-only");
        std::fs::write(&private, "root's").unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        let o = Owner {
            uid: 4243,
            gid: 4243,
        };
        let made = t.path().join("made");
        o.run_as(|| std::fs::write(&made, "theirs")).unwrap();
        let m = std::fs::metadata(&made).unwrap();
        assert_eq!((m.uid(), m.gid()), (4243, 4243));
        let e = o.run_as(|| std::fs::read(&private)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        // This thread is still root.
        assert_eq!(std::fs::read(&private).unwrap(), b"root's");
    }

    #[test]
    fn a_gate_lets_its_guest_through_and_nobody_else() {
        let t = tempfile::tempdir().unwrap();
        let d = std::fs::File::open(t.path()).unwrap();
        match gate_directory(d.as_fd(), Some(4242)) {
            Ok(()) => {}
            // A test file system without ACLs says so; the server would refuse.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return,
            Err(e) => panic!("{e}"),
        }
        let out = std::process::Command::new("getfacl")
            .args(["-n", "-p"])
            .arg(t.path())
            .output();
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("user:4242:--x"), "{text}");
            assert!(
                text.contains("mask::--x") && text.contains("other::---"),
                "{text}"
            );
        }
        gate_directory(d.as_fd(), None).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(t.path()).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
    }
}
