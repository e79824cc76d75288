//! Giving freed memory back to the system. The `casfs` binary allocates with jemalloc
//! (its `#[global_allocator]`); RocksDB's C++ side allocates with glibc's malloc. After
//! a burst of frees (a mount daemon unloading the nodes the kernel forgot, a server
//! ending a run) both are asked to return their free pages at once, so that resident
//! memory follows what is in use instead of waiting for the allocators' own decay.

use crate::sys::allocators;

/// Returns free pages of both allocators to the system. Costs a few milliseconds when
/// much was freed: call it after bursts, not per free.
pub fn give_back() {
    allocators::purge_jemalloc();
    allocators::trim_malloc();
}
