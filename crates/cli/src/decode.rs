//! `lightpath decode`: decodes RoCE v2 packets given as hex text or a pcap file, prints every
//! header field and checks the ICRC.
//!
//! The decoding itself is `lightpath_wire::pretty`; this module reads the input, decides where
//! each packet starts (Ethernet, IP or the UDP payload), and renders text or JSON lines.

use std::io::Read;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use lightpath_wire::capture::{hex_text, pcap};
use lightpath_wire::ethernet::{ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETHERTYPE_VLAN};
use lightpath_wire::icrc::Endpoints;
use lightpath_wire::pretty::{self, Dump, IcrcStatus, Value};
use lightpath_wire::ROCE_V2_PORT;

/// Options of `lightpath decode`.
///
/// Exit status: 0 if every RoCE v2 packet decoded completely with a good ICRC; 1 if any packet
/// had a bad ICRC, failed to decode, or (for hex input) was not RoCE v2 at all. Non-RoCE frames
/// in a pcap file are listed and skipped.
#[derive(Debug, clap::Args)]
#[command(after_help = "Exit status: 0 if every RoCE v2 packet decoded with a good ICRC; 1 if any \
    had a bad ICRC, failed to decode, or (hex input) was not RoCE v2; 2 on unreadable input.")]
pub struct Args {
    /// Packet bytes in hex (spaces, colons and 0x allowed). Without it, hex is read from stdin:
    /// plain hex (a blank or `#` line separates packets) or offset dumps ("0000  52 54 00 ...").
    #[arg(value_name = "HEX", conflicts_with = "pcap")]
    pub hex: Vec<String>,
    /// Read packets from a classic pcap file (Ethernet, raw IP or Linux cooked link types).
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,
    /// Where hex packets start; `auto` tells Ethernet from IP by looking at the bytes.
    #[arg(long, value_enum, default_value_t = Layer::Auto)]
    pub from: Layer,
    /// Source IP, for checking the ICRC of bare UDP payloads (`--from udp-payload`).
    #[arg(long, requires_all = ["dst", "sport"])]
    pub src: Option<IpAddr>,
    /// Destination IP, for `--from udp-payload`.
    #[arg(long)]
    pub dst: Option<IpAddr>,
    /// UDP source port, for `--from udp-payload`.
    #[arg(long)]
    pub sport: Option<u16>,
    /// UDP destination port, for `--from udp-payload`.
    #[arg(long, default_value_t = ROCE_V2_PORT)]
    pub dport: u16,
    /// Print one JSON object per packet instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The layer a hex packet starts at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layer {
    /// Ethernet if the EtherType at bytes 12..14 says IP or VLAN, else IP.
    Auto,
    /// An Ethernet II frame (optionally 802.1Q tagged), without FCS.
    Ether,
    /// An IPv4 or IPv6 packet.
    Ip,
    /// A UDP payload: BTH … ICRC.
    UdpPayload,
}

/// One packet to decode, with where it came from.
struct Input {
    label: String,
    start: Layer,
    bytes: Vec<u8>,
    /// Non-RoCE traffic is expected in a pcap and is not a failure there.
    foreign_is_failure: bool,
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let inputs = if let Some(path) = &args.pcap { pcap_inputs(path)? } else { hex_inputs(&args)? };
    if inputs.is_empty() {
        bail!("no packets in the input");
    }
    let endpoints = match (args.src, args.dst, args.sport) {
        (Some(src), Some(dst), Some(src_port)) => {
            Some(Endpoints { src, dst, src_port, dst_port: args.dport })
        }
        _ => None,
    };
    let mut tally = Tally::default();
    for (index, input) in inputs.iter().enumerate() {
        let dump = decode(input, endpoints.as_ref());
        tally.count(&dump, input.foreign_is_failure);
        if args.json {
            outln!("{}", json(index + 1, input, &dump));
        } else {
            outln!("packet {} ({}, {} bytes)", index + 1, input.label, input.bytes.len());
            print!("{dump}");
            if dump.roce && dump.icrc == IcrcStatus::Unchecked && dump.error.is_none() {
                outln!("{:<15} not checked (give --src, --dst and --sport)", "icrc");
            }
            outln!();
        }
    }
    if !args.json {
        outln!("{}", tally.line());
    }
    Ok(if tally.failures() == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn decode(input: &Input, endpoints: Option<&Endpoints>) -> Dump {
    let start = match input.start {
        Layer::Auto => detect(&input.bytes),
        other => other,
    };
    match start {
        Layer::Ether => pretty::frame(&input.bytes),
        Layer::UdpPayload => pretty::datagram(&input.bytes, endpoints),
        Layer::Ip | Layer::Auto => pretty::ip_packet(&input.bytes),
    }
}

/// Ethernet if bytes 12..14 hold an IP or VLAN EtherType and an IP version nibble follows;
/// otherwise IP. (An IPv4 header's bytes 12..14 are the first half of its source address.)
fn detect(bytes: &[u8]) -> Layer {
    let ethertype = bytes.get(12..14).map(|b| u16::from_be_bytes([b[0], b[1]]));
    let next_version = |at: usize| bytes.get(at).map(|b| b >> 4);
    let ether = match ethertype {
        Some(ETHERTYPE_IPV4) => next_version(14) == Some(4),
        Some(ETHERTYPE_IPV6) => next_version(14) == Some(6),
        Some(ETHERTYPE_VLAN) => matches!(next_version(18), Some(4 | 6)),
        _ => false,
    };
    let ip = matches!(bytes.first().map(|b| b >> 4), Some(4 | 6));
    if ether || !ip {
        Layer::Ether
    } else {
        Layer::Ip
    }
}

fn hex_inputs(args: &Args) -> anyhow::Result<Vec<Input>> {
    let (text, origin) = if args.hex.is_empty() {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("reading hex from stdin")?;
        (text, "stdin")
    } else {
        (args.hex.join(" "), "argument")
    };
    let packets = hex_text::parse_packets(&text).with_context(|| format!("hex {origin}"))?;
    let many = packets.len() > 1;
    Ok(packets
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| Input {
            label: if many { format!("{origin}, packet {}", i + 1) } else { origin.to_string() },
            start: args.from,
            bytes,
            foreign_is_failure: true,
        })
        .collect())
}

fn pcap_inputs(path: &PathBuf) -> anyhow::Result<Vec<Input>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let reader = pcap::Reader::new(&data).with_context(|| format!("{}", path.display()))?;
    let link = reader.link_type();
    let Some(start) = pcap::link_start(link) else {
        bail!(
            "{}: link type {link} is not supported (Ethernet, raw IP or Linux cooked only)",
            path.display()
        );
    };
    let mut inputs = Vec::new();
    for record in reader {
        let record = record.with_context(|| format!("{}: after record {}", path.display(), inputs.len()))?;
        let (layer, bytes) = match start {
            pcap::LinkStart::Ethernet => (Layer::Ether, record.data),
            pcap::LinkStart::Ip => (Layer::Ip, record.data),
            // The cooked header is 16 bytes; IP follows.
            pcap::LinkStart::LinuxSll => (Layer::Ip, record.data.get(16..).unwrap_or_default()),
        };
        let truncated =
            if (record.orig_len as usize) > record.data.len() { ", truncated by the capture" } else { "" };
        inputs.push(Input {
            label: format!(
                "pcap record {}, t={}.{:09}{truncated}",
                record.number,
                record.timestamp_nanos / 1_000_000_000,
                record.timestamp_nanos % 1_000_000_000
            ),
            start: layer,
            bytes: bytes.to_vec(),
            foreign_is_failure: false,
        });
    }
    Ok(inputs)
}

