//! Behaviour specific to the soft provider's driver: the completion fd under poll(2), regions
//! over moved-in vectors, the polling mode's helper thread and its ACK timing, UDP offloads,
//! device opening and naming, and the single-port, single-GID addressing rules.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice, SoftProvider};
use lightpath_verbs::conformance::harness::{connect, pattern, wait_n, PairOptions, Side, DEADLINE, MR_ALL};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, Device, Error, MemoryRegion, Mtu, ProtectionDomain,
    Provider, QpAttr, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

fn connected(mode: ProgressMode) -> (Side<SoftDevice>, Side<SoftDevice>) {
    let options = PairOptions::default();
    let (a, b) = common::open_pair(mode);
    let mtu = lightpath_verbs::conformance::harness::common_mtu(&a, &b);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    connect(&a.qp, &b.qp, mtu, &options);
    (a, b)
}

/// Waits with poll(2) for `fd` to become readable; returns whether it did before the deadline.
fn poll_readable(fd: i32, timeout: Duration) -> bool {
    let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `pollfd` is a live, initialised struct and we pass a count of one.
    let ret = unsafe { libc::poll(&mut pollfd, 1, millis) };
    ret == 1 && pollfd.revents & libc::POLLIN != 0
}

#[test]
fn notify_fd_works_with_poll() {
    let (a, b) = connected(ProgressMode::Thread);
    let fd = b.cq.notify_fd().expect("the soft provider has a notification fd");
    let src = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.cq.request_notify().expect("arm");
    assert!(!poll_readable(fd, Duration::ZERO), "readable before any completion");

    b.post_recv(1, &inbox, 0, 64);
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)])).expect("post_send");
    assert!(poll_readable(fd, DEADLINE), "the fd never became readable");
    assert!(b.cq.take_notify().expect("take"));
    assert!(!poll_readable(fd, Duration::ZERO), "still readable after take_notify");
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 2];
    assert_eq!(b.cq.poll(&mut out).expect("poll"), 1);
    assert_eq!((out[0].wr_id, out[0].status), (1, WcStatus::Success));
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
}

/// The completion hook runs, from the thread that made the completion (the progress thread
/// for a receive) with the engine unlocked — it polls the queue itself here, which would
/// deadlock otherwise — and nobody needs to poll or wait on the queue for it to run.
#[test]
fn the_completion_hook_runs_unlocked_for_what_arrives() {
    use std::sync::{mpsc, Arc, Mutex};
    let (a, b) = connected(ProgressMode::Thread);
    let src = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    let (tx, rx) = mpsc::channel::<Vec<WorkCompletion>>();
    let cq = b.cq.clone();
    let tx = Mutex::new(tx);
    let hook: lightpath_verbs::CompletionHook = Arc::new(move || {
        let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
        let n = cq.poll(&mut out).expect("poll from the hook");
        if n > 0 {
            let _ = tx.lock().unwrap().send(out[..n].to_vec());
        }
    });
    assert!(b.cq.set_completion_hook(Arc::clone(&hook)).expect("set"), "the soft provider takes a hook");
    assert!(!b.cq.set_completion_hook(hook).expect("set again"), "one hook per queue");
    b.post_recv(7, &inbox, 0, 64);
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)])).expect("post_send");
    let got = rx.recv_timeout(DEADLINE).expect("the hook never handed over the receive");
    assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (7, WcStatus::Success, WcOpcode::Recv));
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
}

