//! `casfs-sandbox-init`: the first process of an isolated sandbox
//! (`casfs::middleware::isolate::init`), and with `sandbox-spawn` the spare process
//! that becomes a sandbox's bubblewrap (`casfs::middleware::isolate::spare_main`): a
//! small executable of its own so that a sandbox's start does not load what the server
//! links (RocksDB, libstdc++: most of `casfs`'s start-up time). The server runs it when
//! it is installed beside `casfs`, else `casfs sandbox-init` / `casfs sandbox-spawn`.

fn main() {
    let spare = std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "sandbox-spawn");
    let done = if spare {
        casfs::middleware::isolate::spare_main()
    } else {
        casfs::middleware::isolate::init::run()
    };
    if let Err(e) = done {
        eprintln!("casfs-sandbox-init: {e}");
        std::process::exit(1);
    }
}
