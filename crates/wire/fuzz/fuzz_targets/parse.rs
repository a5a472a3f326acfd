//! Feeds arbitrary bytes to every parser of lightpath-wire: nothing may panic, and whatever
//! parses must survive parse → emit → parse unchanged.

#![no_main]

use std::net::Ipv4Addr;

use libfuzzer_sys::fuzz_target;
use lightpath_wire::capture::{hex_text, pcap};
use lightpath_wire::icrc::{self, Endpoints};
use lightpath_wire::{
    pretty, AethPacket, AethRepr, AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr,
    BthPacket, BthRepr, DethPacket, DethRepr, EthernetFrame, EthernetRepr, IethPacket, ImmDtPacket,
    Ipv4Packet, Ipv4Repr, Ipv6Packet, Ipv6Repr, RethPacket, RethRepr, TransportRepr, UdpPacket, UdpRepr,
};

/// Parses a header, emits it into a buffer of `$len(&repr)` bytes (header plus whatever
/// payload its length fields announce), and checks the re-parse matches.
macro_rules! round_trip {
    ($data:expr, $packet:ident, $repr:ident) => {
        round_trip!($data, $packet, $repr, |repr: &$repr| repr.buffer_len())
    };
    ($data:expr, $packet:ident, $repr:ident, $len:expr) => {
        if let Ok(packet) = $packet::new_checked($data) {
            if let Ok(repr) = $repr::parse(&packet) {
                let mut out = vec![0u8; $len(&repr)];
                repr.emit(&mut $packet::new_unchecked(&mut out[..])).expect("emit");
                let again = $repr::parse(&$packet::new_checked(&out[..]).expect("check"));
                assert_eq!(again, Ok(repr));
            }
        }
    };
}

fuzz_target!(|data: &[u8]| {
    // The whole transport packet.
    if let Ok(repr) = TransportRepr::parse(data) {
        assert_eq!(repr.buffer_len(), data.len());
        let mut out = vec![0u8; repr.buffer_len()];
        assert_eq!(repr.emit(&mut out), Ok(data.len()));
        assert_eq!(TransportRepr::parse(&out), Ok(repr));
        let _ = repr.check_payload_len(1024);
    }

    // Each header on its own.
    round_trip!(data, BthPacket, BthRepr);
    round_trip!(data, RethPacket, RethRepr);
    round_trip!(data, AethPacket, AethRepr);
    round_trip!(data, AtomicEthPacket, AtomicEthRepr);
    round_trip!(data, AtomicAckEthPacket, AtomicAckEthRepr);
    round_trip!(data, DethPacket, DethRepr);
    round_trip!(data, UdpPacket, UdpRepr, |r: &UdpRepr| 8 + r.payload_len);
    round_trip!(data, Ipv6Packet, Ipv6Repr, |r: &Ipv6Repr| 40 + r.payload_len);
    round_trip!(data, Ipv4Packet, Ipv4Repr, |r: &Ipv4Repr| 20 + r.payload_len);
    if let Ok(packet) = ImmDtPacket::new_checked(data) {
        let _ = packet.imm();
    }
    if let Ok(packet) = IethPacket::new_checked(data) {
        let _ = packet.rkey();
    }
    if let Ok(packet) = Ipv4Packet::new_checked(data) {
        let _ = (packet.verify_checksum(), packet.payload().len(), packet.frag_offset());
    }
    if let Ok(frame) = EthernetFrame::new_checked(data) {
        let _ = frame.payload().len();
        if let Ok(repr) = EthernetRepr::parse(&frame) {
            let mut out = vec![0u8; repr.buffer_len()];
            repr.emit(&mut out).expect("emit");
            assert_eq!(out[..], data[..repr.buffer_len()]);
        }
    }

    // ICRC and the pretty-printer.
    let _ = icrc::check_ip_packet(data);
    let endpoints = Endpoints {
        src: Ipv4Addr::new(10, 0, 0, 1).into(),
        dst: Ipv4Addr::new(10, 0, 0, 2).into(),
        src_port: 0xC000,
        dst_port: 4791,
    };
    let _ = icrc::verify(&endpoints, data);
    let _ = pretty::frame(data).to_string();
    let _ = pretty::ip_packet(data).summary();
    let _ = pretty::datagram(data, Some(&endpoints)).to_string();

    // Capture readers.
    let _ = hex_text::parse_packets(&String::from_utf8_lossy(data));
    if let Ok(reader) = pcap::Reader::new(data) {
        for record in reader.take(64) {
            let _ = record.map(|r| r.data.len());
        }
    }
});
