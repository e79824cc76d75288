//! The allocators' free pages given back to the system: jemalloc's arenas purged,
//! glibc's malloc trimmed.

use std::ffi::CStr;

/// jemalloc's "every arena" index (`MALLCTL_ARENAS_ALL`).
const ALL_ARENAS_PURGE: &CStr = c"arena.4096.purge";

/// Purges every jemalloc arena: its free pages go back to the system.
pub fn purge_jemalloc() {
    // SAFETY: a "void" mallctl (no old or new value) on a NUL-terminated name; jemalloc
    // is initialised on first use, and purging only releases pages no allocation holds.
    // In a binary whose global allocator is not jemalloc it purges an idle jemalloc.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            ALL_ARENAS_PURGE.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
}

/// Gives glibc malloc's free memory back to the system (`malloc_trim(0)`).
pub fn trim_malloc() {
    // SAFETY: malloc_trim only releases free memory; any thread may call it.
    unsafe { libc::malloc_trim(0) };
}
