//! `lightpath perf`: perftest-style latency and bandwidth tests.
//!
//! Every test runs between two `lightpath perf` processes: the server (no SERVER argument) and the
//! client. They meet on an out-of-band TCP connection (`-p`, default 18515, as perftest), agree on
//! the test and its parameters there ([`control`]), then move data with the chosen provider:
//! `soft` (the userspace RoCE v2 engine over UDP), `ibverbs` (RDMA devices), `shm` (shared
//! memory between two processes of one host) or `tcp` (the same message pattern over kernel
//! TCP, the baseline every RDMA number is compared with). Latency tests report min / median / p99
//! / max one-way latency in µs (round-trip tests such as READ and atomics report the round trip,
//! as perftest does); bandwidth tests report MB/s (10^6 bytes per second) and million messages per
//! second. Bandwidth tests verify the payload with a checksum at the end of each size.
//!
//! The server runs one client's test and exits; connections that are not such a client (or ask
//! for another test, or bring an endpoint it cannot use) are answered or dropped and it goes on
//! waiting ([`session`]). soft and ibverbs clients and servers meet each other: they speak one
//! wire, RoCE v2 ([`ProviderKind::interoperates_with`]). Every result carries both processes'
//! CPU time over the size ([`cpu`]).

mod args;
mod control;
pub mod cpu;
mod ibverbs;
mod pattern;
mod progress;
mod rdma;
mod report;
mod session;
mod shm;
mod soft;
mod stats;
pub mod stream;
mod tcp;

use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::process::ExitCode;

use anyhow::{anyhow, Result};

pub use args::{Args, PerfTest, ProviderKind};
pub use report::SizeResult;

/// Runs `lightpath perf`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.validate()?;
    if args.perftest {
        rdma::perftest::run(&args)?;
        return Ok(ExitCode::SUCCESS);
    }
    match args.provider {
        ProviderKind::Soft => soft::run(&args)?,
        ProviderKind::Tcp => tcp::run(&args)?,
        ProviderKind::Ibverbs => ibverbs::run(&args)?,
        ProviderKind::Shm => shm::run(&args)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs one test between a server thread and a client in this process (used by `lightpath
/// demo`): the control connection is on 127.0.0.1 with an ephemeral port; soft devices live on
/// 127.0.0.1 and 127.0.0.2 at `udp_port`.
pub fn run_in_process(
    provider: ProviderKind,
    test: PerfTest,
    plan: &[(usize, u64)],
    udp_port: u16,
) -> Result<Vec<SizeResult>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let server_options =
        soft::EndpointOptions { bind: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)), udp_port, mtu: None };
    let server = std::thread::spawn(move || -> Result<()> {
        let (stream, _) = listener.accept()?;
        stream.set_nodelay(true)?;
        match provider {
            ProviderKind::Soft => soft::serve_stream(stream, &server_options, test),
            ProviderKind::Tcp => tcp::serve_stream(stream, test),
            ProviderKind::Ibverbs => {
                ibverbs::serve_stream(stream, &ibverbs::EndpointOptions::default(), test)
            }
            ProviderKind::Shm => shm::serve_stream(stream, test),
        }
    });
    let stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let mut results = Vec::new();
    let client_options =
        soft::EndpointOptions { bind: Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))), udp_port, mtu: None };
    let client = match provider {
        ProviderKind::Soft => {
            soft::client_stream(stream, &client_options, test, plan, 128, |r| results.push(r.clone()))
        }
        ProviderKind::Tcp => tcp::client_stream(stream, test, plan, 128, |r| results.push(r.clone())),
        ProviderKind::Ibverbs => {
            ibverbs::client_stream(stream, &ibverbs::EndpointOptions::default(), test, plan, 128, |r| {
                results.push(r.clone())
            })
        }
        ProviderKind::Shm => shm::client_stream(stream, test, plan, 128, |r| results.push(r.clone())),
    };
    let served = server.join().map_err(|_| anyhow!("the in-process server thread panicked"))?;
    client?;
    served?;
    Ok(results)
}
