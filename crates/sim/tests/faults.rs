//! Seeds under faults the transport cannot recover from (total loss, a dead or cut-off peer,
//! a link MTU smaller than the path MTU) and ones it must recover from (a temporary
//! partition, a single scripted drop); plus replay determinism.

mod common;

use common::assert_all_pass;
use lightpath_sim::{run_seed, OpKind, ScriptedFault, SimConfig, SimTime};
use lightpath_verbs::Mtu;

#[test]
fn black_hole_ends_in_retry_exceeded_then_flushes() {
    let mut config = SimConfig::default();
    config.link.loss = 1.0;
    let summary = assert_all_pass("loss 100%", &config, 0, 150);
    // Exactly one request per direction gives up; everything else is flushed.
    assert_eq!(summary.stats.retry_exhausted, 2 * 150);
    assert_eq!(summary.stats.bytes_delivered, 0);
    assert_eq!(summary.stats.packets_delivered, 0);
    assert!(summary.stats.timeouts >= 2 * 150 * 8, "every QP times out retry_cnt + 1 times");
}

#[test]
fn fewer_retries_give_up_sooner() {
    let mut config = SimConfig::default();
    config.link.loss = 1.0;
    config.qp.retry_cnt = 2;
    let summary = assert_all_pass("loss 100%, retry_cnt 2", &config, 0, 50);
    assert_eq!(summary.stats.retry_exhausted, 2 * 50);
    assert_eq!(summary.stats.timeouts, 2 * 50 * 3);
}

#[test]
fn killed_peer_makes_the_survivor_give_up() {
    for (at_micros, first) in [(0, 0), (150, 100), (400, 200)] {
        let mut config = SimConfig::default();
        config.workload.negative = 0.0;
        config.scripted = vec![ScriptedFault::Kill { node: 1, at: SimTime::from_micros(at_micros) }];
        let summary = assert_all_pass("killed peer", &config, first, 100);
        assert!(summary.stats.retry_exhausted > 0, "the survivor never gave up");
    }
}

#[test]
fn permanent_partition_makes_both_sides_give_up() {
    let mut config = SimConfig::default();
    config.workload.negative = 0.0;
    config.scripted =
        vec![ScriptedFault::Partition { a: 0, b: 1, from: SimTime::from_micros(100), until: None }];
    let summary = assert_all_pass("permanent partition", &config, 0, 150);
    assert!(summary.stats.retry_exhausted > 0);
}

#[test]
fn temporary_partition_is_survived() {
    // Two milliseconds without connectivity is well inside 8 × 4.2 ms of retries.
    let config = SimConfig {
        scripted: vec![ScriptedFault::Partition {
            a: 0,
            b: 1,
            from: SimTime::from_micros(50),
            until: Some(SimTime::from_micros(2_050)),
        }],
        ..SimConfig::default()
    };
    let summary = assert_all_pass("temporary partition", &config, 0, 150);
    assert_eq!(summary.stats.retry_exhausted, 0);
    assert!(summary.stats.timeouts > 0);
}

#[test]
fn single_scripted_drops_are_recovered() {
    for nth in 0..12 {
        let mut config = SimConfig {
            scripted: vec![
                ScriptedFault::DropNth { from: 0, to: 1, nth },
                ScriptedFault::DropNth { from: 1, to: 0, nth: nth + 1 },
            ],
            ..SimConfig::default()
        };
        config.workload.negative = 0.0;
        let summary = assert_all_pass("drop the k-th datagram", &config, 100 * nth, 40);
        // Short workloads may not send that many datagrams on a link; most do.
        assert!(summary.stats.packets_dropped > 40 && summary.stats.packets_dropped <= 2 * 40);
        assert_eq!(summary.stats.retry_exhausted, 0);
    }
}

#[test]
fn link_mtu_below_path_mtu_loses_full_packets() {
    let mut config = SimConfig::default();
    config.link.mtu = 1500;
    config.qp.mtu = Some(Mtu::Mtu4096);
    config.workload.ops = vec![OpKind::Write, OpKind::Send];
    config.workload.negative = 0.0;
    let summary = assert_all_pass("link MTU 1500, path MTU 4096", &config, 0, 100);
    assert!(summary.stats.packets_dropped > 0);
    assert!(summary.stats.retry_exhausted > 0, "large messages can never arrive");
    assert!(summary.ops.values().map(|c| c.succeeded).sum::<u64>() > 0, "small ones do");
}

#[test]
fn a_seed_replays_exactly() {
    let mut config = SimConfig::default();
    config.link.loss = 0.1;
    config.link.reorder = 0.05;
    config.link.duplicate = 0.05;
    config.trace = true;
    for seed in [3, 17, 99] {
        let a = run_seed(&config, seed);
        let b = run_seed(&config, seed);
        assert!(!a.trace.is_empty());
        assert_eq!(a.trace, b.trace);
        assert_eq!(a.stats, b.stats);
        assert_eq!(a.ops, b.ops);
        assert_eq!(a.failures, b.failures);
    }
    assert_ne!(run_seed(&config, 3).trace, run_seed(&config, 4).trace);
}
