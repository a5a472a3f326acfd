//! Hostile and broken input: every datagram the engine refuses is counted under one
//! `drops_*` reason; nothing panics and nothing reaches memory.

mod common;

use common::*;
use lightpath_roce::{Engine, EngineConfig, EngineStats};
use lightpath_verbs::{Gid, Mtu, QpState, SendOp, WcStatus};
use lightpath_wire::icrc::{self, Endpoints};
use lightpath_wire::{
    AethRepr, AtomicAckEthRepr, BthRepr, Opcode, Psn, RethRepr, Syndrome, TransportHeader, TransportRepr,
};

fn drops(s: &EngineStats) -> u64 {
    s.drops_malformed
        + s.drops_icrc
        + s.drops_unknown_qp
        + s.drops_bad_state
        + s.drops_wrong_peer
        + s.drops_unsupported
}

fn bth(opcode: Opcode, dest_qpn: u32, psn: u32) -> BthRepr {
    BthRepr {
        opcode,
        solicited: false,
        mig_req: false,
        pad_count: 0,
        tver: 0,
        pkey: 0xFFFF,
        fecn: false,
        becn: false,
        dest_qpn,
        ack_req: true,
        psn: Psn::new(psn),
    }
}

/// A sealed datagram from engine `from` to engine `to`.
fn craft(header: TransportHeader, payload: &[u8], from: usize, to: usize) -> Vec<u8> {
    let repr = TransportRepr { header, payload };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    let endpoints = Endpoints { src: ip(from), dst: ip(to), src_port: 0xC123, dst_port: 4791 };
    icrc::seal(&endpoints, &mut buf).unwrap();
    buf
}

struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_garbage_is_counted_and_never_panics() {
    for verify_icrc in [true, false] {
        let mut net = Net::new(2);
        if !verify_icrc {
            net.engines[1] =
                Engine::new(EngineConfig { verify_icrc, ..EngineConfig::new(Gid::from_ip(ip(1))) });
        }
        let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
        let target = reg(&mut net, 1, vec![0x11; 512], 0x4000, rw());
        let dst = reg(&mut net, 1, vec![0x22; 512], 0x8000, rw());
        post_recv(&mut net, c.b, 1, &[dst.all()]);
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for i in 0..20_000u32 {
            let len = (rng.next() % 320) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if len >= 12 && i % 2 == 0 {
                // Aim half of them at the live QP with a plausible RC opcode and TVer 0.
                bytes[0] &= 0x1F;
                bytes[1] &= 0xF0;
                bytes[5..8].copy_from_slice(&c.b.qpn.to_be_bytes()[1..]);
            }
            net.inject(0, 1, 0xC000, &bytes);
            // Anything the engine wants to send in reply must be well-formed.
            net.pump();
        }
        let stats = net.engines[1].stats().clone();
        assert_eq!(stats.rx_datagrams, 20_000 + net.trace.iter().filter(|s| s.to == 1).count() as u64);
        if verify_icrc {
            // Nothing forged without the ICRC gets through.
            assert_eq!(drops(&stats), 20_000, "{stats:?}");
            assert_eq!(target.contents(), vec![0x11; 512]);
            assert_eq!(dst.contents(), vec![0x22; 512]);
            assert_eq!(net.engines[1].qp_state(c.b.qpn).unwrap(), QpState::Rts);
        } else {
            assert!(drops(&stats) > 10_000);
        }
        assert!(target.mem.guards_intact() && dst.mem.guards_intact());
    }
}

/// A connection and one captured, valid SEND_ONLY datagram from a to b (not delivered).
fn captured_send() -> (Net, Conn, Buf, Vec<u8>, u16) {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(100, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 100], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    let mut buf = vec![0; lightpath_roce::MAX_DATAGRAM];
    let t = net.engines[0].poll_transmit(net.now, &mut buf).unwrap();
    (net, c, dst, buf[..t.len].to_vec(), t.src_port)
}

#[test]
fn truncated_datagrams_are_dropped() {
    let (mut net, c, dst, bytes, port) = captured_send();
    for len in 0..bytes.len() {
        net.inject(0, 1, port, &bytes[..len]);
    }
    let stats = net.engines[1].stats().clone();
    assert_eq!(drops(&stats), bytes.len() as u64);
    assert!(poll_all(&mut net, 1, c.b.recv_cq).is_empty());
    assert_eq!(dst.contents(), vec![0; 100]);
    // The intact datagram is still accepted afterwards.
    net.inject(0, 1, port, &bytes);
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
}

#[test]
fn every_single_bit_flip_is_refused() {
    let (mut net, c, _dst, bytes, port) = captured_send();
    for bit in 0..bytes.len() * 8 {
        // BTH byte 4 (FECN/BECN/reserved) is masked out of the ICRC by design and carries
        // nothing the engine uses; every other flip must be refused.
        if bit / 8 == 4 {
            continue;
        }
        let mut corrupt = bytes.clone();
        corrupt[bit / 8] ^= 1 << (bit % 8);
        let before = drops(net.engines[1].stats());
        net.inject(0, 1, port, &corrupt);
        assert_eq!(drops(net.engines[1].stats()), before + 1, "bit {bit} flipped was accepted");
    }
    assert!(poll_all(&mut net, 1, c.b.recv_cq).is_empty());
    assert!(net.engines[1].stats().drops_icrc > 0);
    // The original still goes through.
    net.inject(0, 1, port, &bytes);
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
}

