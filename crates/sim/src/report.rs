//! Results: the report of one seed and the summary of many.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::op::OpKind;
use crate::trace::TraceEvent;

/// How the operations of one kind fared in a run (or summed over runs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpCounts {
    /// Work requests posted.
    pub posted: u64,
    /// Of those, how many ended exactly as the model expected.
    pub passed: u64,
    /// Of those, how many did not.
    pub failed: u64,
    /// Of those, how many completed successfully.
    pub succeeded: u64,
    /// Of those, how many were negative cases (deliberate errors).
    pub negative: u64,
}

impl OpCounts {
    fn add(&mut self, other: &OpCounts) {
        self.posted += other.posted;
        self.passed += other.passed;
        self.failed += other.failed;
        self.succeeded += other.succeeded;
        self.negative += other.negative;
    }
}

/// Counters of one run (or summed over runs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RunStats {
    /// Datagrams the engines handed to the network.
    pub packets_sent: u64,
    /// Datagrams delivered (duplicates included).
    pub packets_delivered: u64,
    /// Datagrams the network dropped (loss, MTU, scripted, partition, dead peer).
    pub packets_dropped: u64,
    /// Extra copies the network made.
    pub packets_duplicated: u64,
    /// Datagrams the network damaged.
    pub packets_corrupted: u64,
    /// Datagrams the network held back.
    pub packets_reordered: u64,
    /// Retransmitted packets (engine counters).
    pub retransmits: u64,
    /// Retransmission timeouts (engine counters).
    pub timeouts: u64,
    /// NAKs sent (engine counters).
    pub naks_sent: u64,
    /// RNR NAKs sent (engine counters).
    pub rnr_naks_sent: u64,
    /// Datagrams the engines dropped for a bad ICRC.
    pub drops_icrc: u64,
    /// Damaged datagrams an engine processed (IPv4 ICRC false accepts); their connection is
    /// checked for memory safety only.
    pub undetected_corruptions: u64,
    /// Application bytes of successfully completed operations.
    pub bytes_delivered: u64,
    /// Requests that ended with RETRY_EXC_ERR.
    pub retry_exhausted: u64,
    /// Virtual nanoseconds until all work finished.
    pub virtual_nanos: u64,
    /// Driver steps.
    pub steps: u64,
}

impl RunStats {
    fn add(&mut self, other: &RunStats) {
        self.packets_sent += other.packets_sent;
        self.packets_delivered += other.packets_delivered;
        self.packets_dropped += other.packets_dropped;
        self.packets_duplicated += other.packets_duplicated;
        self.packets_corrupted += other.packets_corrupted;
        self.packets_reordered += other.packets_reordered;
        self.undetected_corruptions += other.undetected_corruptions;
        self.retransmits += other.retransmits;
        self.timeouts += other.timeouts;
        self.naks_sent += other.naks_sent;
        self.rnr_naks_sent += other.rnr_naks_sent;
        self.drops_icrc += other.drops_icrc;
        self.bytes_delivered += other.bytes_delivered;
        self.retry_exhausted += other.retry_exhausted;
        self.virtual_nanos += other.virtual_nanos;
        self.steps += other.steps;
    }

    /// Application bytes per virtual second (0 when no virtual time passed).
    pub fn goodput(&self) -> f64 {
        if self.virtual_nanos == 0 {
            0.0
        } else {
            self.bytes_delivered as f64 * 1e9 / self.virtual_nanos as f64
        }
    }
}

/// The result of one seed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// Whether every invariant held.
    pub passed: bool,
    /// Every violated invariant, most important first (empty when passed).
    pub failures: Vec<String>,
    /// Per operation kind.
    pub ops: BTreeMap<OpKind, OpCounts>,
    /// Counters.
    pub stats: RunStats,
    /// The datagram trace, when tracing was on.
    #[serde(skip)]
    pub trace: Vec<TraceEvent>,
}

impl SeedReport {
    /// The first failure, as a one-line reason.
    pub fn reason(&self) -> Option<&str> {
        self.failures.first().map(String::as_str)
    }
}

/// A failing seed and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SeedFailure {
    /// The seed (replay with `run_seed(config, seed)`).
    pub seed: u64,
    /// The first violated invariant.
    pub reason: String,
}

/// The results of many seeds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Seeds run.
    pub seeds: u64,
    /// Seeds whose invariants all held.
    pub passed: u64,
    /// Seeds with a violation.
    pub failed: u64,
    /// The failing seeds.
    pub failures: Vec<SeedFailure>,
    /// Per operation kind, summed.
    pub ops: BTreeMap<OpKind, OpCounts>,
    /// Counters, summed.
    pub stats: RunStats,
}

impl Summary {
    /// Adds one seed's report.
    pub fn record(&mut self, report: &SeedReport) {
        self.seeds += 1;
        if report.passed {
            self.passed += 1;
        } else {
            self.failed += 1;
            self.failures.push(SeedFailure {
                seed: report.seed,
                reason: report.reason().unwrap_or("unknown").to_string(),
            });
        }
        for (kind, counts) in &report.ops {
            self.ops.entry(*kind).or_default().add(counts);
        }
        self.stats.add(&report.stats);
    }

    /// Application bytes per virtual second over all seeds.
    pub fn goodput(&self) -> f64 {
        self.stats.goodput()
    }

    /// Whether every seed passed.
    pub fn all_passed(&self) -> bool {
        self.failed == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_adds_up() {
        let mut good = SeedReport { seed: 1, passed: true, ..SeedReport::default() };
        good.ops.insert(OpKind::Read, OpCounts { posted: 2, passed: 2, succeeded: 2, ..OpCounts::default() });
        good.stats.bytes_delivered = 1000;
        good.stats.virtual_nanos = 1_000_000;
        let bad =
            SeedReport { seed: 2, passed: false, failures: vec!["boom".into()], ..SeedReport::default() };
        let mut summary = Summary::default();
        summary.record(&good);
        summary.record(&bad);
        assert_eq!((summary.seeds, summary.passed, summary.failed), (2, 1, 1));
        assert_eq!(summary.failures, vec![SeedFailure { seed: 2, reason: "boom".into() }]);
        assert_eq!(summary.ops[&OpKind::Read].posted, 2);
        assert_eq!(summary.goodput(), 1e6);
        assert!(!summary.all_passed());
    }
}
