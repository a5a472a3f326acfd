//! The queue-pair state machine: refusals, flushing on ERR, RESET and reuse, SQD, and the
//! resource-lifetime rules around it.

mod common;

use common::*;
use lightpath_roce::{EngineEvent, Time};
use lightpath_verbs::{AddressVector, Error, Gid, Mtu, QpAttr, QpCaps, QpState, RecvWr, SendOp, WcStatus};

#[test]
fn posting_is_refused_before_the_queue_pair_is_ready() {
    let mut net = Net::new(2);
    let opts = Opts::default();
    let e = &mut net.engines[0];
    let cq = e.create_cq(16).unwrap();
    let qpn = e.create_qp(cq, cq, QpCaps::default()).unwrap();
    let wr = send_wr(1, SendOp::Send, &[]);
    assert!(matches!(e.post_send(Time::ZERO, qpn, &wr), Err(Error::InvalidState(QpState::Reset))));
    assert!(matches!(e.post_recv(qpn, &RecvWr::new(1, &[])), Err(Error::InvalidState(QpState::Reset))));
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(opts.access)).unwrap();
    assert!(matches!(e.post_send(Time::ZERO, qpn, &wr), Err(Error::InvalidState(QpState::Init))));
    e.post_recv(qpn, &RecvWr::new(1, &[])).unwrap(); // receives may be posted from INIT on
    let av = AddressVector::new(Gid::from_ip(ip(1)), 0);
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x11, 0)).unwrap();
    assert!(matches!(e.post_send(Time::ZERO, qpn, &wr), Err(Error::InvalidState(QpState::Rtr))));
    assert!(matches!(e.post_send(Time::ZERO, 0x999, &wr), Err(Error::NotFound(_))));
}

#[test]
fn transitions_are_checked_and_refusals_change_nothing() {
    let mut net = Net::new(2);
    let e = &mut net.engines[0];
    let cq = e.create_cq(16).unwrap();
    let qpn = e.create_qp(cq, cq, QpCaps::default()).unwrap();
    let av = AddressVector::new(Gid::from_ip(ip(1)), 0);
    // Skipping INIT.
    let rtr = QpAttr::to_rtr(av, Mtu::Mtu1024, 0x11, 0);
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &rtr), Err(Error::InvalidTransition { .. })));
    assert_eq!(e.qp_state(qpn).unwrap(), QpState::Reset);
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(rw())).unwrap();
    // Missing attribute, out-of-range values, and what this engine cannot do.
    let mut missing = rtr;
    missing.path_mtu = None;
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &missing), Err(Error::MissingAttribute { .. })));
    let mut bad = rtr;
    bad.av = Some(AddressVector::new(Gid::from_ip(ip(1)), 1));
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &bad), Err(Error::InvalidAttribute(_))));
    bad.av = Some(AddressVector::new("fe80::1".parse().unwrap(), 0));
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &bad), Err(Error::InvalidAttribute(_))));
    let mut deep = rtr;
    deep.max_dest_rd_atomic = Some(200);
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &deep), Err(Error::InvalidAttribute(_))));
    assert_eq!(e.qp_state(qpn).unwrap(), QpState::Init);
    e.modify_qp(Time::ZERO, qpn, &rtr).unwrap();
    // RTR → SQD is not a transition; RTS → SQE is UC/UD only; the path MTU is fixed at RTR.
    let mut mtu_change = QpAttr::to_rts(0);
    mtu_change.path_mtu = Some(Mtu::Mtu4096);
    assert!(matches!(e.modify_qp(Time::ZERO, qpn, &mtu_change), Err(Error::InvalidAttribute(_))));
    assert!(e.modify_qp(Time::ZERO, qpn, &QpAttr::state(QpState::Sqd)).is_err());
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(0)).unwrap();
    assert!(e.modify_qp(Time::ZERO, qpn, &QpAttr::state(QpState::Sqe)).is_err());
    // ERR goes only to RESET.
    e.modify_qp(Time::ZERO, qpn, &QpAttr::state(QpState::Err)).unwrap();
    assert!(e.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(0)).is_err());
    e.modify_qp(Time::ZERO, qpn, &QpAttr::state(QpState::Reset)).unwrap();
    assert_eq!(e.qp_state(qpn).unwrap(), QpState::Reset);
}

