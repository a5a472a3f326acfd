//! The shared queues over a real provider: queue pairs of one soft device (talking to each
//! other through its socket) all report to one hub.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long each blocked thread waits: a minute, far beyond any routing delay.
const WAITER_PATIENCE: Duration = Duration::from_secs(60);

use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::conformance::harness::{connect, PairOptions};
use lightpath_verbs::{
    Device, Mtu, ProtectionDomain, QpCaps, QueuePair, RecvWr, SendOp, SendWr, WakeFor, WcOpcode, WcStatus,
    WorkCompletion,
};

use super::{ConnCompletions, HubPool};

type Qp = lightpath_verbs::QpOf<SoftDevice>;
type Pd = lightpath_verbs::PdOf<SoftDevice>;

fn device(mode: ProgressMode) -> SoftDevice {
    let mut config = SoftConfig::with_addr("127.0.0.1:0".parse().unwrap());
    config.mode = mode;
    config.lock_memory = false;
    SoftDevice::open(config).unwrap()
}

/// One connection's end: a queue pair on a shared queue, and its view of that queue.
struct End {
    qp: Qp,
    completions: ConnCompletions<SoftDevice>,
}

fn end(device: &SoftDevice, pd: &Pd, hubs: &HubPool<SoftDevice>) -> End {
    let entries = 64;
    let mut completions =
        ConnCompletions::new(hubs.reserve(device, entries, Some(true)).unwrap(), entries).unwrap();
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, ..QpCaps::default() };
    let qp = pd.create_qp(completions.cq(), completions.cq(), caps).unwrap();
    completions.attach(&qp, true, false).unwrap();
    End { qp, completions }
}

/// `pairs` connected pairs of ends, all on one device and one hub.
fn pairs(device: &SoftDevice, hubs: &HubPool<SoftDevice>, pairs: usize) -> (Pd, Vec<(End, End)>) {
    let pd = device.alloc_pd().unwrap();
    let ends = (0..pairs)
        .map(|_| {
            let (a, b) = (end(device, &pd, hubs), end(device, &pd, hubs));
            connect(&a.qp, &b.qp, Mtu::Mtu1024, &PairOptions::default());
            (a, b)
        })
        .collect();
    (pd, ends)
}

/// A zero-length SEND (the receives have no buffer).
fn send_empty(qp: &Qp, wr_id: u64) {
    qp.post_send(&SendWr::new(wr_id, SendOp::Send, &[])).unwrap();
}

/// Collects `n` completions of `end`, panicking if a wait of 30 s finds none.
fn collect(end: &End, n: usize) -> Vec<WorkCompletion> {
    collect_within(end, n, Duration::from_secs(30))
}

/// Collects `n` completions, panicking if a wait of `patience` finds none.
fn collect_within(end: &End, n: usize, patience: Duration) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 8];
    while got.len() < n {
        let count = end.completions.wait(&end.qp, &mut buf, patience, WakeFor::Anything).unwrap();
        assert!(count > 0, "no completion within {patience:?} after {} of {n}", got.len());
        got.extend_from_slice(&buf[..count]);
    }
    got
}

