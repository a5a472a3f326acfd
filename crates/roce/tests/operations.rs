//! Every RC operation end to end between two engines, at several sizes and path MTUs.

mod common;

use common::*;
use lightpath_roce::Time;
use lightpath_verbs::{Mtu, QpState, SendOp, WcOpcode, WcStatus};
use lightpath_wire::Opcode;

fn sizes(mtu: Mtu) -> Vec<usize> {
    let p = mtu.bytes() as usize;
    vec![0, 1, p - 1, p, p + 1, 3 * p + 17]
}

#[test]
fn send_all_sizes_and_mtus() {
    for mtu in Mtu::ALL {
        for len in sizes(mtu) {
            let mut net = Net::new(2);
            let opts = Opts { mtu, ..Opts::default() };
            let c = connect(&mut net, 0, 1, &opts);
            let src = reg(&mut net, 0, pattern(len, 7), 0x1000, rw());
            let dst = reg(&mut net, 1, vec![0; len + 8], 0x9000, rw());
            post_recv(&mut net, c.b, 42, &[dst.all()]);
            post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
            net.run();
            let sent = poll_all(&mut net, 0, c.a.send_cq);
            assert_eq!(sent.len(), 1, "mtu {mtu} len {len}");
            assert_eq!(
                (sent[0].wr_id, sent[0].status, sent[0].opcode),
                (1, WcStatus::Success, WcOpcode::Send)
            );
            let got = poll_all(&mut net, 1, c.b.recv_cq);
            assert_eq!(got.len(), 1);
            assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (42, WcStatus::Success, WcOpcode::Recv));
            assert_eq!(got[0].byte_len as usize, len);
            assert_eq!(got[0].src_qp, c.a.qpn);
            assert_eq!(got[0].qp_num, c.b.qpn);
            assert_eq!(&dst.contents()[..len], &pattern(len, 7)[..]);
            assert!(dst.contents()[len..].iter().all(|&b| b == 0));
            assert!(dst.mem.guards_intact());
            let packets = len.div_ceil(mtu.bytes() as usize).max(1);
            let requests = net.trace.iter().filter(|s| s.from == 0).count();
            assert_eq!(requests, packets);
            assert_eq!(net.engines[0].stats().retransmits, 0);
        }
    }
}

#[test]
fn engines_go_idle_after_traffic() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(10, 1), 0, rw());
    let dst = reg(&mut net, 1, vec![0; 10], 0, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(net.engines[0].poll_timeout(), None);
    assert_eq!(net.engines[1].poll_timeout(), None);
    assert_eq!(net.engines[0].qp_state(c.a.qpn).unwrap(), QpState::Rts);
    assert!(net.now < Time::from_nanos(1));
    assert_eq!(net.count(Opcode::RC_SEND_ONLY), 1);
    assert_eq!(net.count(Opcode::RC_ACKNOWLEDGE), 1);
}

#[test]
fn write_all_sizes_and_mtus() {
    for mtu in Mtu::ALL {
        for len in sizes(mtu) {
            let mut net = Net::new(2);
            let c = connect(&mut net, 0, 1, &Opts { mtu, ..Opts::default() });
            let src = reg(&mut net, 0, pattern(len, 3), 0x1000, rw());
            let dst = reg(&mut net, 1, vec![0; len + 16], 0x7000_0000, rw());
            let op = SendOp::Write { remote_addr: dst.addr + 8, rkey: dst.keys.rkey };
            post_send(&mut net, c.a, &send_wr(5, op, &[src.all()]));
            net.run();
            let sent = poll_all(&mut net, 0, c.a.send_cq);
            assert_eq!(sent.len(), 1);
            assert_eq!((sent[0].status, sent[0].opcode), (WcStatus::Success, WcOpcode::RdmaWrite));
            let contents = dst.contents();
            assert_eq!(&contents[8..8 + len], &pattern(len, 3)[..], "mtu {mtu} len {len}");
            assert!(contents[..8].iter().chain(&contents[8 + len..]).all(|&b| b == 0));
            assert!(dst.mem.guards_intact());
            // A plain WRITE consumes no receive and produces no responder completion.
            assert!(poll_all(&mut net, 1, c.b.recv_cq).is_empty());
        }
    }
}

