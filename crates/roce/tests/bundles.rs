//! Acknowledgement bundles: between two Lightpath soft devices whose address vectors say
//! `lightpath_bundles`, an RC Acknowledge may share a datagram with the request behind it
//! (the soft driver puts them together). The engine takes such a datagram apart and handles
//! both packets; towards anybody else it stays what it is for rxe, a malformed ACK.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use lightpath_roce::{
    CqHandle, Engine, EngineConfig, Time, Transmit, VecMemory, ACK_DATAGRAM_LEN, MAX_DATAGRAM,
};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};
use lightpath_wire::Opcode;

const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const SEND_ADDR: u64 = 0x10_0000;
const RECV_ADDR: u64 = 0x20_0000;

struct Side {
    engine: Engine,
    qpn: u32,
    cq: CqHandle,
    send_lkey: u32,
    recv_lkey: u32,
}

/// An engine at `ip` with one queue pair connected to the same-numbered one at `peer`, a
/// region holding `message` to send from and one to receive into.
fn side(ip: IpAddr, peer: IpAddr, lightpath_peer: bool, bundles: bool, message: &[u8]) -> Side {
    let mut engine = Engine::new(EngineConfig::new(Gid::from_ip(ip)));
    let cq = engine.create_cq(16).expect("cq");
    let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("init");
    let av = AddressVector {
        lightpath_peer,
        lightpath_bundles: bundles,
        ..AddressVector::new(Gid::from_ip(peer), 0)
    };
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, qpn, 100)).expect("rtr");
    engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(100)).expect("rts");
    let send = Arc::new(VecMemory::from_bytes(message.to_vec()));
    let send_lkey = engine.reg_mr(send, SEND_ADDR, AccessFlags::LOCAL_WRITE).expect("mr").lkey;
    let recv = Arc::new(VecMemory::new(64));
    let recv_lkey = engine.reg_mr(recv, RECV_ADDR, AccessFlags::LOCAL_WRITE).expect("mr").lkey;
    Side { engine, qpn, cq, send_lkey, recv_lkey }
}

impl Side {
    fn post_recv(&mut self, id: u64) {
        let room = [Sge { addr: RECV_ADDR, length: 64, lkey: self.recv_lkey }];
        self.engine.post_recv(self.qpn, &RecvWr::new(id, &room)).expect("recv");
    }

    fn send(&mut self, id: u64, len: u32) {
        let sge = [Sge { addr: SEND_ADDR, length: len, lkey: self.send_lkey }];
        self.engine.post_send(Time::ZERO, self.qpn, &SendWr::new(id, SendOp::Send, &sge)).expect("post");
    }

    /// Everything the engine has to send now.
    fn transmit(&mut self) -> Vec<(Transmit, Vec<u8>)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while let Some(transmit) = self.engine.poll_transmit(Time::ZERO, &mut buf) {
            out.push((transmit, buf[..transmit.len].to_vec()));
        }
        out
    }

    fn completions(&mut self) -> Vec<(u64, WcOpcode)> {
        let mut wcs = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 8];
        let n = self.engine.poll_cq(self.cq, &mut wcs);
        wcs[..n]
            .iter()
            .map(|wc| {
                assert!(wc.status.is_success(), "{wc:?}");
                (wc.wr_id, wc.opcode)
            })
            .collect()
    }
}

/// A datagram as an engine produced it.
type Datagram = (Transmit, Vec<u8>);

/// A sends B a message; B acknowledges it and sends its reply. Returns A, and B's ACK and
/// reply datagrams.
fn exchange(lightpath_peer: bool, bundles: bool) -> (Side, Datagram, Datagram) {
    let mut a = side(A, B, lightpath_peer, bundles, b"request!");
    let mut b = side(B, A, lightpath_peer, bundles, b"reply");
    b.post_recv(10);
    a.post_recv(20);
    a.send(1, 8);
    for (transmit, datagram) in a.transmit() {
        b.engine.handle_datagram(Time::ZERO, A, B, transmit.src_port, &datagram);
    }
    assert_eq!(b.completions(), [(10, WcOpcode::Recv)]);
    b.send(2, 5);
    let out = b.transmit();
    let is_ack = |d: &[u8]| d[0] == Opcode::RC_ACKNOWLEDGE.0;
    let ack = out.iter().find(|(_, d)| is_ack(d)).cloned().expect("B acknowledges A's message");
    let reply = out.iter().find(|(_, d)| !is_ack(d)).cloned().expect("B's reply");
    (a, ack, reply)
}

