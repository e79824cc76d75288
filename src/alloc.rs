//! The `casfs` binary's allocator: jemalloc, with settings. Included by src/main.rs
//! and by the bench binaries that run casfs in their own process (benches/common), so
//! that they measure it as it runs (with glibc's malloc the fleet bench's first upload
//! at 100k files took 8.8-11.9 s where the binary took 5.4-6.6 s).

/// jemalloc gives freed pages back (see `casfs::memory`); glibc's malloc kept most of
/// what a mount daemon freed when the kernel forgot its nodes.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Pages freed stay mapped for at most a second, then go straight back to the system
/// (no "muzzy" stage), so resident memory follows what is in use.
#[repr(transparent)]
pub struct MallocConf(*const u8);
// SAFETY: a pointer to an immutable, static, NUL-terminated string.
unsafe impl Sync for MallocConf {}

#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: MallocConf =
    MallocConf(c"dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr().cast());
