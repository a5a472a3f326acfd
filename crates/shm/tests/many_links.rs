//! Many linked queue pairs between two devices, set up and torn down in waves: every hang-up
//! is noticed and every surviving link keeps working.
//!
//! The socket thread watches one socket per link and adds and removes them as links come and
//! go (an epoll set, not a poll list rebuilt each round). A socket left out of the set would
//! leave its peer waiting forever; one left in after it closed would be reported again, or
//! would keep a dead link's socket open. So: link `LINKS` pairs, drop half of one side, check
//! each orphan goes to ERR (its receive flushed) and each survivor still carries WRITEs, then
//! link a fresh wave on top of the survivors and check that too.

mod common;

use common::{open_device, to_init, to_rtr, to_rts, End};
use lightpath_shm::ShmDevice;
use lightpath_verbs::conformance::harness::{assert_empty, wait_n};
use lightpath_verbs::{QpState, QueuePair, WcStatus};

/// Links per wave.
const LINKS: usize = 48;

/// `LINKS` pairs, `a` on `left` and `b` on `right`, both in RTS with a receive posted.
fn link_wave(left: &ShmDevice, right: &ShmDevice, seed: u8) -> Vec<(End, End)> {
    let pairs: Vec<(End, End)> = (0..LINKS)
        .map(|i| {
            let tag = seed.wrapping_add(i as u8);
            (End::new(left, tag), End::new(right, !tag))
        })
        .collect();
    for (a, b) in &pairs {
        to_init(&a.qp);
        to_init(&b.qp);
        a.post_recv();
        b.post_recv();
        to_rtr(&a.qp, &b.qp);
        to_rtr(&b.qp, &a.qp);
        to_rts(&a.qp);
        to_rts(&b.qp);
    }
    pairs
}

/// Both directions of a link carry WRITEs; each side has a receive posted again afterwards.
fn check_link(a: &End, b: &End, round: usize) {
    a.post_writes(b);
    a.check_writes(b, a_seed(a), round);
    b.post_recv();
    b.post_writes(a);
    b.check_writes(a, a_seed(b), round);
    a.post_recv();
}

/// The seed `End::new` filled `end`'s source with (its first byte: index 0 times 13 plus seed).
fn a_seed(end: &End) -> u8 {
    lightpath_verbs::conformance::harness::read_region(&end.src, 0, 1)[0]
}

/// The queue pair whose peer went away: its receive is flushed and it is in ERR.
fn check_orphan(orphan: &End, round: usize) {
    let flushed = wait_n(&orphan.cq, 1);
    assert_eq!(flushed[0].status, WcStatus::WrFlushErr, "round {round}: {flushed:?}");
    assert_eq!(flushed[0].wr_id, 7, "round {round}");
    assert_eq!(orphan.qp.state().expect("state"), QpState::Err, "round {round}");
    assert_empty(&orphan.cq);
}

#[test]
fn hang_ups_across_many_links_are_all_noticed_and_survivors_keep_working() {
    let left = open_device();
    let right = open_device();
    let mut survivors = Vec::new();
    let mut orphans = Vec::new();
    for (i, (a, b)) in link_wave(&left, &right, 0).into_iter().enumerate() {
        if i % 2 == 0 {
            drop(a);
            orphans.push(b);
        } else {
            survivors.push((a, b));
        }
    }
    for (round, orphan) in orphans.iter().enumerate() {
        check_orphan(orphan, round);
    }
    drop(orphans);
    let fresh = link_wave(&left, &right, 100);
    for (round, (a, b)) in survivors.iter().chain(&fresh).enumerate() {
        check_link(a, b, round);
    }
    // The other direction: the right side goes, the left side's queue pairs are orphaned.
    for (round, (a, b)) in fresh.into_iter().enumerate() {
        drop(b);
        check_orphan(&a, round);
    }
    for (round, (a, b)) in survivors.iter().enumerate() {
        check_link(a, b, round);
    }
}
