//! Cases: waiting on a completion queue (blocking wait, the notification protocol) and
//! tearing objects down in any order.

use std::time::{Duration, Instant};

use crate::conformance::harness::{
    assert_success, connect, pattern, read_region, wait_n, Pair, PairOptions, DEADLINE,
};
use crate::conformance::ConformanceFixture;
use crate::{
    AccessFlags, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpAttr, QpState, QueuePair, SendOp,
    SendWr, WcOpcode, WcStatus, WorkCompletion,
};

fn empty_buf() -> [WorkCompletion; 4] {
    [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4]
}

/// A thread blocked in `wait` wakes when a completion arrives; `wait` on an empty queue returns
/// 0 when its timeout passes.
pub fn cq_wait_wakes<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    let mut buf = empty_buf();
    assert_eq!(pair.b.cq.wait(&mut buf, Duration::from_millis(5)).expect("wait"), 0);

    pair.b.post_recv(1, &inbox, 0, 4096);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let mut buf = empty_buf();
            let count = pair.b.cq.wait(&mut buf, DEADLINE).expect("wait");
            buf[..count].to_vec()
        });
        // Give the waiter time to block first (it works either way; this makes the blocked path
        // the likely one).
        std::thread::sleep(Duration::from_millis(20));
        pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 100)])).expect("post_send");
        let woke_with = waiter.join().expect("waiter thread");
        assert_eq!(woke_with.len(), 1, "waiter returned {woke_with:?}");
        assert_success(&woke_with[0], 1, WcOpcode::Recv);
    });
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);
}

/// Many threads blocked in `wait` on one device at once, as a server with a thread per
/// connection has them: each gets every completion of its own queue. (Providers may let only
/// one waiter drive the device and wake the others; a waiter never woken fails here at the
/// deadline instead of hanging.)
pub fn cq_wait_many_blocked_threads<F: ConformanceFixture>() {
    const CONNECTIONS: usize = 24;
    const ROUNDS: u64 = 50;
    let pair = Pair::connected::<F>();
    let options = PairOptions::default();
    let ends: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let end = |side: &crate::conformance::harness::Side<F::Device>| {
                let cq = side.device.create_cq(64).expect("create_cq");
                let qp = side.pd.create_qp(&cq, &cq, options.caps).expect("create_qp");
                let mr = side.alloc(64, AccessFlags::LOCAL_WRITE);
                (qp, cq, mr)
            };
            let (client, server) = (end(&pair.a), end(&pair.b));
            connect(&client.0, &server.0, pair.mtu, &options);
            (client, server)
        })
        .collect();
    std::thread::scope(|scope| {
        for (i, ((client_qp, client_cq, client_mr), (server_qp, server_cq, server_mr))) in
            ends.iter().enumerate()
        {
            // Server: receive a word, send it back plus one; every wait blocks.
            scope.spawn(move || {
                for _ in 0..ROUNDS {
                    server_qp.post_recv(&crate::RecvWr::new(1, &[server_mr.sge(0, 8)])).expect("post_recv");
                    assert_success(&wait_n(server_cq, 1)[0], 1, WcOpcode::Recv);
                    let value = server_mr.read_u64(0).expect("read");
                    server_mr.write_u64(8, value + 1).expect("write");
                    server_qp
                        .post_send(&SendWr::new(2, SendOp::Send, &[server_mr.sge(8, 8)]))
                        .expect("post_send");
                    assert_success(&wait_n(server_cq, 1)[0], 2, WcOpcode::Send);
                }
            });
            // Client: ping-pong, checking every answer.
            scope.spawn(move || {
                for round in 0..ROUNDS {
                    let value = (i as u64) << 32 | round;
                    client_qp.post_recv(&crate::RecvWr::new(3, &[client_mr.sge(8, 8)])).expect("post_recv");
                    client_mr.write_u64(0, value).expect("write");
                    client_qp
                        .post_send(&SendWr::new(4, SendOp::Send, &[client_mr.sge(0, 8)]))
                        .expect("post_send");
                    let mut got = wait_n(client_cq, 2);
                    got.sort_by_key(|wc| wc.wr_id);
                    assert_success(&got[0], 3, WcOpcode::Recv);
                    assert_success(&got[1], 4, WcOpcode::Send);
                    assert_eq!(
                        client_mr.read_u64(8).expect("read"),
                        value + 1,
                        "connection {i} round {round}"
                    );
                }
            });
        }
    });
}