#[test]
fn unknown_qp_wrong_peer_and_wrong_state() {
    let mut net = Net::new(3);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let ack = |qpn, psn| {
        let mut h = TransportHeader::new(bth(Opcode::RC_ACKNOWLEDGE, qpn, psn));
        h.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 0 });
        h
    };
    // Unknown QPN.
    net.inject(0, 1, 0xC123, &craft(ack(0x77, 0), &[], 0, 1));
    assert_eq!(net.engines[1].stats().drops_unknown_qp, 1);
    // The right QPN from the wrong address, and sealed for the wrong destination address.
    net.inject(2, 1, 0xC123, &craft(ack(c.b.qpn, 0), &[], 2, 1));
    let wrong_dst = craft(ack(c.b.qpn, 0), &[], 0, 1);
    net.engines[1].handle_datagram(net.now, ip(0), ip(2), 0xC123, &wrong_dst);
    assert_eq!(net.engines[1].stats().drops_wrong_peer, 2);
    // A QP still in INIT accepts nothing; one in RTR accepts requests but no responses.
    let opts = Opts::default();
    let idle = create_end(&mut net, 2, &opts);
    net.inject(0, 2, 0xC123, &craft(ack(idle.qpn, 0), &[], 0, 2));
    bring_up(&mut net, idle, c.a, 0, 0, &opts);
    net.engines[2].modify_qp(net.now, idle.qpn, &lightpath_verbs::QpAttr::state(QpState::Err)).unwrap();
    net.inject(0, 2, 0xC123, &craft(ack(idle.qpn, 0), &[], 0, 2));
    assert_eq!(net.engines[2].stats().drops_bad_state, 2);
}

#[test]
fn responses_nobody_asked_for() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let mut ack = TransportHeader::new(bth(Opcode::RC_ACKNOWLEDGE, c.a.qpn, 0x1000));
    ack.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 });
    let mut read = TransportHeader::new(bth(Opcode::RC_RDMA_READ_RESPONSE_ONLY, c.a.qpn, 0x1000));
    read.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 });
    let mut atomic = TransportHeader::new(bth(Opcode::RC_ATOMIC_ACKNOWLEDGE, c.a.qpn, 0x1000));
    atomic.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 });
    atomic.atomic_ack = Some(AtomicAckEthRepr { orig: 5 });
    net.inject(1, 0, 0xC123, &craft(ack, &[], 1, 0));
    net.inject(1, 0, 0xC123, &craft(read, &[1, 2, 3, 4], 1, 0));
    net.inject(1, 0, 0xC123, &craft(atomic, &[], 1, 0));
    assert_eq!(net.engines[0].stats().drops_unexpected_response, 3);
    // While a WRITE is outstanding, a READ response for its PSN does not fit it.
    let src = reg(&mut net, 0, pattern(64, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 64], 0x2000, rw());
    post_send(
        &mut net,
        c.a,
        &send_wr(1, SendOp::Write { remote_addr: 0x2000, rkey: dst.keys.rkey }, &[src.all()]),
    );
    let mut buf = vec![0; lightpath_roce::MAX_DATAGRAM];
    let t = net.engines[0].poll_transmit(net.now, &mut buf).unwrap();
    net.inject(1, 0, 0xC123, &craft(read, &[1, 2, 3, 4], 1, 0));
    assert_eq!(net.engines[0].stats().drops_unexpected_response, 4);
    assert!(poll_all(&mut net, 0, c.a.send_cq).is_empty());
    // The connection is unharmed: deliver the WRITE and finish normally.
    net.inject(0, 1, t.src_port, &buf[..t.len]);
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    assert_eq!(dst.contents(), pattern(64, 1));
}

#[test]
fn other_transports_and_partitions() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let mut ud = TransportHeader::new(bth(Opcode::UD_SEND_ONLY, c.b.qpn, 0));
    ud.deth = Some(lightpath_wire::DethRepr { qkey: 0x8001_0000, src_qpn: 1 });
    net.inject(0, 1, 0xC123, &craft(ud, &[0; 8], 0, 1));
    let cnp = TransportHeader::new(BthRepr { becn: true, ..bth(Opcode::CNP, c.b.qpn, 0) });
    net.inject(0, 1, 0xC123, &craft(cnp, &[], 0, 1));
    // A UC SEND_ONLY (0x24) is not an RC opcode.
    let mut uc = craft(TransportHeader::new(bth(Opcode::RC_SEND_ONLY, c.b.qpn, 0x1000)), &[0; 4], 0, 1);
    uc[0] = 0x24;
    net.inject(0, 1, 0xC123, &uc);
    assert_eq!(net.engines[1].stats().drops_unsupported, 3);
    // P_Key of another partition.
    let other = BthRepr { pkey: 0x8001, ..bth(Opcode::RC_SEND_ONLY, c.b.qpn, 0x1000) };
    net.inject(0, 1, 0xC123, &craft(TransportHeader::new(other), &[0; 4], 0, 1));
    assert_eq!(net.engines[1].stats().drops_malformed, 1);
}

