//! The packet trace of a run: every datagram sent, delivered, dropped, duplicated or damaged,
//! with a one-line summary for debugging a single seed: `lightpath_wire::pretty`'s line
//! (opcode, QP, PSN, AckReq, AETH meaning, payload length, ICRC verdict) followed by the
//! RETH/AtomicETH fields, which say which part of which region a request names.

use std::fmt;

use serde::Serialize;

use lightpath_wire::Endpoints;

use crate::link::DropReason;
use crate::time::SimTime;

/// What happened to a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TraceKind {
    /// Handed to the network by an endpoint.
    Sent,
    /// Given to the destination endpoint.
    Delivered,
    /// Dropped, and why.
    Dropped(DropReason),
    /// A second copy was scheduled.
    Duplicated,
    /// Bits were flipped on the way.
    Corrupted,
    /// Held back so that later datagrams overtake it.
    Reordered,
}

/// One line of the trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    /// When it happened.
    pub at: SimTime,
    /// Sending node index.
    pub from: usize,
    /// Receiving node index (the one the destination address belongs to, if any).
    pub to: usize,
    /// What happened.
    pub kind: TraceKind,
    /// Opcode, PSN and other header fields (see [`summarize`]).
    pub summary: String,
}

impl fmt::Display for TraceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            TraceKind::Sent => "sent".to_string(),
            TraceKind::Delivered => "deliver".to_string(),
            TraceKind::Dropped(reason) => format!("DROP({reason:?})"),
            TraceKind::Duplicated => "DUP".to_string(),
            TraceKind::Corrupted => "CORRUPT".to_string(),
            TraceKind::Reordered => "REORDER".to_string(),
        };
        write!(f, "{:>14} {}->{} {:<14} {}", self.at.to_string(), self.from, self.to, kind, self.summary)
    }
}

/// Names of the RC opcodes (IBA opcode byte, transport RC = 0b000).
fn opcode_name(opcode: u8) -> &'static str {
    match opcode {
        0x00 => "SEND_FIRST",
        0x01 => "SEND_MIDDLE",
        0x02 => "SEND_LAST",
        0x03 => "SEND_LAST_IMM",
        0x04 => "SEND_ONLY",
        0x05 => "SEND_ONLY_IMM",
        0x06 => "WRITE_FIRST",
        0x07 => "WRITE_MIDDLE",
        0x08 => "WRITE_LAST",
        0x09 => "WRITE_LAST_IMM",
        0x0A => "WRITE_ONLY",
        0x0B => "WRITE_ONLY_IMM",
        0x0C => "READ_REQUEST",
        0x0D => "READ_RESP_FIRST",
        0x0E => "READ_RESP_MIDDLE",
        0x0F => "READ_RESP_LAST",
        0x10 => "READ_RESP_ONLY",
        0x11 => "ACK",
        0x12 => "ATOMIC_ACK",
        0x13 => "CMP_SWAP",
        0x14 => "FETCH_ADD",
        0x16 => "SEND_LAST_INV",
        0x17 => "SEND_ONLY_INV",
        _ => "UNKNOWN",
    }
}

fn be32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at + 4)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

fn be64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(be32(bytes, at)?) << 32 | u64::from(be32(bytes, at + 4)?))
}

fn describe_aeth(syndrome: u8, msn: u32) -> String {
    let value = syndrome & 0x1F;
    match syndrome >> 5 {
        0 => format!("ACK msn={msn}"),
        1 => format!("RNR_NAK timer={value} msn={msn}"),
        3 => {
            let code = match value {
                0 => "PSN_SEQ_ERR",
                1 => "INVALID_REQ",
                2 => "REMOTE_ACCESS",
                3 => "REMOTE_OP",
                4 => "INVALID_RD_REQ",
                _ => "RESERVED",
            };
            format!("NAK {code} msn={msn}")
        }
        _ => format!("AETH?{syndrome:#04x}"),
    }
}