#[test]
fn read_all_sizes_and_mtus() {
    for mtu in Mtu::ALL {
        for len in sizes(mtu) {
            let mut net = Net::new(2);
            let c = connect(&mut net, 0, 1, &Opts { mtu, ..Opts::default() });
            let remote = reg(&mut net, 1, pattern(len + 5, 9), 0x4000, rw());
            let local = reg(&mut net, 0, vec![0; len], 0x8000, rw());
            let op = SendOp::Read { remote_addr: remote.addr + 5, rkey: remote.keys.rkey };
            post_send(&mut net, c.a, &send_wr(8, op, &[local.all()]));
            net.run();
            let sent = poll_all(&mut net, 0, c.a.send_cq);
            assert_eq!(sent.len(), 1, "mtu {mtu} len {len}");
            assert_eq!((sent[0].status, sent[0].opcode), (WcStatus::Success, WcOpcode::RdmaRead));
            assert_eq!(sent[0].byte_len as usize, len);
            assert_eq!(local.contents(), pattern(len + 5, 9)[5..].to_vec());
            assert!(local.mem.guards_intact());
            let responses = len.div_ceil(mtu.bytes() as usize).max(1);
            assert_eq!(net.trace.iter().filter(|s| s.from == 1).count(), responses);
            assert_eq!(net.count(Opcode::RC_RDMA_READ_REQUEST), 1);
        }
    }
}

#[test]
fn multi_megabyte_transfers() {
    let len = 3 * 1024 * 1024 + 123;
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu4096, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(len, 1), 0x10_0000, rw());
    let dst = reg(&mut net, 1, vec![0; len], 0x20_0000, rw());
    let back = reg(&mut net, 0, vec![0; len], 0x90_0000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(dst.contents(), pattern(len, 1));
    let write = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
    let src2 = reg(&mut net, 0, pattern(len, 77), 0x50_0000, rw());
    post_send(&mut net, c.a, &send_wr(2, write, &[src2.all()]));
    let read = SendOp::Read { remote_addr: dst.addr, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(3, read, &[back.all()]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(
        done.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success)]
    );
    assert_eq!(back.contents(), pattern(len, 77));
    // AckReq on the last packet of each message and on every 64th packet of long ones, so a
    // peer that ACKs only AckReq packets keeps our 128-PSN window open.
    let send_packets = len.div_ceil(4096);
    let ack_reqs = net.trace.iter().filter(|s| s.from == 0 && s.opcode.0 <= 0x05 && s.ack_req).count();
    assert!(ack_reqs >= send_packets / 64, "{ack_reqs} AckReq packets for {send_packets}");
    assert_eq!(net.engines[0].stats().retransmits, 0);
}

#[test]
fn immediate_data_and_solicited_bit() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(600, 2), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 2048], 0x2000, rw());
    post_recv(&mut net, c.b, 10, &[dst.sge(0, 1024)]);
    post_recv(&mut net, c.b, 11, &[dst.sge(1024, 8)]);
    let sges = [src.all()];
    let send = send_wr(1, SendOp::SendWithImm { imm: 0xDEADBEEF }, &sges)
        .with_flags(lightpath_verbs::SendFlags::SIGNALED | lightpath_verbs::SendFlags::SOLICITED);
    post_send(&mut net, c.a, &send);
    let write = SendOp::WriteWithImm { remote_addr: dst.addr + 1500, rkey: dst.keys.rkey, imm: 0x01020304 };
    post_send(&mut net, c.a, &send_wr(2, write, &[src.sge(0, 300)]));
    net.run();
    let got = poll_all(&mut net, 1, c.b.recv_cq);
    assert_eq!(got.len(), 2);
    assert_eq!((got[0].wr_id, got[0].opcode, got[0].byte_len), (10, WcOpcode::Recv, 600));
    assert_eq!(got[0].imm_data, Some(0xDEADBEEF));
    assert!(got[0].solicited);
    assert_eq!((got[1].wr_id, got[1].opcode, got[1].byte_len), (11, WcOpcode::RecvRdmaWithImm, 300));
    assert_eq!(got[1].imm_data, Some(0x01020304));
    assert!(!got[1].solicited);
    assert_eq!(&dst.contents()[..600], &pattern(600, 2)[..]);
    assert_eq!(&dst.contents()[1500..1800], &pattern(600, 2)[..300]);
    // SE only on the last packet of the solicited SEND.
    let se: Vec<_> = net.trace.iter().filter(|s| s.solicited).map(|s| s.opcode).collect();
    assert_eq!(se, vec![Opcode::RC_SEND_LAST_WITH_IMMEDIATE]);
    assert_eq!(net.count(Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE), 1);
}

