//! The Lightpath path-MTU extension (`QpAttr::lightpath_pmtu`): between two Lightpath soft
//! devices a path MTU of any size from 256 to 32 KiB, such as 1408 bytes on a 1500-byte
//! Ethernet link or 32 KiB on loopback. Every operation moves its bytes in
//! `ceil(len / pmtu)` packets and survives loss; the attribute is refused out of range, after
//! RTR and towards a peer that is not a Lightpath soft device.

mod common;

use common::*;
use lightpath_roce::Time;
use lightpath_verbs::{
    AddressVector, Error, Gid, Mtu, QpAttr, QpState, SendOp, WcOpcode, WcStatus, MAX_LIGHTPATH_PMTU,
};
use lightpath_wire::Opcode;

/// 1408: a 1500-byte link; 8896: a 9000-byte one; 32 KiB: loopback.
const PMTUS: [u32; 3] = [1408, 8896, MAX_LIGHTPATH_PMTU];

fn opts(pmtu: u32) -> Opts {
    Opts { lightpath_pmtu: Some(pmtu), mtu: Mtu::Mtu1024, ..Opts::default() }
}

fn sizes(pmtu: u32) -> Vec<usize> {
    let p = pmtu as usize;
    vec![0, 1, p - 1, p, p + 1, 3 * p + 17]
}

#[test]
fn send_write_and_read_use_the_larger_mtu() {
    for pmtu in PMTUS {
        for len in sizes(pmtu) {
            let mut net = Net::new(2);
            let c = connect(&mut net, 0, 1, &opts(pmtu));
            let packets = len.div_ceil(pmtu as usize).max(1);

            // SEND into a receive buffer.
            let src = reg(&mut net, 0, pattern(len, 7), 0x1000, rw());
            let dst = reg(&mut net, 1, vec![0; len + 8], 0x10_0000, rw());
            post_recv(&mut net, c.b, 42, &[dst.all()]);
            post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
            net.run();
            let got = poll_all(&mut net, 1, c.b.recv_cq);
            assert_eq!((got.len(), got[0].status, got[0].byte_len as usize), (1, WcStatus::Success, len));
            assert_eq!(&dst.contents()[..len], &pattern(len, 7)[..], "pmtu {pmtu} len {len}");
            assert_eq!(net.trace.iter().filter(|s| s.from == 0).count(), packets, "pmtu {pmtu} len {len}");
            assert!(net.trace.iter().filter(|s| s.from == 0).all(|s| s.payload_len <= pmtu as usize));

            // RDMA WRITE with immediate, then RDMA READ of the same bytes back.
            net.trace.clear();
            let wdst = reg(&mut net, 1, vec![0; len + 16], 0x7000_0000, rw());
            let op = SendOp::WriteWithImm { remote_addr: wdst.addr + 8, rkey: wdst.keys.rkey, imm: 0xfeed };
            let src2 = reg(&mut net, 0, pattern(len, 3), 0x40_0000, rw());
            post_recv(&mut net, c.b, 43, &[]);
            post_send(&mut net, c.a, &send_wr(2, op, &[src2.all()]));
            net.run();
            assert_eq!(&wdst.contents()[8..8 + len], &pattern(len, 3)[..], "pmtu {pmtu} len {len}");
            assert!(wdst.mem.guards_intact());
            assert_eq!(net.trace.iter().filter(|s| s.from == 0).count(), packets);
            let back = reg(&mut net, 0, vec![0; len], 0x80_0000, rw());
            net.trace.clear();
            let read = SendOp::Read { remote_addr: wdst.addr + 8, rkey: wdst.keys.rkey };
            post_send(&mut net, c.a, &send_wr(3, read, &[back.all()]));
            net.run();
            assert_eq!(back.contents(), pattern(len, 3), "pmtu {pmtu} len {len}");
            assert_eq!(net.trace.iter().filter(|s| s.from == 1).count(), packets, "read responses");
            let sent = poll_all(&mut net, 0, c.a.send_cq);
            let statuses: Vec<_> = sent.iter().map(|wc| (wc.wr_id, wc.status, wc.opcode)).collect();
            assert_eq!(
                statuses,
                [
                    (1, WcStatus::Success, WcOpcode::Send),
                    (2, WcStatus::Success, WcOpcode::RdmaWrite),
                    (3, WcStatus::Success, WcOpcode::RdmaRead)
                ]
            );
            assert_eq!(net.engines[0].stats().retransmits, 0);
        }
    }
}

