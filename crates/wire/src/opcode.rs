//! The BTH opcode table (digest §4): for every opcode this crate parses, which extension
//! headers follow the BTH and in which order, what payload it may carry, and what it means.
//!
//! `Opcode` is a newtype over the raw byte rather than an enum, so that every byte read from
//! the wire is representable; [`Opcode::info`] returns `None` for reserved opcodes and for the
//! transports (UC, RD, XRC) this stack does not speak.

use core::fmt;

use crate::error::{Error, Result};

/// A BTH opcode byte: bits 7:5 the transport, bits 4:0 the operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(pub u8);

/// Which extension headers follow the BTH. Their wire order is fixed: DETH, RETH, AtomicETH,
/// AETH, AtomicAckETH, ImmDt, IETH (then the CNP's 16 reserved bytes, which no other opcode has).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HeaderSet {
    /// RDMA ETH, 16 bytes: virtual address, R_Key, DMA length.
    pub reth: bool,
    /// ACK ETH, 4 bytes: syndrome and MSN.
    pub aeth: bool,
    /// Atomic ETH, 28 bytes: VA, R_Key, swap/add data, compare data.
    pub atomic_eth: bool,
    /// Atomic ACK ETH, 8 bytes: the original remote value.
    pub atomic_ack_eth: bool,
    /// Immediate data, 4 bytes.
    pub imm: bool,
    /// Invalidate ETH, 4 bytes: the R_Key to invalidate.
    pub ieth: bool,
    /// Datagram ETH (UD only), 8 bytes: Q_Key and source QP.
    pub deth: bool,
    /// The 16 reserved bytes of a CNP.
    pub cnp_reserved: bool,
}

impl HeaderSet {
    /// Bytes of extension headers after the BTH.
    pub const fn len(self) -> usize {
        (self.deth as usize) * crate::deth::DethRepr::LEN
            + (self.reth as usize) * crate::reth::RethRepr::LEN
            + (self.atomic_eth as usize) * crate::atomic::AtomicEthRepr::LEN
            + (self.aeth as usize) * crate::aeth::AethRepr::LEN
            + (self.atomic_ack_eth as usize) * crate::atomic::AtomicAckEthRepr::LEN
            + (self.imm as usize) * crate::imm::IMM_DT_LEN
            + (self.ieth as usize) * crate::imm::IETH_LEN
            + (self.cnp_reserved as usize) * CNP_RESERVED_LEN
    }

    /// True if no extension header follows the BTH.
    pub const fn is_empty(self) -> bool {
        self.len() == 0
    }
}

/// Bytes of reserved (zero) data a CNP carries after its BTH.
pub const CNP_RESERVED_LEN: usize = 16;

/// How many payload bytes a packet of an opcode may carry, relative to the path MTU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadRule {
    /// No payload at all (READ requests, ACKs, atomics, CNPs).
    None,
    /// Exactly one PMTU (FIRST and MIDDLE packets).
    FullMtu,
    /// 1..=PMTU bytes (LAST packets: never empty).
    UpToMtu,
    /// 0..=PMTU bytes (ONLY packets).
    ZeroToMtu,
}

impl PayloadRule {
    /// Checks a payload length (pad excluded) against this rule for a path MTU in bytes.
    pub fn check(self, len: usize, pmtu: usize) -> Result<()> {
        let ok = match self {
            PayloadRule::None => len == 0,
            PayloadRule::FullMtu => len == pmtu,
            PayloadRule::UpToMtu => (1..=pmtu).contains(&len),
            PayloadRule::ZeroToMtu => len <= pmtu,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::BadPayloadLength { len, rule: self, pmtu })
        }
    }
}

/// What an opcode does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// RC SEND (any position, with or without immediate or invalidate).
    Send,
    /// RC RDMA WRITE (any position, with or without immediate).
    Write,
    /// RC RDMA READ request.
    ReadRequest,
    /// RC RDMA READ response (any position).
    ReadResponse,
    /// RC ACKNOWLEDGE: an ACK, RNR NAK or NAK, told apart by the AETH syndrome.
    Ack,
    /// RC ATOMIC ACKNOWLEDGE, carrying the original value.
    AtomicAck,
    /// RC COMPARE & SWAP.
    CompareSwap,
    /// RC FETCH & ADD.
    FetchAdd,
    /// Congestion notification packet (RoCE v2).
    Cnp,
    /// UD SEND_ONLY (with or without immediate), e.g. CM MADs on QP1.
    UdSend,
}