/// An event loop (here: the completion hook itself, as the application) that answers what it
/// received finds the engine's ACK for the request held back by the progress thread, and the
/// two leave in one `sendmmsg`: one send batch per round where the ACK used to go alone first.
#[test]
fn an_event_loops_reply_carries_the_ack_of_the_request() {
    use std::sync::{Arc, Weak};
    const ROUNDS: u64 = 50;
    let (a, b) = connected(ProgressMode::Thread);
    let b = Arc::new(b);
    let request = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let a_inbox = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let b_inbox = b.alloc(64 * ROUNDS as usize, AccessFlags::LOCAL_WRITE);
    let reply = b.alloc(64, AccessFlags::LOCAL_WRITE);
    for i in 0..ROUNDS {
        b.post_recv(i, &b_inbox, 64 * i as usize, 64);
    }
    let weak: Weak<Side<SoftDevice>> = Arc::downgrade(&b);
    let reply_sge = reply.sge(0, 16);
    let hook: lightpath_verbs::CompletionHook = Arc::new(move || {
        let Some(b) = weak.upgrade() else { return };
        let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 8];
        let n = b.cq.poll(&mut out).expect("poll from the hook");
        for wc in &out[..n] {
            if wc.opcode == WcOpcode::Recv {
                b.qp.post_send(&SendWr::new(1000 + wc.wr_id, SendOp::Send, &[reply_sge])).expect("reply");
            }
        }
    });
    assert!(b.cq.set_completion_hook(hook).unwrap());
    let before = b.device.stats().driver.tx_batches;
    for i in 0..ROUNDS {
        a.post_recv(i, &a_inbox, 0, 64);
        a.qp.post_send(&SendWr::new(i, SendOp::Send, &[request.sge(0, 16)])).expect("request");
        let wcs = wait_n(&a.cq, 2);
        assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success), "{wcs:?}");
    }
    let batches = b.device.stats().driver.tx_batches - before;
    assert!(batches >= ROUNDS, "every reply was sent ({batches} batches)");
    assert!(batches <= ROUNDS + 5, "{batches} send batches for {ROUNDS} rounds: the ACKs went alone");
}

/// An event loop that goes back to waiting without replying (`consumer_idle`) sends the ACK
/// the progress thread held for its reply there and then, not when the hold runs out.
#[test]
fn an_idle_consumer_releases_the_held_ack() {
    use std::sync::{mpsc, Arc, Mutex, Weak};
    let (a, b) = connected(ProgressMode::Thread);
    let b = Arc::new(b);
    let src = a.alloc(64, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, 64);
    let (tx, rx) = mpsc::channel::<(u64, u64)>();
    let tx = Mutex::new(tx);
    let weak: Weak<Side<SoftDevice>> = Arc::downgrade(&b);
    let hook: lightpath_verbs::CompletionHook = Arc::new(move || {
        let Some(b) = weak.upgrade() else { return };
        let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
        if b.cq.poll(&mut out).expect("poll") == 0 {
            return;
        }
        let before = b.device.stats().engine.tx_datagrams;
        b.cq.consumer_idle();
        let after = b.device.stats().engine.tx_datagrams;
        let _ = tx.lock().unwrap().send((before, after));
    });
    assert!(b.cq.set_completion_hook(hook).unwrap());
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)])).expect("post_send");
    let (before, after) = rx.recv_timeout(DEADLINE).expect("the hook never saw the receive");
    assert_eq!(after, before + 1, "the held ACK left when the consumer went idle");
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn moved_in_vector_is_a_region() {
    let (a, b) = connected(ProgressMode::Thread);
    let mut memory = vec![0xEEu8; 4096];
    memory[..4].copy_from_slice(b"keep");
    let region = b.pd.reg_vec(memory, MR_ALL).expect("reg_vec");
    assert_eq!(region.len(), 4096);
    let src = a.alloc(100, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(100, 4)).expect("fill");
    let remote = region.remote();
    let op = SendOp::Write { remote_addr: remote.addr + 1000, rkey: remote.rkey };
    a.qp.post_send(&SendWr::new(1, op, &[src.sge(0, 100)])).expect("write");
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
    let mut out = vec![0u8; 1200];
    region.read(0, &mut out).expect("read");
    assert_eq!(&out[..4], b"keep");
    assert_eq!(&out[1000..1100], &pattern(100, 4)[..]);
    assert!(out[4..1000].iter().chain(&out[1100..]).all(|&b| b == 0xEE));
    assert_eq!(region.with_bytes(|bytes| bytes[1000]), pattern(1, 4)[0]);
    assert_refused_invalid(b.pd.reg_vec(vec![0; 8], AccessFlags::REMOTE_WRITE));
}

fn assert_refused_invalid<T>(result: lightpath_verbs::Result<T>) {
    assert!(matches!(result, Err(Error::InvalidAttribute(_))), "expected InvalidAttribute");
}

#[test]
fn polling_helper_answers_for_an_idle_application() {
    let (a, b) = connected(ProgressMode::polling());
    // B's application never polls; its helper thread must step in to answer A.
    let target = b.alloc(1 << 16, MR_ALL);
    let src = a.alloc(1 << 16, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(1 << 16, 6)).expect("fill");
    let remote = target.remote();
    let op = SendOp::Write { remote_addr: remote.addr, rkey: remote.rkey };
    a.qp.post_send(&SendWr::new(1, op, &[src.sge(0, 1 << 16)])).expect("write");
    let wc = wait_n(&a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success), "{wc:?}");
    let mut data = vec![0u8; 1 << 16];
    target.read(0, &mut data).expect("read");
    assert_eq!(data, pattern(1 << 16, 6));
    assert!(b.device.stats().driver.assists > 0, "B's helper thread never ran");
}

