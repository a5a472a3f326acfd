//! Two engines that share one IP address and listen on different UDP ports (two processes
//! with soft devices on one host), connected through the address vector's `udp_dport`: every
//! kind of datagram — requests, ACKs, READ responses, atomic ACKs and retransmissions — must go
//! to the peer's port with an ICRC sealed for it, and be accepted although it comes from a
//! port other than the receiver's.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use lightpath_roce::{CqHandle, Engine, EngineConfig, MrKeys, Time, VecMemory, MAX_DATAGRAM};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};
use lightpath_wire::icrc::{self, Endpoints};
use lightpath_wire::Opcode;

/// The one address both engines have.
const SHARED_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
/// Each engine's receive port, which is also the source port of everything it sends.
const PORTS: [u16; 2] = [5000, 6000];
const REGION: usize = 8192;
const REGION_ADDR: u64 = 0x10_0000;

struct Node {
    engine: Engine,
    cq: CqHandle,
    qpn: u32,
    memory: Arc<VecMemory>,
    keys: MrKeys,
}

impl Node {
    fn new(index: usize) -> Self {
        let config = EngineConfig {
            roce_port: PORTS[index],
            fixed_src_port: Some(PORTS[index]),
            ..EngineConfig::new(Gid::from_ip(SHARED_IP))
        };
        let mut engine = Engine::new(config);
        let cq = engine.create_cq(64).expect("cq");
        let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
        let pattern = (0..REGION).map(|i| (i * 7 + index * 101) as u8).collect();
        let memory = Arc::new(VecMemory::from_bytes(pattern));
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        let keys = engine.reg_mr(memory.clone(), REGION_ADDR, access).expect("mr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(access)).expect("init");
        Node { engine, cq, qpn, memory, keys }
    }

    fn sge(&self, offset: u64, length: u32) -> Sge {
        Sge { addr: REGION_ADDR + offset, length, lkey: self.keys.lkey }
    }

    fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        self.memory.snapshot()[offset..offset + len].to_vec()
    }

    fn completions(&mut self) -> Vec<WorkCompletion> {
        let mut wcs = [WorkCompletion::new(0, WcStatus::WrFlushErr, WcOpcode::Send, 0); 64];
        let n = self.engine.poll_cq(self.cq, &mut wcs);
        wcs[..n].to_vec()
    }
}

/// What crossed the wire, by kind.
#[derive(Debug, Default)]
struct Tally {
    requests: usize,
    acks: usize,
    read_responses: usize,
    atomic_acks: usize,
    dropped: usize,
}

/// Both nodes connected to each other's port (`udp_dport`), or with `udp_dport` 0.
fn connected(udp_dport_set: bool) -> [Node; 2] {
    let mut nodes = [Node::new(0), Node::new(1)];
    let qpns = [nodes[0].qpn, nodes[1].qpn];
    for (i, node) in nodes.iter_mut().enumerate() {
        let udp_dport = if udp_dport_set { PORTS[1 - i] } else { 0 };
        let av = AddressVector { udp_dport, ..AddressVector::new(Gid::from_ip(SHARED_IP), 0) };
        let rtr = QpAttr::to_rtr(av, Mtu::Mtu1024, qpns[1 - i], 100 * (1 - i as u32));
        node.engine.modify_qp(Time::ZERO, node.qpn, &rtr).expect("rtr");
        node.engine.modify_qp(Time::ZERO, node.qpn, &QpAttr::to_rts(100 * i as u32)).expect("rts");
    }
    nodes
}

