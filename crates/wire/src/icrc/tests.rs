//! ICRC tests against the worked examples of digest §5.3 and single-bit corruption.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::*;
use crate::transport::TransportRepr;

fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits.chunks(2).map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap()).collect()
}

/// The ConnectX-4 Lx CNP from scapy's RoCE tests (IP header onwards), ICRC 0x2A00FD82.
fn connectx_cnp() -> Vec<u8> {
    hex("45c2003c718c400040119161 0a001101 0a001201 000012b700280000
         8100ffff40000118 00000000 00000000000000000000000000000000 82fd002a")
}

/// Scapy's UC SEND_ONLY unit-test packet: TOS 1, ID 1144, DF, TTL 64; checksums are masked,
/// so they are left zero here.
fn scapy_uc() -> Vec<u8> {
    hex("45010040 04784000 40110000 c0a80007 c0a80007 c00012b7002c0000
         2460ffff000000d300cf1710
         4630818be28935d90e9a95505401be885e500000 78f353f3")
}

/// Digest §5.3 self-made RC SEND_ONLY "hello" (ICRC 0x62D2D538).
fn self_made_send() -> Vec<u8> {
    hex("45000034123440004011b31ec0a87a0ac0a87a0bc13212b7002000000430ffff000000118012345668656c6c6f000000 38d5d262")
}

/// Digest §5.3 self-made RC ACK (ICRC 0x8768A9AB).
fn self_made_ack() -> Vec<u8> {
    hex("450000304321400040118235c0a87a0bc0a87a0ac13212b7001c00001100ffff00000012001234561f000001 aba96887")
}

fn ipv4_endpoints(packet: &[u8]) -> Endpoints {
    let ip = Ipv4Packet::new_checked(packet).unwrap();
    let udp = UdpPacket::new_checked(ip.payload()).unwrap();
    Endpoints {
        src: IpAddr::V4(ip.src_addr()),
        dst: IpAddr::V4(ip.dst_addr()),
        src_port: udp.src_port(),
        dst_port: udp.dst_port(),
    }
}

fn datagram_of(packet: &[u8]) -> &[u8] {
    let udp_len = usize::from(u16::from_be_bytes([packet[24], packet[25]]));
    &packet[28..20 + udp_len]
}

#[test]
fn worked_examples_match() {
    let cases = [
        (connectx_cnp(), 0x2A00_FD82u32),
        (scapy_uc(), 0xF353_F378),
        (self_made_send(), 0x62D2_D538),
        (self_made_ack(), 0x8768_A9AB),
    ];
    for (packet, expected) in cases {
        assert_eq!(check_ip_packet(&packet), Ok((expected, expected)));
    }
}

#[test]
fn verify_solves_the_real_id_and_flags() {
    for packet in [connectx_cnp(), scapy_uc(), self_made_send(), self_made_ack()] {
        let endpoints = ipv4_endpoints(&packet);
        let datagram = datagram_of(&packet);
        assert!(verify(&endpoints, datagram));
        let ip = Ipv4Packet::new_checked(&packet[..]).unwrap();
        assert_eq!(
            solve_ipv4_id_flags(&endpoints, datagram),
            Some(Ipv4IdFlags { ident: ip.ident(), flags_frag: ip.flags_frag() })
        );
    }
}

#[test]
fn seal_assumes_id_zero_and_df() {
    let packet = self_made_send();
    let endpoints = ipv4_endpoints(&packet);
    let mut datagram = datagram_of(&packet).to_vec();
    seal(&endpoints, &mut datagram).unwrap();
    // Rebuild the packet as a socket with IP_PMTUDISC_DO sends it and check it exactly.
    let mut rebuilt = packet.clone();
    rebuilt[4..6].copy_from_slice(&[0, 0]);
    rebuilt[28..].copy_from_slice(&datagram);
    let (computed, on_wire) = check_ip_packet(&rebuilt).unwrap();
    assert_eq!(computed, on_wire);
    assert_eq!(solve_ipv4_id_flags(&endpoints, &datagram), Some(Ipv4IdFlags::SOCKET_DEFAULT));
    assert!(verify(&endpoints, &datagram));
}

#[test]
fn ipv4_mapped_addresses_use_the_ipv4_pseudo_header() {
    let packet = self_made_ack();
    let plain = ipv4_endpoints(&packet);
    let map = |addr: IpAddr| match addr {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        other => other,
    };
    let mapped = Endpoints { src: map(plain.src), dst: map(plain.dst), ..plain };
    assert!(mapped.is_ipv4());
    assert!(verify(&mapped, datagram_of(&packet)));
    assert_eq!(compute(&mapped, datagram_of(&packet)), compute(&plain, datagram_of(&packet)));
}

fn ipv6_packet() -> (Endpoints, Vec<u8>) {
    let src = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x5054, 0xff, 0xfe77, 2);
    let dst = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x5054, 0xff, 0xfe77, 3);
    let endpoints = Endpoints { src: src.into(), dst: dst.into(), src_port: 0xC132, dst_port: 4791 };
    let datagram = datagram_of(&self_made_send()).to_vec();
    let mut packet = vec![0x60, 0, 0, 0];
    packet.extend_from_slice(&(8 + datagram.len() as u16).to_be_bytes());
    packet.extend_from_slice(&[17, 64]);
    packet.extend_from_slice(&src.octets());
    packet.extend_from_slice(&dst.octets());
    packet.extend_from_slice(&[0xC1, 0x32, 0x12, 0xB7]);
    packet.extend_from_slice(&(8 + datagram.len() as u16).to_be_bytes());
    packet.extend_from_slice(&[0, 0]);
    packet.extend_from_slice(&datagram);
    let at = packet.len() - 4;
    seal(&endpoints, &mut packet[48..]).unwrap();
    assert!(at > 48);
    (endpoints, packet)
}

