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
        Owner {
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        }
    }

    /// The user `name` (or a numeric uid) and their primary group, from the system's
    /// user database.
    pub fn of_user(name: &str) -> std::io::Result<Owner> {
        let not_found =
            || std::io::Error::new(std::io::ErrorKind::NotFound, format!("no user {name:?}"));
        let c = std::ffi::CString::new(name).map_err(|_| not_found())?;
        if let Some((uid, gid)) = crate::sys::users::lookup(&c)? {
            return Ok(Owner { uid, gid });
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
                // The raw system call (glibc's setgroups changes every thread's).
                rustix::thread::set_thread_groups(&[rustix::process::Gid::from_raw(gid)])?;
                // setfsuid/setfsgid report no failure: success is seen in the ids they
                // leave.
                if crate::sys::users::set_thread_fs_ids(uid, gid) != (uid, gid) {
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
    use rustix::io::Errno;
    rustix::fs::fchmod(dir, rustix::fs::Mode::from_raw_mode(0o700))?;
    let name = c"system.posix_acl_access";
    let Some(uid) = guest else {
        match rustix::fs::fremovexattr(dir, name) {
            Ok(()) | Err(Errno::NODATA) | Err(Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(());
    };
    let acl = access_acl(uid);
    if let Err(e) = rustix::fs::fsetxattr(dir, name, &acl, rustix::fs::XattrFlags::empty()) {
        let e = std::io::Error::from(e);
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
        if !rustix::process::geteuid().is_root() {
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