#[test]
fn each_connection_gets_its_own_completions_in_order() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::new(4096);
    let (_pd, ends) = pairs(&device, &hubs, 4);
    assert_eq!(hubs.len(), 1, "eight connections fit one queue");
    for (a, b) in &ends {
        for i in 0..8 {
            b.qp.post_recv(&RecvWr::new(100 + i, &[])).unwrap_or_else(|_| panic!("post recv"));
        }
        let _ = a;
    }
    // Interleaved across pairs, so the queue holds everyone's completions mixed.
    for i in 0..8u64 {
        for (p, (a, _)) in ends.iter().enumerate() {
            send_empty(&a.qp, (p as u64) << 8 | i);
        }
    }
    for (p, (a, b)) in ends.iter().enumerate() {
        let sends = collect(a, 8);
        let recvs = collect(b, 8);
        let ids: Vec<u64> = sends.iter().map(|wc| wc.wr_id).collect();
        let want: Vec<u64> = (0..8).map(|i| (p as u64) << 8 | i).collect();
        assert_eq!(ids, want, "pair {p}: its sends, in order");
        assert!(sends.iter().all(|wc| wc.qp_num == a.qp.qpn() && wc.status.is_success()), "{sends:?}");
        let ids: Vec<u64> = recvs.iter().map(|wc| wc.wr_id).collect();
        assert_eq!(ids, (100..108).collect::<Vec<u64>>(), "pair {p}: its receives, in order");
        assert!(recvs
            .iter()
            .all(|wc| wc.qp_num == b.qp.qpn() && wc.opcode == WcOpcode::Recv && wc.status.is_success()));
    }
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
    for (a, b) in &ends {
        assert_eq!(a.completions.poll(&mut buf).unwrap(), 0);
        assert_eq!(b.completions.poll(&mut buf).unwrap(), 0);
    }
}

#[test]
fn completions_of_a_detached_queue_pair_go_nowhere() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::new(4096);
    let (_pd, mut ends) = pairs(&device, &hubs, 2);
    let (a1, b1) = ends.pop().unwrap();
    let (a0, b0) = ends.pop().unwrap();
    let hub = Arc::clone(&a1.completions.hub);
    // A connection that goes away first stops routing (its queue pair lives on here).
    let End { qp: a1_qp, completions: gone } = a1;
    drop(gone);
    b1.qp.post_recv(&RecvWr::new(1, &[])).unwrap();
    b0.qp.post_recv(&RecvWr::new(2, &[])).unwrap();
    send_empty(&a1_qp, 11);
    send_empty(&a0.qp, 10);
    let got = collect(&a0, 1);
    assert_eq!(got[0].wr_id, 10);
    assert_eq!(collect(&b1, 1)[0].wr_id, 1, "the receiving side is still attached");
    assert_eq!(collect(&b0, 1)[0].wr_id, 2);
    assert_eq!(hub.strays(), 1, "the detached sender's completion was dropped, not misrouted");
}

#[test]
fn a_full_queue_makes_the_pool_open_a_larger_one() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::<SoftDevice>::new(100);
    let first = hubs.reserve(&device, 60, Some(true)).unwrap();
    assert_eq!(first.capacity(), 100);
    let second = hubs.reserve(&device, 60, Some(true)).unwrap();
    assert_eq!(second.capacity(), 200, "doubled");
    let third = hubs.reserve(&device, 60, Some(true)).unwrap();
    assert!(Arc::ptr_eq(&second, &third), "the second queue still had room");
    assert_eq!(hubs.len(), 2);
    first.release(60);
    let again = hubs.reserve(&device, 60, Some(true)).unwrap();
    assert!(Arc::ptr_eq(&first, &again), "released room is used again");
    assert_eq!(hubs.len(), 2);
    let max = device.query().unwrap().max_cqe;
    let refused = hubs.reserve(&device, max + 1, Some(true)).map(|_| ()).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::OutOfMemory);
}

