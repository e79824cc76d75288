//! The `casfs` command: parses arguments and calls the library (see `cli`).

mod cli;

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

fn main() {
    // Like other Unix tools, end quietly when the reader of our output goes away
    // (`casfs log | head`) instead of failing on a broken pipe.
    // SAFETY: setting a signal disposition before any other thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    std::process::exit(cli::main());
}
