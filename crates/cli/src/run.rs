//! `lightpath run [--providers LIST] [--peers RULE] [--report FILE] -- CMD ARGS...`: runs an
//! unmodified program with Lightpath's preload library (`liblightpath_preload.so`, crate
//! `lightpath-preload`), so its TCP connections to peers that also run under it move to
//! Lightpath streams (shm on one host; soft between hosts the rule names) and all others stay
//! plain TCP. The library is looked
//! for beside this binary (`cargo build` puts both in `target/<profile>/`), or where
//! `LIGHTPATH_PRELOAD_LIB` says.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

/// The preload library's file name.
const LIBRARY: &str = "liblightpath_preload.so";

/// Options of `lightpath run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Transports to offer, best first (shm, soft, ibverbs, tcp); sets LIGHTPATH_PROVIDERS.
    #[arg(long)]
    pub providers: Option<String>,
    /// Peers on other hosts (or network namespaces) to pair with: addresses and CIDR prefixes,
    /// comma-separated, or `all`; sets LIGHTPATH_PRELOAD_PEERS. Without it only connections
    /// within this host's network namespace switch.
    #[arg(long, value_name = "RULE")]
    pub peers: Option<String>,
    /// Print one line per connection (transport, why, bytes per transport) to FILE when it
    /// closes or the program exits; `stderr` for the standard error.
    #[arg(long, value_name = "FILE")]
    pub report: Option<String>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

/// Where the preload library is.
fn library() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("LIGHTPATH_PRELOAD_LIB") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("finding this program's path")?;
    let dir = exe.parent().context("this program's directory")?;
    for candidate in [dir.join(LIBRARY), dir.join("../lib").join(LIBRARY)] {
        if candidate.is_file() {
            return Ok(candidate.canonicalize().unwrap_or(candidate));
        }
    }
    bail!(
        "{LIBRARY} is not beside {} (build it with `cargo build --release -p lightpath-preload`, \
         or set LIGHTPATH_PRELOAD_LIB)",
        exe.display()
    )
}

/// Refuses a peer rule with an entry that is neither `all`, an address nor ADDRESS/BITS.
fn check_peers(rule: &str) -> Result<()> {
    let (_, bad) = lightpath::options::PeerRule::parse(rule);
    if !bad.is_empty() {
        bail!("--peers: {bad:?} not an address, ADDRESS/BITS (prefix 0..=32 or 0..=128) or `all`");
    }
    Ok(())
}

/// Runs `lightpath run`: replaces this process with the command.
pub fn run(args: Args) -> Result<ExitCode> {
    if let Some(list) = &args.providers {
        lightpath::options::parse_providers(list).map_err(anyhow::Error::msg)?;
    }
    if let Some(rule) = &args.peers {
        check_peers(rule)?;
    }
    let library = library()?;
    let mut preload = OsString::from(library.as_os_str());
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(existing);
    }
    let (program, rest) = args.command.split_first().context("no command given")?;
    let mut command = std::process::Command::new(program);
    command.args(rest).env("LD_PRELOAD", preload);
    if let Some(list) = &args.providers {
        command.env("LIGHTPATH_PROVIDERS", list);
    }
    if let Some(rule) = &args.peers {
        command.env("LIGHTPATH_PRELOAD_PEERS", rule);
    }
    if let Some(report) = &args.report {
        command.env("LIGHTPATH_PRELOAD_REPORT", report);
    }
    let err = command.exec();
    bail!("could not run {}: {err}", program.to_string_lossy())
}
