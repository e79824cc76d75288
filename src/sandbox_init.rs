//! `casfs-sandbox-init`: the first process of an isolated sandbox
//! (`casfs::middleware::isolate::init`), a small executable of its own so that a
//! sandbox's start does not load what the server links (RocksDB, libstdc++: most of
//! `casfs`'s start-up time). The server runs it when it is installed beside `casfs`,
//! else `casfs sandbox-init`.

fn main() {
    if let Err(e) = casfs::middleware::isolate::init::run() {
        eprintln!("casfs-sandbox-init: {e}");
        std::process::exit(1);
    }
}
