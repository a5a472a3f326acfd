//! Cases: queue limits and traffic patterns (full queues, PSN wrap-around, many queue pairs on
//! one completion queue).

use crate::conformance::harness::{
    assert_refused, assert_success, connect, pattern, read_region, wait_n, Pair, PairOptions,
    FULL_REMOTE_ACCESS, MR_ALL,
};
use crate::conformance::ConformanceFixture;
use crate::{
    AccessFlags, CompletionQueue, Device, Error, MemoryRegion, ProtectionDomain, QpAttr, QpCaps, QueuePair,
    SendOp, SendWr, WcOpcode,
};

fn small_queues() -> PairOptions {
    let caps = QpCaps { max_send_wr: 8, max_recv_wr: 8, ..QpCaps::default() };
    PairOptions { caps, ..PairOptions::default() }
}

/// Posting one receive more than `max_recv_wr` is refused with `QueueFull`.
pub fn recv_queue_full<F: ConformanceFixture>() {
    let pair = Pair::unconnected_with::<F>(&small_queues());
    let qp = &pair.a.qp;
    let depth = qp.caps().max_recv_wr;
    assert!(depth >= 8, "granted max_recv_wr {depth} below the 8 requested");
    let mr = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    qp.modify(&QpAttr::to_init(FULL_REMOTE_ACCESS)).expect("to INIT");
    for wr_id in 0..u64::from(depth) {
        pair.a.post_recv(wr_id, &mr, 0, 64);
    }
    let sge = [mr.sge(0, 64)];
    assert_refused(qp.post_recv(&crate::RecvWr::new(999, &sge)), "one receive too many", |e| {
        matches!(e, Error::QueueFull)
    });
}

/// Posting one send more than `max_send_wr` while all are outstanding (held up by RNR: the
/// peer has no receive yet) is refused with `QueueFull`; once the peer posts receives every
/// request completes.
pub fn send_queue_full<F: ConformanceFixture>() {
    let pair = Pair::connected_with::<F>(&small_queues());
    let depth = pair.a.qp.caps().max_send_wr;
    assert!(depth >= 8, "granted max_send_wr {depth} below the 8 requested");
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(64 * depth as usize, AccessFlags::LOCAL_WRITE);
    let sge = [src.sge(0, 64)];
    for wr_id in 0..u64::from(depth) {
        pair.a.qp.post_send(&SendWr::new(wr_id, SendOp::Send, &sge)).expect("post_send within depth");
    }
    assert_refused(pair.a.qp.post_send(&SendWr::new(999, SendOp::Send, &sge)), "one send too many", |e| {
        matches!(e, Error::QueueFull)
    });
    // The receiver's queue is as deep as the sender's, so all receives fit.
    for wr_id in 0..u64::from(depth) {
        pair.b.post_recv(wr_id, &inbox, 64 * wr_id as usize, 64);
    }
    for (i, wc) in wait_n(&pair.a.cq, depth as usize).iter().enumerate() {
        assert_success(wc, i as u64, WcOpcode::Send);
    }
    for (i, wc) in wait_n(&pair.b.cq, depth as usize).iter().enumerate() {
        assert_success(wc, i as u64, WcOpcode::Recv);
    }
}

