//! Helpers shared by the seed suites.

// Each test crate uses only some of the helpers.
#![allow(dead_code)]

use lightpath_sim::{run_seed, SimConfig, Summary};

/// Runs `count` seeds from `first` and fails with every failing seed, its reason and how to
/// replay it.
pub fn assert_all_pass(label: &str, config: &SimConfig, first: u64, count: u64) -> Summary {
    let mut summary = Summary::default();
    let mut failures = Vec::new();
    for seed in first..first + count {
        let report = run_seed(config, seed);
        if !report.passed {
            failures.push(format!("  seed {seed}: {}", report.failures.join("\n      ")));
        }
        summary.record(&report);
    }
    assert!(
        failures.is_empty(),
        "{label}: {} of {count} seeds failed (replay one with lightpath_sim::run_seed or `lightpath sim --trace SEED` with the same options):\n{}",
        failures.len(),
        failures.join("\n")
    );
    summary
}

/// Runs the listed seeds and fails with every failing one, as [`assert_all_pass`] does.
pub fn assert_seeds_pass(label: &str, config: &SimConfig, seeds: &[u64]) -> Summary {
    let mut summary = Summary::default();
    let mut failures = Vec::new();
    for &seed in seeds {
        let report = run_seed(config, seed);
        if !report.passed {
            failures.push(format!("  seed {seed}: {}", report.failures.join("\n      ")));
        }
        summary.record(&report);
    }
    assert!(
        failures.is_empty(),
        "{label}: {} of {} seeds failed (replay one with `lightpath sim --trace SEED` and the same options):\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
    summary
}

/// Every op kind was posted and most requests succeeded (so the suite is not vacuous).
pub fn assert_meaningful(label: &str, summary: &Summary, min_posted: u64) {
    let posted: u64 = summary.ops.values().map(|c| c.posted).sum();
    let succeeded: u64 = summary.ops.values().map(|c| c.succeeded).sum();
    assert!(posted >= min_posted, "{label}: only {posted} requests posted");
    assert!(succeeded * 10 >= posted * 7, "{label}: only {succeeded} of {posted} requests succeeded");
    assert!(summary.stats.bytes_delivered > 0, "{label}: no bytes delivered");
}
