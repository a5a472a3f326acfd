//! A queue pair's own doorbell (`QueuePair::set_waiter_fd` / `arm_waiter`): the peer writes it
//! directly when it publishes news for a waiter, a reader is not woken by the acknowledgement
//! of its own request, and a queue pair without one says so.

mod common;

use common::Fixture;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use lightpath_shm::ShmDevice;
use lightpath_verbs::conformance::harness::{assert_success, connect, Pair, PairOptions};
use lightpath_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, QueuePair, SendOp, SendWr, WakeFor, WcOpcode, WcStatus,
    WorkCompletion,
};
use rustix::event::{poll, EventfdFlags, PollFd, PollFlags, Timespec};

fn eventfd() -> Arc<OwnedFd> {
    Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).expect("eventfd"))
}

/// Whether `fd` becomes readable within `within` (its count is taken if so).
fn rung(fd: &OwnedFd, within: Duration) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let timeout = Timespec { tv_sec: within.as_secs() as i64, tv_nsec: i64::from(within.subsec_nanos()) };
    let ready = poll(&mut fds, Some(&timeout)).expect("poll") > 0;
    if ready {
        let mut count = [0u8; 8];
        rustix::io::read(fd.as_fd(), &mut count).expect("take the count");
    }
    ready
}

fn take(cq: &impl CompletionQueue) -> Vec<WorkCompletion> {
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
    let n = cq.poll(&mut buf).expect("poll");
    buf[..n].to_vec()
}

/// A pair whose side `b` has a doorbell of its own, handed over before RTR.
fn pair_with_waiter() -> (Pair<ShmDevice>, Arc<OwnedFd>) {
    let pair = Pair::<ShmDevice>::unconnected_with::<Fixture>(&PairOptions::default());
    let fd = eventfd();
    assert!(pair.b.qp.set_waiter_fd(&fd).expect("set_waiter_fd"), "shm takes a doorbell before RTR");
    connect(&pair.a.qp, &pair.b.qp, pair.mtu, &PairOptions::default());
    (pair, fd)
}

#[test]
fn the_peer_rings_a_waiter_directly() {
    let (pair, fd) = pair_with_waiter();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, b"ring me").expect("fill");
    for round in 0..3u64 {
        pair.b.post_recv(round, &inbox, 0, 4096);
        assert!(pair.b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"), "a linked doorbell");
        assert!(take(&pair.b.cq).is_empty(), "round {round}: a completion before anything was sent");
        pair.a.qp.post_send(&SendWr::new(100 + round, SendOp::Send, &[src.sge(0, 7)])).expect("send");
        // Nobody on b's side polls: only the doorbell ends this wait (written by the peer, or
        // by b's driver thread if it takes the message in first).
        assert!(rung(&fd, Duration::from_secs(10)), "round {round}: the waiter was not rung");
        let got = pair.b.wait_one();
        assert_success(&got, round, WcOpcode::Recv);
        assert_success(&pair.a.wait_one(), 100 + round, WcOpcode::Send);
    }
}

#[test]
fn a_reader_is_not_rung_for_acknowledgements_but_a_writer_is() {
    let (pair, fd) = pair_with_waiter();
    let src = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    pair.a.post_recv(1, &inbox, 0, 4096);
    pair.b.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 64)])).expect("send");
    assert!(pair.b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"));
    // `a` takes the message and acknowledges it: no arrival for `b`.
    assert_success(&pair.a.wait_one(), 1, WcOpcode::Recv);
    assert!(!rung(&fd, Duration::from_millis(200)), "an acknowledgement rang a reader");
    // A writer waiting for the acknowledgement finds it (already published) when it arms.
    assert!(pair.b.qp.arm_waiter(WakeFor::Anything).expect("arm"));
    let got = pair.b.wait_one();
    assert_success(&got, 2, WcOpcode::Send);

    // And is rung for one that comes later.
    pair.a.post_recv(3, &inbox, 0, 4096);
    pair.b.qp.post_send(&SendWr::new(4, SendOp::Send, &[src.sge(0, 64)])).expect("send");
    assert!(pair.b.qp.arm_waiter(WakeFor::Anything).expect("arm"));
    let acked = {
        assert_success(&pair.a.wait_one(), 3, WcOpcode::Recv);
        rung(&fd, Duration::from_secs(10))
    };
    // The acknowledgement may also have been found by the arm's own look (then no ring).
    let completions = take(&pair.b.cq);
    assert!(
        acked || completions.iter().any(|wc| wc.wr_id == 4),
        "a writer was neither rung nor given its acknowledgement"
    );
}

#[test]
fn without_a_doorbell_nothing_is_armed() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    assert!(!pair.b.qp.arm_waiter(WakeFor::Anything).expect("arm"), "armed a queue pair without a doorbell");
    assert!(!pair.b.qp.set_waiter_fd(&eventfd()).expect("set_waiter_fd"), "took a doorbell after RTR");
    assert!(!pair.b.qp.arm_waiter(WakeFor::Anything).expect("arm"), "the late doorbell was linked");
}

/// What reached the queue pair before an arming is in its queue when `arm_waiter` returns, so
/// the look that follows may take it with `take_queued` (which looks at no queue pair): how the
/// completions layer takes it, once per wait.
#[test]
fn an_arming_leaves_what_arrived_for_take_queued() {
    let (pair, _fd) = pair_with_waiter();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, b"arrived").expect("fill");
    // A first exchange, so both introductions are applied and the next SEND is published into
    // b's ring as it is posted.
    pair.b.post_recv(1, &inbox, 0, 4096);
    pair.a.qp.post_send(&SendWr::new(101, SendOp::Send, &[src.sge(0, 7)])).expect("send");
    assert_success(&pair.b.wait_one(), 1, WcOpcode::Recv);
    assert_success(&pair.a.wait_one(), 101, WcOpcode::Send);
    for round in 2..5u64 {
        pair.b.post_recv(round, &inbox, 0, 4096);
        pair.a.qp.post_send(&SendWr::new(100 + round, SendOp::Send, &[src.sge(0, 7)])).expect("send");
        assert!(pair.b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"), "a linked doorbell");
        let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
        let n = pair.b.cq.take_queued(&mut buf).expect("take_queued");
        assert_eq!(n, 1, "round {round}: the arming left {n} completions in the queue");
        assert_success(&buf[0], round, WcOpcode::Recv);
        assert_success(&pair.a.wait_one(), 100 + round, WcOpcode::Send);
    }
}
