//! Activity marks (see `lightpath_shm::activity`): with many queue pairs on a device, news for
//! one of them is found by looking at that one only; news whose mark was lost is still found:
//! at once by a poll of the queue pair's own queue (which looks at its few queue pairs
//! whatever the marks say), and on a queue shared by many by the look at every queue pair the
//! device takes now and then; garbage written over the
//! activity area (every peer can write it) costs looks, not data; and a device with many
//! queue pairs that sleeps is woken for news on any one of them.
//!
//! The counters come from `lightpath_shm::fault::counters`. Applications here never let the
//! driver thread take over (`idle_after` of an hour), so every look is one the test caused.

use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightpath_shm::fault::{self, EngineCounters};
use lightpath_shm::{ShmConfig, ShmDevice};
use lightpath_verbs::conformance::harness::{assert_success, connect, pattern, read_region, PairOptions};
use lightpath_verbs::{
    AccessFlags, CompletionQueue, CqOf, Device, MemoryRegion, MrOf, Mtu, PdOf, ProtectionDomain, QpCaps,
    QpOf, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

/// More queue pairs than a device looks at on every call (it then relies on marks).
const QUEUE_PAIRS: usize = 40;
const DEADLINE: Duration = Duration::from_secs(30);
const LEN: usize = 256;

/// One end of every connection: a region per queue pair, one device, and a queue per queue
/// pair or one queue for all of them.
struct End {
    qps: Vec<QpOf<ShmDevice>>,
    cqs: Vec<Arc<CqOf<ShmDevice>>>,
    mrs: Vec<MrOf<ShmDevice>>,
    _pd: PdOf<ShmDevice>,
    device: ShmDevice,
}

/// Whether the queue pairs of an end report to queues of their own or to one they share.
#[derive(Clone, Copy)]
enum Queues {
    Own,
    Shared,
}

fn open_end(config: ShmConfig, queues: Queues) -> End {
    let device = ShmDevice::open(config).expect("shm device");
    let pd = device.alloc_pd().expect("pd");
    let mut end = End { qps: Vec::new(), cqs: Vec::new(), mrs: Vec::new(), _pd: pd, device };
    let shared = Arc::new(end.device.create_cq(64 * QUEUE_PAIRS as u32).expect("cq"));
    for _ in 0..QUEUE_PAIRS {
        let cq = match queues {
            Queues::Own => Arc::new(end.device.create_cq(64).expect("cq")),
            Queues::Shared => Arc::clone(&shared),
        };
        end.qps.push(end._pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp"));
        end.cqs.push(cq);
        end.mrs.push(end._pd.alloc_mr(2 * LEN, AccessFlags::LOCAL_WRITE).expect("mr"));
    }
    end
}

/// Two devices with `QUEUE_PAIRS` connections between them, each on a queue of its own, whose
/// driver threads stay out.
fn connected() -> (End, End) {
    connected_with(Queues::Own)
}

fn connected_with(queues: Queues) -> (End, End) {
    let config = ShmConfig { idle_after: Duration::from_secs(3600), ..ShmConfig::default() };
    let (a, b) = (open_end(config.clone(), queues), open_end(config, queues));
    for (qp_a, qp_b) in a.qps.iter().zip(&b.qps) {
        connect(qp_a, qp_b, Mtu::Mtu4096, &PairOptions::default());
    }
    // The first call after a device stopped looking at everything on every call (past a few
    // queue pairs) looks at everything once more; let that pass before anything is counted.
    let mut buf = empty();
    for end in [&a, &b] {
        assert_eq!(end.cqs[0].poll(&mut buf).expect("poll"), 0);
    }
    (a, b)
}

fn empty() -> [WorkCompletion; 4] {
    [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4]
}

/// Polls `cq` (never blocking) until it yields a completion; returns it and how many polls
/// came back empty.
fn poll_one(cq: &CqOf<ShmDevice>) -> (WorkCompletion, u64) {
    let deadline = Instant::now() + DEADLINE;
    let mut buf = empty();
    let mut empty_polls = 0;
    loop {
        if cq.poll(&mut buf[..1]).expect("poll") == 1 {
            return (buf[0], empty_polls);
        }
        empty_polls += 1;
        assert!(Instant::now() < deadline, "no completion after {empty_polls} polls");
    }
}

/// Posts a receive on `to`'s queue pair `k` and a SEND of `LEN` pattern bytes from `from`'s.
fn send(from: &End, to: &End, k: usize, seed: u8) {
    let sge = [to.mrs[k].sge(LEN, LEN as u32)];
    to.qps[k].post_recv(&RecvWr::new(k as u64, &sge)).expect("post_recv");
    from.mrs[k].write(0, &pattern(LEN, seed)).expect("fill");
    let sge = [from.mrs[k].sge(0, LEN as u32)];
    from.qps[k].post_send(&SendWr::new(1000 + k as u64, SendOp::Send, &sge)).expect("post_send");
}

/// Checks that queue pair `k` of `to` received what `send` sent with `seed`.
fn check_received(to: &End, k: usize, wc: &WorkCompletion, seed: u8) {
    assert_success(wc, k as u64, WcOpcode::Recv);
    assert_eq!(wc.byte_len as usize, LEN);
    assert_eq!(read_region(&to.mrs[k], LEN, LEN), pattern(LEN, seed), "payload of queue pair {k}");
}

fn counters(end: &End) -> EngineCounters {
    fault::counters(&end.device)
}

#[test]
fn news_for_one_queue_pair_among_many_costs_one_look() {
    let (a, b) = connected();
    for k in [0, 17, QUEUE_PAIRS - 1] {
        // A device also looks at every queue pair once per FULL_SCAN_INTERVAL (100 ms), the
        // safety net for lost marks, whatever the marks say. On a loaded machine one exchange
        // can take long enough to contain it (seen once in a full test run: 41 looks on the
        // receiver); such an exchange says nothing about the marks, so it is done again, at
        // most twice. The one that counts must show no full scan and at most 2 looks.
        let mut attempt = 0;
        let (before, after) = loop {
            attempt += 1;
            let before = (counters(&a), counters(&b));
            send(&a, &b, k, k as u8);
            let (wc, _) = poll_one(&b.cqs[k]);
            check_received(&b, k, &wc, k as u8);
            let (wc, _) = poll_one(&a.cqs[k]);
            assert_success(&wc, 1000 + k as u64, WcOpcode::Send);
            let after = (counters(&a), counters(&b));
            let scanned =
                after.0.full_scans != before.0.full_scans || after.1.full_scans != before.1.full_scans;
            if !scanned || attempt == 3 {
                break (before, after);
            }
        };
        // The receiver looks at the queue pair marked for the SEND, the sender at the one
        // marked for the acknowledgement: the other 39 are never looked at.
        let looks = (after.0.looks - before.0.looks, after.1.looks - before.1.looks);
        assert!(looks.0 <= 2 && looks.1 <= 2, "queue pair {k}: looks (sender, receiver) = {looks:?}");
        assert_eq!(after.1.full_scans, before.1.full_scans, "the receiver looked at every queue pair");
    }
}

#[test]
fn a_lost_mark_costs_nothing_to_a_poll_of_the_queue_pairs_own_queue() {
    let (a, b) = connected();
    let k = 23;
    for round in 0..5u8 {
        send(&a, &b, k, round);
        fault::clear_activity(&b.device);
        let before = counters(&b);
        let (wc, _) = poll_one(&b.cqs[k]);
        check_received(&b, k, &wc, round);
        assert_eq!(counters(&b).full_scans, before.full_scans, "round {round}: a look at every queue pair");
        assert_success(&poll_one(&a.cqs[k]).0, 1000 + k as u64, WcOpcode::Send);
    }
}

#[test]
fn a_lost_mark_is_found_by_the_look_at_every_queue_pair() {
    // One queue for every queue pair: a poll of it drives the device, which relies on marks.
    let (a, b) = connected_with(Queues::Shared);
    let k = 23;
    // The receiver's driver thread may take the mark before the test clears it (it runs on
    // its own, and how soon depends on timing, such as the page faults of a fresh segment):
    // then nothing was lost and the round says nothing. A lost mark must be found, by a look at
    // every queue pair, in some round; every round's message must arrive.
    let mut lost_and_found = 0;
    for round in 0..20u8 {
        send(&a, &b, k, round);
        // As a hostile peer could: the mark for the SEND disappears before the receiver sees it.
        fault::clear_activity(&b.device);
        let before = counters(&b);
        let (wc, empty_polls) = poll_one(&b.cqs[k]);
        check_received(&b, k, &wc, round);
        let after = counters(&b);
        if after.full_scans > before.full_scans && empty_polls > 0 {
            lost_and_found += 1;
        }
        assert_success(&poll_one(&a.cqs[k]).0, 1000 + k as u64, WcOpcode::Send);
        if lost_and_found >= 3 {
            break;
        }
    }
    assert!(lost_and_found >= 3, "a lost mark was found by a full look in {lost_and_found} of 20 rounds");
}

#[test]
fn garbage_over_the_activity_area_does_no_harm() {
    let (a, b) = connected();
    for (round, seed) in [0x5EED_0001u64, 0xFFFF_FFFF_FFFF_FFFF, 0].into_iter().enumerate() {
        // Marks on every slot and past them, and a state and rung word the owner never wrote.
        fault::scribble_activity(&a.device, seed);
        fault::scribble_activity(&b.device, seed.rotate_left(17));
        for k in 0..QUEUE_PAIRS {
            send(&a, &b, k, (k + round) as u8);
            send(&b, &a, k, (k + round + 100) as u8);
        }
        for k in 0..QUEUE_PAIRS {
            let mut recv_b = None;
            let mut recv_a = None;
            let mut sends = 0;
            while recv_a.is_none() || recv_b.is_none() || sends < 2 {
                for (end, slot) in [(&a, &mut recv_a), (&b, &mut recv_b)] {
                    let (wc, _) = poll_one(&end.cqs[k]);
                    if wc.opcode == WcOpcode::Recv {
                        assert!(slot.replace(wc).is_none(), "two receives on queue pair {k}");
                    } else {
                        assert_success(&wc, 1000 + k as u64, WcOpcode::Send);
                        sends += 1;
                    }
                }
            }
            check_received(&b, k, &recv_b.expect("receive"), (k + round) as u8);
            check_received(&a, k, &recv_a.expect("receive"), (k + round + 100) as u8);
        }
    }
}

/// The receiver only waits on its notification fd, as an event loop would: its driver thread
/// sleeps on the doorbell, and a mark on one queue pair among many wakes it.
#[test]
fn a_sleeping_device_with_many_queue_pairs_is_woken_for_any_of_them() {
    let config = ShmConfig { idle_after: Duration::from_millis(1), ..ShmConfig::default() };
    let (a, b) = (open_end(config.clone(), Queues::Own), open_end(config, Queues::Own));
    for (qp_a, qp_b) in a.qps.iter().zip(&b.qps) {
        connect(qp_a, qp_b, Mtu::Mtu4096, &PairOptions::default());
    }
    for k in [5, QUEUE_PAIRS - 2] {
        let cq = &b.cqs[k];
        let sge = [b.mrs[k].sge(LEN, LEN as u32)];
        b.qps[k].post_recv(&RecvWr::new(k as u64, &sge)).expect("post_recv");
        cq.request_notify().expect("arm");
        let mut buf = empty();
        assert_eq!(cq.poll(&mut buf).expect("poll"), 0);
        a.mrs[k].write(0, &pattern(LEN, 9)).expect("fill");
        let sge = [a.mrs[k].sge(0, LEN as u32)];
        a.qps[k].post_send(&SendWr::new(1000 + k as u64, SendOp::Send, &sge)).expect("post_send");

        let fd = cq.notify_fd().expect("an fd");
        // SAFETY: the fd belongs to the queue, which outlives this borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
        let timeout = Timespec { tv_sec: 30, tv_nsec: 0 };
        assert_eq!(poll(&mut fds, Some(&timeout)).expect("poll(2)"), 1, "queue pair {k}: never woken");
        assert!(cq.take_notify().expect("take"));
        assert_eq!(cq.poll(&mut buf).expect("poll"), 1);
        check_received(&b, k, &buf[0], 9);
        assert_success(&poll_one(&a.cqs[k]).0, 1000 + k as u64, WcOpcode::Send);
    }
}

/// Threads blocked in `wait` on many queue pairs of one device (one watches the doorbell,
/// the others sleep on their queue) each get their own message.
#[test]
fn blocked_waiters_on_many_queue_pairs_each_get_theirs() {
    let (a, b) = connected();
    let waiters = 8;
    for k in 0..waiters {
        let sge = [b.mrs[k].sge(LEN, LEN as u32)];
        b.qps[k].post_recv(&RecvWr::new(k as u64, &sge)).expect("post_recv");
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..waiters)
            .map(|k| {
                let cq = &b.cqs[k];
                scope.spawn(move || {
                    let mut buf = empty();
                    let started = Instant::now();
                    let got = cq.wait(&mut buf[..1], DEADLINE).expect("wait");
                    assert_eq!(got, 1, "queue pair {k}: no completion");
                    // Woken by its completion, not by its deadline: a waiter sleeping on its own
                    // queue when the doorbell's watcher left was found only by its own last look
                    // at the deadline (about one run in fifteen before the watch was handed over).
                    let waited = started.elapsed();
                    assert!(waited < DEADLINE / 6, "queue pair {k}: completion seen only after {waited:?}");
                    buf[0]
                })
            })
            .collect();
        // In reverse order, so the first waiter to block is the last one served.
        for k in (0..waiters).rev() {
            a.mrs[k].write(0, &pattern(LEN, k as u8)).expect("fill");
            let sge = [a.mrs[k].sge(0, LEN as u32)];
            a.qps[k].post_send(&SendWr::new(1000 + k as u64, SendOp::Send, &sge)).expect("post_send");
        }
        for (k, handle) in handles.into_iter().enumerate() {
            check_received(&b, k, &handle.join().expect("waiter"), k as u8);
        }
    });
}

/// `take_queued` hands over what the queue holds and looks at no queue pair (the caller's
/// arming just did), where `poll` on an empty queue takes in what the peer published.
#[test]
fn take_queued_takes_only_what_is_queued() {
    let (a, b) = connected();
    send(&a, &b, 0, 7);
    let mut buf = empty();
    assert_eq!(
        b.cqs[0].take_queued(&mut buf).expect("take_queued"),
        0,
        "take_queued took in the SEND waiting in the ring"
    );
    let (wc, _) = poll_one(&b.cqs[0]);
    assert_success(&wc, 0, WcOpcode::Recv);
}
