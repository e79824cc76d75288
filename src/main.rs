//! The `casfs` command: parses arguments and calls the library (see `cli`).

mod cli;

// The allocator and its settings, shared with the bench binaries that run casfs in
// their own process.
mod alloc;

fn main() {
    // Like other Unix tools, end quietly when the reader of our output goes away
    // (`casfs log | head`) instead of failing on a broken pipe.
    // SAFETY: setting a signal disposition before any other thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    std::process::exit(cli::main());
}
