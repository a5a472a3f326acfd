//! Field-by-field extraction of each header into a [`Layer`] for the pretty-printer.

use super::{Dump, Layer};
use crate::aeth::credit_count;
use crate::bth::BthPacket;
use crate::ethernet::EthernetFrame;
use crate::ipv4::Ipv4Packet;
use crate::ipv6::Ipv6Packet;
use crate::opcode::Opcode;
use crate::opcode::{PayloadRule, CNP_RESERVED_LEN};
use crate::transport::{TransportHeader, TransportRepr, ACK_PACKET_LEN, ICRC_LEN};
use crate::udp::UdpPacket;

/// Payload bytes shown in a dump before eliding the rest.
const PREVIEW_BYTES: usize = 32;

pub(super) fn ethernet(eth: &EthernetFrame<&[u8]>) -> Layer {
    let mut layer = Layer::new("ethernet");
    layer.text("dst", eth.dst_addr().to_string()).text("src", eth.src_addr().to_string());
    if let Some(tag) = eth.vlan() {
        layer.uint("vlan_pcp", tag.pcp).flag("vlan_dei", tag.dei).uint("vlan_id", tag.vid);
    }
    layer.hex("ethertype", eth.ethertype(), 4);
    layer
}

pub(super) fn ipv4(ip: &Ipv4Packet<&[u8]>) -> Layer {
    let mut layer = Layer::new("ipv4");
    layer
        .uint("version", ip.version())
        .uint("header_len", ip.header_len() as u64)
        .hex("tos", ip.tos(), 2)
        .uint("dscp", ip.dscp())
        .uint("ecn", ip.ecn())
        .uint("total_len", ip.total_len())
        .hex("ident", ip.ident(), 4)
        .flag("dont_frag", ip.dont_frag())
        .flag("more_frags", ip.more_frags())
        .uint("frag_offset", ip.frag_offset())
        .uint("ttl", ip.ttl())
        .uint("protocol", ip.protocol())
        .hex("checksum", ip.checksum(), 4)
        .flag("checksum_ok", ip.verify_checksum())
        .text("src", ip.src_addr().to_string())
        .text("dst", ip.dst_addr().to_string());
    layer
}

pub(super) fn ipv6(ip: &Ipv6Packet<&[u8]>) -> Layer {
    let mut layer = Layer::new("ipv6");
    layer
        .uint("version", ip.version())
        .hex("traffic_class", ip.traffic_class(), 2)
        .hex("flow_label", ip.flow_label(), 5)
        .uint("payload_len", ip.payload_len())
        .uint("next_header", ip.next_header())
        .uint("hop_limit", ip.hop_limit())
        .text("src", ip.src_addr().to_string())
        .text("dst", ip.dst_addr().to_string());
    layer
}

pub(super) fn udp(udp: &UdpPacket<&[u8]>) -> Layer {
    let mut layer = Layer::new("udp");
    layer.uint("src_port", udp.src_port()).uint("dst_port", udp.dst_port()).uint("length", udp.len()).hex(
        "checksum",
        udp.checksum(),
        4,
    );
    layer
}

/// Appends the BTH, extension headers and payload of a UDP payload to `dump`.
pub(super) fn transport(mut dump: Dump, datagram: &[u8]) -> Dump {
    // Between Lightpath soft devices an RC Acknowledge may lead a second packet in one UDP
    // payload (an acknowledgement bundle): both are shown, the ACK's layers first.
    if datagram.len() > ACK_PACKET_LEN && datagram[0] == Opcode::RC_ACKNOWLEDGE.0 {
        let (ack, rest) = datagram.split_at(ACK_PACKET_LEN);
        dump.notes.push(format!(
            "an acknowledgement bundle (Lightpath soft devices only): a {ACK_PACKET_LEN}-byte RC \
             Acknowledge, then a packet of {} bytes",
            rest.len()
        ));
        let dump = packet(dump, ack);
        if dump.error.is_some() {
            return dump;
        }
        return packet(dump, rest);
    }
    packet(dump, datagram)
}

