//! A queue pair whose address vector says `lightpath_peer` (a Lightpath soft device at the
//! other end) may keep 1,024 PSNs in flight and marks its datagrams segmentable; towards any
//! other peer (rxe, an RNIC) it keeps rxe's 128 and never asks for segmentation.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use lightpath_roce::{Engine, EngineConfig, Time, VecMemory, MAX_DATAGRAM};
use lightpath_verbs::{AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, SendOp, SendWr, Sge};

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const PEER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const REGION: usize = 4 << 20;
const REGION_ADDR: u64 = 0x100_0000;

/// Datagrams one engine sends for a 4 MiB RDMA WRITE at MTU 1024 before any acknowledgement
/// comes back, whether they were all marked segmentable, and the PSN offsets of those that ask
/// for an ACK (AckReq).
fn burst_before_any_ack(lightpath_peer: bool) -> (usize, bool, Vec<usize>) {
    let mut engine = Engine::new(EngineConfig::new(Gid::from_ip(LOCAL)));
    let cq = engine.create_cq(16).expect("cq");
    let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
    let memory = Arc::new(VecMemory::from_bytes(vec![7u8; REGION]));
    let keys = engine.reg_mr(memory, REGION_ADDR, AccessFlags::LOCAL_WRITE).expect("mr");
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("init");
    let av = AddressVector { lightpath_peer, ..AddressVector::new(Gid::from_ip(PEER), 0) };
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x12, 0)).expect("rtr");
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(100)).expect("rts");
    let sge = Sge { addr: REGION_ADDR, length: REGION as u32, lkey: keys.lkey };
    let op = SendOp::Write { remote_addr: 0x2000, rkey: 0x33 };
    engine.post_send(Time::ZERO, qpn, &SendWr::new(1, op, &[sge])).expect("post");
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (mut count, mut all_segmentable, mut ack_reqs) = (0, true, Vec::new());
    while let Some(transmit) = engine.poll_transmit(Time::ZERO, &mut buf) {
        all_segmentable &= transmit.segmentable;
        // BTH byte 8, top bit: AckReq.
        if buf[8] & 0x80 != 0 {
            ack_reqs.push(count);
        }
        count += 1;
        assert!(count <= 4096, "the window never closed");
    }
    (count, all_segmentable, ack_reqs)
}

#[test]
fn lightpath_peers_get_a_wider_window_and_segmentable_datagrams() {
    let (count, segmentable, _) = burst_before_any_ack(false);
    assert_eq!((count, segmentable), (128, false), "rxe's window towards other peers");
    let (count, segmentable, _) = burst_before_any_ack(true);
    assert_eq!((count, segmentable), (1024, true));
}

/// Towards rxe every 64th packet of a long message asks for an ACK (rxe ACKs only those);
/// towards a Lightpath peer, with its eight times wider window, every quarter window does, so
/// the peer sends a quarter as many ACK datagrams. The packet that fills the window always asks.
#[test]
fn lightpath_peers_are_asked_for_an_ack_every_quarter_window() {
    let (_, _, ack_reqs) = burst_before_any_ack(false);
    assert_eq!(ack_reqs, [63, 127]);
    let (_, _, ack_reqs) = burst_before_any_ack(true);
    assert_eq!(ack_reqs, [255, 511, 767, 1023]);
}

/// Between two Lightpath soft devices the ICRC is neither computed nor checked (UDP's
/// checksum covers the same bytes); towards any other peer every datagram is sealed and a
/// datagram whose ICRC is wrong is dropped.
#[test]
fn the_icrc_is_skipped_only_between_lightpath_peers() {
    use lightpath_roce::CqHandle;
    use lightpath_verbs::{RecvWr, WcStatus, WorkCompletion};
    use lightpath_wire::icrc::{self, Endpoints};

    fn engine_at(ip: IpAddr, peer: IpAddr, lightpath_peer: bool) -> (Engine, u32, CqHandle) {
        let mut engine = Engine::new(EngineConfig::new(Gid::from_ip(ip)));
        let cq = engine.create_cq(16).expect("cq");
        let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("init");
        let av = AddressVector { lightpath_peer, ..AddressVector::new(Gid::from_ip(peer), 0) };
        // Both engines number their first QP alike, so each names the other's by its own.
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, qpn, 100)).expect("rtr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(100)).expect("rts");
        (engine, qpn, cq)
    }

    for lightpath_peer in [true, false] {
        let (mut sender, qpn, _) = engine_at(LOCAL, PEER, lightpath_peer);
        let (mut receiver, peer_qpn, cq) = engine_at(PEER, LOCAL, lightpath_peer);
        assert_eq!(qpn, peer_qpn);
        let memory = Arc::new(VecMemory::from_bytes(b"twelve bytes".to_vec()));
        let keys = sender.reg_mr(memory, REGION_ADDR, AccessFlags::LOCAL_WRITE).expect("mr");
        let sge = Sge { addr: REGION_ADDR, length: 12, lkey: keys.lkey };
        let landing = Arc::new(VecMemory::new(64));
        let landing_keys = receiver.reg_mr(landing, 0x9000, AccessFlags::LOCAL_WRITE).expect("mr");
        let room = [Sge { addr: 0x9000, length: 64, lkey: landing_keys.lkey }];
        receiver.post_recv(qpn, &RecvWr::new(5, &room)).expect("recv");
        sender.post_send(Time::ZERO, qpn, &SendWr::new(1, SendOp::Send, &[sge])).expect("post");
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let transmit = sender.poll_transmit(Time::ZERO, &mut buf).expect("a datagram");
        let datagram = buf[..transmit.len].to_vec();
        let endpoints =
            Endpoints { src: LOCAL, dst: PEER, src_port: transmit.src_port, dst_port: transmit.dst_port };
        let icrc_field = &datagram[datagram.len() - 4..];
        if lightpath_peer {
            assert_eq!(icrc_field, [0; 4], "not computed towards a Lightpath peer");
        } else {
            assert!(icrc::verify(&endpoints, &datagram), "sealed towards rxe or an RNIC");
        }
        // A flipped payload bit: a Lightpath peer takes it (the UDP checksum is what guards
        // it on a real wire); any other peer drops it on the ICRC.
        let mut flipped = datagram.clone();
        flipped[12] ^= 0x01;
        receiver.handle_datagram(Time::ZERO, LOCAL, PEER, transmit.src_port, &flipped);
        let mut wcs = [WorkCompletion::new(0, WcStatus::Success, lightpath_verbs::WcOpcode::Send, 0); 4];
        let got = receiver.poll_cq(cq, &mut wcs);
        assert_eq!(got, usize::from(lightpath_peer), "lightpath_peer {lightpath_peer}");
        assert_eq!(receiver.stats().drops_icrc, u64::from(!lightpath_peer));
    }
}