/// Waits until one SEND completion (if `send`) and one receive completion have arrived, and
/// returns the received 8-byte value.
fn await_round(side: &Side<SoftDevice>, buf: &lightpath_soft::SoftMr, mut send: bool) -> u64 {
    let mut value = None;
    while send || value.is_none() {
        let wc = wait_n(&side.cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        match wc.opcode {
            WcOpcode::Send => send = false,
            WcOpcode::Recv => value = Some(buf.read_u64(32).expect("read")),
            other => panic!("unexpected completion {other:?}"),
        }
    }
    value.unwrap_or_default()
}

#[test]
fn polling_mode_ping_pong_between_threads() {
    const ROUNDS: u64 = 200;
    let (a, b) = connected(ProgressMode::polling());
    let (a_buf, b_buf) = (a.alloc(64, AccessFlags::LOCAL_WRITE), b.alloc(64, AccessFlags::LOCAL_WRITE));
    a.post_recv(0, &a_buf, 32, 8);
    b.post_recv(0, &b_buf, 32, 8);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for round in 0..ROUNDS {
                a.qp.post_send(&SendWr::inline(round, SendOp::Send, &round.to_ne_bytes())).expect("ping");
                assert_eq!(await_round(&a, &a_buf, true), round + 1000, "reply to round {round}");
                a.post_recv(round + 1, &a_buf, 32, 8);
            }
        });
        scope.spawn(|| {
            for round in 0..ROUNDS {
                // The previous reply's SEND completion and this ping may arrive in either order.
                assert_eq!(await_round(&b, &b_buf, round > 0), round, "ping of round {round}");
                b.post_recv(round + 1, &b_buf, 32, 8);
                let reply = round + 1000;
                b.qp.post_send(&SendWr::inline(round, SendOp::Send, &reply.to_ne_bytes())).expect("pong");
            }
            await_round_send_only(&b);
        });
    });
}

fn await_round_send_only(side: &Side<SoftDevice>) {
    let wc = wait_n(&side.cq, 1)[0];
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send), "{wc:?}");
}

#[test]
fn opening_refusals_and_names() {
    let unspecified = SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
    assert!(
        matches!(SoftDevice::open(unspecified), Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::InvalidInput)
    );

    let first = common::open_device(|_| {});
    let again = SoftDevice::open(SoftConfig::with_addr(first.local_addr()));
    assert!(matches!(again, Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::AddrInUse));

    let addr = common::fresh_addr();
    let provider = SoftProvider { mode: ProgressMode::Thread, mtu: Mtu::Mtu4096 };
    let name = SoftConfig::with_addr(addr).device_name();
    let device = provider.open(&name).expect("open by name");
    assert_eq!(device.name(), name);
    assert_eq!(device.local_addr(), addr);
    assert_eq!(device.gid(), lightpath_verbs::Gid::from_ip(addr.ip()));
    assert_eq!(device.query_port(1).expect("port").active_mtu, Mtu::Mtu4096);
    assert!(matches!(provider.open("rxe0"), Err(Error::NotFound(_))));
}

#[test]
fn one_port_one_gid_and_own_queues_only() {
    let (dev_a, dev_b) = common::open_pair(ProgressMode::Thread);
    let pd = dev_a.alloc_pd().expect("pd");
    let cq = dev_a.create_cq(16).expect("cq");
    let foreign_cq = dev_b.create_cq(16).expect("cq");
    assert_refused_invalid(pd.create_qp(&cq, &foreign_cq, PairOptions::default().caps));

    let qp = pd.create_qp(&cq, &cq, PairOptions::default().caps).expect("qp");
    let mut init = QpAttr::to_init(AccessFlags::NONE);
    init.port_num = Some(2);
    assert_refused_invalid(qp.modify(&init));
    qp.modify(&QpAttr::to_init(AccessFlags::NONE)).expect("INIT");
    let av = AddressVector::new(dev_b.gid(), 1);
    assert_refused_invalid(qp.modify(&QpAttr::to_rtr(av, Mtu::Mtu1024, 0x11, 0)));
    assert!(dev_a.gids(2).is_err());
}

