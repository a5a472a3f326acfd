//! Pretty-printer tests on the digest's worked examples.

use std::net::Ipv4Addr;

use super::*;

fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits.chunks(2).map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap()).collect()
}

fn cnp_frame() -> Vec<u8> {
    hex("e41d2dab2bc2 7cfe90643b32 0800
         45c2003c718c400040119161 0a001101 0a001201 000012b700280000
         8100ffff40000118 00000000 00000000000000000000000000000000 82fd002a")
}

fn ack_packet() -> Vec<u8> {
    hex("450000304321400040118235c0a87a0bc0a87a0ac13212b7001c00001100ffff00000012001234561f000001 aba96887")
}

#[test]
fn frame_dump_shows_every_layer() {
    let dump = frame(&cnp_frame());
    assert!(dump.is_good(), "{dump}");
    let names: Vec<_> = dump.layers.iter().map(|l| l.name).collect();
    assert_eq!(names, ["ethernet", "ipv4", "udp", "bth", "cnp", "payload"]);
    let bth = dump.layer("bth").unwrap();
    assert_eq!(bth.get("opcode_name"), Some(&Value::Text("CNP".into())));
    assert_eq!(bth.get("becn"), Some(&Value::Bool(true)));
    assert_eq!(bth.get("dest_qpn").unwrap().to_string(), "0x000118");
    assert_eq!(dump.layer("ipv4").unwrap().get("tos").unwrap().to_string(), "0xc2");
    let text = dump.to_string();
    assert!(text.contains("icrc            ok (0x2a00fd82)"), "{text}");
    assert!(text.contains("ethertype=0x0800"), "{text}");
}

#[test]
fn ack_dump_explains_the_syndrome() {
    let dump = ip_packet(&ack_packet());
    assert!(dump.is_good());
    let aeth = dump.layer("aeth").unwrap();
    assert_eq!(aeth.get("meaning").unwrap().to_string(), "\"ACK, no credit limit (code 31)\"");
    assert_eq!(aeth.get("msn"), Some(&Value::Uint(1)));
    assert_eq!(
        dump.summary(),
        "192.168.122.11:49458 > 192.168.122.10:4791 RC_ACKNOWLEDGE dqpn=0x000012 psn=0x123456 \
         [ACK, no credit limit (code 31)] len=0 icrc ok"
    );
}

#[test]
fn a_zero_icrc_is_named_as_what_lightpath_peers_send() {
    let mut packet = ack_packet();
    let at = packet.len() - 4;
    packet[at..].fill(0);
    let dump = ip_packet(&packet);
    assert!(!dump.is_good());
    assert!(
        dump.summary().ends_with("icrc 0 (not computed: between Lightpath soft devices, or BAD)"),
        "{}",
        dump.summary()
    );
}

#[test]
fn bad_icrc_is_reported_with_both_values() {
    let mut packet = ack_packet();
    packet[40] ^= 0x01; // last MSN byte
    let dump = ip_packet(&packet);
    assert!(!dump.is_good());
    assert_eq!(dump.icrc, IcrcStatus::Bad { computed: dump_crc(&packet), found: 0x8768_A9AB });
    assert!(dump.to_string().contains("BAD (computed 0x"), "{dump}");
}

fn dump_crc(packet: &[u8]) -> u32 {
    crate::icrc::check_ip_packet(packet).unwrap().0
}

#[test]
fn datagram_with_endpoints_reports_the_solved_id() {
    let packet = ack_packet();
    let endpoints = Endpoints {
        src: Ipv4Addr::new(192, 168, 122, 11).into(),
        dst: Ipv4Addr::new(192, 168, 122, 10).into(),
        src_port: 0xC132,
        dst_port: 4791,
    };
    let dump = datagram(&packet[28..], Some(&endpoints));
    assert!(dump.is_good());
    assert!(dump.notes.iter().any(|n| n.contains("ID 0x4321")), "{:?}", dump.notes);
    let unchecked = datagram(&packet[28..], None);
    assert_eq!(unchecked.icrc, IcrcStatus::Unchecked);
    assert!(datagram_line(&packet[28..]).starts_with("RC_ACKNOWLEDGE dqpn=0x000012"));
}

#[test]
fn foreign_and_broken_packets() {
    let mut arp = cnp_frame();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let dump = frame(&arp);
    assert!(!dump.roce && !dump.is_good());
    assert!(dump.summary().contains("0x0806"));
    let mut other_port = ack_packet();
    other_port[22..24].copy_from_slice(&[0, 53]);
    assert!(!ip_packet(&other_port).roce);
    let mut unknown = ack_packet();
    unknown[28] = 0x1C; // RC_FLUSH: named, but not parsed
    let dump = ip_packet(&unknown);
    assert!(dump.roce && dump.error.is_some());
    assert!(dump.summary().contains("RC_FLUSH"));
    for len in 0..cnp_frame().len() {
        let dump = frame(&cnp_frame()[..len]);
        assert!(!dump.is_good());
    }
}

#[test]
fn an_acknowledgement_bundle_shows_both_packets() {
    // The worked example's RC Acknowledge (UDP payload), then a SEND ONLY of 4 bytes to the
    // same queue pair with a zero ICRC (Lightpath soft devices do not compute it).
    let ack = hex("1100ffff 00000012 00123456 1f000001 aba96887");
    let send = hex("0400ffff 00000012 00000007 deadbeef 00000000");
    let dump = datagram(&[ack.clone(), send].concat(), None);
    assert!(dump.error.is_none(), "{dump}");
    let names: Vec<_> = dump.layers.iter().map(|l| l.name).collect();
    assert_eq!(names, ["bth", "aeth", "payload", "bth", "payload"], "{dump}");
    assert_eq!(dump.layers[3].get("opcode_name"), Some(&Value::Text("RC_SEND_ONLY".into())));
    assert_eq!(dump.layers[4].get("len"), Some(&Value::Uint(4)));
    assert!(dump.notes.iter().any(|n| n.contains("acknowledgement bundle")), "{:?}", dump.notes);
    // An acknowledgement alone is no bundle.
    let alone = datagram(&ack, None);
    assert!(alone.notes.iter().all(|n| !n.contains("bundle")), "{:?}", alone.notes);
}
