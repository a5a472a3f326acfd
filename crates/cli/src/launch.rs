//! `lightpath launch -n N [--hosts A:2,B:2 [--agent ...] [--store-addr ...]] -- CMD [ARGS...]`:
//! runs N copies of CMD as the ranks of one collectives job, on this host or spread over
//! hosts (see `lightpath_collectives::launch`).

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
    /// CPUs this launcher may use; never with --hosts).
    #[arg(long)]
    no_bind: bool,
    /// Spread the ranks over these hosts, by block: a comma-separated list of HOST or
    /// HOST:SLOTS (SLOTS ranks each, default 1). Each rank starts through --agent; rank 0
    /// serves the rendezvous store.
    #[arg(long)]
    hosts: Option<String>,
    /// How a rank starts on a host (with --hosts): words, with {host} replaced by the host
    /// (or the host appended), then the rank's command as one shell string. E.g. `ip netns
    /// exec {host} sh -c` for network namespaces.
    #[arg(long, default_value = "ssh -o BatchMode=yes")]
    agent: String,
    /// Address the ranks reach rank 0's store at (with --hosts; default the first host).
    #[arg(long)]
    store_addr: Option<String>,
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
    if let Some(hosts) = &args.hosts {
        opts.hosts =
            lightpath_collectives::launch::parse_hosts(hosts).map_err(|e| anyhow::anyhow!("--hosts {e}"))?;
        if opts.hosts.is_empty() {
            bail!("--hosts names no host");
        }
        opts.agent = args.agent.split_whitespace().map(String::from).collect();
        opts.store_addr = args.store_addr.clone();
    }
    let outcome = launch(&args.command[0], &args.command[1..], &opts)?;
    if let Some(rank) = outcome.first_failure {
        eprintln!("lightpath launch: rank {rank} failed ({:?})", outcome.statuses[rank]);
    }
    Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
}