/// Thirty-two threads block in `wait` on one hub, each for its own receive; the sends come in
/// an order unrelated to who leads. Every thread must get its completion: the leader routes
/// the others', and hands the watch on when it leaves.
fn blocked_threads_all_get_theirs(mode: ProgressMode) {
    let device = device(mode);
    let hubs = HubPool::new(4096);
    let (_pd, ends) = pairs(&device, &hubs, 32);
    let ends: Vec<(End, Arc<End>)> = ends.into_iter().map(|(a, b)| (a, Arc::new(b))).collect();
    for round in 0..3u64 {
        let waiters: Vec<_> = ends
            .iter()
            .map(|(_, b)| {
                b.qp.post_recv(&RecvWr::new(round, &[])).unwrap();
                let b = Arc::clone(b);
                std::thread::spawn(move || {
                    let started = Instant::now();
                    let wc = collect_within(&b, 1, WAITER_PATIENCE)[0];
                    (wc, started.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        // One at a time, spaced so that each leader has left before the next arrives: the
        // later ones reach their threads only if the watch was handed on. This thread must
        // not route (it would serve the sleepers itself), so it collects the sends after.
        for (i, (a, _)) in ends.iter().enumerate().rev() {
            send_empty(&a.qp, round << 16 | i as u64);
            std::thread::sleep(Duration::from_millis(2));
        }
        let received: Vec<(WorkCompletion, Duration)> =
            waiters.into_iter().map(|w| w.join().unwrap()).collect();
        for ((wc, waited), (a, b)) in received.into_iter().zip(&ends) {
            // A wait ends with its last look at the queue, so a sleeper nobody woke still
            // gets its completion — after its whole timeout. That is what this catches.
            assert!(waited < WAITER_PATIENCE / 2, "a sleeper was left asleep for {waited:?}: no hand-off");
            assert_eq!(
                (wc.qp_num, wc.wr_id, wc.opcode, wc.status),
                (b.qp.qpn(), round, WcOpcode::Recv, WcStatus::Success)
            );
            let sent = collect(a, 1)[0];
            assert_eq!((sent.wr_id >> 16, sent.status), (round, WcStatus::Success));
        }
    }
}

#[test]
fn blocked_threads_all_get_theirs_polling_mode() {
    blocked_threads_all_get_theirs(ProgressMode::polling());
}

#[test]
fn blocked_threads_all_get_theirs_thread_mode() {
    blocked_threads_all_get_theirs(ProgressMode::Thread);
}

#[test]
fn an_armed_inbox_fd_fires_through_the_notifier() {
    let device = device(ProgressMode::Thread);
    let hubs = HubPool::new(4096);
    let (_pd, ends) = pairs(&device, &hubs, 3);
    for (i, (a, b)) in ends.iter().enumerate() {
        b.qp.post_recv(&RecvWr::new(i as u64, &[])).unwrap();
        b.completions.request_notify(&b.qp, &mut [], WakeFor::Anything, super::PortLook::TakeIn).unwrap();
        let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 2];
        assert_eq!(b.completions.poll(&mut buf).unwrap(), 0);
        send_empty(&a.qp, 7);
        // Nobody polls: only the notifier can route the receive and make the fd readable.
        let fd = b.completions.notify_fd().unwrap();
        // SAFETY: the fd belongs to `b`'s inbox, alive for this whole loop iteration.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let mut fds = [rustix::event::PollFd::new(&borrowed, rustix::event::PollFlags::IN)];
        let timeout = rustix::event::Timespec { tv_sec: 30, tv_nsec: 0 };
        assert_eq!(
            rustix::event::poll(&mut fds, Some(&timeout)).unwrap(),
            1,
            "connection {i}: fd never fired"
        );
        assert!(b.completions.take_notify());
        assert_eq!(b.completions.poll(&mut buf).unwrap(), 1);
        assert_eq!(
            (buf[0].wr_id, buf[0].opcode, buf[0].status),
            (i as u64, WcOpcode::Recv, WcStatus::Success)
        );
        assert!(!b.completions.take_notify(), "one wake-up per arm");
    }
}

#[test]
fn a_private_queue_is_not_shared_or_kept() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::<SoftDevice>::new(4096);
    let a = hubs.reserve(&device, 60, Some(false)).unwrap();
    let b = hubs.reserve(&device, 60, Some(false)).unwrap();
    assert!(!Arc::ptr_eq(&a, &b));
    assert_eq!((a.capacity(), b.capacity()), (60, 60), "sized for its one connection");
    assert_eq!(hubs.len(), 0, "private queues are not offered to later connections");
    assert!(!a.reserve(1), "full");
}

/// A thread that blocks before anything arrives leads: what the queue gives it comes straight
/// into its buffer, in order, also when more of its own arrive than the buffer holds (the rest
/// waits in its inbox, ahead of anything newer), and everybody else's completions reach their
/// inboxes.
#[test]
fn a_leader_keeps_its_own_in_order_and_routes_the_rest() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::new(4096);
    let (_pd, ends) = pairs(&device, &hubs, 2);
    let ends: Vec<(Arc<End>, End)> = ends.into_iter().map(|(a, b)| (Arc::new(a), b)).collect();
    for (_, b) in &ends {
        for i in 0..16 {
            b.qp.post_recv(&RecvWr::new(i, &[])).unwrap();
        }
    }
    let leader = {
        let a = Arc::clone(&ends[0].0);
        std::thread::spawn(move || collect(&a, 16))
    };
    std::thread::sleep(Duration::from_millis(20));
    for i in 0..16u64 {
        for (p, (a, _)) in ends.iter().enumerate() {
            send_empty(&a.qp, (p as u64) << 8 | i);
        }
    }
    let got = leader.join().unwrap();
    assert_eq!(got.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(), (0..16).collect::<Vec<u64>>());
    let others = collect(&ends[1].0, 16);
    assert_eq!(others.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(), (256..272).collect::<Vec<u64>>());
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
    assert_eq!(ends[0].0.completions.poll(&mut buf).unwrap(), 0, "a completion was delivered twice");
}

/// The race behind lost message parts: connection `b` found its inbox empty, then another
/// thread routed `b`'s first receive into it, then `b`'s own poll of the queue (once it holds
/// the router lock) finds its second. The router lock holder must take the routed one first,
/// or `b` sees its records out of order (a stream record handled after the one behind it).
#[test]
fn a_poll_takes_what_was_routed_before_what_the_queue_holds() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::new(4096);
    let (_pd, ends) = pairs(&device, &hubs, 2);
    let (a, b) = &ends[0];
    let (other, _) = &ends[1];
    for i in 0..2 {
        b.qp.post_recv(&RecvWr::new(i, &[])).unwrap();
    }
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 8];
    // The first send's receive is routed into b's inbox by another connection's poll.
    send_empty(&a.qp, 10);
    let deadline = Instant::now() + Duration::from_secs(30);
    while b.completions.inbox.is_empty() {
        assert!(Instant::now() < deadline, "the first receive never reached b's inbox");
        assert_eq!(other.completions.poll(&mut buf).unwrap(), 0, "the other connection has nothing");
    }
    // The second one stays in the queue until b itself polls.
    send_empty(&a.qp, 11);
    let qpn = b.qp.qpn();
    let mut got = Vec::new();
    while got.len() < 2 {
        assert!(Instant::now() < deadline, "b has {got:?} of its two receives");
        let n = b.completions.hub.poll_for(&b.completions.inbox, qpn, &mut buf).unwrap();
        got.extend(buf[..n].iter().filter(|wc| wc.opcode == WcOpcode::Recv).map(|wc| wc.wr_id));
    }
    assert_eq!(got, [0, 1], "b's receives out of order");
}

