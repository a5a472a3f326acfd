//! A human-readable (and machine-walkable) dump of a RoCE v2 packet: every header field, the
//! opcode name, the AETH syndrome's meaning, payload length and pad, and the ICRC verdict.
//!
//! [`Dump`] is a list of [`Layer`]s of named [`Value`]s, so the text form (its `Display`) and
//! other renderings (the CLI's JSON) come from the same walk. Building a dump never panics:
//! whatever cannot be parsed ends the walk with an error note.

mod layers;

use core::fmt;

use crate::ethernet::{EthernetFrame, ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETHERTYPE_ROCE_V1};
use crate::icrc::{self, Endpoints};
use crate::ipv4::{Ipv4Packet, PROTOCOL_UDP};
use crate::ipv6::{self, Ipv6Packet};
use crate::udp::{UdpPacket, ROCE_V2_PORT};

/// One field value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A number shown in decimal.
    Uint(u64),
    /// A number shown in hexadecimal with `digits` digits.
    Hex {
        /// The number.
        value: u64,
        /// Digits to show (zero-padded).
        digits: u8,
    },
    /// A single-bit flag.
    Bool(bool),
    /// Free text (addresses, names, meanings, byte previews).
    Text(String),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Uint(v) => write!(f, "{v}"),
            Value::Hex { value, digits } => {
                write!(f, "0x{value:0width$x}", width = usize::from(*digits))
            }
            Value::Bool(b) => f.write_str(if *b { "1" } else { "0" }),
            Value::Text(t) if t.contains(' ') => write!(f, "\"{t}\""),
            Value::Text(t) => f.write_str(t),
        }
    }
}

/// The fields of one header (or of the payload, or of the ICRC check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// Short lowercase name: "ethernet", "ipv4", "ipv6", "udp", "bth", "deth", "reth",
    /// "atomic_eth", "aeth", "atomic_ack_eth", "immdt", "ieth", "cnp", "payload", "icrc".
    pub name: &'static str,
    /// Field names and values in wire order.
    pub fields: Vec<(&'static str, Value)>,
}

impl Layer {
    fn new(name: &'static str) -> Layer {
        Layer { name, fields: Vec::new() }
    }

    fn uint(&mut self, name: &'static str, value: impl Into<u64>) -> &mut Layer {
        self.fields.push((name, Value::Uint(value.into())));
        self
    }

    fn hex(&mut self, name: &'static str, value: impl Into<u64>, digits: u8) -> &mut Layer {
        self.fields.push((name, Value::Hex { value: value.into(), digits }));
        self
    }

    fn flag(&mut self, name: &'static str, value: bool) -> &mut Layer {
        self.fields.push((name, Value::Bool(value)));
        self
    }

    fn text(&mut self, name: &'static str, value: impl Into<String>) -> &mut Layer {
        self.fields.push((name, Value::Text(value.into())));
        self
    }

    /// The value of a field, if present.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

/// The outcome of the ICRC check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IcrcStatus {
    /// The ICRC is correct.
    Ok(u32),
    /// The ICRC is wrong. For a bare IPv4 datagram `computed` assumes ID 0 and DF.
    Bad {
        /// What the ICRC should have been.
        computed: u32,
        /// What the packet carries.
        found: u32,
    },
    /// Not checked (no addresses known, or the packet did not get that far).
    Unchecked,
}

/// A decoded packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dump {
    /// The headers decoded, outermost first.
    pub layers: Vec<Layer>,
    /// False if the packet is not RoCE v2 at all (not IP, not UDP, or not to port 4791).
    pub roce: bool,
    /// Why decoding stopped early, if it did.
    pub error: Option<String>,
    /// The ICRC verdict.
    pub icrc: IcrcStatus,
    /// Observations that are not errors (non-zero reserved bits, a bad IP checksum, ...).
    pub notes: Vec<String>,
}

impl Dump {
    fn new() -> Dump {
        Dump { layers: Vec::new(), roce: true, error: None, icrc: IcrcStatus::Unchecked, notes: Vec::new() }
    }

    fn not_roce(mut self, why: impl Into<String>) -> Dump {
        self.roce = false;
        self.notes.push(why.into());
        self
    }