#[test]
fn modify_to_err_flushes_everything_in_order() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let buf = reg(&mut net, 0, vec![0; 64], 0x1000, rw());
    post_recv(&mut net, c.a, 100, &[buf.all()]);
    post_recv(&mut net, c.a, 101, &[buf.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[buf.sge(0, 8)]));
    post_send(
        &mut net,
        c.a,
        &send_wr(2, SendOp::Read { remote_addr: 0, rkey: 0 }, &[buf.sge(0, 8)]).with_flags(unsignaled()),
    );
    let now = net.now;
    net.engines[0].modify_qp(now, c.a.qpn, &QpAttr::state(QpState::Err)).unwrap();
    let sent: Vec<_> = poll_all(&mut net, 0, c.a.send_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(sent, vec![(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]);
    let recv: Vec<_> = poll_all(&mut net, 0, c.a.recv_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(recv, vec![(100, WcStatus::WrFlushErr), (101, WcStatus::WrFlushErr)]);
    // New work is accepted and flushed at once; nothing is ever transmitted.
    post_send(&mut net, c.a, &send_wr(3, SendOp::Send, &[]));
    post_recv(&mut net, c.a, 102, &[]);
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::WrFlushErr);
    assert_eq!(poll_all(&mut net, 0, c.a.recv_cq)[0].wr_id, 102);
    net.run();
    assert!(net.trace.is_empty());
    // A modify_qp to ERR is the application's own doing: no QpError event.
    let events: Vec<_> = std::iter::from_fn(|| net.engines[0].poll_event()).collect();
    assert!(events.iter().all(|e| matches!(e, EngineEvent::Completion(_))));
}

#[test]
fn reset_clears_and_the_queue_pair_can_be_reconnected() {
    let mut net = Net::new(2);
    let opts = Opts::default();
    let c = connect(&mut net, 0, 1, &opts);
    let src = reg(&mut net, 0, pattern(2000, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 2000], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    poll_all(&mut net, 0, c.a.send_cq);
    poll_all(&mut net, 1, c.b.recv_cq);
    // Queue something that never goes out, then RESET both ends: no completions appear.
    post_recv(&mut net, c.b, 2, &[dst.all()]);
    let now = net.now;
    for end in [c.a, c.b] {
        net.engines[end.engine].modify_qp(now, end.qpn, &QpAttr::state(QpState::Reset)).unwrap();
        net.engines[end.engine].modify_qp(now, end.qpn, &QpAttr::to_init(opts.access)).unwrap();
    }
    assert!(poll_all(&mut net, 1, c.b.recv_cq).is_empty());
    // Reconnect with fresh PSNs (MSN restarts at 0) and transfer again.
    bring_up(&mut net, c.a, c.b, 0x50_0000, 0x70_0000, &opts);
    bring_up(&mut net, c.b, c.a, 0x70_0000, 0x50_0000, &opts);
    post_recv(&mut net, c.b, 3, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(4, SendOp::Send, &[src.sge(0, 1500)]));
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq)[0].wr_id, 3);
    let last_ack =
        net.trace.iter().rev().find(|s| s.opcode == lightpath_wire::Opcode::RC_ACKNOWLEDGE).unwrap();
    assert_eq!((last_ack.psn, last_ack.msn), (0x70_0001, Some(1)));
}

#[test]
fn sqd_stops_new_requests_until_back_in_rts() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(64, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 64], 0x2000, rw());
    let now = net.now;
    net.engines[0].modify_qp(now, c.a.qpn, &QpAttr::state(QpState::Sqd)).unwrap();
    let write = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, write, &[src.all()]));
    net.run();
    assert!(net.trace.is_empty());
    // The responder side keeps working in SQD.
    let b_src = reg(&mut net, 1, pattern(32, 2), 0x3000, rw());
    let a_dst = reg(&mut net, 0, vec![0; 32], 0x4000, rw());
    post_recv(&mut net, c.a, 9, &[a_dst.all()]);
    post_send(&mut net, c.b, &send_wr(9, SendOp::Send, &[b_src.all()]));
    net.run();
    assert_eq!(a_dst.contents(), pattern(32, 2));
    net.engines[0].modify_qp(now, c.a.qpn, &QpAttr::state(QpState::Rts)).unwrap();
    net.run();
    assert_eq!(dst.contents(), pattern(64, 1));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].wr_id, 1);
}