#[test]
fn ipv6_seal_verify_and_capture_check_agree() {
    let (endpoints, packet) = ipv6_packet();
    assert!(!endpoints.is_ipv4());
    assert!(verify(&endpoints, &packet[48..]));
    let (computed, on_wire) = check_ip_packet(&packet).unwrap();
    assert_eq!(computed, on_wire);
    // Traffic class, flow label and hop limit are masked.
    let mut changed = packet.clone();
    changed[0..4].copy_from_slice(&[0x6A, 0xBC, 0xDE, 0xF1]);
    changed[7] = 1;
    assert_eq!(check_ip_packet(&changed).unwrap(), (computed, on_wire));
}

/// Positions (byte, mask) that the ICRC masks in an IPv4 packet: TOS, TTL, header checksum,
/// UDP checksum, BTH byte 4.
fn masked_ipv4_bytes() -> [usize; 7] {
    [1, 8, 10, 11, 26, 27, 28 + 4]
}

#[test]
fn every_covered_bit_matters_and_masked_bytes_do_not() {
    for packet in [self_made_send(), self_made_ack(), connectx_cnp()] {
        let (good, _) = check_ip_packet(&packet).unwrap();
        let covered_end = packet.len() - ICRC_LEN;
        for byte in 0..covered_end {
            for bit in 0..8 {
                let mut flipped = packet.clone();
                flipped[byte] ^= 1 << bit;
                let result = check_ip_packet(&flipped);
                if masked_ipv4_bytes().contains(&byte) {
                    assert_eq!(result.unwrap().0, good, "masked byte {byte}");
                } else if let Ok((computed, _)) = result {
                    // Length, version or protocol flips may make the packet unparsable; any
                    // packet that still parses must have a different CRC.
                    assert_ne!(computed, good, "byte {byte} bit {bit}");
                }
            }
        }
    }
}

#[test]
fn verify_rejects_every_single_bit_flip_of_small_datagrams() {
    for packet in [self_made_send(), self_made_ack(), connectx_cnp(), scapy_uc()] {
        let endpoints = ipv4_endpoints(&packet);
        let datagram = datagram_of(&packet).to_vec();
        for byte in 0..datagram.len() {
            for bit in 0..8 {
                let mut flipped = datagram.clone();
                flipped[byte] ^= 1 << bit;
                let accepted = verify(&endpoints, &flipped);
                assert_eq!(accepted, byte == crate::bth::ICRC_MASKED_BYTE, "byte {byte} bit {bit}");
            }
        }
        let (endpoints, packet) = ipv6_packet();
        for byte in 48..packet.len() {
            let mut flipped = packet.clone();
            flipped[byte] ^= 0x10;
            assert_eq!(verify(&endpoints, &flipped[48..]), byte == 48 + 4, "IPv6 byte {byte}");
        }
    }
}

