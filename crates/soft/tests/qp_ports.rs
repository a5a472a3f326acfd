//! Queue-pair ports: a queue pair given a waiter's doorbell (`QueuePair::set_waiter_fd`)
//! receives on a UDP port of its own, which its peer addresses (`AddressVector::udp_dport`).
//! The kernel then wakes the waiter sleeping on that port directly; news another thread makes
//! rings the doorbell; and a port nobody reads is still drained by the progress thread, so the
//! peer's requests are acknowledged.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightpath_soft::{ProgressMode, SoftDevice};
use lightpath_verbs::conformance::harness::{pattern, read_region, wait_n, PairOptions, Side, DEADLINE};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpAttr, QueuePair,
    SendOp, SendWr, WakeFor, WcOpcode, WcStatus, WorkCompletion,
};

fn eventfd() -> Arc<OwnedFd> {
    Arc::new(
        rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .expect("eventfd"),
    )
}

/// Whether `fd` becomes readable within `timeout`.
fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    let spec = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    matches!(rustix::event::poll(&mut fds, Some(&spec)), Ok(n) if n > 0)
}

/// Moves `side`'s queue pair (in INIT) to RTS towards `peer`, addressing it at `dport`, as
/// the stream negotiation does between two soft devices (Lightpath peers).
fn connect_from_init(side: &Side<SoftDevice>, peer: &Side<SoftDevice>, dport: u16) {
    let mut av = AddressVector::new(peer.qp.endpoint().gid, 0);
    av.udp_dport = dport;
    av.lightpath_peer = true;
    let mtu = lightpath_verbs::conformance::harness::common_mtu(&side.device, &peer.device);
    side.qp.modify(&QpAttr::to_rtr(av, mtu, peer.qp.endpoint().qpn, 0)).expect("RTR");
    let mut rts = QpAttr::to_rts(0);
    rts.timeout = Some(PairOptions::default().timeout);
    side.qp.modify(&rts).expect("RTS");
}

/// A pair where `b`'s queue pair has a port of its own (and `a` sends there); returns `b`'s
/// doorbell too.
fn pair_with_port() -> (Side<SoftDevice>, Side<SoftDevice>, Arc<OwnedFd>) {
    let options = PairOptions::default();
    let (dev_a, dev_b) = common::open_pair(ProgressMode::Thread);
    let (a, b) = (Side::new(dev_a, &options), Side::new(dev_b, &options));
    for side in [&a, &b] {
        side.qp.modify(&QpAttr::to_init(options.qp_access)).expect("INIT");
    }
    let doorbell = eventfd();
    // b's port must exist before a is told where to send.
    assert!(b.qp.set_waiter_fd(&doorbell).expect("set_waiter_fd"));
    let port = b.qp.own_udp_port().expect("a queue pair with a doorbell has a port of its own");
    assert_ne!(port, b.device.local_addr().port(), "the port is not the device's");
    connect_from_init(&a, &b, port);
    connect_from_init(&b, &a, a.device.local_addr().port());
    (a, b, doorbell)
}

fn poll_all(cq: &impl CompletionQueue) -> Vec<WorkCompletion> {
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
    let n = cq.poll(&mut out).expect("poll");
    out[..n].to_vec()
}

/// Whether `a` or `b` becomes readable within `timeout`.
fn either_readable(
    a: std::os::fd::BorrowedFd<'_>,
    b: std::os::fd::BorrowedFd<'_>,
    timeout: Duration,
) -> bool {
    let mut fds = [
        rustix::event::PollFd::new(&a, rustix::event::PollFlags::IN),
        rustix::event::PollFd::new(&b, rustix::event::PollFlags::IN),
    ];
    let spec = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    matches!(rustix::event::poll(&mut fds, Some(&spec)), Ok(n) if n > 0)
}

/// The waiter's protocol: arm, look, sleep on the port and the doorbell, arm again when
/// either fires; the peer's SEND arrives on the port (not the device socket).
#[test]
fn a_waiter_sleeping_on_its_port_gets_what_the_peer_sends_there() {
    let (a, b, doorbell) = pair_with_port();
    let socket = b.qp.waiter_poll_fd().expect("a port to sleep on");
    let src = a.alloc(64, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(64, 7)).expect("fill");
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, 64);
    assert!(b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"));
    assert!(poll_all(&b.cq).is_empty());
    assert!(
        !either_readable(socket.as_fd(), doorbell.as_fd(), Duration::ZERO),
        "readable before anything was sent"
    );
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 64)])).expect("send");
    let deadline = Instant::now() + DEADLINE;
    let got = loop {
        // The datagram wakes this sleeper through the port, or (when the device's progress
        // thread took it in first, as it may after a quiet spell) through the doorbell.
        assert!(either_readable(socket.as_fd(), doorbell.as_fd(), DEADLINE), "the waiter was never woken");
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&*doorbell, &mut count);
        assert!(b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"));
        let got = poll_all(&b.cq);
        if !got.is_empty() {
            break got;
        }
        assert!(Instant::now() < deadline, "woken, but the receive never completed");
    };
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (1, WcStatus::Success, WcOpcode::Recv));
    assert_eq!(read_region(&inbox, 0, 64), pattern(64, 7));
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success, "the SEND was acknowledged");
}

