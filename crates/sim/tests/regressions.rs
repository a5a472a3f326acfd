//! Every engine bug the simulator found, as the configuration and seeds that exposed it (plus
//! a range of neighbouring seeds). The `lightpath sim` options that replay each case are given
//! in the comments; the matching engine-level tests live in `crates/roce/tests`.

mod common;

use common::{assert_all_pass, assert_seeds_pass};
use lightpath_sim::{OpKind, SimConfig};

fn seeds_with(named: &[u64], range: std::ops::Range<u64>) -> Vec<u64> {
    named.iter().copied().chain(range).collect()
}

/// K1: a fatal NAK that arrives while an earlier READ/atomic response is missing used to
/// report the earlier requests as flushed before the NAKed request's error. A correct
/// requester takes the missing response as lost and retries it (the responder is in ERR),
/// so the oldest request ends in RETRY_EXC_ERR and the rest flush. CLI (whose `min_ops` is 1,
/// so its seed numbers differ): `lightpath sim --loss 0.3 --ops fetch_add,cmp_swap,write
/// --max-ops 3 --negative 1 --max-message 64`. Engine test:
/// `recovery.rs::fatal_nak_behind_a_lost_atomic_response_never_flushes_before_the_error`.
#[test]
fn k1_negative_cases_under_loss() {
    let mut config = SimConfig::default();
    config.workload.ops = vec![OpKind::FetchAdd, OpKind::CmpSwap, OpKind::Write];
    config.workload.min_ops = 2;
    config.workload.max_ops = 3;
    config.workload.negative = 1.0;
    config.workload.spread_posts = false;
    config.workload.max_message = 64;
    config.link.loss = 0.3;
    let summary = assert_seeds_pass("K1 negative cases under 30% loss", &config, &seeds_with(&[19], 0..300));
    // The case happens: some directions end in RETRY_EXC_ERR on a request before the NAKed one.
    assert!(summary.stats.retry_exhausted > 0);
}

/// K1 again, with every operation and 5% of every fault (and the brief's report: seed 66 of
/// `lightpath sim --loss 0.05 --dup 0.02 --reorder 0.05 --corrupt 0.01`, an error reported
/// after a flush).
#[test]
fn k1_negative_cases_with_all_faults() {
    let mut config = SimConfig::default();
    config.link.loss = 0.05;
    config.link.duplicate = 0.05;
    config.link.reorder = 0.05;
    config.link.corrupt = 0.05;
    config.workload.negative = 0.3;
    assert_all_pass("K1 negative cases with all faults", &config, 0, 300);
    let mut config = SimConfig::default();
    config.link.loss = 0.05;
    config.link.duplicate = 0.02;
    config.link.reorder = 0.05;
    config.link.corrupt = 0.01;
    assert_seeds_pass("the brief's seed 66", &config, &[66]);
}

/// K1 under reordering, lossless: the NAK of a negative request overtakes the answer to an
/// atomic before it (seed 37), or the answers to two atomics swap places (seed 152). The
/// engine used to drop the out-of-order answer or let the NAK fail the atomic into
/// RETRY_EXC_ERR; on a network that loses nothing the negative request must fail with its own
/// error. `lightpath sim --reorder 0.2 --negative 1 --ops fetch_add,cmp_swap,read,write,send
/// --max-ops 4 --max-message 4096`. Engine tests: `reordering.rs::an_atomic_answer_*`,
/// `reordering.rs::a_fatal_nak_that_overtakes_*`.
#[test]
fn reordered_answers_around_a_negative_request() {
    let mut config = SimConfig::default();
    config.link.reorder = 0.2;
    config.workload.negative = 1.0;
    config.workload.ops = vec![OpKind::FetchAdd, OpKind::CmpSwap, OpKind::Read, OpKind::Write, OpKind::Send];
    config.workload.max_ops = 4;
    config.workload.max_message = 4096;
    let summary = assert_seeds_pass("reordered answers, negative", &config, &seeds_with(&[37, 152], 0..600));
    assert_eq!(summary.stats.retry_exhausted, 0, "lossless: every negative request fails with its own error");
    let negatives: u64 = summary.ops.values().map(|c| c.negative).sum();
    assert!(negatives > 500);
}

