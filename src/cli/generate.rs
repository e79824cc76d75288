//! What is generated from the command line's own definition: shell completions
//! (`casfs completions SHELL`) and man pages (`casfs man-pages DIR`, hidden: the
//! Debian package runs it at build time, scripts/package-deb.sh).

use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;

use super::args::Cli;

pub fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "casfs", &mut std::io::stdout());
    Ok(())
}

/// Writes `casfs.1` and one `casfs-COMMAND.1` per visible command into `dir`.
pub fn man_pages(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))
}