#[test]
fn absurd_lengths_are_invalid_requests() {
    let cases: Vec<(TransportHeader, Vec<u8>)> = {
        let write = |dma_len| {
            let mut h = TransportHeader::new(bth(Opcode::RC_RDMA_WRITE_ONLY, 0, 0x1000));
            h.reth = Some(RethRepr { va: 0x4000, rkey: 0, dma_len });
            h
        };
        let mut read = TransportHeader::new(bth(Opcode::RC_RDMA_READ_REQUEST, 0, 0x1000));
        read.reth = Some(RethRepr { va: 0x4000, rkey: 0, dma_len: 0x8000_0001 });
        let mut first = TransportHeader::new(bth(Opcode::RC_RDMA_WRITE_FIRST, 0, 0x1000));
        first.reth = Some(RethRepr { va: 0x4000, rkey: 0, dma_len: 100 });
        vec![
            (write(0xFFFF_FFFF), vec![0; 16]), // DMA length far beyond the payload
            (write(8), vec![0; 16]),           // payload longer than the DMA length
            (read, vec![]),                    // READ longer than 2^31
            (first, vec![0; 256]),             // FIRST carrying all of a 100-byte WRITE
            (TransportHeader::new(bth(Opcode::RC_SEND_FIRST, 0, 0x1000)), vec![0; 100]), // short FIRST
            (TransportHeader::new(bth(Opcode::RC_SEND_MIDDLE, 0, 0x1000)), vec![0; 256]), // no FIRST
        ]
    };
    for (mut header, payload) in cases {
        let mut net = Net::new(2);
        let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
        let target = reg(&mut net, 1, vec![7; 256], 0x4000, rw());
        let dst = reg(&mut net, 1, vec![7; 1024], 0x8000, rw());
        post_recv(&mut net, c.b, 1, &[dst.all()]);
        header.bth.dest_qpn = c.b.qpn;
        if let Some(reth) = header.reth.as_mut() {
            reth.rkey = target.keys.rkey;
        }
        let opcode = header.bth.opcode;
        net.inject(0, 1, 0xC123, &craft(header, &payload, 0, 1));
        net.pump();
        let naks: Vec<_> = net.trace.iter().filter_map(|s| s.syndrome).collect();
        assert_eq!(naks, vec![Syndrome::Nak(lightpath_wire::NakCode::InvalidRequest)], "{opcode:?}");
        assert_eq!(target.contents(), vec![7; 256]);
        assert_eq!(net.engines[1].qp_state(c.b.qpn).unwrap(), QpState::Err);
    }
}

#[test]
fn responder_output_stays_bounded_under_a_duplicate_flood() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { max_dest_rd_atomic: 4, ..Opts::default() });
    let target = reg(&mut net, 1, vec![1; 1 << 20], 0x10_0000, rw());
    let read = |psn: u32| {
        let mut h = TransportHeader::new(bth(Opcode::RC_RDMA_READ_REQUEST, c.b.qpn, psn));
        h.reth = Some(RethRepr { va: 0x10_0000, rkey: target.keys.rkey, dma_len: 1 << 20 });
        craft(h, &[], 0, 1)
    };
    // The first is new, the rest are duplicates; nobody polls the engine's transmissions.
    let bytes = read(0x1000);
    for _ in 0..10_000 {
        net.inject(0, 1, 0xC123, &bytes);
    }
    assert_eq!(net.engines[1].stats().duplicates, 9_999);
    // The duplicates restarted the one queued response stream instead of adding streams.
    net.set_filter(|_| Verdict::Drop);
    net.pump();
    assert_eq!(net.trace.len(), 1024);

    // New READs beyond what the output queue holds are dropped (not executed), and the
    // requester would retry them.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { max_dest_rd_atomic: 4, ..Opts::default() });
    let target = reg(&mut net, 1, vec![1; 4096], 0x10_0000, rw());
    for i in 0..100u32 {
        let mut h = TransportHeader::new(bth(Opcode::RC_RDMA_READ_REQUEST, c.b.qpn, 0x1000 + i));
        h.reth = Some(RethRepr { va: 0x10_0000, rkey: target.keys.rkey, dma_len: 8 });
        net.inject(0, 1, 0xC123, &craft(h, &[], 0, 1));
    }
    let stats = net.engines[1].stats().clone();
    assert!(stats.drops_responder_busy >= 1, "{stats:?}");
    net.set_filter(|_| Verdict::Drop);
    net.pump();
    let responses = net.trace.iter().filter(|s| s.opcode == Opcode::RC_RDMA_READ_RESPONSE_ONLY).count();
    assert!(responses <= 12, "{responses} responses queued");
}
