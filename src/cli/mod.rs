//! The command line: parsing (clap), store location, output as text or JSON, progress.
//! All behaviour lives in the library; this module only parses, calls and prints.
//! This file is the entry point: `args` defines the command line, `commands` runs one.

mod args;
mod bench;
mod commands;
mod generate;
mod maintain;
mod mount;
mod output;
mod serve;
mod units;
mod watch;

use clap::Parser;

use args::Cli;

pub fn main() -> i32 {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: a service's log (journalctl -u casfs) or a file gets
    // plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    match commands::run(&cli) {
        Ok(()) => 0,
        Err(e) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            let mut msg = chain[0].clone();
            for c in &chain[1..] {
                if !msg.contains(c.as_str()) {
                    msg.push_str(": ");
                    msg.push_str(c);
                }
            }
            eprintln!("casfs: error: {msg}");
            1
        }
    }
}