/// Polls `cq` until a completion with `opcode` arrives; fails on any other.
fn poll_for(cq: &lightpath_soft::SoftCq, opcode: WcOpcode) {
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 1];
    loop {
        if cq.poll(&mut out).expect("poll") == 1 {
            assert_eq!((out[0].status, out[0].opcode), (WcStatus::Success, opcode), "{:?}", out[0]);
            return;
        }
        assert!(std::time::Instant::now() < deadline, "no {opcode:?} completion");
    }
}

/// Polling mode with the helper thread kept out of the way, so only the test drives.
fn polling_without_helper() -> ProgressMode {
    ProgressMode::Polling { spin: Duration::from_micros(50), assist_after: Duration::from_secs(600) }
}

#[test]
fn polling_mode_shows_a_message_before_acknowledging_it() {
    let (a, b) = connected(polling_without_helper());
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, 8);
    a.qp.post_send(&SendWr::inline(2, SendOp::Send, b"ping....")).expect("ping");
    poll_for(&b.cq, WcOpcode::Recv);
    // The poll that found the message returned before B's engine produced the ACK…
    assert_eq!(b.device.stats().engine.acks_sent, 0);
    // …which goes out with B's next poll, empty as it is.
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 1];
    assert_eq!(b.cq.poll(&mut out).expect("poll"), 0);
    assert_eq!(b.device.stats().engine.acks_sent, 1);
    poll_for(&a.cq, WcOpcode::Send);
}

#[test]
fn polling_mode_sends_the_held_ack_with_the_reply() {
    let (a, b) = connected(polling_without_helper());
    let (a_inbox, b_inbox) = (a.alloc(64, AccessFlags::LOCAL_WRITE), b.alloc(64, AccessFlags::LOCAL_WRITE));
    a.post_recv(1, &a_inbox, 0, 8);
    b.post_recv(1, &b_inbox, 0, 8);
    a.qp.post_send(&SendWr::inline(2, SendOp::Send, b"ping....")).expect("ping");
    poll_for(&b.cq, WcOpcode::Recv);
    // Re-posting the receive sends nothing; the reply leaves with the ACK in one system call.
    b.post_recv(3, &b_inbox, 0, 8);
    let before = b.device.stats();
    assert_eq!(before.engine.acks_sent, 0);
    b.qp.post_send(&SendWr::inline(4, SendOp::Send, b"pong....")).expect("pong");
    let after = b.device.stats();
    assert_eq!(after.engine.tx_datagrams - before.engine.tx_datagrams, 2, "the reply and the ACK");
    assert_eq!(after.driver.tx_batches - before.driver.tx_batches, 1, "in one sendmmsg");
    assert_eq!(after.engine.acks_sent, 1);
    // A gets both: the ACK completes its SEND, the reply its receive (in either order).
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 2];
    while seen.len() < 2 {
        let n = a.cq.poll(&mut out).expect("poll");
        seen.extend(out[..n].iter().map(|wc| (wc.status, wc.opcode)));
        assert!(std::time::Instant::now() < deadline, "A saw only {seen:?}");
    }
    seen.sort_by_key(|&(_, opcode)| opcode == WcOpcode::Recv);
    assert_eq!(seen, [(WcStatus::Success, WcOpcode::Send), (WcStatus::Success, WcOpcode::Recv)]);
    let mut reply = [0u8; 8];
    a_inbox.read(0, &mut reply).expect("read");
    assert_eq!(&reply, b"pong....");
}

/// An event loop in polling mode sleeps on its queue's notification, which only a reader of
/// the socket can make: once it says so (`consumer_idle`, which the completions layer calls
/// before every such sleep), the helper thread reads the socket at once. Before, it stepped in
/// only after `assist_after` without a look (1 ms by default; 600 s here, so a message waited
/// past the deadline); a tokio client over soft in polling mode waited ~1.1 ms per request.
#[test]
fn polling_mode_reads_the_socket_for_an_event_loop_that_waits_on_its_notification() {
    let (a, b) = connected(polling_without_helper());
    let inbox = b.alloc(64, AccessFlags::LOCAL_WRITE);
    b.post_recv(1, &inbox, 0, 8);
    let fd = b.cq.notify_fd().expect("notification fd");
    for round in 0..3u64 {
        b.cq.request_notify().expect("arm");
        b.cq.consumer_idle();
        a.qp.post_send(&SendWr::inline(10 + round, SendOp::Send, b"request.")).expect("send");
        assert!(poll_readable(fd, DEADLINE), "round {round}: nobody read the socket for the event loop");
        assert!(b.cq.take_notify().expect("take"), "round {round}");
        let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 1];
        assert_eq!(b.cq.poll(&mut out).expect("poll"), 1, "round {round}");
        assert_eq!((out[0].status, out[0].opcode), (WcStatus::Success, WcOpcode::Recv));
        b.post_recv(2 + round, &inbox, 0, 8);
        poll_for(&a.cq, WcOpcode::Send);
    }
}