#[test]
fn a_large_mtu_recovers_from_loss() {
    let len = 2 * 1024 * 1024 + 5;
    for pmtu in PMTUS {
        let mut net = Net::new(2);
        let c = connect(&mut net, 0, 1, &opts(pmtu));
        let mut n = 0;
        // Every 5th request datagram vanishes once.
        net.set_filter(move |seen| {
            n += 1;
            if seen.from == 0 && n % 5 == 0 && n < 200 {
                Verdict::Drop
            } else {
                Verdict::Deliver
            }
        });
        let src = reg(&mut net, 0, pattern(len, 11), 0x10_0000, rw());
        let dst = reg(&mut net, 1, vec![0; len], 0x90_0000, rw());
        let op = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
        post_send(&mut net, c.a, &send_wr(9, op, &[src.all()]));
        net.run();
        let sent = poll_all(&mut net, 0, c.a.send_cq);
        assert_eq!((sent.len(), sent[0].status), (1, WcStatus::Success), "pmtu {pmtu}");
        assert_eq!(dst.contents(), pattern(len, 11), "pmtu {pmtu}");
        assert!(net.engines[0].stats().retransmits > 0, "the filter dropped datagrams");
        assert!(net.count(Opcode::RC_RDMA_WRITE_MIDDLE) > 0);
    }
}

/// An engine with one queue pair in INIT.
fn init_qp() -> (lightpath_roce::Engine, u32) {
    let mut engine = lightpath_roce::Engine::new(lightpath_roce::EngineConfig::new(Gid::from_ip(ip(0))));
    let cq = engine.create_cq(8).unwrap();
    let qpn = engine.create_qp(cq, cq, Default::default()).unwrap();
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(rw())).unwrap();
    (engine, qpn)
}

#[test]
fn the_attribute_is_refused_where_it_cannot_apply() {
    let peer = Gid::from_ip(ip(1));
    let lightpath = AddressVector { lightpath_peer: true, ..AddressVector::new(peer, 0) };
    let rtr = |av, pmtu| QpAttr { lightpath_pmtu: Some(pmtu), ..QpAttr::to_rtr(av, Mtu::Mtu1024, 5, 0) };
    for (av, pmtu, why) in [
        (AddressVector::new(peer, 0), 8192, "towards rxe or an RNIC"),
        (lightpath, 255, "below 256"),
        (lightpath, MAX_LIGHTPATH_PMTU + 1, "above 32 KiB"),
    ] {
        let (mut engine, qpn) = init_qp();
        let err = engine.modify_qp(Time::ZERO, qpn, &rtr(av, pmtu)).unwrap_err();
        assert!(matches!(err, Error::InvalidAttribute(_)), "{why}: {err}");
        assert_eq!(engine.qp_state(qpn).unwrap(), QpState::Init, "{why}: nothing changed");
    }
    // Once in RTR the path MTU is fixed: later transitions may not carry it.
    let (mut engine, qpn) = init_qp();
    engine.modify_qp(Time::ZERO, qpn, &rtr(lightpath, 8192)).unwrap();
    let rts = QpAttr { lightpath_pmtu: Some(4096), ..QpAttr::to_rts(0) };
    assert!(matches!(engine.modify_qp(Time::ZERO, qpn, &rts), Err(Error::InvalidAttribute(_))));
    assert_eq!(engine.qp_state(qpn).unwrap(), QpState::Rtr);
}