/// Moves datagrams (routed by destination port, as the kernel would) and fires timers until
/// nothing is left, dropping the datagrams `drop` picks the first time each is offered.
fn run(nodes: &mut [Node; 2], now: &mut Time, mut drop: impl FnMut(Opcode) -> bool) -> Tally {
    let mut tally = Tally::default();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    for _ in 0..100_000 {
        let mut moved = false;
        for from in 0..2 {
            while let Some(t) = nodes[from].engine.poll_transmit(*now, &mut buf) {
                moved = true;
                let datagram = &buf[..t.len];
                assert_eq!((t.dst, t.dst_port, t.src_port), (SHARED_IP, PORTS[1 - from], PORTS[from]));
                let sealed =
                    Endpoints { src: SHARED_IP, dst: t.dst, src_port: t.src_port, dst_port: t.dst_port };
                assert!(icrc::verify(&sealed, datagram), "ICRC sealed for the peer's port");
                let opcode = Opcode(datagram[0]);
                match opcode {
                    Opcode::RC_ACKNOWLEDGE => tally.acks += 1,
                    Opcode::RC_ATOMIC_ACKNOWLEDGE => tally.atomic_acks += 1,
                    op if op.info().is_some_and(|info| info.is_response()) => tally.read_responses += 1,
                    _ => tally.requests += 1,
                }
                if drop(opcode) {
                    tally.dropped += 1;
                    continue;
                }
                let to = PORTS.iter().position(|&port| port == t.dst_port).expect("a listening port");
                nodes[to].engine.handle_datagram(*now, SHARED_IP, SHARED_IP, t.src_port, datagram);
            }
        }
        if moved {
            continue;
        }
        let Some(next) = nodes.iter().filter_map(|node| node.engine.poll_timeout()).min() else {
            return tally;
        };
        *now = next.max(*now);
        for node in nodes.iter_mut() {
            node.engine.handle_timeout(*now);
        }
    }
    panic!("the exchange did not settle");
}

/// Drops the first datagram of each listed opcode.
fn drop_first_of(opcodes: &[Opcode]) -> impl FnMut(Opcode) -> bool + '_ {
    let mut dropped = Vec::new();
    move |opcode| {
        let first = opcodes.contains(&opcode) && !dropped.contains(&opcode);
        if first {
            dropped.push(opcode);
        }
        first
    }
}

