use std::ptr::NonNull;

use crate::session::MAX_WRITE_SIZE;

/// Size of the buffer for reading a request from the kernel. Since the kernel may send
/// up to `MAX_WRITE_SIZE` bytes in a write request, we use that value plus some extra space.
const BUFFER_SIZE: usize = MAX_WRITE_SIZE + 4096;

/// A buffer that provides an aligned slice for FUSE operations.
///
/// casfs patch 0002: the buffer is an anonymous mapping of its own instead of a
/// `Vec<u8>`. A `vec![0; 16 MiB]` comes from the allocator, and once glibc has freed one
/// mapping of that size it raises its mmap threshold and serves the next from the heap,
/// zeroing all 16 MiB by hand: every serving thread of every later session then holds
/// 16 MiB resident whether or not a large write ever came, and the heap does not give it
/// back. A mapping of its own costs resident memory only for the pages a request
/// touches, and is returned to the kernel when the thread ends. Page alignment satisfies
/// `fuse_in_header`'s.
#[derive(Debug)]
pub(crate) struct FuseReadBuf {
    ptr: NonNull<u8>,
}

// SAFETY: the mapping is owned by this value alone.
unsafe impl Send for FuseReadBuf {}

impl FuseReadBuf {
    /// Creates a new `FuseReadBuf` with the default buffer size.
    pub(crate) fn new() -> Self {
        // SAFETY: an anonymous private mapping; no file, no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BUFFER_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            p != libc::MAP_FAILED,
            "mapping a {BUFFER_SIZE}-byte FUSE read buffer: {}",
            std::io::Error::last_os_error()
        );
        Self {
            ptr: NonNull::new(p.cast()).expect("mmap does not return null on success"),
        }
    }

    /// Returns the buffer (page-aligned, zero-filled when new).
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is BUFFER_SIZE bytes, readable and writable, and borrowed
        // mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), BUFFER_SIZE) }
    }
}

impl Drop for FuseReadBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), BUFFER_SIZE) };
    }
}