#[test]
fn resources_and_limits() {
    let mut net = Net::new(1);
    let e = &mut net.engines[0];
    let cq = e.create_cq(2).unwrap();
    assert!(e.create_cq(0).is_err());
    let qpn = e.create_qp(cq, cq, QpCaps { max_send_wr: 2, ..QpCaps::default() }).unwrap();
    assert!(matches!(e.destroy_cq(cq), Err(Error::Busy(_))));
    let too_many_sges = QpCaps { max_send_sge: 1000, ..QpCaps::default() };
    assert!(e.create_qp(cq, cq, too_many_sges).is_err());
    assert!(e.create_qp(lightpath_roce::CqHandle(0xABCD), cq, QpCaps::default()).is_err());
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(rw())).unwrap();
    let av = AddressVector::new(Gid::from_ip(ip(1)), 0);
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x11, 0)).unwrap();
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(0)).unwrap();
    // Atomics need exactly 8 local bytes; READs and atomics cannot be inline.
    let sge = [lightpath_verbs::Sge { addr: 0, length: 4, lkey: 1 }];
    let fadd = send_wr(1, SendOp::FetchAdd { remote_addr: 0, rkey: 0, add: 1 }, &sge);
    assert!(matches!(e.post_send(Time::ZERO, qpn, &fadd), Err(Error::InvalidAttribute(_))));
    let inline_read = lightpath_verbs::SendWr::inline(1, SendOp::Read { remote_addr: 0, rkey: 0 }, b"x");
    assert!(matches!(e.post_send(Time::ZERO, qpn, &inline_read), Err(Error::InvalidAttribute(_))));
    // Messages are limited to 2^31 bytes.
    let huge = [lightpath_verbs::Sge { addr: 0, length: u32::MAX, lkey: 1 }];
    assert!(matches!(
        e.post_send(Time::ZERO, qpn, &send_wr(1, SendOp::Send, &huge)),
        Err(Error::TooLarge(_))
    ));
    // The send queue holds max_send_wr requests.
    let wr = send_wr(1, SendOp::Send, &[]);
    e.post_send(Time::ZERO, qpn, &wr).unwrap();
    e.post_send(Time::ZERO, qpn, &wr).unwrap();
    assert!(matches!(e.post_send(Time::ZERO, qpn, &wr), Err(Error::QueueFull)));
    e.destroy_qp(qpn).unwrap();
    assert!(e.qp_state(qpn).is_err());
    e.destroy_cq(cq).unwrap();
}

#[test]
fn cq_overflow_is_counted() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { cq_size: 2, ..Opts::default() });
    for i in 0..5 {
        post_send(&mut net, c.a, &send_wr(i, SendOp::Write { remote_addr: 0, rkey: 0 }, &[]));
    }
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq).len(), 2);
    assert_eq!(net.engines[0].stats().cq_overflows, 3);
}

#[test]
fn qp_numbers_look_like_rxe_and_are_not_reused_at_once() {
    let mut net = Net::new(1);
    let e = &mut net.engines[0];
    let cq = e.create_cq(4).unwrap();
    let first = e.create_qp(cq, cq, QpCaps::default()).unwrap();
    assert_eq!(first, 0x11);
    e.destroy_qp(first).unwrap();
    let second = e.create_qp(cq, cq, QpCaps::default()).unwrap();
    assert_ne!(second, first);
    assert!(e.qp_state(first).is_err());
}

/// With `set_qp_news` on, every completion also queues a `QpNews` naming its queue pair (an
/// arrival for a receive, not for the acknowledgement of a SEND), after the queue's own
/// `Completion` event; with it off (the default), none.
#[test]
fn qp_news_follow_each_completion_when_asked_for() {
    let mut net = Net::new(2);
    let opts = Opts::default();
    let c = connect(&mut net, 0, 1, &opts);
    let src = reg(&mut net, 0, pattern(64, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 64], 0x2000, rw());
    // Off: only the queue events.
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    for engine in 0..2 {
        let events: Vec<_> = std::iter::from_fn(|| net.engines[engine].poll_event()).collect();
        assert!(events.iter().all(|e| matches!(e, EngineEvent::Completion(_))), "{events:?}");
    }
    poll_all(&mut net, 0, c.a.send_cq);
    poll_all(&mut net, 1, c.b.recv_cq);
    // On: each completion is followed by its news.
    net.engines[0].set_qp_news(true);
    net.engines[1].set_qp_news(true);
    post_recv(&mut net, c.b, 2, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[src.all()]));
    net.run();
    let sender: Vec<_> = std::iter::from_fn(|| net.engines[0].poll_event()).collect();
    assert_eq!(
        sender,
        [EngineEvent::Completion(c.a.send_cq), EngineEvent::QpNews { qpn: c.a.qpn, arrival: false }]
    );
    let receiver: Vec<_> = std::iter::from_fn(|| net.engines[1].poll_event()).collect();
    assert_eq!(
        receiver,
        [EngineEvent::Completion(c.b.recv_cq), EngineEvent::QpNews { qpn: c.b.qpn, arrival: true }]
    );
    // A completion added while the queue's event is still pending queues its news only.
    for id in [3, 4] {
        post_recv(&mut net, c.b, id, &[dst.all()]);
        post_send(&mut net, c.a, &send_wr(id, SendOp::Send, &[src.all()]));
    }
    net.run();
    let news = EngineEvent::QpNews { qpn: c.b.qpn, arrival: true };
    let receiver: Vec<_> = std::iter::from_fn(|| net.engines[1].poll_event()).collect();
    assert_eq!(receiver, [EngineEvent::Completion(c.b.recv_cq), news, news]);
}
