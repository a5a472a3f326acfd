//! `lightpath launch -n N -- CMD [ARGS...]`: runs N copies of CMD on this host as the ranks
//! of one collectives job (see `lightpath_collectives::launch`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use lightpath_collectives::launch::{launch, LaunchOptions};

/// Arguments of `lightpath launch`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of ranks.
    #[arg(short = 'n', long = "np")]
    ranks: usize,
    /// Seconds the other ranks may run after one failed, before they are killed.
    #[arg(long, default_value_t = 10)]
    grace: u64,
    /// Do not bind each rank to a CPU (by default rank i runs on the (i mod n)-th of the n
    /// CPUs this launcher may use).
    #[arg(long)]
    no_bind: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs the job; exits with the first failing rank's status (0 when all succeed).
pub fn run(args: Args) -> Result<ExitCode> {
    if args.ranks == 0 {
        bail!("-n must be at least 1");
    }
    let mut opts = LaunchOptions::new(args.ranks);
    opts.grace = Duration::from_secs(args.grace);
    opts.bind = !args.no_bind;
    let outcome = launch(&args.command[0], &args.command[1..], &opts)?;
    if let Some(rank) = outcome.first_failure {
        eprintln!("lightpath launch: rank {rank} failed ({:?})", outcome.statuses[rank]);
    }
    Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
}
