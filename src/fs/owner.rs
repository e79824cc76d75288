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

impl Default for Owner {
    fn default() -> Owner {
        Owner::current()
    }
}