    fn fail(mut self, why: impl fmt::Display) -> Dump {
        self.error = Some(why.to_string());
        self
    }

    fn push(&mut self, layer: Layer) {
        self.layers.push(layer);
    }

    /// True for a RoCE v2 packet that decoded completely and whose ICRC is correct.
    pub fn is_good(&self) -> bool {
        self.roce && self.error.is_none() && matches!(self.icrc, IcrcStatus::Ok(_))
    }

    /// The layer of a given name, if decoded.
    pub fn layer(&self, name: &str) -> Option<&Layer> {
        self.layers.iter().find(|layer| layer.name == name)
    }

    /// One line: opcode, QP, PSN, payload length and ICRC verdict.
    pub fn summary(&self) -> String {
        let field =
            |layer: &str, name: &str| self.layer(layer).and_then(|l| l.get(name)).map(ToString::to_string);
        let mut out = String::new();
        if !self.roce {
            out.push_str("not RoCE v2");
            if let Some(note) = self.notes.first() {
                out.push_str(": ");
                out.push_str(note);
            }
            return out;
        }
        if let (Some(src), Some(dst)) =
            (field("ipv4", "src").or(field("ipv6", "src")), field("ipv4", "dst").or(field("ipv6", "dst")))
        {
            let sport = field("udp", "src_port").unwrap_or_default();
            let dport = field("udp", "dst_port").unwrap_or_default();
            out.push_str(&format!("{src}:{sport} > {dst}:{dport} "));
        }
        match field("bth", "opcode_name") {
            Some(name) => out.push_str(&name),
            None => out.push('?'),
        }
        for (label, name) in [("dqpn", "dest_qpn"), ("psn", "psn")] {
            if let Some(value) = field("bth", name) {
                out.push_str(&format!(" {label}={value}"));
            }
        }
        if field("bth", "ack_req").as_deref() == Some("1") {
            out.push_str(" ackreq");
        }
        if let Some(meaning) = field("aeth", "meaning") {
            out.push_str(&format!(" [{}]", meaning.trim_matches('"')));
        }
        if let Some(len) = field("payload", "len") {
            out.push_str(&format!(" len={len}"));
        }
        if let Some(error) = &self.error {
            out.push_str(&format!(" ERROR: {error}"));
        }
        out.push_str(match self.icrc {
            IcrcStatus::Ok(_) => " icrc ok",
            IcrcStatus::Bad { found: 0, .. } => {
                " icrc 0 (not computed: between Lightpath soft devices, or BAD)"
            }
            IcrcStatus::Bad { .. } => " icrc BAD",
            IcrcStatus::Unchecked => "",
        });
        out
    }
}

impl fmt::Display for Dump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for layer in &self.layers {
            write!(f, "{:<15}", layer.name)?;
            for (name, value) in &layer.fields {
                write!(f, " {name}={value}")?;
            }
            writeln!(f)?;
        }
        match self.icrc {
            IcrcStatus::Ok(crc) => writeln!(f, "{:<15} ok ({crc:#010x})", "icrc")?,
            IcrcStatus::Bad { computed, found } => {
                writeln!(f, "{:<15} BAD (computed {computed:#010x}, found {found:#010x})", "icrc")?
            }
            IcrcStatus::Unchecked => {}
        }
        for note in &self.notes {
            writeln!(f, "{:<15} {note}", "note")?;
        }
        if !self.roce {
            writeln!(f, "not a RoCE v2 packet")?;
        }
        if let Some(error) = &self.error {
            writeln!(f, "{:<15} {error}", "error")?;
        }
        Ok(())
    }
}

/// Decodes an Ethernet frame (no FCS), with or without an 802.1Q tag.
pub fn frame(bytes: &[u8]) -> Dump {
    let mut dump = Dump::new();
    let eth = match EthernetFrame::new_checked(bytes) {
        Ok(eth) => eth,
        Err(err) => return dump.fail(format!("Ethernet: {err}")),
    };
    dump.push(layers::ethernet(&eth));
    match eth.ethertype() {
        ETHERTYPE_IPV4 | ETHERTYPE_IPV6 => ip_into(dump, eth.payload()),
        ETHERTYPE_ROCE_V1 => dump.not_roce("RoCE v1 (EtherType 0x8915), not RoCE v2"),
        other => dump.not_roce(format!("EtherType {other:#06x} is not IPv4 or IPv6")),
    }
}

