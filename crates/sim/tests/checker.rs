//! The checker is not vacuous: a correct run passes, and each kind of damage done to its
//! observation afterwards (a wrong byte, a lost/duplicated/reordered/altered completion, a
//! touched guard) is reported; and it is exact about errors: retry exhaustion before a
//! negative request only when the network loses datagrams, never an error on the other
//! direction of that connection, never a flush before the first error.

use lightpath_roce::RegionMemory;
use lightpath_sim::check::check;
use lightpath_sim::driver::{drive, send_wr_id, Observation};
use lightpath_sim::workload::Workload;
use lightpath_sim::{OpKind, SimConfig};
use lightpath_verbs::{WcStatus, WorkCompletion};

fn observed(config: &SimConfig, seed: u64) -> (Workload, Observation) {
    let workload = Workload::generate(config, seed);
    let observation = drive(config, &workload, seed);
    (workload, observation)
}

fn clean() -> SimConfig {
    let mut config = SimConfig::default();
    config.workload.negative = 0.0;
    config.workload.unsignaled = 0.0;
    config.workload.min_ops = 6;
    config
}

fn failures(config: &SimConfig, workload: &Workload, obs: &Observation) -> Vec<String> {
    check(config, workload, obs).failures
}

#[test]
fn an_untouched_run_passes() {
    let config = clean();
    for seed in 0..20 {
        let (workload, obs) = observed(&config, seed);
        assert_eq!(failures(&config, &workload, &obs), Vec::<String>::new(), "seed {seed}");
    }
}

#[test]
fn a_stray_byte_in_a_region_is_found() {
    let config = clean();
    let (workload, obs) = observed(&config, 1);
    let target = &obs.directions[0].regions.as_ref().unwrap().target.memory;
    // The last byte of the target region lies past every planned range (8 bytes of slack).
    let last = target.len() - 1;
    let mut byte = [0u8];
    target.read(last, &mut byte);
    target.write(last, &[byte[0] ^ 0x40]);
    let found = failures(&config, &workload, &obs);
    assert!(
        found.iter().any(|f| f.contains("region target") && f.contains("outside every operation's range")),
        "{found:?}"
    );
}

#[test]
fn wrong_received_data_is_found() {
    let mut config = clean();
    config.workload.ops = vec![OpKind::Send];
    let (workload, obs) = observed(&config, 2);
    let plan = &workload.directions[0];
    let recv = plan.recvs.iter().find(|r| plan.ops[r.op].len > 0).expect("a non-empty SEND");
    let span = recv.sges.iter().find(|s| s.len > 0).unwrap();
    let memory = &obs.directions[0].regions.as_ref().unwrap().recv_area.memory;
    let mut byte = [0u8];
    memory.read(span.offset, &mut byte);
    memory.write(span.offset, &[!byte[0]]);
    let found = failures(&config, &workload, &obs);
    assert!(found.iter().any(|f| f.contains("region recv") && f.contains("inside")), "{found:?}");
}

#[test]
fn wrong_read_result_is_found() {
    let mut config = clean();
    config.workload.ops = vec![OpKind::Read];
    let (workload, obs) = observed(&config, 3);
    let plan = &workload.directions[1];
    let op = plan.ops.iter().find(|op| op.len > 0).expect("a non-empty READ");
    let span = op.sink.iter().find(|s| s.len > 0).unwrap();
    let memory = &obs.directions[1].regions.as_ref().unwrap().sink.memory;
    let at = span.offset + span.len - 1;
    let mut byte = [0u8];
    memory.read(at, &mut byte);
    memory.write(at, &[!byte[0]]);
    let found = failures(&config, &workload, &obs);
    assert!(found.iter().any(|f| f.contains("region sink")), "{found:?}");
}

#[test]
fn lost_duplicated_reordered_or_altered_completions_are_found() {
    let config = clean();
    let (workload, obs) = observed(&config, 4);
    let mutate = |change: &dyn Fn(&mut Observation)| {
        let mut copy = Observation {
            directions: obs.directions.clone(),
            alive: obs.alive.clone(),
            ..Observation::default()
        };
        change(&mut copy);
        failures(&config, &workload, &copy)
    };
    let lost = mutate(&|o| {
        o.directions[0].send_wcs.pop();
    });
    assert!(lost.iter().any(|f| f.contains("never completed")), "{lost:?}");

    let twice = mutate(&|o| {
        let first = o.directions[0].send_wcs[0];
        o.directions[0].send_wcs.push(first);
    });
    assert!(twice.iter().any(|f| f.contains("completed twice")), "{twice:?}");

    let swapped = mutate(&|o| o.directions[0].send_wcs.swap(0, 1));
    assert!(swapped.iter().any(|f| f.contains("out of order")), "{swapped:?}");

    let failed = mutate(&|o| o.directions[0].send_wcs[1].status = WcStatus::RetryExcErr);
    assert!(failed.iter().any(|f| f.contains("RetryExcErr, expected success")), "{failed:?}");

    let wrong_qp = mutate(&|o| o.directions[1].send_wcs[0].qp_num ^= 1);
    assert!(wrong_qp.iter().any(|f| f.contains("names QP")), "{wrong_qp:?}");

    let wrong_recv = mutate(&|o| {
        if let Some(wc) = o.directions[0].recv_wcs.first_mut() {
            wc.byte_len += 1;
            wc.imm_data = Some(wc.imm_data.unwrap_or(0) ^ 1);
        }
    });
    if !obs.directions[0].recv_wcs.is_empty() {
        assert!(wrong_recv.iter().any(|f| f.contains("byte_len")), "{wrong_recv:?}");
        assert!(wrong_recv.iter().any(|f| f.contains("imm_data")), "{wrong_recv:?}");
    }
}