#[test]
fn news_another_thread_makes_rings_the_doorbell() {
    let (a, b, doorbell) = pair_with_port();
    let src = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, 64);
    assert!(b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"));
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)])).expect("send");
    // Nobody here reads the port: the progress thread does, and rings the armed doorbell.
    assert!(readable(doorbell.as_fd(), DEADLINE), "the doorbell was never rung");
    let got = poll_all(&b.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].wr_id, 1);
    // Rung once per arming: a second message does not ring it until the waiter arms again.
    let mut count = [0u8; 8];
    rustix::io::read(&*doorbell, &mut count).expect("take the ring");
    b.post_recv(3, &inbox, 0, 64);
    a.qp.post_send(&SendWr::new(4, SendOp::Send, &[src.sge(0, 8)])).expect("send");
    wait_n(&a.cq, 2);
    let deadline = Instant::now() + DEADLINE;
    while poll_all(&b.cq).is_empty() {
        assert!(Instant::now() < deadline, "the second receive never completed");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!readable(doorbell.as_fd(), Duration::ZERO), "rung without an arming");
}

#[test]
fn a_port_nobody_reads_is_still_answered() {
    let (a, b, _doorbell) = pair_with_port();
    let src = a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(64 * 4096, AccessFlags::LOCAL_WRITE);
    for i in 0..64 {
        b.post_recv(i, &inbox, i as usize * 4096, 4096);
    }
    // b's owner never arms, polls or waits: the SENDs are acknowledged all the same (the
    // progress thread drains the port), long before the peer's retry budget runs out.
    let started = Instant::now();
    for i in 0..64 {
        a.qp.post_send(&SendWr::new(100 + i, SendOp::Send, &[src.sge(0, 4096)])).expect("send");
    }
    let acks = wait_n(&a.cq, 64);
    assert!(acks.iter().all(|wc| wc.status == WcStatus::Success), "{acks:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "acknowledged only after {:?}", started.elapsed());
    assert_eq!(a.qp.stats().expect("stats").retransmits, 0, "the peer had to retransmit");
    assert_eq!(wait_n(&b.cq, 64).len(), 64);
    // Now the ports count as busy, so the progress thread no longer sleeps on them: it looks
    // every tick and drains a port found unread twice in a row. Once armed, the port is no
    // longer fresh (fresh ones it always sleeps on); SENDs one by one, unread by the owner,
    // are acknowledged within a few ticks each all the same.
    assert!(b.qp.arm_waiter(WakeFor::Anything).expect("arm"));
    for i in 0..16 {
        b.post_recv(200 + i, &inbox, 0, 4096);
    }
    let rescues_before = b.device.stats().driver.port_rescues;
    for i in 0..16 {
        let sent = Instant::now();
        a.qp.post_send(&SendWr::new(300 + i, SendOp::Send, &[src.sge(0, 4096)])).expect("send");
        let ack = wait_n(&a.cq, 1);
        assert_eq!(ack[0].status, WcStatus::Success);
        assert!(
            sent.elapsed() < Duration::from_millis(200),
            "SEND {i} acknowledged after {:?}",
            sent.elapsed()
        );
    }
    assert_eq!(a.qp.stats().expect("stats").retransmits, 0, "the peer had to retransmit");
    assert_eq!(wait_n(&b.cq, 16).len(), 16);
    // Each of those SENDs waited for the progress thread's two-tick rule: the counter an
    // operator reads (`lightpath devices --stats`) says so.
    let rescues = b.device.stats().driver.port_rescues - rescues_before;
    assert!((1..=16).contains(&rescues), "{rescues} rescues counted for 16 unread SENDs");
}

#[test]
fn no_port_in_polling_mode_or_past_the_limit() {
    let options = PairOptions::default();
    let polling = common::open_device(|config| config.mode = ProgressMode::polling());
    let side = Side::new(polling, &options);
    side.qp.modify(&QpAttr::to_init(options.qp_access)).expect("INIT");
    assert!(!side.qp.set_waiter_fd(&eventfd()).expect("set_waiter_fd"), "polling mode took a doorbell");
    assert_eq!(side.qp.own_udp_port(), None);
    assert!(side.qp.waiter_poll_fd().is_none());
    assert!(!side.qp.arm_waiter(WakeFor::Anything).expect("arm"), "armed without a doorbell");

    let limited = common::open_device(|config| config.max_qp_ports = 1);
    let Side { qp: first, cq, pd, device } = Side::new(limited, &options);
    let init = |qp: &lightpath_soft::SoftQp| qp.modify(&QpAttr::to_init(options.qp_access)).expect("INIT");
    init(&first);
    assert!(first.set_waiter_fd(&eventfd()).expect("set_waiter_fd"));
    let port = first.own_udp_port().expect("the first queue pair has a port");
    let second = pd.create_qp(&cq, &cq, options.caps).expect("qp");
    init(&second);
    assert!(!second.set_waiter_fd(&eventfd()).expect("set_waiter_fd"), "a port past the limit");
    assert_eq!(second.own_udp_port(), None);
    // Destroying the queue pair closes its port and frees its place.
    drop(first);
    let ip = device.local_addr().ip();
    drop(std::net::UdpSocket::bind((ip, port)).expect("the closed port is free again"));
    let third = pd.create_qp(&cq, &cq, options.caps).expect("qp");
    init(&third);
    assert!(third.set_waiter_fd(&eventfd()).expect("set_waiter_fd"), "the freed place was not reused");
    // Too late once in RTR: the peer was already told where to send.
    let late = pd.create_qp(&cq, &cq, options.caps).expect("qp");
    init(&late);
    let mut av = AddressVector::new(device.gids(1).expect("gids")[0], 0);
    av.udp_dport = port;
    late.modify(&QpAttr::to_rtr(av, lightpath_verbs::Mtu::Mtu1024, 1, 0)).expect("RTR");
    assert!(!late.set_waiter_fd(&eventfd()).expect("set_waiter_fd"), "a doorbell after RTR");
}

#[test]
fn the_port_is_not_shared_with_a_plain_socket() {
    let (_a, b, _doorbell) = pair_with_port();
    let port = b.qp.own_udp_port().expect("port");
    let ip = b.device.local_addr().ip();
    let taken = std::net::UdpSocket::bind((ip, port));
    assert!(taken.is_err(), "another socket could bind the queue pair's port");
}

/// A queue pair whose waiter is an event loop's task (`set_waiter_task`) offers the device's
/// spin (`QueuePair::task_spin`): a look takes in what reached the port and wakes the armed
/// task once, for the completed message, whose completion is then in the queue. (The
/// device's progress thread may take the datagrams in first after a quiet spell; it wakes
/// the task the same way.)
#[test]
fn a_task_spin_look_wakes_the_armed_task_once_for_a_message() {
    let options = PairOptions::default();
    let (dev_a, dev_b) = common::open_pair(ProgressMode::Thread);
    let (a, b) = (Side::new(dev_a, &options), Side::new(dev_b, &options));
    for side in [&a, &b] {
        side.qp.modify(&QpAttr::to_init(options.qp_access)).expect("INIT");
    }
    let wakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&wakes);
    let wake: lightpath_verbs::TaskWake = Arc::new(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    assert!(a.qp.task_spin().is_none(), "a spin for a queue pair without a task waiter");
    assert!(b.qp.set_waiter_task(wake).expect("set_waiter_task"));
    let spin = b.qp.task_spin().expect("a task waiter's queue pair offers the device's spin");
    assert_eq!(spin.tasks(), 1);
    let port = b.qp.own_udp_port().expect("a port of its own");
    connect_from_init(&a, &b, port);
    connect_from_init(&b, &a, a.device.local_addr().port());

    // A message of several datagrams.
    let len = 3 * 4096 + 100;
    let src = a.alloc(len, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(len, 3)).expect("fill");
    let inbox = b.alloc(len, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, len as u32);
    assert!(b.qp.arm_waiter(WakeFor::Arrivals).expect("arm"));
    assert!(!spin.look(), "news before anything was sent");
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, len as u32)])).expect("send");
    let deadline = Instant::now() + DEADLINE;
    while wakes.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        spin.look();
        assert!(Instant::now() < deadline, "the armed task was never woken");
    }
    let got = poll_all(&b.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (1, WcStatus::Success, WcOpcode::Recv));
    assert_eq!(read_region(&inbox, 0, len), pattern(len, 3));
    std::thread::sleep(Duration::from_millis(20));
    spin.look();
    assert_eq!(wakes.load(std::sync::atomic::Ordering::SeqCst), 1, "woken more than once for one message");
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success, "the SEND was acknowledged");
}
