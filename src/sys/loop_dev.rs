//! Loop devices: a free one asked of `/dev/loop-control`, and one set up over a file.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

// <linux/loop.h>
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// The number of a free loop device (`/dev/loop<n>`), asked of `ctl`, an open
/// `/dev/loop-control`; the kernel makes one if none is free.
pub fn free(ctl: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: an ioctl without an argument on the loop control device.
    let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as u32)
}

/// Sets up the loop device `dev` (open for reading and writing) over the file
/// `backing`, in one `LOOP_CONFIGURE`: cleared when its last user closes it
/// (autoclear), read and written with direct I/O. `EBUSY` if another took it first.
pub fn configure(dev: BorrowedFd<'_>, backing: BorrowedFd<'_>) -> io::Result<()> {
    let config = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: 0,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
            lo_file_name: [0; 64],
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads a `struct loop_config` that outlives the call.
    if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &config) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
