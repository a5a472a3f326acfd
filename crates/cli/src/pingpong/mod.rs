//! `lightpath pingpong` (being written): rdma-core's `ibv_rc_pingpong`, interoperable with it.

pub mod oob;

use std::process::ExitCode;

/// Options of `lightpath pingpong`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`lightpath pingpong` is not built yet")
}
