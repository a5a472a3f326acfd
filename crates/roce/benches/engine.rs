//! Per-packet cost of the engine: two engines exchanging datagrams in memory (no sockets),
//! each datagram handed straight from one engine's `poll_transmit` to the other's
//! `handle_datagram`. Reported as datagrams per second on one core (requests and ACKs alike,
//! ICRC sealed and verified).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lightpath_roce::{CqHandle, Engine, EngineConfig, Time, VecMemory, MAX_DATAGRAM};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

struct Pair {
    engines: [Engine; 2],
    ips: [IpAddr; 2],
    qpns: [u32; 2],
    cqs: [CqHandle; 2],
    buf: Vec<u8>,
    wcs: Vec<WorkCompletion>,
    datagrams: u64,
}

impl Pair {
    fn new(mtu: Mtu, verify_icrc: bool) -> Self {
        let ips = [IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))];
        let mut engines =
            ips.map(|ip| Engine::new(EngineConfig { verify_icrc, ..EngineConfig::new(Gid::from_ip(ip)) }));
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let caps = QpCaps { max_send_wr: 1024, max_recv_wr: 1024, ..QpCaps::default() };
        let mut cqs = [CqHandle(0); 2];
        let mut qpns = [0; 2];
        for i in 0..2 {
            cqs[i] = engines[i].create_cq(8192).unwrap();
            qpns[i] = engines[i].create_qp(cqs[i], cqs[i], caps).unwrap();
            engines[i].modify_qp(Time::ZERO, qpns[i], &QpAttr::to_init(access)).unwrap();
        }
        for i in 0..2 {
            let av = AddressVector::new(Gid::from_ip(ips[1 - i]), 0);
            engines[i].modify_qp(Time::ZERO, qpns[i], &QpAttr::to_rtr(av, mtu, qpns[1 - i], 0)).unwrap();
            engines[i].modify_qp(Time::ZERO, qpns[i], &QpAttr::to_rts(0)).unwrap();
        }
        let wcs = vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 64];
        Self { engines, ips, qpns, cqs, buf: vec![0; MAX_DATAGRAM], wcs, datagrams: 0 }
    }

    /// Moves datagrams between the two engines until both are quiet.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            for from in 0..2 {
                let to = 1 - from;
                while let Some(t) = self.engines[from].poll_transmit(Time::ZERO, &mut self.buf) {
                    let (src, dst) = (self.ips[from], self.ips[to]);
                    self.engines[to].handle_datagram(Time::ZERO, src, dst, t.src_port, &self.buf[..t.len]);
                    self.datagrams += 1;
                    moved = true;
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn drain(&mut self, side: usize) -> usize {
        let mut total = 0;
        loop {
            let n = self.engines[side].poll_cq(self.cqs[side], &mut self.wcs);
            total += n;
            if n < self.wcs.len() {
                return total;
            }
        }
    }
}