/// Connections of one device are counted over all its hubs, private ones too (a thread alone
/// on its hub still waits on its doorbell while the device has other connections).
#[test]
fn a_device_counts_its_connections_over_every_hub() {
    let device = device(ProgressMode::polling());
    let hubs = HubPool::<SoftDevice>::new(4096);
    let first = hubs.connection(&device, 60, Some(false)).unwrap();
    assert_eq!(first.device_connections(), 1);
    let shared = hubs.connection(&device, 60, Some(true)).unwrap();
    let private = hubs.connection(&device, 60, Some(false)).unwrap();
    assert_eq!((first.device_connections(), shared.device_connections()), (3, 3));
    drop(shared);
    drop(private);
    assert_eq!(first.device_connections(), 1, "dropped connections leave the count");
    let alone = ConnCompletions::new(hubs.reserve(&device, 60, Some(false)).unwrap(), 60).unwrap();
    assert_eq!(alone.device_connections(), 1, "made outside the pool: counted alone");
}

/// Blocking waits on an shm queue pair's doorbell (`spin_on_queue`).
mod shm_doorbell_spin {
    use super::*;
    use lightpath_shm::{ShmConfig, ShmDevice};

    use crate::completions::HubPool;

    struct ShmEnd {
        qp: lightpath_verbs::QpOf<ShmDevice>,
        completions: ConnCompletions<ShmDevice>,
    }