/// Where a packet sits in a multi-packet message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Position {
    /// The first of several packets.
    First,
    /// Neither first nor last.
    Middle,
    /// The last of several packets.
    Last,
    /// The whole message in one packet (also every single-packet opcode).
    Only,
}

/// Everything the opcode table says about one opcode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// Extension headers after the BTH.
    pub headers: HeaderSet,
    /// The payload length rule.
    pub payload: PayloadRule,
    /// What the opcode does.
    pub kind: OpKind,
    /// Its place in a message.
    pub position: Position,
}

impl OpcodeInfo {
    /// True for packets a requester sends (SEND, WRITE, READ request, atomics, UD SEND).
    pub const fn is_request(self) -> bool {
        matches!(
            self.kind,
            OpKind::Send
                | OpKind::Write
                | OpKind::ReadRequest
                | OpKind::CompareSwap
                | OpKind::FetchAdd
                | OpKind::UdSend
        )
    }

    /// True for packets a responder sends (READ responses, ACKs, atomic ACKs).
    pub const fn is_response(self) -> bool {
        matches!(self.kind, OpKind::ReadResponse | OpKind::Ack | OpKind::AtomicAck)
    }

    /// True if the packet carries immediate data.
    pub const fn has_immediate(self) -> bool {
        self.headers.imm
    }

    /// True if the packet carries an IETH (SEND with invalidate).
    pub const fn has_invalidate(self) -> bool {
        self.headers.ieth
    }

    /// BTH plus extension headers, in bytes.
    pub const fn header_len(self) -> usize {
        crate::bth::BthRepr::LEN + self.headers.len()
    }

    /// Checks a payload length (pad excluded) against the opcode's rule for a path MTU.
    pub fn check_payload_len(self, len: usize, pmtu: usize) -> Result<()> {
        self.payload.check(len, pmtu)
    }
}

const NONE: HeaderSet = HeaderSet {
    reth: false,
    aeth: false,
    atomic_eth: false,
    atomic_ack_eth: false,
    imm: false,
    ieth: false,
    deth: false,
    cnp_reserved: false,
};
const IMM: HeaderSet = HeaderSet { imm: true, ..NONE };
const RETH: HeaderSet = HeaderSet { reth: true, ..NONE };
const RETH_IMM: HeaderSet = HeaderSet { reth: true, imm: true, ..NONE };
const AETH: HeaderSet = HeaderSet { aeth: true, ..NONE };
const AETH_ATOMIC_ACK: HeaderSet = HeaderSet { aeth: true, atomic_ack_eth: true, ..NONE };
const ATOMIC: HeaderSet = HeaderSet { atomic_eth: true, ..NONE };
const IETH: HeaderSet = HeaderSet { ieth: true, ..NONE };
const DETH: HeaderSet = HeaderSet { deth: true, ..NONE };
const DETH_IMM: HeaderSet = HeaderSet { deth: true, imm: true, ..NONE };
const CNP: HeaderSet = HeaderSet { cnp_reserved: true, ..NONE };

const fn info(headers: HeaderSet, payload: PayloadRule, kind: OpKind, position: Position) -> OpcodeInfo {
    OpcodeInfo { headers, payload, kind, position }
}