#[test]
fn a_touched_guard_is_found() {
    let config = clean();
    let (workload, obs) = observed(&config, 5);
    let memory = &obs.directions[0].regions.as_ref().unwrap().src.memory;
    let len = memory.len();
    let mut tail = [0u8; 1];
    memory.read(len - 1, &mut tail);
    // One byte in bounds (unchanged), one past the end.
    memory.write(len - 1, &[tail[0], 0x00]);
    let found = failures(&config, &workload, &obs);
    assert!(found.iter().any(|f| f.contains("out-of-bounds memory accesses")), "{found:?}");
    assert!(found.iter().any(|f| f.contains("guard bytes")), "{found:?}");
}

/// A run with a negative request in direction 0 at op `k ≥ 1`, on a lossless network.
fn negative_run() -> (SimConfig, Workload, Observation, usize) {
    let mut config = SimConfig::default();
    config.workload.negative = 1.0;
    config.workload.min_ops = 4;
    config.workload.unsignaled = 0.0;
    for seed in 0..200 {
        let (workload, obs) = observed(&config, seed);
        let plan = &workload.directions[0];
        let Some(k) = plan.negative_index().filter(|&k| k >= 1) else { continue };
        if plan.connection == 0 && failures(&config, &workload, &obs).is_empty() {
            return (config, workload, obs, k);
        }
    }
    panic!("no seed with a negative request after the first op");
}

/// Direction `d` of `obs` rewritten so that op `failed` ends with `status` and every later
/// op is flushed (what an engine reports when it gives up there).
fn fail_from(obs: &Observation, d: usize, failed: usize, status: WcStatus) -> Observation {
    let mut copy = Observation {
        directions: obs.directions.clone(),
        alive: obs.alive.clone(),
        ..Observation::default()
    };
    let dir = &mut copy.directions[d];
    let qpn = dir.requester_qpn;
    let ops = dir.posted.len();
    let template = dir.send_wcs[0];
    dir.send_wcs.retain(|wc| (wc.wr_id & 0xFFFF_FFFF) < failed as u64);
    for i in failed..ops {
        let mut wc = template;
        wc.wr_id = send_wr_id(d, i);
        wc.status = if i == failed { status } else { WcStatus::WrFlushErr };
        wc.qp_num = qpn;
        dir.send_wcs.push(wc);
    }
    copy
}

#[test]
fn retry_exhaustion_before_a_negative_request_needs_a_lossy_network() {
    let (mut config, workload, obs, k) = negative_run();
    // Giving up on the request before the negative one: on a network that loses nothing the
    // NAK always arrives, so the negative request must fail with its own error.
    let gave_up = fail_from(&obs, 0, k - 1, WcStatus::RetryExcErr);
    let found = failures(&config, &workload, &gave_up);
    assert!(found.iter().any(|f| f.contains("RetryExcErr, expected success")), "{found:?}");
    // With loss the NAK (or an answer before it) may be lost while the responder is in ERR:
    // then exactly this is what a correct requester reports.
    config.link.loss = 0.05;
    let found = failures(&config, &workload, &gave_up);
    assert!(!found.iter().any(|f| f.contains("RetryExcErr")), "{found:?}");
    // Flushing before the first error is never right.
    let flushed_first = fail_from(&obs, 0, k - 1, WcStatus::WrFlushErr);
    let mut reordered = flushed_first.directions[0].send_wcs.clone();
    let error = WorkCompletion { status: WcStatus::RemAccessErr, ..reordered[reordered.len() - 1] };
    let last = reordered.len() - 1;
    reordered[last] = error;
    let mut broken = Observation {
        directions: flushed_first.directions.clone(),
        alive: obs.alive.clone(),
        ..Observation::default()
    };
    broken.directions[0].send_wcs = reordered;
    let found = failures(&config, &workload, &broken);
    assert!(found.iter().any(|f| f.contains("a second error") || f.contains("after op")), "{found:?}");
}

#[test]
fn the_other_direction_of_a_negative_connection_reports_no_error() {
    let (mut config, workload, obs, _) = negative_run();
    config.link.loss = 0.05;
    // Direction 1's requester is the queue pair that went to ERR when it NAKed: everything it
    // had outstanding is flushed, so an error completion there is wrong even under loss.
    if obs.directions[1].send_wcs.is_empty() {
        return; // (that direction posted nothing)
    }
    let gave_up = fail_from(&obs, 1, 0, WcStatus::RetryExcErr);
    let found = failures(&config, &workload, &gave_up);
    assert!(found.iter().any(|f| f.contains("dir 1") && f.contains("RetryExcErr")), "{found:?}");
    let flushed = fail_from(&obs, 1, 0, WcStatus::WrFlushErr);
    let found = failures(&config, &workload, &flushed);
    assert!(!found.iter().any(|f| f.contains("dir 1 (") && f.contains("flushed")), "{found:?}");
}
