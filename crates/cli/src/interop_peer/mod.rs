//! `lightpath interop-peer` (being written): the Lightpath side of interop/PROTOCOL.md.

use std::process::ExitCode;

/// Options of `lightpath interop-peer`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`lightpath interop-peer` is not built yet")
}