    /// A connected pair of ends on one shm device, each with a queue of its own (as streams'
    /// are), whose blocking waits spin for `spin` before they sleep.
    /// With `tasks`, their queue pairs wake them through the device's task doorbell (an
    /// event loop's connections, see `ConnCompletions::attach`).
    fn pair(device: &ShmDevice, hubs: &HubPool<ShmDevice>, spin: Duration, tasks: bool) -> (ShmEnd, ShmEnd) {
        let pd = device.alloc_pd().unwrap();
        let end = || {
            let mut completions = hubs.connection(device, 64, None).unwrap();
            let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, ..QpCaps::default() };
            let qp = pd.create_qp(completions.cq(), completions.cq(), caps).unwrap();
            completions.attach(&qp, true, tasks).unwrap();
            assert_eq!(completions.task_doorbell().is_some(), tasks, "shm took the task waiter or not");
            completions.set_wait_spin(spin);
            ShmEnd { qp, completions }
        };
        let (a, b) = (end(), end());
        connect(&a.qp, &b.qp, Mtu::Mtu4096, &PairOptions::default());
        (a, b)
    }

    /// `b` waits for a SEND that `a` posts after a while; returns whether `b`'s waiter was
    /// seen asleep on its doorbell before that.
    fn slept_before_the_send(spin: Duration, tasks: bool) -> bool {
        let config = ShmConfig {
            name: Some(format!("spin-test-{}-{tasks}", spin.as_millis())),
            ..ShmConfig::default()
        };
        let device = ShmDevice::open(config).unwrap();
        let hubs = HubPool::own_queues_by_default(1024);
        let (a, b) = pair(&device, &hubs, spin, tasks);
        assert!(b.completions.waits_alone(), "two connections on the device: doorbell waits");
        b.qp.post_recv(&RecvWr::new(7, &[])).unwrap();
        let b = Arc::new(b);
        let waiter = {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
                let n = b.completions.wait(&b.qp, &mut buf, WAITER_PATIENCE, WakeFor::Arrivals).unwrap();
                buf[..n].to_vec()
            })
        };
        let watch_until = Instant::now() + Duration::from_millis(200);
        let mut slept = false;
        while Instant::now() < watch_until {
            slept |= b.completions.inbox.is_sleeping();
            std::thread::sleep(Duration::from_millis(1));
        }
        send_empty_to(&a.qp, 1);
        let got = waiter.join().unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (7, WcStatus::Success, WcOpcode::Recv));
        slept
    }

    fn send_empty_to(qp: &lightpath_verbs::QpOf<ShmDevice>, wr_id: u64) {
        qp.post_send(&SendWr::new(wr_id, SendOp::Send, &[])).unwrap();
    }

    #[test]
    fn a_doorbell_wait_spins_before_it_sleeps_and_still_gets_what_comes() {
        // A spin longer than the test: the waiter is never seen asleep, and the SEND that
        // comes while it spins ends its wait (no doorbell rung: it never armed).
        assert!(!slept_before_the_send(Duration::from_secs(30), false), "a spinning waiter slept");
        // Without a spin it sleeps on its doorbell at once, and the SEND wakes it.
        assert!(slept_before_the_send(Duration::ZERO, false), "a waiter without a spin never slept");
    }

    #[test]
    fn a_blocked_thread_on_a_task_woken_queue_pair_watches_the_task_doorbell_itself() {
        // No event loop watches the device's task doorbell: the sleeping thread does, and the
        // peer's SEND (which rings that doorbell, the queue pair having no doorbell of its
        // own) still ends its wait long before `WAITER_PATIENCE`.
        let started = Instant::now();
        assert!(slept_before_the_send(Duration::ZERO, true), "a waiter without a spin never slept");
        assert!(started.elapsed() < WAITER_PATIENCE / 2, "the wait ended by its timeout");
    }
}