/// K2: heavy reordering of a long READ response stream set off a storm of READ reissues and
/// full replays; the backlog outgrew the ACK timeout. `lightpath sim --reorder 0.2
/// --negative 0`, seeds 4 and 42. Engine test:
/// `recovery.rs::reordered_read_responses_reissue_at_most_once_per_round_trip_*`.
#[test]
fn k2_heavy_reordering_of_large_reads() {
    let mut config = SimConfig::default();
    config.link.reorder = 0.2;
    config.workload.negative = 0.0;
    let summary = assert_seeds_pass("K2 reorder 20%", &config, &seeds_with(&[4, 42], 0..300));
    assert_eq!(summary.stats.retry_exhausted, 0);
    assert_eq!(summary.stats.timeouts, 0, "reordering alone never needs the retransmit timer");
}

/// A sequence NAK behind a READ still being answered rewound to the READ, so every such NAK
/// made the responder replay the whole READ and the replays filled the link for tens of
/// milliseconds. `lightpath sim --reorder 0.5 --negative 0`, seed 668. Engine test:
/// `reordering.rs::a_sequence_nak_behind_a_read_resends_from_the_nak_not_the_read`.
#[test]
fn read_replays_under_heavy_reordering() {
    let mut config = SimConfig::default();
    config.link.reorder = 0.5;
    config.workload.negative = 0.0;
    let summary = assert_seeds_pass("reorder 50%", &config, &seeds_with(&[668], 0..100));
    assert_eq!(summary.stats.retry_exhausted, 0);
}

/// Go-back-N with one retry under reordering: stale NAKs counted as new losses, a NAK per
/// overtaken packet resent the window again and again, and a retransmission overtaken once
/// more waited for the retransmit timer — each used up the single retry. `lightpath sim
/// --retry-cnt 1 --reorder 0.2`, seeds 11, 16, 38, 113, 117, 238, 650 (and `--reorder 0.5`).
/// Engine tests: `reordering.rs::a_retransmission_overtaken_again_*`,
/// `reordering.rs::after_a_go_back_*`.
#[test]
fn one_retry_under_reordering() {
    let mut config = SimConfig::default();
    config.qp.retry_cnt = 1;
    config.link.reorder = 0.2;
    let named = [11, 16, 38, 113, 117, 238, 650];
    let summary = assert_seeds_pass("retry_cnt 1, reorder 20%", &config, &seeds_with(&named, 0..150));
    assert_eq!(summary.stats.retry_exhausted, 0);
    config.link.reorder = 0.5;
    let summary = assert_all_pass("retry_cnt 1, reorder 50%", &config, 0, 100);
    assert_eq!(summary.stats.retry_exhausted, 0);
}

/// A responder error discarded the responses still owed to requests executed before it
/// (queued READ data, atomic ACKs) when a driver handed over several requests before polling
/// for output: the requester then retried the READ/atomic into a responder in ERR and ended
/// in RETRY_EXC_ERR. Found once the driver could batch receives: `lightpath sim
/// --receive-batch-us 5 --negative 1` failed 162 of seeds 0..1000 (seed 2 first). Engine
/// test: `protection.rs::responses_owed_before_a_fatal_error_still_go_out`.
#[test]
fn responses_owed_before_a_responder_error_with_batched_receive() {
    let mut config = SimConfig { receive_batch: std::time::Duration::from_micros(5), ..SimConfig::default() };
    config.workload.negative = 1.0;
    let summary = assert_seeds_pass("batched receive, negatives", &config, &seeds_with(&[2], 0..300));
    assert_eq!(summary.stats.retry_exhausted, 0, "lossless: every negative request fails with its own error");
}
