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
/// comes back, and whether they were all marked segmentable.
fn burst_before_any_ack(lightpath_peer: bool) -> (usize, bool) {
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
    let (mut count, mut all_segmentable) = (0, true);
    while let Some(transmit) = engine.poll_transmit(Time::ZERO, &mut buf) {
        count += 1;
        all_segmentable &= transmit.segmentable;
        assert!(count <= 4096, "the window never closed");
    }
    (count, all_segmentable)
}

#[test]
fn lightpath_peers_get_a_wider_window_and_segmentable_datagrams() {
    assert_eq!(burst_before_any_ack(false), (128, false), "rxe's window towards other peers");
    assert_eq!(burst_before_any_ack(true), (1024, true));
}