/// Memory that says where its bytes are (as the soft provider's regions do), so the engine
/// may leave payloads in place.
struct PinnedMemory(VecMemory, usize);

impl lightpath_roce::RegionMemory for PinnedMemory {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, offset: usize, dst: &mut [u8]) {
        self.0.read(offset, dst)
    }
    fn write(&self, offset: usize, src: &[u8]) {
        self.0.write(offset, src)
    }
    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        self.0.compare_swap(offset, compare, swap)
    }
    fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        self.0.fetch_add(offset, add)
    }
    fn stable_addr(&self) -> Option<usize> {
        Some(self.1)
    }
}

/// With `gather_payloads`, a request to a Lightpath peer leaves its payload in place (the
/// driver sends headers, the region's bytes and a zero trailer): the transmit names exactly
/// the bytes the copying path would have put in the buffer. Towards other peers, from memory
/// that cannot say where its bytes are, and without the option, payloads are copied.
#[test]
fn payloads_stay_in_place_only_when_everything_allows_it() {
    use lightpath_roce::Gathered;
    const BASE: usize = 0x7000_0000;
    let datagrams = |gather: bool, lightpath_peer: bool, pinned: bool| {
        let config = EngineConfig { gather_payloads: gather, ..EngineConfig::new(Gid::from_ip(LOCAL)) };
        let mut engine = Engine::new(config);
        let cq = engine.create_cq(16).expect("cq");
        let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
        let bytes: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let memory: Arc<dyn lightpath_roce::RegionMemory> = if pinned {
            Arc::new(PinnedMemory(VecMemory::from_bytes(bytes), BASE))
        } else {
            Arc::new(VecMemory::from_bytes(bytes))
        };
        let keys = engine.reg_mr(memory, REGION_ADDR, AccessFlags::LOCAL_WRITE).expect("mr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("init");
        let av = AddressVector { lightpath_peer, ..AddressVector::new(Gid::from_ip(PEER), 0) };
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x12, 0)).expect("rtr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(100)).expect("rts");
        // 2,001 bytes from offset 7: packets of 1024 and 977 (the last padded by 3).
        let sge = Sge { addr: REGION_ADDR + 7, length: 2001, lkey: keys.lkey };
        let op = SendOp::Write { remote_addr: 0x2000, rkey: 0x33 };
        engine.post_send(Time::ZERO, qpn, &SendWr::new(1, op, &[sge])).expect("post");
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut out = Vec::new();
        while let Some(t) = engine.poll_transmit(Time::ZERO, &mut buf) {
            out.push((t.len, t.gathered));
        }
        out
    };
    // WRITE FIRST: BTH + RETH = 28 header bytes; WRITE LAST: 12.
    assert_eq!(
        datagrams(true, true, true),
        [
            (28, Some(Gathered { addr: BASE + 7, len: 1024, trailer: 4 })),
            (12, Some(Gathered { addr: BASE + 7 + 1024, len: 977, trailer: 3 + 4 })),
        ]
    );
    for (gather, lightpath_peer, pinned) in [(false, true, true), (true, false, true), (true, true, false)] {
        assert_eq!(
            datagrams(gather, lightpath_peer, pinned),
            [(28 + 1024 + 4, None), (12 + 977 + 3 + 4, None)],
            "gather {gather} lightpath_peer {lightpath_peer} pinned {pinned}"
        );
    }
}
