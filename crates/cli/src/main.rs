//! `lightpath`: the command-line tool of the Lightpath RDMA stack.
//!
//! Each subcommand lives in its own module with a clap `Args` struct and a `run` function;
//! this file only dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `println!` that ends the program quietly (exit status 141, as a Unix tool killed by SIGPIPE)
/// when stdout is closed (`lightpath perf … | head`), instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(141);
        }
    }};
}

mod cat;
mod decode;
mod demo;
mod demo_streams;
mod devices;
mod interop_peer;
mod launch;
mod perf;
mod perf_coll;
mod pingpong;
mod plot;
mod run;
mod sim;
mod size;

/// Lightpath: RDMA (RoCE v2) for everyone — tools and diagnostics.
#[derive(Debug, Parser)]
#[command(name = "lightpath", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Two soft RoCE v2 endpoints on loopback: every operation, verified, then a side-by-side with kernel TCP.
    Demo(demo::Args),
    /// List the providers and devices this machine can use, and why any is unavailable.
    Devices(devices::Args),
    /// Decode RoCE v2 packets (hex or pcap) and check their ICRC.
    Decode(decode::Args),
    /// rdma-core's ibv_rc_pingpong, interoperable with it (either side may be the real tool).
    Pingpong(pingpong::Args),
    /// The Lightpath side of the interop test protocol (interop/PROTOCOL.md) against verbs_peer on rxe.
    InteropPeer(interop_peer::Args),
    /// netcat over Lightpath streams: `cat -l PORT` or `cat HOST PORT`; stdin to the peer, the peer to stdout.
    Cat(cat::Args),
    /// perftest-style latency and bandwidth tests between two lightpath processes.
    #[command(after_help = "Stream-layer tests (lightpath::Stream, as applications use it) take the same \
form with options of their own:\n  lightpath perf stream_lat|stream_bw|stream_rr [SERVER] --provider soft|shm|tcp \
[-s SIZE] [-n ITERS] [--conns N] [--polling] [--server threads|loop] [--json]\nSee `lightpath perf stream_lat --help`. \
Results carry both processes' CPU time; `lightpath plot` draws --json lines.\n\nCollectives, run as every rank of a job \
(e.g. `lightpath launch -n 2 -- lightpath perf allreduce -a`):\n  lightpath perf allreduce|reduce|bcast|allgather|reduce_scatter|alltoall|barrier \
[-s SIZE | -a] [-n ITERS] [--dtype T] [--json]")]
    Perf(perf::Args),
    /// Run N copies of a command on this host as the ranks of one collectives job: `launch -n N -- CMD`.
    Launch(launch::Args),
    /// Run the RC transport over a simulated lossy network, many seeds, and check invariants.
    Sim(sim::Args),
    /// Run an unmodified program with the preload library: its TCP connections to peers that also run under it move to Lightpath (shm on one host).
    Run(run::Args),
    /// Draw `perf --json` / compare.sh results as an SVG chart: size across, one line per provider.
    Plot(plot::Args),
}

/// Logging: `LIGHTPATH_LOG` is a tracing filter (`debug`, `lightpath_roce=trace`, ...);
/// events go to stderr. Unset, nothing is installed and events cost a check each.
fn init_logging() -> anyhow::Result<()> {
    let Some(spec) = std::env::var_os("LIGHTPATH_LOG") else { return Ok(()) };
    let spec = spec.to_str().ok_or_else(|| anyhow::anyhow!("LIGHTPATH_LOG is not UTF-8"))?;
    let filter = tracing_subscriber::EnvFilter::try_new(spec)
        .map_err(|err| anyhow::anyhow!("LIGHTPATH_LOG={spec:?} is not a valid filter: {err}"))?;
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

fn main() -> ExitCode {
    if let Err(err) = init_logging() {
        eprintln!("lightpath: {err:#}");
        return ExitCode::from(2);
    }
    // `perf stream_…` has options of its own (see `perf::stream`).
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let result = if perf::stream::wants(&args) {
        perf::stream::run_from(args)
    } else if perf_coll::wants(&args) {
        perf_coll::run_from(args)
    } else {
        dispatch(Cli::parse())
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("lightpath: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Cat(args) => cat::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Decode(args) => decode::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Sim(args) => sim::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Perf(args) => perf::run(args),
        Command::Pingpong(args) => pingpong::run(args),
        Command::InteropPeer(args) => interop_peer::run(args),
        Command::Run(args) => run::run(args),
    }
}
