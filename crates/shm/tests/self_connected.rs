//! Two queue pairs of one device connected to each other (as the stream layer connects a
//! process to itself): a WRITE queued before its queue pair's peer attached is carried out by
//! the device's driver thread once the peer's introduction arrives, and the question it then
//! asks about the peer's region goes to this very device. Before the helper was split in two,
//! the one thread that should answer was the one waiting for the answer, and the WRITE failed
//! with `RetryExcErr` after `rpc_timeout`.

mod common;

use common::{open_device, to_init, to_rtr, to_rts, wait_for_notification, End};
use lightpath_verbs::conformance::harness::assert_empty;
use lightpath_verbs::CompletionQueue;

/// Set-ups per test. The first test asks from the driver thread every round; in the second,
/// where the stream layer hit the bug in 1 of 10–30 set-ups, it depends on who gets there first.
const ROUNDS: usize = 200;

/// The application arms its queue and only waits on the notification fd from before the
/// responder's RTR until the WRITEs completed, so the device's driver thread (never the
/// application) applies the introduction and carries out the queued WRITEs: the question about
/// the region is asked from the driver thread every round.
#[test]
fn writes_queued_before_the_peer_attached_complete_when_the_driver_thread_issues_them() {
    let device = open_device();
    for round in 0..ROUNDS {
        let a = End::new(&device, round as u8);
        let b = End::new(&device, !(round as u8));
        to_init(&a.qp);
        to_rtr(&a.qp, &b.qp);
        to_rts(&a.qp);
        to_init(&b.qp);
        b.post_recv();
        // `a` has no peer yet (b has not introduced itself): the WRITEs wait in its queue.
        a.cq.request_notify().expect("arm");
        a.post_writes(&b);
        to_rtr(&b.qp, &a.qp);
        wait_for_notification(&a.cq, round);
        a.check_writes(&b, round as u8, round);
    }
}

/// As the stream layer does it: the requester goes to RTS and posts, the responder goes to RTR,
/// and the application blocks in `wait` on the requester's queue. Whichever of the application
/// and the driver thread applies the introduction issues the WRITEs; both must succeed.
#[test]
fn writes_posted_before_the_peer_reached_rtr_complete_while_the_application_waits() {
    let device = open_device();
    for round in 0..ROUNDS {
        let a = End::new(&device, round as u8);
        let b = End::new(&device, !(round as u8));
        to_init(&a.qp);
        to_rtr(&a.qp, &b.qp);
        to_rts(&a.qp);
        to_init(&b.qp);
        b.post_recv();
        a.post_writes(&b);
        to_rtr(&b.qp, &a.qp);
        a.check_writes(&b, round as u8, round);
        assert_empty(&a.cq);
    }
}
