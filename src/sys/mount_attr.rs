//! Mount attributes of a whole mount tree at once (`mount_setattr(2)`, which `rustix`
//! does not wrap), such as a detached tree before it is attached.

use std::os::fd::{AsRawFd, BorrowedFd};

/// `MOUNT_ATTR_NOSUID`: set-user-id and set-group-id bits are ignored.
pub const NOSUID: u64 = 0x2;
/// `MOUNT_ATTR_NODEV`: device files cannot be opened.
pub const NODEV: u64 = 0x4;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Sets the attributes `set` ([`NOSUID`], [`NODEV`], ...) on every mount of the tree
/// whose root `tree` is (a descriptor of `open_tree` or of the tree's root).
pub fn set_recursive(tree: BorrowedFd<'_>, set: u64) -> rustix::io::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr on a descriptor the caller holds, with an attribute
    // structure of the size passed, alive for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(rustix::io::Errno::from_raw_os_error(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL),
        ));
    }
    Ok(())
}