/// Decodes an IPv4 or IPv6 packet (IP header … ICRC), checking the ICRC exactly.
pub fn ip_packet(bytes: &[u8]) -> Dump {
    ip_into(Dump::new(), bytes)
}

fn ip_into(mut dump: Dump, bytes: &[u8]) -> Dump {
    let udp_bytes = match bytes.first().map(|b| b >> 4) {
        Some(4) => {
            let ip = match Ipv4Packet::new_checked(bytes) {
                Ok(ip) => ip,
                Err(err) => return dump.fail(format!("IPv4: {err}")),
            };
            dump.push(layers::ipv4(&ip));
            if !ip.verify_checksum() {
                dump.notes.push("IPv4 header checksum is wrong (checksum offload?)".into());
            }
            if ip.protocol() != PROTOCOL_UDP {
                return dump.not_roce(format!("IP protocol {} is not UDP", ip.protocol()));
            }
            // check_len guarantees header_len <= total_len <= bytes.len().
            &bytes[ip.header_len()..usize::from(ip.total_len())]
        }
        Some(6) => {
            let ip = match Ipv6Packet::new_checked(bytes) {
                Ok(ip) => ip,
                Err(err) => return dump.fail(format!("IPv6: {err}")),
            };
            dump.push(layers::ipv6(&ip));
            if ip.next_header() != PROTOCOL_UDP {
                return dump.not_roce(format!("IPv6 next header {} is not UDP", ip.next_header()));
            }
            &bytes[ipv6::HEADER_LEN..ipv6::HEADER_LEN + usize::from(ip.payload_len())]
        }
        Some(v) => return dump.not_roce(format!("IP version {v}")),
        None => return dump.fail("empty packet"),
    };
    let udp = match UdpPacket::new_checked(udp_bytes) {
        Ok(udp) => udp,
        Err(err) => return dump.fail(format!("UDP: {err}")),
    };
    dump.push(layers::udp(&udp));
    if udp.dst_port() != ROCE_V2_PORT {
        return dump.not_roce(format!("UDP destination port {} is not 4791", udp.dst_port()));
    }
    dump = layers::transport(dump, udp.payload());
    match icrc::check_ip_packet(bytes) {
        Ok((computed, found)) if computed == found => dump.icrc = IcrcStatus::Ok(found),
        Ok((computed, found)) => dump.icrc = IcrcStatus::Bad { computed, found },
        Err(err) => {
            if dump.error.is_none() {
                dump.error = Some(format!("ICRC not checkable: {err}"));
            }
        }
    }
    dump
}

/// Decodes a RoCE v2 UDP payload (BTH … ICRC). With endpoints the ICRC is verified as a
/// receiver on a UDP socket does (IPv4: solving for the ID and flags); without, it is not.
pub fn datagram(bytes: &[u8], endpoints: Option<&Endpoints>) -> Dump {
    let mut dump = layers::transport(Dump::new(), bytes);
    if let Some(endpoints) = endpoints {
        dump.icrc = datagram_icrc(&mut dump.notes, endpoints, bytes);
    }
    dump
}

fn datagram_icrc(notes: &mut Vec<String>, endpoints: &Endpoints, bytes: &[u8]) -> IcrcStatus {
    let (Ok(computed), Some(found)) = (icrc::compute(endpoints, bytes), icrc::found(bytes)) else {
        return IcrcStatus::Unchecked;
    };
    if !endpoints.is_ipv4() {
        return if computed == found { IcrcStatus::Ok(found) } else { IcrcStatus::Bad { computed, found } };
    }
    match icrc::solve_ipv4_id_flags(endpoints, bytes) {
        Some(solved) => {
            notes.push(format!(
                "ICRC matches IPv4 ID {:#06x}, flags/fragment {:#06x}",
                solved.ident, solved.flags_frag
            ));
            IcrcStatus::Ok(found)
        }
        None => IcrcStatus::Bad { computed, found },
    }
}

/// A one-line description of a RoCE v2 UDP payload for debug logs (no ICRC check).
pub fn datagram_line(bytes: &[u8]) -> String {
    datagram(bytes, None).summary()
}

#[cfg(test)]
mod tests;