#[test]
fn send_with_invalidate_withdraws_remote_access() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let target = reg(&mut net, 1, vec![1; 64], 0x3000, rw());
    let dst = reg(&mut net, 1, vec![0; 64], 0x4000, rw());
    let src = reg(&mut net, 0, pattern(64, 4), 0x1000, rw());
    post_recv(&mut net, c.b, 7, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::SendWithInv { rkey: target.keys.rkey }, &[src.sge(0, 10)]));
    net.run();
    let got = poll_all(&mut net, 1, c.b.recv_cq);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].status, got[0].invalidated_rkey), (WcStatus::Success, Some(target.keys.rkey)));
    assert_eq!(net.count(Opcode::RC_SEND_ONLY_WITH_INVALIDATE), 1);
    // The region no longer accepts remote writes: NAK remote access error.
    let write = SendOp::Write { remote_addr: target.addr, rkey: target.keys.rkey };
    post_send(&mut net, c.a, &send_wr(2, write, &[src.sge(0, 8)]));
    net.run();
    let sent = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(sent.last().map(|w| (w.wr_id, w.status)), Some((2, WcStatus::RemAccessErr)));
    assert_eq!(target.contents(), vec![1; 64]);
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let mut init = vec![0u8; 32];
    init[8..16].copy_from_slice(&100u64.to_ne_bytes());
    init[16..24].copy_from_slice(&7u64.to_ne_bytes());
    let remote = reg(&mut net, 1, init, 0x8000, rw());
    let results = reg(&mut net, 0, vec![0; 32], 0x1000, rw());
    let rkey = remote.keys.rkey;
    post_send(
        &mut net,
        c.a,
        &send_wr(1, SendOp::FetchAdd { remote_addr: 0x8008, rkey, add: 5 }, &[results.sge(0, 8)]),
    );
    let cas_hit = SendOp::CompareSwap { remote_addr: 0x8010, rkey, compare: 7, swap: 99 };
    post_send(&mut net, c.a, &send_wr(2, cas_hit, &[results.sge(8, 8)]));
    let cas_miss = SendOp::CompareSwap { remote_addr: 0x8010, rkey, compare: 7, swap: 1234 };
    post_send(&mut net, c.a, &send_wr(3, cas_miss, &[results.sge(16, 8)]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    let summary: Vec<_> = done.iter().map(|w| (w.wr_id, w.status, w.opcode, w.byte_len)).collect();
    assert_eq!(
        summary,
        vec![
            (1, WcStatus::Success, WcOpcode::FetchAdd, 8),
            (2, WcStatus::Success, WcOpcode::CompSwap, 8),
            (3, WcStatus::Success, WcOpcode::CompSwap, 8)
        ]
    );
    let word = |bytes: &[u8], at: usize| u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap());
    let r = results.contents();
    assert_eq!((word(&r, 0), word(&r, 8), word(&r, 16)), (100, 7, 99));
    let m = remote.contents();
    assert_eq!((word(&m, 8), word(&m, 16)), (105, 99));
    assert_eq!(net.count(Opcode::RC_ATOMIC_ACKNOWLEDGE), 3);
}

#[test]
fn inline_data_is_copied_at_post_time() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let dst = reg(&mut net, 1, vec![0; 256], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    let mut payload = pattern(200, 5);
    let wr = lightpath_verbs::SendWr::inline(1, SendOp::Send, &payload);
    post_send(&mut net, c.a, &wr);
    payload.fill(0xFF); // the caller may reuse the buffer at once
    let write = SendOp::Write { remote_addr: 0x2000 + 210, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &lightpath_verbs::SendWr::inline(2, write, b"inline!"));
    net.run();
    assert_eq!(&dst.contents()[..200], &pattern(200, 5)[..]);
    assert_eq!(&dst.contents()[210..217], b"inline!");
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq).len(), 2);
    // Larger than max_inline_data is refused at post time.
    let big = vec![0u8; 257];
    let err =
        net.engines[0].post_send(net.now, c.a.qpn, &lightpath_verbs::SendWr::inline(3, SendOp::Send, &big));
    assert!(matches!(err, Err(lightpath_verbs::Error::TooLarge(_))));
}