/// Both directions start at PSN 0xFFFFF0 and exchange multi-packet SENDs and READs until the
/// PSNs have wrapped past zero.
pub fn psn_wrap<F: ConformanceFixture>() {
    let options = PairOptions { a_psn: 0xFF_FFF0, b_psn: 0xFF_FFF0, ..PairOptions::default() };
    let pair = Pair::connected_with::<F>(&options);
    let len = 2 * pair.mtu.bytes() as usize + 1;
    let a_mem = pair.a.alloc(len, MR_ALL);
    let b_mem = pair.b.alloc(len, MR_ALL);
    for round in 0..12u8 {
        // A → B SEND (3 packets), B → A SEND, then A READs B's buffer (3 response packets).
        let data = pattern(len, round);
        a_mem.write(0, &data).expect("fill");
        pair.b.post_recv(u64::from(round), &b_mem, 0, len as u32);
        pair.a
            .qp
            .post_send(&SendWr::new(u64::from(round), SendOp::Send, &[a_mem.sge(0, len as u32)]))
            .expect("send");
        assert_success(&pair.b.wait_one(), u64::from(round), WcOpcode::Recv);
        assert_success(&pair.a.wait_one(), u64::from(round), WcOpcode::Send);
        assert_eq!(read_region(&b_mem, 0, len), data, "round {round}: A→B");

        let reply = pattern(len, round.wrapping_add(100));
        b_mem.write(0, &reply).expect("fill");
        pair.a.post_recv(500 + u64::from(round), &a_mem, 0, len as u32);
        pair.b.qp.post_send(&SendWr::new(7, SendOp::Send, &[b_mem.sge(0, len as u32)])).expect("send back");
        assert_success(&pair.a.wait_one(), 500 + u64::from(round), WcOpcode::Recv);
        assert_success(&pair.b.wait_one(), 7, WcOpcode::Send);
        assert_eq!(read_region(&a_mem, 0, len), reply, "round {round}: B→A");

        a_mem.write(0, &vec![0u8; len]).expect("clear");
        let remote = b_mem.remote();
        let op = SendOp::Read { remote_addr: remote.addr, rkey: remote.rkey };
        pair.a.qp.post_send(&SendWr::new(900, op, &[a_mem.sge(0, len as u32)])).expect("read");
        assert_success(&pair.a.wait_one(), 900, WcOpcode::RdmaRead);
        assert_eq!(read_region(&a_mem, 0, len), reply, "round {round}: READ");
    }
}

/// Eight queue pairs per side share one completion queue per side; each completion names the
/// queue pair it belongs to and each message arrives on the right one.
pub fn many_qps_one_cq<F: ConformanceFixture>() {
    const QPS: usize = 8;
    let options = PairOptions::default();
    let (dev_a, dev_b) = F::open_pair();
    let mtu = crate::conformance::harness::common_mtu(&dev_a, &dev_b);
    let (pd_a, pd_b) = (dev_a.alloc_pd().expect("pd"), dev_b.alloc_pd().expect("pd"));
    let (cq_a, cq_b) = (dev_a.create_cq(256).expect("cq"), dev_b.create_cq(256).expect("cq"));
    let qps: Vec<_> = (0..QPS)
        .map(|_| {
            let a = pd_a.create_qp(&cq_a, &cq_a, options.caps).expect("qp");
            let b = pd_b.create_qp(&cq_b, &cq_b, options.caps).expect("qp");
            connect(&a, &b, mtu, &options);
            (a, b)
        })
        .collect();
    let src = pd_a.alloc_mr(QPS * 64, AccessFlags::LOCAL_WRITE).expect("mr");
    let dst = pd_b.alloc_mr(QPS * 64, AccessFlags::LOCAL_WRITE).expect("mr");
    for (i, (a, b)) in qps.iter().enumerate() {
        src.write(i * 64, &pattern(64, i as u8)).expect("fill");
        b.post_recv(&crate::RecvWr::new(i as u64, &[dst.sge(i * 64, 64)])).expect("post_recv");
        a.post_send(&SendWr::new(i as u64, SendOp::Send, &[src.sge(i * 64, 64)])).expect("post_send");
    }
    let mut received = wait_n(&cq_b, QPS);
    received.sort_by_key(|wc| wc.wr_id);
    for (i, wc) in received.iter().enumerate() {
        assert_success(wc, i as u64, WcOpcode::Recv);
        assert_eq!(wc.qp_num, qps[i].1.qpn(), "{wc:?}");
        assert_eq!(wc.src_qp, qps[i].0.qpn(), "{wc:?}");
        assert_eq!(read_region(&dst, i * 64, 64), pattern(64, i as u8));
    }
    let mut sent = wait_n(&cq_a, QPS);
    sent.sort_by_key(|wc| wc.wr_id);
    for (i, wc) in sent.iter().enumerate() {
        assert_success(wc, i as u64, WcOpcode::Send);
        assert_eq!(wc.qp_num, qps[i].0.qpn(), "{wc:?}");
    }
    let mut spare = [crate::WorkCompletion::new(0, crate::WcStatus::Success, WcOpcode::Send, 0); 4];
    assert_eq!(cq_a.poll(&mut spare).expect("poll"), 0);
}
