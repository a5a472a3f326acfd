//! The checker is not vacuous: a correct run passes, and each kind of damage done to its
//! observation afterwards (a wrong byte, a lost/duplicated/reordered/altered completion, a
//! touched guard) is reported.

use lightpath_roce::RegionMemory;
use lightpath_sim::check::check;
use lightpath_sim::driver::{drive, Observation};
use lightpath_sim::workload::Workload;
use lightpath_sim::{OpKind, SimConfig};
use lightpath_verbs::WcStatus;

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
