//! `lightpath-sim`: a deterministic network simulator that drives several Lightpath RC engines
//! through the same sans-I/O interface a real driver uses, injects faults, and checks that the
//! transport delivers what the verbs semantics promise.
//!
//! A run is a pure function of a [`SimConfig`] and a seed ([`run_seed`]): the seed generates a
//! random workload of SEND/WRITE/READ/atomic operations (with known-bad ones mixed in), the
//! network delays, drops, duplicates, reorders and corrupts datagrams with the seed's random
//! streams, and a virtual clock replaces real time. After the run, a reference model checks
//! every completion and every byte of every registered region (see [`check`]). A failing seed
//! replays exactly, and with `trace` on it records every datagram.
//!
//! Layers: [`time`] and [`rng`] (clock and randomness), [`link`], [`faults`] and [`network`]
//! (the network model), [`memory`] (guarded region memory), [`op`], [`workload`] and [`model`]
//! (what is posted and what must result), [`driver`] (steps engines and network),
//! [`check`] (the invariants) and [`report`] (results).
#![forbid(unsafe_code)]

pub mod check;
pub mod config;
pub mod driver;
pub mod faults;
pub mod link;
pub mod memory;
pub mod model;
pub mod network;
pub mod op;
pub mod report;
pub mod rng;
pub mod time;
pub mod trace;
pub mod workload;

use std::panic::{catch_unwind, AssertUnwindSafe};

pub use config::{AddressFamily, QpConfig, SimConfig, WorkloadConfig};
pub use faults::ScriptedFault;
pub use link::{DropReason, LinkConfig};
pub use network::{NetStats, Network};
pub use op::{Negative, OpKind};
pub use report::{OpCounts, RunStats, SeedFailure, SeedReport, Summary};
pub use time::SimTime;
pub use trace::{describe_datagram, summarize, TraceEvent, TraceKind};
pub use workload::Workload;

/// Runs one seed and checks every invariant. Pure: the same config and seed give the same
/// report. A panic inside the engine is caught and reported as a failure of the seed.
pub fn run_seed(config: &SimConfig, seed: u64) -> SeedReport {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let workload = Workload::generate(config, seed);
        let observation = driver::drive(config, &workload, seed);
        let result = check::check(config, &workload, &observation);
        (observation, result)
    }));
    let (observation, result) = match outcome {
        Ok(done) => done,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "non-string panic payload".to_string());
            return SeedReport {
                seed,
                passed: false,
                failures: vec![format!("panic: {message}")],
                ..SeedReport::default()
            };
        }
    };
    let engines = &observation.engine_stats;
    let sum = |field: fn(&lightpath_roce::EngineStats) -> u64| engines.iter().map(field).sum::<u64>();
    let net = &observation.net;
    let stats = RunStats {
        packets_sent: net.sent,
        packets_delivered: net.delivered,
        packets_dropped: net.dropped(),
        packets_duplicated: net.duplicated,
        packets_corrupted: net.corrupted,
        packets_reordered: net.reordered,
        retransmits: sum(|s| s.retransmits),
        timeouts: sum(|s| s.timeouts),
        naks_sent: sum(|s| s.naks_sent),
        rnr_naks_sent: sum(|s| s.rnr_naks_sent),
        drops_icrc: sum(|s| s.drops_icrc),
        undetected_corruptions: observation.undetected_corruption.len() as u64,
        bytes_delivered: result.bytes_delivered,
        retry_exhausted: result.retry_exhausted,
        virtual_nanos: observation.finished_at.as_nanos(),
        steps: observation.steps,
    };
    SeedReport {
        seed,
        passed: result.failures.is_empty(),
        failures: result.failures,
        ops: result.ops,
        stats,
        trace: observation.trace,
    }
}

/// Runs `count` seeds starting at `first` and summarizes them.
pub fn run_seeds(config: &SimConfig, first: u64, count: u64) -> Summary {
    let mut summary = Summary::default();
    for seed in first..first.saturating_add(count) {
        summary.record(&run_seed(config, seed));
    }
    summary
}