fn sends(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    // 64-byte SENDs, 32 per batch: 32 SEND_ONLY + 32 ACKs per iteration.
    let mut pair = Pair::new(Mtu::Mtu4096, true);
    let src = Arc::new(VecMemory::new(64));
    let dst = Arc::new(VecMemory::new(64 * 32));
    let src_keys = pair.engines[0].reg_mr(src, 0x1000, AccessFlags::LOCAL_WRITE).unwrap();
    let dst_keys = pair.engines[1].reg_mr(dst, 0x8000, AccessFlags::LOCAL_WRITE).unwrap();
    let send_sge = [Sge { addr: 0x1000, length: 64, lkey: src_keys.lkey }];
    let recv_sges: Vec<[Sge; 1]> =
        (0..32).map(|i| [Sge { addr: 0x8000 + i * 64, length: 64, lkey: dst_keys.lkey }]).collect();
    let batch = |pair: &mut Pair| {
        for sges in &recv_sges {
            pair.engines[1].post_recv(pair.qpns[1], &RecvWr::new(1, sges)).unwrap();
        }
        for i in 0..32 {
            pair.engines[0]
                .post_send(Time::ZERO, pair.qpns[0], &SendWr::new(i, SendOp::Send, &send_sge))
                .unwrap();
        }
        pair.pump();
        assert_eq!(pair.drain(0), 32);
        assert_eq!(pair.drain(1), 32);
    };
    // Count the datagrams of one batch (32 SENDs plus however many coalesced ACKs).
    pair.datagrams = 0;
    batch(&mut pair);
    let per_batch = pair.datagrams;
    group.throughput(Throughput::Elements(per_batch));
    group.bench_function("send_64B_x32", |b| b.iter(|| batch(&mut pair)));
    println!("send_64B_x32: {per_batch} datagrams per batch of 32 SENDs");

    // 1 MiB RDMA WRITEs at PMTU 4096: 256 WRITE packets + 4 ACKs per iteration.
    for verify_icrc in [true, false] {
        let mut pair = Pair::new(Mtu::Mtu4096, verify_icrc);
        let len = 1 << 20;
        let src = Arc::new(VecMemory::new(len));
        let dst = Arc::new(VecMemory::new(len));
        let src_keys = pair.engines[0].reg_mr(src, 0x10_0000, AccessFlags::LOCAL_WRITE).unwrap();
        let dst_keys = pair.engines[1]
            .reg_mr(dst, 0x100_0000, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
        let sge = [Sge { addr: 0x10_0000, length: len as u32, lkey: src_keys.lkey }];
        let op = SendOp::Write { remote_addr: 0x100_0000, rkey: dst_keys.rkey };
        let name = if verify_icrc { "write_1MiB_mtu4096" } else { "write_1MiB_mtu4096_no_icrc_check" };
        let write = |pair: &mut Pair| {
            pair.engines[0].post_send(Time::ZERO, pair.qpns[0], &SendWr::new(1, op, &sge)).unwrap();
            pair.pump();
            assert_eq!(pair.drain(0), 1);
        };
        pair.datagrams = 0;
        write(&mut pair);
        let per_write = pair.datagrams;
        println!("{name}: {per_write} datagrams per WRITE");
        group.throughput(Throughput::Elements(per_write));
        group.bench_function(name, |b| b.iter(|| write(&mut pair)));
    }
    group.finish();
}

/// The engine's share of one `send_lat` half round trip: a SEND of `size` bytes goes out
/// (8 bytes inline, larger ones gathered from a registered region), the peer takes it (ICRC
/// check, receive completion, ACK), polls it and re-posts its receive. The ACK of each SEND
/// travels with the next message the other way, as the soft driver sends it.
fn ping_pong(c: &mut Criterion, size: usize) {
    let mut group = c.benchmark_group("engine");
    let mut pair = Pair::new(Mtu::Mtu4096, true);
    // Each side's region: the message to send at 0, the receive buffer at `size`.
    let regions = [Arc::new(VecMemory::new(2 * size)), Arc::new(VecMemory::new(2 * size))];
    let access = AccessFlags::LOCAL_WRITE;
    let keys = [0, 1].map(|i| pair.engines[i].reg_mr(regions[i].clone(), 0x2000, access).unwrap());
    let len = size as u32;
    let recv_sges = keys.map(|k| [Sge { addr: 0x2000 + size as u64, length: len, lkey: k.lkey }]);
    let send_sges = keys.map(|k| [Sge { addr: 0x2000, length: len, lkey: k.lkey }]);
    for (i, sge) in recv_sges.iter().enumerate() {
        for _ in 0..4 {
            pair.engines[i].post_recv(pair.qpns[i], &RecvWr::new(1, sge)).unwrap();
        }
    }
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut wcs = vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 8];
    let inline = vec![7u8; size];
    let mut from = 0;
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("send_{size}B_one_way"), |b| {
        b.iter(|| {
            let to = 1 - from;
            let wr = if size <= 8 {
                SendWr::inline(2, SendOp::Send, &inline)
            } else {
                SendWr::new(2, SendOp::Send, &send_sges[from])
            };
            pair.engines[from].post_send(Time::ZERO, pair.qpns[from], &wr).unwrap();
            while let Some(t) = pair.engines[from].poll_transmit(Time::ZERO, &mut buf) {
                let (src, dst) = (pair.ips[from], pair.ips[to]);
                pair.engines[to].handle_datagram(Time::ZERO, src, dst, t.src_port, &buf[..t.len]);
            }
            let mut received = false;
            while !received {
                let n = pair.engines[to].poll_cq(pair.cqs[to], &mut wcs);
                received = wcs[..n].iter().any(|wc| wc.opcode == WcOpcode::Recv);
                assert!(n > 0, "the SEND arrived");
            }
            pair.engines[to].post_recv(pair.qpns[to], &RecvWr::new(1, &recv_sges[to])).unwrap();
            from = to;
        })
    });
    group.finish();
}

fn ping_pongs(c: &mut Criterion) {
    ping_pong(c, 8);
    ping_pong(c, 4096);
}

criterion_group!(benches, sends, ping_pongs);
criterion_main!(benches);