/// A one-line description of a RoCE v2 UDP payload (BTH … ICRC): opcode, destination QP, PSN,
/// AckReq, and the most telling extension-header fields. Never panics; short or unknown input
/// is described as such.
pub fn describe_datagram(bytes: &[u8]) -> String {
    if bytes.len() < 12 {
        return format!("short datagram ({} bytes)", bytes.len());
    }
    let opcode = bytes[0];
    let dest_qp = be32(bytes, 4).unwrap_or(0) & 0x00FF_FFFF;
    let ack_req = bytes[8] & 0x80 != 0;
    let psn = be32(bytes, 8).unwrap_or(0) & 0x00FF_FFFF;
    let mut line = format!(
        "{} qp={dest_qp:#x} psn={psn:#08x}{} len={}",
        opcode_name(opcode),
        if ack_req { " A" } else { "" },
        bytes.len()
    );
    line.push_str(&extension_detail(bytes));
    line
}

/// The RETH, AETH or AtomicETH fields of a datagram, as " name=value …" (empty otherwise).
fn extension_detail(bytes: &[u8]) -> String {
    let Some(&opcode) = bytes.first() else { return String::new() };
    let ext = 12;
    match opcode {
        // RETH: VA, R_Key, DMA length.
        0x06 | 0x0A | 0x0B | 0x0C => match (be64(bytes, ext), be32(bytes, ext + 8), be32(bytes, ext + 12)) {
            (Some(va), Some(rkey), Some(len)) => format!(" va={va:#x} rkey={rkey:#x} dma_len={len}"),
            _ => " (truncated RETH)".to_string(),
        },
        // AETH first.
        0x0D | 0x0F | 0x10 | 0x11 | 0x12 => match be32(bytes, ext) {
            Some(aeth) => format!(" {}", describe_aeth((aeth >> 24) as u8, aeth & 0x00FF_FFFF)),
            None => " (truncated AETH)".to_string(),
        },
        // AtomicETH: VA, R_Key.
        0x13 | 0x14 => match (be64(bytes, ext), be32(bytes, ext + 8)) {
            (Some(va), Some(rkey)) => format!(" va={va:#x} rkey={rkey:#x}"),
            _ => " (truncated AtomicETH)".to_string(),
        },
        _ => String::new(),
    }
}

/// The trace line of a datagram sent between `endpoints`: the wire crate's summary (with the
/// ICRC checked as the receiver would) plus the remote address fields of requests.
pub fn summarize(bytes: &[u8], endpoints: Option<&Endpoints>) -> String {
    let mut line = lightpath_wire::pretty::datagram(bytes, endpoints).summary();
    line.push_str(&extension_detail(bytes));
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_a_send_and_a_nak() {
        let mut send = vec![0u8; 12 + 4];
        send[0] = 0x04;
        send[4..8].copy_from_slice(&0x0000_0011u32.to_be_bytes());
        send[8..12].copy_from_slice(&(0x8000_0000u32 | 0x00FF_FFFE).to_be_bytes());
        assert_eq!(describe_datagram(&send), "SEND_ONLY qp=0x11 psn=0xfffffe A len=16");

        let mut nak = vec![0u8; 12 + 4 + 4];
        nak[0] = 0x11;
        nak[8..12].copy_from_slice(&5u32.to_be_bytes());
        nak[12..16].copy_from_slice(&(0x6000_0000u32 | 7).to_be_bytes());
        assert_eq!(describe_datagram(&nak), "ACK qp=0x0 psn=0x000005 len=20 NAK PSN_SEQ_ERR msn=7");
    }

    #[test]
    fn short_and_truncated_input_is_described() {
        assert_eq!(describe_datagram(&[1, 2, 3]), "short datagram (3 bytes)");
        let mut read = vec![0u8; 14];
        read[0] = 0x0C;
        assert!(describe_datagram(&read).ends_with("(truncated RETH)"));
    }
}
