//! Criterion benchmarks of the hot per-packet paths: transport parse and emit (64 B SEND_ONLY,
//! 4 KiB WRITE_MIDDLE, ACK), ICRC seal, and IPv4 ICRC verification with the ID/flags solve.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lightpath_wire::icrc::{self, Endpoints};
use lightpath_wire::{AethRepr, BthRepr, Opcode, Psn, Syndrome, TransportHeader, TransportRepr};

fn endpoints() -> Endpoints {
    Endpoints {
        src: Ipv4Addr::new(10, 77, 0, 3).into(),
        dst: Ipv4Addr::new(10, 77, 0, 2).into(),
        src_port: 0xC121,
        dst_port: 4791,
    }
}

/// (name, header, payload length) of the three benchmarked packets.
fn packets() -> Vec<(&'static str, TransportHeader, usize)> {
    let mut send = BthRepr::new(Opcode::RC_SEND_ONLY, 0x11, Psn::new(0x606af9));
    send.ack_req = true;
    let middle = BthRepr::new(Opcode::RC_RDMA_WRITE_MIDDLE, 0x13, Psn::new(0x2db5df));
    let mut ack = TransportHeader::new(BthRepr::new(Opcode::RC_ACKNOWLEDGE, 0x11, Psn::new(1)));
    ack.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 });
    vec![
        ("send_only_64", TransportHeader::new(send), 64),
        ("write_middle_4096", TransportHeader::new(middle), 4096),
        ("ack", ack, 0),
    ]
}

fn sealed(header: &TransportHeader, payload_len: usize) -> Vec<u8> {
    let payload: Vec<u8> = (0..payload_len).map(|i| i as u8).collect();
    let repr = TransportRepr { header: *header, payload: &payload };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    icrc::seal(&endpoints(), &mut buf).unwrap();
    buf
}

fn parse_and_emit(c: &mut Criterion) {
    let mut group = c.benchmark_group("transport");
    for (name, header, payload_len) in packets() {
        let datagram = sealed(&header, payload_len);
        group.throughput(Throughput::Bytes(datagram.len() as u64));
        group.bench_function(format!("parse/{name}"), |b| {
            b.iter(|| TransportRepr::parse(black_box(&datagram)).unwrap().payload.len())
        });
        let payload = vec![0x5Au8; payload_len];
        let mut buf = vec![0u8; datagram.len()];
        group.bench_function(format!("emit/{name}"), |b| {
            b.iter(|| {
                let repr = TransportRepr { header: black_box(header), payload: &payload };
                repr.emit(black_box(&mut buf)).unwrap()
            })
        });
    }
    group.finish();
}

fn icrc_paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("icrc");
    let endpoints = endpoints();
    for (name, header, payload_len) in packets().into_iter().take(2) {
        let mut datagram = sealed(&header, payload_len);
        group.throughput(Throughput::Bytes(datagram.len() as u64));
        group.bench_function(format!("seal/{name}"), |b| {
            b.iter(|| icrc::seal(black_box(&endpoints), black_box(&mut datagram)).unwrap())
        });
        group.bench_function(format!("verify_ipv4_solve/{name}"), |b| {
            b.iter(|| assert!(icrc::verify(black_box(&endpoints), black_box(&datagram))))
        });
        group.bench_function(format!("crc32_only/{name}"), |b| {
            b.iter(|| crc32fast::hash(black_box(&datagram)))
        });
    }
    group.finish();
}

criterion_group!(benches, parse_and_emit, icrc_paths);
criterion_main!(benches);
