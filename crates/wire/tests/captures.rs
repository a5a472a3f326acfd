//! Every packet in `tests/vectors/` (Linux rxe captures between two VMs, and the worked
//! examples of the protocol digest) parses and carries a correct ICRC.

use std::net::IpAddr;
use std::path::PathBuf;

use lightpath_wire::icrc::{self, Endpoints, Ipv4IdFlags};
use lightpath_wire::{pretty, EthernetFrame, Ipv4Packet, Opcode, TransportRepr, UdpPacket, ROCE_V2_PORT};

/// The bytes on the last line of a vector file ("# one-line ... hex:" precedes it).
fn load(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
    (0..line.len() / 2).map(|i| u8::from_str_radix(&line[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn vector_names() -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".txt"))
        .collect();
    names.sort();
    names
}

/// The IP packet inside a vector: captures start at Ethernet, digest examples at IP.
fn ip_packet(bytes: &[u8]) -> &[u8] {
    if bytes[0] >> 4 == 4 || bytes[0] >> 4 == 6 {
        bytes
    } else {
        let frame = EthernetFrame::new_checked(bytes).unwrap();
        let offset = frame.header_len();
        &bytes[offset..]
    }
}

#[test]
fn there_are_eight_vectors() {
    assert_eq!(vector_names().len(), 8, "{:?}", vector_names());
}

#[test]
fn every_vector_has_a_correct_icrc() {
    for name in vector_names() {
        let bytes = load(&name);
        let (computed, found) = icrc::check_ip_packet(ip_packet(&bytes)).unwrap();
        assert_eq!(computed, found, "{name}");
    }
}

#[test]
fn every_vector_parses_and_reemits_byte_for_byte() {
    for name in vector_names() {
        let bytes = load(&name);
        let ip = Ipv4Packet::new_checked(ip_packet(&bytes)).unwrap();
        let udp = UdpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!(udp.dst_port(), ROCE_V2_PORT);
        let datagram = udp.payload();
        let repr = TransportRepr::parse(datagram).unwrap_or_else(|e| panic!("{name}: {e}"));
        let info = repr.header.check().unwrap();
        assert_eq!(repr.buffer_len(), datagram.len(), "{name}");
        let mut out = vec![0u8; repr.buffer_len()];
        repr.emit(&mut out).unwrap();
        // Everything but the ICRC slot (and the masked BTH byte 4, which a ConnectX CNP sets).
        assert_eq!(out[..4], datagram[..4], "{name}");
        assert_eq!(out[5..out.len() - 4], datagram[5..datagram.len() - 4], "{name}");
        // The UDP-socket receive path: verify with addresses only, solving for ID and flags.
        let endpoints = Endpoints {
            src: IpAddr::V4(ip.src_addr()),
            dst: IpAddr::V4(ip.dst_addr()),
            src_port: udp.src_port(),
            dst_port: udp.dst_port(),
        };
        assert!(icrc::verify(&endpoints, datagram), "{name}");
        assert_eq!(
            icrc::solve_ipv4_id_flags(&endpoints, datagram),
            Some(Ipv4IdFlags { ident: ip.ident(), flags_frag: ip.flags_frag() }),
            "{name}"
        );
        // The captured packets respect the payload rules at rxe's PMTU of 1024.
        if info.kind != lightpath_wire::OpKind::Cnp {
            repr.check_payload_len(1024).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}

#[test]
fn capture_fields_match_the_file_comments() {
    let ack_bytes = load("two-vm-rc-ack.txt");
    let ack = TransportRepr::parse(udp_payload(&ack_bytes)).unwrap();
    assert_eq!(ack.header.bth.opcode, Opcode::RC_ACKNOWLEDGE);
    assert_eq!(ack.header.bth.psn.value(), 0x606af9);
    assert_eq!(ack.header.aeth.map(|a| (a.syndrome.to_byte(), a.msn)), Some((0x1f, 1)));
    let read_bytes = load("two-vm-rc-rdma-read-request.txt");
    let read = TransportRepr::parse(udp_payload(&read_bytes)).unwrap();
    let reth = read.header.reth.unwrap();
    assert_eq!((reth.va, reth.rkey, reth.dma_len), (0x5587_eca4_f000, 0x5cd, 64));
    let first_bytes = load("two-vm-rc-rdma-write-first.txt");
    let first = TransportRepr::parse(udp_payload(&first_bytes)).unwrap();
    assert_eq!(first.payload.len(), 1024);
    assert_eq!(first.header.reth.unwrap().dma_len, 2500);
    let send_bytes = load("two-vm-rc-send-only.txt");
    let send = TransportRepr::parse(udp_payload(&send_bytes)).unwrap();
    assert_eq!(send.payload, &[0x7b; 64][..]);
    assert!(send.header.bth.ack_req);
}

fn udp_payload(bytes: &[u8]) -> &[u8] {
    let ip = ip_packet(bytes);
    let udp_len = usize::from(u16::from_be_bytes([ip[24], ip[25]]));
    &ip[28..20 + udp_len]
}

#[test]
fn every_vector_pretty_prints_as_good() {
    for name in vector_names() {
        let bytes = load(&name);
        let dump = if bytes[0] >> 4 == 4 { pretty::ip_packet(&bytes) } else { pretty::frame(&bytes) };
        assert!(dump.is_good(), "{name}:\n{dump}");
        assert!(dump.summary().ends_with("icrc ok"), "{name}: {}", dump.summary());
    }
}
