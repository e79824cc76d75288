//! Giving freed memory back to the system. The `casfs` binary allocates with jemalloc
//! (its `#[global_allocator]`); RocksDB's C++ side allocates with glibc's malloc. After
//! a burst of frees (a mount daemon unloading the nodes the kernel forgot, a server
//! ending a run) both are asked to return their free pages at once, so that resident
//! memory follows what is in use instead of waiting for the allocators' own decay.

/// jemalloc's "every arena" index (`MALLCTL_ARENAS_ALL`).
const ALL_ARENAS_PURGE: &[u8] = b"arena.4096.purge\0";

/// Returns free pages of both allocators to the system. Costs a few milliseconds when
/// much was freed: call it after bursts, not per free.
pub fn give_back() {
    // SAFETY: a "void" mallctl (no old or new value) on a NUL-terminated name; jemalloc
    // is initialised on first use, and purging only releases pages no allocation holds.
    // In a binary whose global allocator is not jemalloc it purges an idle jemalloc.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            ALL_ARENAS_PURGE.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
    // SAFETY: malloc_trim only releases free memory; any thread may call it.
    unsafe { libc::malloc_trim(0) };
}