#[test]
fn every_kind_of_datagram_goes_to_the_peers_port() {
    let mut nodes = connected(true);
    let mut now = Time::ZERO;
    let before = [nodes[0].memory.snapshot(), nodes[1].memory.snapshot()];
    let rkeys = [nodes[0].keys.rkey, nodes[1].keys.rkey];
    // B takes a SEND at 4096 and a WRITE with immediate; A takes a SEND at 6144.
    let b_recv = [nodes[1].sge(4096, 2048)];
    nodes[1].engine.post_recv(nodes[1].qpn, &RecvWr::new(10, &b_recv)).expect("recv");
    nodes[1].engine.post_recv(nodes[1].qpn, &RecvWr::new(11, &b_recv)).expect("recv");
    let a_recv = [nodes[0].sge(6144, 2048)];
    nodes[0].engine.post_recv(nodes[0].qpn, &RecvWr::new(20, &a_recv)).expect("recv");

    // A: SEND 1500 bytes, WRITE 2000 bytes with immediate to B's 2048, READ B's first 2000
    // bytes into its 3000, fetch-and-add on B's word at 8000 (the old value to A's 5504).
    let a = &nodes[0];
    let (a_send, a_write, a_read, a_old) =
        ([a.sge(0, 1500)], [a.sge(0, 2000)], [a.sge(3000, 2000)], [a.sge(5504, 8)]);
    let write = SendOp::WriteWithImm { remote_addr: REGION_ADDR + 2048, rkey: rkeys[1], imm: 0xFEED };
    let read = SendOp::Read { remote_addr: REGION_ADDR, rkey: rkeys[1] };
    let add = SendOp::FetchAdd { remote_addr: REGION_ADDR + 8000, rkey: rkeys[1], add: 5 };
    let posts = [
        SendWr::new(1, SendOp::Send, &a_send),
        SendWr::new(2, write, &a_write),
        SendWr::new(3, read, &a_read),
        SendWr::new(4, add, &a_old),
    ];
    for wr in &posts {
        nodes[0].engine.post_send(now, nodes[0].qpn, wr).expect("post from A");
    }
    // B: SEND 1200 bytes, READ 900 bytes of A's from 1000 into its 7000.
    let (b_send, b_read) = ([nodes[1].sge(100, 1200)], [nodes[1].sge(7000, 900)]);
    let read = SendOp::Read { remote_addr: REGION_ADDR + 1000, rkey: rkeys[0] };
    nodes[1]
        .engine
        .post_send(now, nodes[1].qpn, &SendWr::new(5, SendOp::Send, &b_send))
        .expect("send from B");
    nodes[1].engine.post_send(now, nodes[1].qpn, &SendWr::new(6, read, &b_read)).expect("read from B");

    // One lost request and one lost READ response come back as retransmissions, which must
    // go to the same port as the originals.
    let lost = [Opcode::RC_SEND_FIRST, Opcode::RC_RDMA_READ_RESPONSE_FIRST];
    let tally = run(&mut nodes, &mut now, drop_first_of(&lost));
    assert_eq!(tally.dropped, 2, "{tally:?}");
    assert!(tally.requests > 0 && tally.acks > 0 && tally.read_responses > 0, "{tally:?}");
    assert_eq!(tally.atomic_acks, 1, "{tally:?}");

    let mut a_done = nodes[0].completions();
    let mut b_done = nodes[1].completions();
    a_done.sort_by_key(|wc| wc.wr_id);
    b_done.sort_by_key(|wc| wc.wr_id);
    let summary = |wcs: &[WorkCompletion]| {
        wcs.iter().map(|wc| (wc.wr_id, wc.status, wc.opcode, wc.imm_data)).collect::<Vec<_>>()
    };
    let ok = WcStatus::Success;
    assert_eq!(
        summary(&a_done),
        [
            (1, ok, WcOpcode::Send, None),
            (2, ok, WcOpcode::RdmaWrite, None),
            (3, ok, WcOpcode::RdmaRead, None),
            (4, ok, WcOpcode::FetchAdd, None),
            (20, ok, WcOpcode::Recv, None),
        ]
    );
    assert_eq!(
        summary(&b_done),
        [
            (5, ok, WcOpcode::Send, None),
            (6, ok, WcOpcode::RdmaRead, None),
            (10, ok, WcOpcode::Recv, None),
            (11, ok, WcOpcode::RecvRdmaWithImm, Some(0xFEED)),
        ]
    );
    assert_eq!(nodes[1].bytes(4096, 1500), before[0][..1500], "A's SEND");
    assert_eq!(nodes[1].bytes(2048, 2000), before[0][..2000], "A's WRITE");
    assert_eq!(nodes[0].bytes(3000, 2000), before[1][..2000], "A's READ");
    assert_eq!(nodes[0].bytes(5504, 8), before[1][8000..8008], "the value A's fetch-and-add found");
    let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().expect("8 bytes"));
    assert_eq!(word(&nodes[1].bytes(8000, 8)), word(&before[1][8000..8008]).wrapping_add(5));
    assert_eq!(nodes[0].bytes(6144, 1200), before[1][100..1300], "B's SEND");
    assert_eq!(nodes[1].bytes(7000, 900), before[0][1000..1900], "B's READ");
    for node in &nodes {
        let stats = node.engine.stats();
        assert_eq!(stats.drops_icrc + stats.drops_wrong_peer + stats.drops_unknown_qp, 0, "{stats:?}");
    }
}

#[test]
fn without_a_port_each_engine_sends_to_its_own() {
    let mut nodes = connected(false);
    let sge = [nodes[0].sge(0, 64)];
    nodes[0].engine.post_send(Time::ZERO, nodes[0].qpn, &SendWr::new(1, SendOp::Send, &sge)).expect("post");
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let t = nodes[0].engine.poll_transmit(Time::ZERO, &mut buf).expect("the SEND");
    assert_eq!((t.dst_port, t.src_port), (PORTS[0], PORTS[0]), "as before udp_dport existed");
    let sealed = Endpoints { src: SHARED_IP, dst: SHARED_IP, src_port: PORTS[0], dst_port: PORTS[0] };
    assert!(icrc::verify(&sealed, &buf[..t.len]));
    // Delivered to B anyway (to the port B does not listen on), its ICRC does not match.
    nodes[1].engine.handle_datagram(Time::ZERO, SHARED_IP, SHARED_IP, t.src_port, &buf[..t.len]);
    assert_eq!(nodes[1].engine.stats().drops_icrc, 1);
}
