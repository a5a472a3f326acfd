//! Two devices whose driver threads ask each other about regions at the same time. Each queue
//! pair posts WRITEs before its peer introduced itself, then the application only waits on
//! notification fds, so each device's driver thread applies the introduction and carries out
//! the WRITEs, asking the other device about the target region. With one helper thread per
//! device, both could be blocked asking while neither answered, and both WRITEs failed with
//! `RetryExcErr` after `rpc_timeout`; the socket threads answer whatever the drivers do.

mod common;

use std::sync::Barrier;

use common::{bytes, open_device, to_init, to_rtr, to_rts, wait_for_notification, End, IMM, LEN};
use lightpath_shm::ShmDevice;
use lightpath_verbs::conformance::harness::{assert_success, read_region, wait_n};
use lightpath_verbs::{CompletionQueue, WcOpcode};

/// Set-ups. Without the socket threads the very first round already deadlocked in every run;
/// more rounds cover the timings where one driver finishes before the other asks.
const ROUNDS: usize = 200;

/// One side of a round, run by its own thread: up to RTS with WRITEs queued, then only waiting
/// on the notification fd until something completed, then collecting this side's completions:
/// its two WRITEs and the receive the peer's WRITE with immediate consumed.
fn run_side(me: &End, peer: &End, barrier: &Barrier, round: usize) {
    to_init(&me.qp);
    me.post_recv();
    barrier.wait();
    to_rtr(&me.qp, &peer.qp);
    to_rts(&me.qp);
    // Armed before posting, so no completion can slip in unnoticed between the two.
    me.cq.request_notify().expect("arm");
    me.post_writes(peer);
    wait_for_notification(&me.cq, round);
    let mut completions = wait_n(&me.cq, 3);
    completions.sort_by_key(|wc| wc.wr_id);
    for wc in &completions {
        assert!(wc.status.is_success(), "round {round}: {wc:?}");
    }
    assert_success(&completions[0], 1, WcOpcode::RdmaWrite);
    assert_success(&completions[1], 2, WcOpcode::RdmaWrite);
    assert_success(&completions[2], 7, WcOpcode::RecvRdmaWithImm);
    assert_eq!(completions[2].imm_data, Some(IMM), "round {round}");
}

#[test]
fn driver_threads_of_two_devices_asking_each_other_at_once_both_get_answers() {
    let devices: [ShmDevice; 2] = [open_device(), open_device()];
    let len = 2 * LEN as usize;
    for round in 0..ROUNDS {
        let a = End::new(&devices[0], 1);
        let b = End::new(&devices[1], 2);
        let barrier = Barrier::new(2);
        std::thread::scope(|scope| {
            scope.spawn(|| run_side(&a, &b, &barrier, round));
            run_side(&b, &a, &barrier, round);
        });
        assert_eq!(read_region(&b.dst, 0, len), bytes(1, len), "round {round}");
        assert_eq!(read_region(&a.dst, 0, len), bytes(2, len), "round {round}");
    }
}
