//! The `casfs` command: parses arguments and calls the library (see `cli`).

mod cli;

fn main() {
    std::process::exit(cli::main());
}
