//! The `casfs` command: parses arguments and calls the library (see `cli`).

mod cli;

// The allocator and its settings, shared with the bench binaries that run casfs in
// their own process.
mod alloc;

fn main() {
    // Like other Unix tools, end quietly when the reader of our output goes away
    // (`casfs log | head`) instead of failing on a broken pipe.
    casfs::sys::signal::default_action(libc::SIGPIPE);
    std::process::exit(cli::main());
}