/// One packet's layers (BTH … payload).
fn packet(mut dump: Dump, datagram: &[u8]) -> Dump {
    let bth = match BthPacket::new_checked(datagram) {
        Ok(bth) => bth,
        Err(err) => return dump.fail(format!("BTH: {err} ({} bytes)", datagram.len())),
    };
    let mut layer = Layer::new("bth");
    layer
        .hex("opcode", bth.opcode().0, 2)
        .text("opcode_name", bth.opcode().name())
        .flag("solicited", bth.solicited())
        .flag("mig_req", bth.mig_req())
        .uint("pad_count", bth.pad_count())
        .uint("tver", bth.tver())
        .hex("pkey", bth.pkey(), 4)
        .flag("fecn", bth.fecn())
        .flag("becn", bth.becn())
        .hex("resv6", bth.resv6(), 2)
        .hex("dest_qpn", bth.dest_qpn(), 6)
        .flag("ack_req", bth.ack_req())
        .hex("resv7", bth.resv7(), 2)
        .hex("psn", bth.psn().value(), 6);
    dump.push(layer);
    if bth.resv7() != 0 {
        dump.notes.push("BTH Resv7 is not zero (it is covered by the ICRC)".into());
    }
    let header = match TransportHeader::parse(datagram) {
        Ok((header, _)) => header,
        Err(err) => {
            let after = datagram.len().saturating_sub(crate::bth::BthRepr::LEN);
            return dump.fail(format!("{err} ({after} bytes after the BTH)"));
        }
    };
    extension_layers(&mut dump, &header, datagram);
    let repr = match TransportRepr::parse(datagram) {
        Ok(repr) => repr,
        Err(err) => return dump.fail(err),
    };
    let mut layer = Layer::new("payload");
    layer.uint("len", repr.payload.len() as u64).uint("pad", repr.header.bth.pad_count);
    let shown = &repr.payload[..repr.payload.len().min(PREVIEW_BYTES)];
    let mut bytes: String = shown.iter().map(|b| format!("{b:02x}")).collect();
    if repr.payload.len() > shown.len() {
        bytes.push_str(&format!("...(+{})", repr.payload.len() - shown.len()));
    }
    layer.text("bytes", bytes);
    dump.push(layer);
    let pad_start = datagram.len() - ICRC_LEN - usize::from(repr.header.bth.pad_count);
    if datagram[pad_start..datagram.len() - ICRC_LEN].iter().any(|&b| b != 0) {
        dump.notes.push("pad bytes are not zero".into());
    }
    if let Some(info) = repr.header.info() {
        if info.payload == PayloadRule::None && !repr.payload.is_empty() {
            dump.notes.push(format!(
                "{} carries no payload, but has {} bytes",
                repr.header.bth.opcode,
                repr.payload.len()
            ));
        }
    }
    dump
}

fn extension_layers(dump: &mut Dump, header: &TransportHeader, datagram: &[u8]) {
    if let Some(deth) = header.deth {
        let mut layer = Layer::new("deth");
        layer.hex("qkey", deth.qkey, 8).hex("src_qpn", deth.src_qpn, 6);
        dump.push(layer);
    }
    if let Some(reth) = header.reth {
        let mut layer = Layer::new("reth");
        layer.hex("va", reth.va, 16).hex("rkey", reth.rkey, 8).uint("dma_len", reth.dma_len);
        dump.push(layer);
    }
    if let Some(atomic) = header.atomic_eth {
        let mut layer = Layer::new("atomic_eth");
        layer.hex("va", atomic.va, 16).hex("rkey", atomic.rkey, 8).hex("swap_add", atomic.swap_add, 16).hex(
            "compare",
            atomic.compare,
            16,
        );
        dump.push(layer);
    }
    if let Some(aeth) = header.aeth {
        let mut layer = Layer::new("aeth");
        layer
            .hex("syndrome", aeth.syndrome.to_byte(), 2)
            .text("meaning", aeth.syndrome.to_string())
            .uint("msn", aeth.msn);
        if let crate::aeth::Syndrome::Ack { credit_code } = aeth.syndrome {
            if let Some(credits) = credit_count(credit_code) {
                layer.uint("credits", credits);
            }
        }
        dump.push(layer);
    }
    if let Some(ack) = header.atomic_ack {
        let mut layer = Layer::new("atomic_ack_eth");
        layer.hex("orig", ack.orig, 16);
        dump.push(layer);
    }
    if let Some(imm) = header.imm {
        let mut layer = Layer::new("immdt");
        layer.hex("imm", imm, 8);
        dump.push(layer);
    }
    if let Some(rkey) = header.ieth {
        let mut layer = Layer::new("ieth");
        layer.hex("rkey", rkey, 8);
        dump.push(layer);
    }
    if header.header_set().cnp_reserved {
        let start = crate::bth::BthRepr::LEN;
        let reserved = &datagram[start..start + CNP_RESERVED_LEN];
        let mut layer = Layer::new("cnp");
        layer.flag("reserved_zero", reserved.iter().all(|&b| b == 0));
        dump.push(layer);
    }
}
