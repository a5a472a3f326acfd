//! `lightpath perf`: perftest-style latency and bandwidth tests.
//!
//! Every test runs between two `lightpath perf` processes: the server (no SERVER argument) and the
//! client. They meet on an out-of-band TCP connection (`-p`, default 18515, as perftest), agree on
//! the test and its parameters there ([`control`]), then move data with the chosen provider:
//! `soft` (the userspace RoCE v2 engine over UDP) or `tcp` (the same message pattern over kernel
//! TCP, the baseline every RDMA number is compared with). Latency tests report min / median / p99
//! / max one-way latency in µs (round-trip tests such as READ and atomics report the round trip,
//! as perftest does); bandwidth tests report MB/s (10^6 bytes per second) and million messages per
//! second. Bandwidth tests verify the payload with a checksum at the end of each size.

mod args;
mod control;
mod pattern;
mod progress;
mod rdma;
mod report;
mod session;
mod soft;
mod stats;
mod tcp;

use std::process::ExitCode;

pub use args::{Args, ProviderKind};

/// Runs `lightpath perf`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.validate()?;
    match args.provider {
        ProviderKind::Soft => soft::run(&args)?,
        ProviderKind::Tcp => tcp::run(&args)?,
    }
    Ok(ExitCode::SUCCESS)
}