/// The notification protocol: after `request_notify` the next completion raises exactly one
/// notification; without a request, none is raised.
pub fn cq_notify<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    if let Some(fd) = pair.b.cq.notify_fd() {
        assert!(fd >= 0, "notify_fd {fd}");
    }
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    let cq = &pair.b.cq;
    cq.request_notify().expect("request_notify");
    let mut buf = empty_buf();
    assert_eq!(cq.poll(&mut buf).expect("poll"), 0);
    assert!(!cq.take_notify().expect("take_notify"), "notification without a completion");

    pair.b.post_recv(1, &inbox, 0, 4096);
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 10)])).expect("post_send");
    let (notified, got) = poll_until_notified(cq);
    assert!(notified, "no notification within {DEADLINE:?}");
    assert_eq!(got.len(), 1, "{got:?}");
    assert_success(&got[0], 1, WcOpcode::Recv);
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);

    // Not re-armed: the next completion raises nothing.
    pair.b.post_recv(3, &inbox, 0, 4096);
    pair.a.qp.post_send(&SendWr::new(4, SendOp::Send, &[src.sge(0, 10)])).expect("post_send");
    assert_success(&wait_n(cq, 1)[0], 3, WcOpcode::Recv);
    assert!(!cq.take_notify().expect("take_notify"), "notification although not armed");
    assert_success(&pair.a.wait_one(), 4, WcOpcode::Send);
}

/// Polls `cq` (which lets providers without a progress thread make progress) until a
/// notification is taken and a completion has arrived, or the deadline passes.
fn poll_until_notified<C: CompletionQueue>(cq: &C) -> (bool, Vec<WorkCompletion>) {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    let mut notified = false;
    while (!notified || got.is_empty()) && Instant::now() < deadline {
        notified |= cq.take_notify().expect("take_notify");
        let mut buf = empty_buf();
        let count = cq.poll(&mut buf).expect("poll");
        got.extend_from_slice(&buf[..count]);
        if count == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    (notified, got)
}

/// Objects keep what they depend on alive: with the devices and protection domains dropped
/// first, connected queue pairs still carry traffic; a queue pair outlives its dropped
/// completion queue handle; and dropping a queue pair before its queue is fine.
pub fn teardown_any_order<F: ConformanceFixture>() {
    let options = PairOptions::default();
    let (dev_a, dev_b) = F::open_pair();
    let mtu = crate::conformance::harness::common_mtu(&dev_a, &dev_b);
    let (pd_a, pd_b) = (dev_a.alloc_pd().expect("pd"), dev_b.alloc_pd().expect("pd"));
    let (cq_a, cq_b) = (dev_a.create_cq(64).expect("cq"), dev_b.create_cq(64).expect("cq"));
    let qp_a = pd_a.create_qp(&cq_a, &cq_a, options.caps).expect("qp");
    let qp_b = pd_b.create_qp(&cq_b, &cq_b, options.caps).expect("qp");
    let src = pd_a.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("mr");
    let dst = pd_b.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("mr");

    // A queue pair whose completion queue handle is dropped right away.
    let lone_cq = dev_a.create_cq(16).expect("cq");
    let lone_qp = pd_a.create_qp(&lone_cq, &lone_cq, options.caps).expect("qp");
    drop(lone_cq);

    drop((pd_a, pd_b, dev_a, dev_b));
    connect(&qp_a, &qp_b, mtu, &options);
    src.write(0, &pattern(100, 1)).expect("fill");
    qp_b.post_recv(&crate::RecvWr::new(1, &[dst.sge(0, 4096)])).expect("post_recv");
    qp_a.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 100)])).expect("post_send");
    assert_success(&wait_n(&cq_b, 1)[0], 1, WcOpcode::Recv);
    assert_success(&wait_n(&cq_a, 1)[0], 2, WcOpcode::Send);
    assert_eq!(read_region(&dst, 0, 100), pattern(100, 1));

    lone_qp.modify(&QpAttr::to_init(AccessFlags::NONE)).expect("modify with its CQ handle gone");
    lone_qp.modify(&QpAttr::state(QpState::Err)).expect("to ERR");
    drop(lone_qp);
    drop(qp_a);
    drop(src);
    drop(cq_a);
    drop((qp_b, dst, cq_b));
}