#[derive(Debug, Default)]
struct Tally {
    good: usize,
    bad_icrc: usize,
    failed: usize,
    unchecked: usize,
    foreign: usize,
    foreign_failures: usize,
}

impl Tally {
    fn count(&mut self, dump: &Dump, foreign_is_failure: bool) {
        if !dump.roce {
            self.foreign += 1;
            self.foreign_failures += usize::from(foreign_is_failure);
        } else if dump.error.is_some() {
            self.failed += 1;
        } else {
            match dump.icrc {
                IcrcStatus::Ok(_) => self.good += 1,
                IcrcStatus::Bad { .. } => self.bad_icrc += 1,
                IcrcStatus::Unchecked => self.unchecked += 1,
            }
        }
    }

    fn failures(&self) -> usize {
        self.bad_icrc + self.failed + self.foreign_failures
    }

    fn line(&self) -> String {
        let total = self.good + self.bad_icrc + self.failed + self.unchecked + self.foreign;
        let mut line = format!(
            "{total} {}: {} good, {} bad ICRC, {} failed to decode",
            if total == 1 { "packet" } else { "packets" },
            self.good,
            self.bad_icrc,
            self.failed
        );
        if self.unchecked > 0 {
            line.push_str(&format!(", {} ICRC not checked", self.unchecked));
        }
        if self.foreign > 0 {
            line.push_str(&format!(", {} not RoCE v2", self.foreign));
        }
        line
    }
}

fn json_value(value: &Value) -> serde_json::Value {
    match value {
        Value::Uint(v) => serde_json::Value::from(*v),
        Value::Bool(b) => serde_json::Value::from(*b),
        Value::Hex { .. } => serde_json::Value::from(value.to_string()),
        Value::Text(t) => serde_json::Value::from(t.as_str()),
    }
}

fn json(index: usize, input: &Input, dump: &Dump) -> serde_json::Value {
    let layers: serde_json::Map<String, serde_json::Value> = dump
        .layers
        .iter()
        .map(|layer| {
            let fields = layer.fields.iter().map(|(name, value)| (name.to_string(), json_value(value)));
            (layer.name.to_string(), serde_json::Value::Object(fields.collect()))
        })
        .collect();
    let icrc = match dump.icrc {
        IcrcStatus::Ok(crc) => serde_json::json!({ "status": "ok", "found": format!("{crc:#010x}") }),
        IcrcStatus::Bad { computed, found } => serde_json::json!({
            "status": "bad",
            "computed": format!("{computed:#010x}"),
            "found": format!("{found:#010x}"),
        }),
        IcrcStatus::Unchecked => serde_json::json!({ "status": "unchecked" }),
    };
    serde_json::json!({
        "packet": index,
        "source": input.label,
        "len": input.bytes.len(),
        "roce": dump.roce,
        "ok": dump.is_good(),
        "summary": dump.summary(),
        "layers": layers,
        "icrc": icrc,
        "error": dump.error,
        "notes": dump.notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_ethernet_and_ip() {
        let frame = [0x52, 0x54, 0, 0x77, 0, 2, 0x52, 0x54, 0, 0x77, 0, 3, 0x08, 0x00, 0x45, 0];
        assert_eq!(detect(&frame), Layer::Ether);
        let ip = [0x45, 0, 0, 0x30, 3, 0x1f, 0x40, 0, 0x40, 0x11, 0x23, 0, 0x0a, 0x4d, 0, 2];
        assert_eq!(detect(&ip), Layer::Ip);
        assert_eq!(detect(&[]), Layer::Ether);
        assert_eq!(detect(&[0x60]), Layer::Ip);
    }
}