macro_rules! opcodes {
    ($( $(#[$doc:meta])* $name:ident = $code:literal => $info:expr ;)*) => {
        impl Opcode {
            $( $(#[$doc])* pub const $name: Opcode = Opcode($code); )*

            /// Every opcode [`Opcode::info`] knows, in numeric order.
            pub const ALL_KNOWN: &'static [Opcode] = &[$(Opcode($code)),*];

            /// The table entry of this opcode; `None` for reserved or unsupported opcodes.
            pub const fn info(self) -> Option<OpcodeInfo> {
                match self.0 {
                    $( $code => Some($info), )*
                    _ => None,
                }
            }

            fn known_name(self) -> Option<&'static str> {
                match self.0 {
                    $( $code => Some(stringify!($name)), )*
                    _ => None,
                }
            }
        }
    };
}

use OpKind::{
    Ack, AtomicAck, Cnp as CnpKind, CompareSwap, FetchAdd, ReadRequest, ReadResponse, Send, UdSend, Write,
};
use PayloadRule::{FullMtu, UpToMtu, ZeroToMtu};
use Position::{First, Last, Middle, Only};

opcodes! {
    /// RC SEND, first packet.
    RC_SEND_FIRST = 0x00 => info(NONE, FullMtu, Send, First);
    /// RC SEND, middle packet.
    RC_SEND_MIDDLE = 0x01 => info(NONE, FullMtu, Send, Middle);
    /// RC SEND, last packet.
    RC_SEND_LAST = 0x02 => info(NONE, UpToMtu, Send, Last);
    /// RC SEND, last packet, with immediate data.
    RC_SEND_LAST_WITH_IMMEDIATE = 0x03 => info(IMM, UpToMtu, Send, Last);
    /// RC SEND in one packet.
    RC_SEND_ONLY = 0x04 => info(NONE, ZeroToMtu, Send, Only);
    /// RC SEND in one packet, with immediate data.
    RC_SEND_ONLY_WITH_IMMEDIATE = 0x05 => info(IMM, ZeroToMtu, Send, Only);
    /// RC RDMA WRITE, first packet (carries the RETH).
    RC_RDMA_WRITE_FIRST = 0x06 => info(RETH, FullMtu, Write, First);
    /// RC RDMA WRITE, middle packet.
    RC_RDMA_WRITE_MIDDLE = 0x07 => info(NONE, FullMtu, Write, Middle);
    /// RC RDMA WRITE, last packet.
    RC_RDMA_WRITE_LAST = 0x08 => info(NONE, UpToMtu, Write, Last);
    /// RC RDMA WRITE, last packet, with immediate data.
    RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09 => info(IMM, UpToMtu, Write, Last);
    /// RC RDMA WRITE in one packet.
    RC_RDMA_WRITE_ONLY = 0x0A => info(RETH, ZeroToMtu, Write, Only);
    /// RC RDMA WRITE in one packet, with immediate data.
    RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B => info(RETH_IMM, ZeroToMtu, Write, Only);
    /// RC RDMA READ request (consumes one PSN per response packet).
    RC_RDMA_READ_REQUEST = 0x0C => info(RETH, PayloadRule::None, ReadRequest, Only);
    /// RC RDMA READ response, first packet.
    RC_RDMA_READ_RESPONSE_FIRST = 0x0D => info(AETH, FullMtu, ReadResponse, First);
    /// RC RDMA READ response, middle packet (no AETH).
    RC_RDMA_READ_RESPONSE_MIDDLE = 0x0E => info(NONE, FullMtu, ReadResponse, Middle);
    /// RC RDMA READ response, last packet.
    RC_RDMA_READ_RESPONSE_LAST = 0x0F => info(AETH, UpToMtu, ReadResponse, Last);
    /// RC RDMA READ response in one packet.
    RC_RDMA_READ_RESPONSE_ONLY = 0x10 => info(AETH, ZeroToMtu, ReadResponse, Only);
    /// RC ACKNOWLEDGE (ACK, RNR NAK or NAK).
    RC_ACKNOWLEDGE = 0x11 => info(AETH, PayloadRule::None, Ack, Only);
    /// RC ATOMIC ACKNOWLEDGE.
    RC_ATOMIC_ACKNOWLEDGE = 0x12 => info(AETH_ATOMIC_ACK, PayloadRule::None, AtomicAck, Only);
    /// RC COMPARE & SWAP.
    RC_COMPARE_SWAP = 0x13 => info(ATOMIC, PayloadRule::None, CompareSwap, Only);
    /// RC FETCH & ADD.
    RC_FETCH_ADD = 0x14 => info(ATOMIC, PayloadRule::None, FetchAdd, Only);
    /// RC SEND, last packet, invalidating an R_Key at the responder.
    RC_SEND_LAST_WITH_INVALIDATE = 0x16 => info(IETH, UpToMtu, Send, Last);
    /// RC SEND in one packet, invalidating an R_Key at the responder.
    RC_SEND_ONLY_WITH_INVALIDATE = 0x17 => info(IETH, ZeroToMtu, Send, Only);
    /// UC SEND, first packet (UC: as RC, without acknowledgements; decoded, not served).
    UC_SEND_FIRST = 0x20 => info(NONE, FullMtu, Send, First);
    /// UC SEND, middle packet.
    UC_SEND_MIDDLE = 0x21 => info(NONE, FullMtu, Send, Middle);
    /// UC SEND, last packet.
    UC_SEND_LAST = 0x22 => info(NONE, UpToMtu, Send, Last);
    /// UC SEND, last packet, with immediate data.
    UC_SEND_LAST_WITH_IMMEDIATE = 0x23 => info(IMM, UpToMtu, Send, Last);
    /// UC SEND in one packet.
    UC_SEND_ONLY = 0x24 => info(NONE, ZeroToMtu, Send, Only);
    /// UC SEND in one packet, with immediate data.
    UC_SEND_ONLY_WITH_IMMEDIATE = 0x25 => info(IMM, ZeroToMtu, Send, Only);
    /// UC RDMA WRITE, first packet (carries the RETH).
    UC_RDMA_WRITE_FIRST = 0x26 => info(RETH, FullMtu, Write, First);
    /// UC RDMA WRITE, middle packet.
    UC_RDMA_WRITE_MIDDLE = 0x27 => info(NONE, FullMtu, Write, Middle);
    /// UC RDMA WRITE, last packet.
    UC_RDMA_WRITE_LAST = 0x28 => info(NONE, UpToMtu, Write, Last);
    /// UC RDMA WRITE, last packet, with immediate data.
    UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29 => info(IMM, UpToMtu, Write, Last);
    /// UC RDMA WRITE in one packet.
    UC_RDMA_WRITE_ONLY = 0x2A => info(RETH, ZeroToMtu, Write, Only);
    /// UC RDMA WRITE in one packet, with immediate data.
    UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2B => info(RETH_IMM, ZeroToMtu, Write, Only);
    /// UD SEND in one packet (UD messages never span packets).
    UD_SEND_ONLY = 0x64 => info(DETH, ZeroToMtu, UdSend, Only);
    /// UD SEND in one packet, with immediate data.
    UD_SEND_ONLY_WITH_IMMEDIATE = 0x65 => info(DETH_IMM, ZeroToMtu, UdSend, Only);
    /// RoCE v2 congestion notification packet.
    CNP = 0x81 => info(CNP, PayloadRule::None, CnpKind, Only);
}

/// The transport class in the opcode's top three bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Reliable connected (0b000).
    Rc,
    /// Unreliable connected (0b001).
    Uc,
    /// Reliable datagram (0b010).
    Rd,
    /// Unreliable datagram (0b011).
    Ud,
    /// Congestion notification (0b100).
    Cnp,
    /// Extended reliable connected (0b101).
    Xrc,
    /// Reserved (0b110).
    Reserved,
    /// Vendor specific (0b111).
    Vendor,
}

impl Opcode {
    /// The transport class (bits 7:5).
    pub const fn transport(self) -> Transport {
        match self.0 >> 5 {
            0 => Transport::Rc,
            1 => Transport::Uc,
            2 => Transport::Rd,
            3 => Transport::Ud,
            4 => Transport::Cnp,
            5 => Transport::Xrc,
            6 => Transport::Reserved,
            _ => Transport::Vendor,
        }
    }

    /// The opcode's name as in digest §4 ("RC_SEND_ONLY", "UC_SEND_ONLY", "UNKNOWN", ...).
    ///
    /// UC opcodes are named for the pretty-printer even though [`Opcode::info`] does not
    /// describe them: an RC engine must never mistake a UC packet for an RC one.
    pub fn name(self) -> &'static str {
        if let Some(name) = self.known_name() {
            return name;
        }
        match self.0 {
            0x1C => "RC_FLUSH",
            0x1D => "RC_ATOMIC_WRITE",
            _ => "UNKNOWN",
        }
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Opcode({:#04x} {})", self.0, self.name())
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_match_the_digest() {
        // Digest §4: BTH through the last extension header is 12, 16, 28, 32 or 40 bytes.
        let len = |op: Opcode| op.info().map(OpcodeInfo::header_len);
        assert_eq!(len(Opcode::RC_SEND_ONLY), Some(12));
        assert_eq!(len(Opcode::RC_SEND_ONLY_WITH_IMMEDIATE), Some(16));
        assert_eq!(len(Opcode::RC_ACKNOWLEDGE), Some(16));
        assert_eq!(len(Opcode::RC_SEND_ONLY_WITH_INVALIDATE), Some(16));
        assert_eq!(len(Opcode::RC_RDMA_WRITE_FIRST), Some(28));
        assert_eq!(len(Opcode::RC_ATOMIC_ACKNOWLEDGE), Some(24));
        assert_eq!(len(Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE), Some(32));
        assert_eq!(len(Opcode::RC_COMPARE_SWAP), Some(40));
        assert_eq!(len(Opcode::UD_SEND_ONLY), Some(20));
        assert_eq!(len(Opcode::UD_SEND_ONLY_WITH_IMMEDIATE), Some(24));
        assert_eq!(len(Opcode::CNP), Some(28));
    }

    #[test]
    fn reserved_and_foreign_opcodes_have_no_info() {
        for code in [0x15u8, 0x18, 0x1C, 0x1D, 0x1F, 0x2C, 0x40, 0x66, 0x80, 0xFF] {
            assert_eq!(Opcode(code).info(), None, "opcode {code:#04x}");
        }
        assert_eq!(Opcode(0x15).name(), "UNKNOWN");
        assert_eq!(Opcode(0x24).name(), "UC_SEND_ONLY");
    }

    #[test]
    fn names_follow_the_constants() {
        assert_eq!(Opcode::RC_SEND_ONLY.name(), "RC_SEND_ONLY");
        assert_eq!(Opcode(0x11).name(), "RC_ACKNOWLEDGE");
        assert_eq!(Opcode(0x81).to_string(), "CNP");
        assert_eq!(format!("{:?}", Opcode(0x0c)), "Opcode(0x0c RC_RDMA_READ_REQUEST)");
        assert_eq!(Opcode::ALL_KNOWN.len(), 38);
    }

    #[test]
    fn kinds_split_into_requests_and_responses() {
        for op in Opcode::ALL_KNOWN {
            let info = op.info().unwrap();
            let both = info.is_request() && info.is_response();
            assert!(!both, "{op:?}");
            let neither = !info.is_request() && !info.is_response();
            assert_eq!(neither, info.kind == OpKind::Cnp, "{op:?}");
            assert_eq!(op.transport() == Transport::Rc, op.0 < 0x20, "{op:?}");
        }
        assert!(Opcode::RC_RDMA_READ_RESPONSE_MIDDLE.info().unwrap().is_response());
        assert!(Opcode::RC_FETCH_ADD.info().unwrap().is_request());
    }

    #[test]
    fn payload_rules() {
        let pmtu = 1024;
        let rule = |op: Opcode| op.info().unwrap().payload;
        assert!(rule(Opcode::RC_SEND_FIRST).check(1024, pmtu).is_ok());
        assert!(rule(Opcode::RC_SEND_MIDDLE).check(1023, pmtu).is_err());
        assert!(rule(Opcode::RC_SEND_LAST).check(0, pmtu).is_err());
        assert!(rule(Opcode::RC_SEND_LAST).check(1, pmtu).is_ok());
        assert!(rule(Opcode::RC_RDMA_WRITE_LAST).check(1025, pmtu).is_err());
        assert!(rule(Opcode::RC_SEND_ONLY).check(0, pmtu).is_ok());
        assert!(rule(Opcode::RC_RDMA_WRITE_ONLY).check(1024, pmtu).is_ok());
        assert!(rule(Opcode::RC_RDMA_READ_REQUEST).check(0, pmtu).is_ok());
        assert_eq!(
            rule(Opcode::RC_ACKNOWLEDGE).check(4, pmtu),
            Err(Error::BadPayloadLength { len: 4, rule: PayloadRule::None, pmtu })
        );
    }

    #[test]
    fn immediate_only_on_last_or_only() {
        for op in Opcode::ALL_KNOWN {
            let info = op.info().unwrap();
            if info.has_immediate() || info.has_invalidate() {
                assert!(matches!(info.position, Position::Last | Position::Only), "{op:?}");
            }
        }
    }
}