#[test]
fn a_bundle_delivers_the_acknowledgement_and_the_request() {
    let (mut a, (ack_tx, ack), (reply_tx, reply)) = exchange(true, true);
    assert_eq!(ack.len(), ACK_DATAGRAM_LEN);
    assert!(ack_tx.bundles && reply_tx.bundles, "both may be bundled: {ack_tx:?} {reply_tx:?}");
    let bundle = [ack, reply].concat();
    a.engine.handle_datagram(Time::ZERO, B, A, ack_tx.src_port, &bundle);
    let mut got = a.completions();
    got.sort_by_key(|&(id, _)| id);
    assert_eq!(got, [(1, WcOpcode::Send), (20, WcOpcode::Recv)], "A's send completed and B's reply arrived");
    let stats = a.engine.stats();
    assert_eq!((stats.rx_bundles, stats.rx_datagrams, stats.total_drops()), (1, 2, 0));
}

#[test]
fn only_lightpath_peers_take_bundles() {
    // Towards rxe or an RNIC (no `lightpath_peer`), nothing is marked for bundling, and a
    // datagram shaped like a bundle is a malformed acknowledgement: dropped whole.
    let (mut a, (ack_tx, ack), (reply_tx, reply)) = exchange(false, true);
    assert!(!ack_tx.bundles && !reply_tx.bundles);
    a.engine.handle_datagram(Time::ZERO, B, A, ack_tx.src_port, &[ack, reply].concat());
    assert_eq!(a.completions(), []);
    let stats = a.engine.stats();
    assert_eq!((stats.rx_bundles, stats.total_drops()), (0, 1));
    // A Lightpath peer that did not negotiate bundles is never sent one, but takes one.
    let (mut a, (ack_tx, ack), (reply_tx, reply)) = exchange(true, false);
    assert!(!ack_tx.bundles && !reply_tx.bundles);
    a.engine.handle_datagram(Time::ZERO, B, A, ack_tx.src_port, &[ack, reply].concat());
    assert_eq!(a.completions().len(), 2);
}

#[test]
fn a_full_size_request_has_no_room_for_an_acknowledgement() {
    // A request whose datagram is as large as the path allows is not marked: with an ACK in
    // front it would exceed the link's MTU.
    let message = vec![7u8; 1024];
    let mut a = side(A, B, true, true, &message);
    a.send(1, 1024);
    let out = a.transmit();
    assert_eq!(out.len(), 1);
    assert!(!out[0].0.bundles, "a 1,024-byte SEND at MTU 1024 fills its datagram");
    // BTH + payload + ICRC + the ACK's 20 bytes must not exceed a middle packet (BTH, 1,024
    // bytes of payload, ICRC).
    let fits = 1024 - ACK_DATAGRAM_LEN as u32;
    let mut a = side(A, B, true, true, &message);
    a.send(1, fits);
    assert!(a.transmit()[0].0.bundles, "{fits} bytes leave room");
    let mut a = side(A, B, true, true, &message);
    a.send(1, fits + 1);
    assert!(!a.transmit()[0].0.bundles, "{} bytes do not", fits + 1);
}

#[test]
fn whatever_follows_an_acknowledgement_is_handled_or_counted_as_a_drop() {
    // A Lightpath peer's queue pair (so bundles are taken apart) gets a valid ACK followed by
    // bytes that are not a valid packet for it: the ACK still completes A's send, the rest is
    // counted as exactly one drop, and nothing panics.
    let tails: Vec<Vec<u8>> = vec![
        vec![0x04],                                                             // one byte: not even a BTH
        vec![0xFF; 19],                                                         // an unknown opcode
        vec![0x04, 0, 0xFF, 0xFF, 0, 0, 0, 0x12, 0, 0, 0, 7],                   // SEND ONLY with no ICRC room
        vec![0x04, 0, 0xFF, 0xFF, 0, 0x77, 0x77, 0x77, 0, 0, 0, 7, 0, 0, 0, 0], // unknown QP
    ];
    for tail in tails {
        let (mut a, (ack_tx, ack), _) = exchange(true, true);
        let drops = a.engine.stats().total_drops();
        a.engine.handle_datagram(Time::ZERO, B, A, ack_tx.src_port, &[ack.clone(), tail.clone()].concat());
        assert_eq!(a.completions(), [(1, WcOpcode::Send)], "tail {tail:02x?}");
        let stats = a.engine.stats();
        assert_eq!((stats.rx_bundles, stats.total_drops() - drops), (1, 1), "tail {tail:02x?}");
    }
    // An ACK behind an ACK is the second packet, handled as a packet of its own (a duplicate
    // here: the first one already completed the send).
    let (mut a, (ack_tx, ack), _) = exchange(true, true);
    a.engine.handle_datagram(Time::ZERO, B, A, ack_tx.src_port, &[ack.clone(), ack].concat());
    assert_eq!(a.completions(), [(1, WcOpcode::Send)]);
    assert_eq!(a.engine.stats().rx_bundles, 1);
}
