//! Steady-state traffic between two engines for N rounds (each round: a 3000-byte SEND, WRITE
//! and READ at PMTU 1024, 11 datagrams), for checking that the engine allocates nothing per
//! packet: the heap-allocation count must not grow with N, e.g.
//!
//! ```text
//! cargo build --release -p lightpath-roce --example steady_state
//! valgrind target/release/examples/steady_state 100  2>&1 | grep 'total heap usage'
//! valgrind target/release/examples/steady_state 1000 2>&1 | grep 'total heap usage'
//! ```
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use lightpath_roce::{CqHandle, Engine, EngineConfig, Time, VecMemory, MAX_DATAGRAM};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

fn main() {
    let rounds: u64 = std::env::args().nth(1).and_then(|arg| arg.parse().ok()).unwrap_or(1000);
    let ips = [IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))];
    let mut engines = ips.map(|ip| Engine::new(EngineConfig::new(Gid::from_ip(ip))));
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mut cqs = [CqHandle(0); 2];
    let mut qpns = [0; 2];
    for side in 0..2 {
        cqs[side] = engines[side].create_cq(4096).unwrap();
        qpns[side] = engines[side].create_qp(cqs[side], cqs[side], QpCaps::default()).unwrap();
        engines[side].modify_qp(Time::ZERO, qpns[side], &QpAttr::to_init(access)).unwrap();
    }
    for side in 0..2 {
        let peer = 1 - side;
        let av = AddressVector::new(Gid::from_ip(ips[peer]), 0);
        let rtr = QpAttr::to_rtr(av, Mtu::Mtu1024, qpns[peer], 0);
        engines[side].modify_qp(Time::ZERO, qpns[side], &rtr).unwrap();
        engines[side].modify_qp(Time::ZERO, qpns[side], &QpAttr::to_rts(0)).unwrap();
    }
    let requester_keys = engines[0].reg_mr(Arc::new(VecMemory::new(1 << 16)), 0x1000, access).unwrap();
    let responder_keys = engines[1].reg_mr(Arc::new(VecMemory::new(1 << 16)), 0x1000, access).unwrap();
    let mut datagram = vec![0u8; MAX_DATAGRAM];
    let mut completions = vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 64];
    let local = [Sge { addr: 0x1000, length: 3000, lkey: requester_keys.lkey }];
    let receive = [Sge { addr: 0x1000, length: 4000, lkey: responder_keys.lkey }];
    let write = SendOp::Write { remote_addr: 0x2000, rkey: responder_keys.rkey };
    let read = SendOp::Read { remote_addr: 0x2000, rkey: responder_keys.rkey };
    for round in 0..rounds {
        let now = Time::from_nanos((round + 1) * 1000);
        engines[1].post_recv(qpns[1], &RecvWr::new(round, &receive)).unwrap();
        for op in [SendOp::Send, write, read] {
            engines[0].post_send(now, qpns[0], &SendWr::new(round, op, &local)).unwrap();
        }
        loop {
            let mut moved = false;
            for from in 0..2 {
                let to = 1 - from;
                while let Some(t) = engines[from].poll_transmit(now, &mut datagram) {
                    engines[to].handle_datagram(now, ips[from], ips[to], t.src_port, &datagram[..t.len]);
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for side in 0..2 {
            while engines[side].poll_cq(cqs[side], &mut completions) > 0 {}
            while engines[side].poll_event().is_some() {}
            engines[side].handle_timeout(now);
        }
    }
    println!("{} datagrams", engines[0].stats().tx_datagrams + engines[1].stats().tx_datagrams);
}