/// A 1 MiB WRITE between two devices with `udp_offload` as given; returns both devices' stats.
fn large_write(udp_offload: bool) -> (lightpath_soft::SoftStats, lightpath_soft::SoftStats) {
    let options = PairOptions::default();
    let configure = |config: &mut SoftConfig| {
        config.mtu = Mtu::Mtu4096;
        config.udp_offload = udp_offload;
    };
    let (a, b) = (common::open_device(configure), common::open_device(configure));
    let mtu = lightpath_verbs::conformance::harness::common_mtu(&a, &b);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    connect(&a.qp, &b.qp, mtu, &options);
    const LEN: usize = 1 << 20;
    let src = a.alloc(LEN, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(LEN, 9)).expect("fill");
    let target = b.alloc(LEN, MR_ALL);
    let remote = target.remote();
    let op = SendOp::Write { remote_addr: remote.addr, rkey: remote.rkey };
    a.qp.post_send(&SendWr::new(1, op, &[src.sge(0, LEN as u32)])).expect("write");
    assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
    let mut data = vec![0u8; LEN];
    target.read(0, &mut data).expect("read");
    assert!(data == pattern(LEN, 9), "the written bytes differ");
    (a.device.stats(), b.device.stats())
}

#[test]
fn loopback_writes_ride_segmented_messages() {
    let (sender, receiver) = large_write(true);
    assert!(sender.driver.tx_segmented > 0, "{sender:#?}");
    assert!(receiver.driver.rx_coalesced > 0, "{receiver:#?}");
    assert_eq!(sender.driver.segmentation_failures, 0);
    assert_eq!(receiver.total_drops(), 0, "{receiver:#?}");
    // 256 datagrams in far fewer system calls.
    assert!(receiver.driver.rx_batches < 128, "{receiver:#?}");

    let (sender, receiver) = large_write(false);
    assert_eq!((sender.driver.tx_segmented, receiver.driver.rx_coalesced), (0, 0));
}

#[test]
fn progress_thread_watches_the_socket_again_after_a_wait() {
    // No retransmit timers: B's progress thread has nothing to wake it but datagrams (while it
    // watches the socket) and its eventfd.
    let options = PairOptions { timeout: 0, ..PairOptions::default() };
    let (a, b) = common::open_pair(ProgressMode::Thread);
    let mtu = lightpath_verbs::conformance::harness::common_mtu(&a, &b);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    connect(&a.qp, &b.qp, mtu, &options);
    let inbox = b.alloc(64, MR_ALL);
    b.post_recv(1, &inbox, 0, 8);
    b.post_recv(2, &inbox, 8, 8);
    std::thread::scope(|scope| {
        // A thread of B waits for the first message, watching the socket itself…
        let waiter = scope.spawn(|| wait_n(&b.cq, 1)[0]);
        // …while a WRITE (no completion at B) wakes B's progress thread, which then leaves the
        // socket to the waiter.
        let remote = inbox.remote();
        let op = SendOp::Write { remote_addr: remote.addr + 32, rkey: remote.rkey };
        a.qp.post_send(&SendWr::inline(9, op, b"written.")).expect("write");
        assert_eq!(wait_n(&a.cq, 1)[0].status, WcStatus::Success);
        a.qp.post_send(&SendWr::inline(1, SendOp::Send, b"first...")).expect("send");
        let wc = waiter.join().expect("waiter");
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    });
    // Nobody waits any more: the second message must be taken in by the progress thread,
    // which shows on the completion fd.
    let fd = b.cq.notify_fd().expect("notification fd");
    b.cq.request_notify().expect("arm");
    a.qp.post_send(&SendWr::inline(2, SendOp::Send, b"second..")).expect("send");
    assert!(poll_readable(fd, DEADLINE), "nobody received the second message");
    let mut out = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 2];
    assert_eq!(b.cq.poll(&mut out).expect("poll"), 1);
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    assert_eq!(wait_n(&a.cq, 2).len(), 2, "both SENDs acknowledged");
}
