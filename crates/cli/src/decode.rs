//! `lightpath decode` (being written).

use std::process::ExitCode;

/// Options of `lightpath decode`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`lightpath decode` is not built yet")
}