#[test]
fn verify_false_accepts_are_rare_on_large_datagrams() {
    // A 4 KiB WRITE_MIDDLE: every single-bit flip is a corruption. With 17 free header bits
    // the solver can absorb some of them (probability 2^-15 each), but never many.
    let endpoints = Endpoints {
        src: Ipv4Addr::new(10, 0, 0, 1).into(),
        dst: Ipv4Addr::new(10, 0, 0, 2).into(),
        src_port: 0xC000,
        dst_port: 4791,
    };
    let mut datagram = vec![0u8; 12 + 4096 + 4];
    datagram[..12].copy_from_slice(&[0x07, 0, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 1]);
    for (i, byte) in datagram[12..12 + 4096].iter_mut().enumerate() {
        *byte = (i * 7 + 3) as u8;
    }
    seal(&endpoints, &mut datagram).unwrap();
    assert!(verify(&endpoints, &datagram));
    let mut accepted = 0;
    for byte in 12..datagram.len() {
        for bit in 0..8 {
            datagram[byte] ^= 1 << bit;
            accepted += usize::from(verify(&endpoints, &datagram));
            datagram[byte] ^= 1 << bit;
        }
    }
    // 32,864 flips × 2^-15 ≈ 1 expected; a broken solver would accept far more.
    assert!(accepted <= 8, "{accepted} single-bit corruptions accepted");
}

#[test]
fn masked_ipv4_fields_leave_the_icrc_unchanged() {
    for packet in [self_made_send(), self_made_ack()] {
        let expected = check_ip_packet(&packet).unwrap();
        let mut changed = packet.clone();
        changed[1] = 0xB8; // TOS
        changed[8] = 1; // TTL
        changed[10..12].copy_from_slice(&[0x12, 0x34]); // header checksum
        changed[26..28].copy_from_slice(&[0xAB, 0xCD]); // UDP checksum
        changed[28 + 4] = 0xC0; // FECN, BECN
        assert_eq!(check_ip_packet(&changed).unwrap(), expected);
        assert!(verify(&ipv4_endpoints(&changed), datagram_of(&changed)));
    }
}

#[test]
fn short_and_foreign_packets_are_errors_not_panics() {
    let packet = self_made_ack();
    for len in 0..packet.len() {
        let _ = check_ip_packet(&packet[..len]);
        assert!(!verify(&ipv4_endpoints(&packet), &datagram_of(&packet)[..len.min(19)]));
    }
    let mut options = packet.clone();
    options[0] = 0x46;
    assert!(check_ip_packet(&options).is_err());
    let mut tcp = packet.clone();
    tcp[9] = 6;
    assert!(matches!(check_ip_packet(&tcp), Err(Error::Malformed(_))));
    let mut endpoints = ipv4_endpoints(&packet);
    let mut datagram = [0u8; 15];
    assert_eq!(seal(&endpoints, &mut datagram), Err(Error::Truncated));
    endpoints.dst_port = 1;
    assert!(!verify(&endpoints, datagram_of(&packet)));
}

#[test]
fn sealed_datagrams_parse() {
    let packet = self_made_send();
    let repr = TransportRepr::parse(datagram_of(&packet)).unwrap();
    assert_eq!(repr.payload, b"hello");
}

#[test]
fn solutions_with_more_fragments_or_the_reserved_flag_are_refused() {
    // Datagrams whose ICRC was computed over a header with MF or the reserved flag set are
    // consistent, but no whole RoCE datagram is sent that way.
    let packet = self_made_ack();
    let endpoints = ipv4_endpoints(&packet);
    let Family::V4(src, dst) = endpoints.family() else { unreachable!() };
    let mut datagram = datagram_of(&packet).to_vec();
    let reseal = |ident: u16, flags: u16, datagram: &mut Vec<u8>| {
        let crc = compute_ipv4(src, dst, ident, flags, 0xC132, 4791, datagram).unwrap();
        let at = datagram.len() - 4;
        datagram[at..].copy_from_slice(&crc.to_le_bytes());
    };
    for flags in [0x2000u16, 0x8000, 0x6000] {
        reseal(0x4321, flags, &mut datagram);
        assert!(!verify(&endpoints, &datagram), "flags {flags:#06x}");
    }
    for flags in [0x0000u16, 0x4000] {
        reseal(0xBEEF, flags, &mut datagram);
        assert_eq!(
            solve_ipv4_id_flags(&endpoints, &datagram),
            Some(Ipv4IdFlags { ident: 0xBEEF, flags_frag: flags })
        );
    }
}