#[test]
fn unsignaled_requests_complete_silently() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(64, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 64], 0x2000, rw());
    let write = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
    // Far more unsignaled WRs than the send queue holds: slots are released on ACK.
    for i in 0..2000u64 {
        let sges = [src.sge((i % 8) as usize, 8)];
        let wr = send_wr(i, write, &sges).with_flags(unsignaled());
        post_send(&mut net, c.a, &wr);
        if i % 100 == 99 {
            net.run();
        }
    }
    post_send(&mut net, c.a, &send_wr(9999, write, &[src.sge(0, 64)]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(done.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![9999]);
    assert_eq!(dst.contents(), pattern(64, 1));
}

#[test]
fn scatter_gather_lists_on_both_sides() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let a = reg(&mut net, 0, pattern(300, 1), 0x1000, rw());
    let b = reg(&mut net, 0, pattern(300, 2), 0x5000, rw());
    let dst1 = reg(&mut net, 1, vec![0; 100], 0x2000, rw());
    let dst2 = reg(&mut net, 1, vec![0; 1000], 0x9000, rw());
    post_recv(&mut net, c.b, 1, &[dst1.all(), dst2.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[a.sge(10, 250), b.sge(0, 300)]));
    net.run();
    let mut expected = pattern(300, 1)[10..260].to_vec();
    expected.extend(pattern(300, 2));
    let mut got = dst1.contents();
    got.extend(&dst2.contents()[..450]);
    assert_eq!(got, expected);
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq)[0].byte_len, 550);
}

#[test]
fn both_directions_at_once() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu512, ..Opts::default() });
    let a_src = reg(&mut net, 0, pattern(5000, 1), 0x1000, rw());
    let a_dst = reg(&mut net, 0, vec![0; 5000], 0x9000, rw());
    let b_src = reg(&mut net, 1, pattern(5000, 2), 0x1000, rw());
    let b_dst = reg(&mut net, 1, vec![0; 5000], 0x9000, rw());
    post_recv(&mut net, c.a, 1, &[a_dst.all()]);
    post_recv(&mut net, c.b, 1, &[b_dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[a_src.all()]));
    post_send(&mut net, c.b, &send_wr(1, SendOp::Send, &[b_src.all()]));
    let read = SendOp::Read { remote_addr: 0x1000, rkey: b_src.keys.rkey };
    post_send(&mut net, c.a, &send_wr(2, read, &[a_src.all()]));
    net.run();
    assert_eq!(b_dst.contents(), pattern(5000, 1));
    assert_eq!(a_dst.contents(), pattern(5000, 2));
    assert_eq!(a_src.contents(), pattern(5000, 2));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq).len(), 2);
}

#[test]
fn three_engines_many_queue_pairs() {
    let mut net = Net::new(3);
    let opts = Opts::default();
    let pairs =
        [connect(&mut net, 0, 1, &opts), connect(&mut net, 1, 2, &opts), connect(&mut net, 2, 0, &opts)];
    let mut buffers = Vec::new();
    for (i, c) in pairs.iter().enumerate() {
        let src = reg(&mut net, c.a.engine, pattern(3000, i as u8), 0x1000 * (i as u64 + 1), rw());
        let dst = reg(&mut net, c.b.engine, vec![0; 3000], 0x10_0000 * (i as u64 + 1), rw());
        post_recv(&mut net, c.b, i as u64, &[dst.all()]);
        post_send(&mut net, c.a, &send_wr(i as u64, SendOp::Send, &[src.all()]));
        buffers.push(dst);
    }
    net.run();
    for (i, dst) in buffers.iter().enumerate() {
        assert_eq!(dst.contents(), pattern(3000, i as u8));
    }
    // The UDP source port follows rxe's formula and is the same in both directions.
    for c in &pairs {
        let ports: std::collections::BTreeSet<u16> = net
            .trace
            .iter()
            .filter(|s| s.from + s.to == c.a.engine + c.b.engine)
            .map(|s| s.src_port)
            .collect();
        assert_eq!(ports.len(), 1);
        assert!(*ports.first().unwrap() >= 0xC000);
    }
}

#[test]
fn ipv6_paths() {
    let mut net = Net::new_v6(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu2048, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(5000, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 5000], 0x8000, rw());
    let back = reg(&mut net, 0, vec![0; 5000], 0x20000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    let read = SendOp::Read { remote_addr: dst.addr, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(2, read, &[back.all()]));
    net.run();
    assert_eq!(back.contents(), pattern(5000, 1));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq).len(), 2);
    assert_eq!(net.engines[1].stats().drops_icrc, 0);
    // An IPv4 peer cannot be reached from an IPv6 address.
    let mut v4 = Opts::default();
    v4.caps.max_send_wr = 1;
    let end = create_end(&mut net, 0, &v4);
    let av = lightpath_verbs::AddressVector::new(lightpath_verbs::Gid::from_ip(ip(1)), 0);
    let rtr = lightpath_verbs::QpAttr::to_rtr(av, Mtu::Mtu1024, 0x11, 0);
    assert!(net.engines[0].modify_qp(Time::ZERO, end.qpn, &rtr).is_err());
}
