//! `lightpath sim` (being written).

use std::process::ExitCode;

/// Options of `lightpath sim`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`lightpath sim` is not built yet")
}
