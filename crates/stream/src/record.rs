//! Records: the unit both transports carry. Over RDMA a record is one RDMA WRITE with immediate
//! whose 32-bit immediate says what the written bytes are; over TCP it is an 8-byte header
//! followed by the payload ([`crate::frame`]).
//!
//! Immediate layout (host order, sent big-endian by the verbs layer):
//!
//! ```text
//!  31    28 27                          0
//! +--------+-----------------------------+
//! |  kind  |        length / value       |
//! +--------+-----------------------------+
//! ```
//!
//! For records that carry ring bytes the low 27 bits are the number of bytes covered (the
//! driver keeps records below 2^27 bytes; rings are smaller) and bit 27 is the *restart* flag:
//! the record starts at the beginning of the receiver's ring, not where the previous one ended
//! (protocol version 4, see [`crate::Conn`]'s "Ring restarts"). Control records use the 28
//! bits for a value: the sender's view of a counter (starved notices), an application value
//! (notify) or the number of a rendezvous (see [`crate::rendezvous`]).

/// Largest record payload (and control value) a record carries.
pub const MAX_RECORD_LEN: u32 = (1 << 27) - 1;

const KIND_SHIFT: u32 = 28;
const VALUE_MASK: u32 = (1 << 28) - 1;
/// Bit 27 of a ring-bytes record's immediate: the record restarts the ring.
const RESTART_FLAG: u32 = 1 << 27;

/// What a record carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// Stream bytes (written into the ring).
    Data,
    /// Part of a message that continues in the next record (ring bytes).
    MsgPart,
    /// The last (or only) part of a message (ring bytes; may be empty).
    MsgEnd,
    /// The sender will send nothing more (half close). No ring bytes.
    Close,
    /// The sender's credit word was rewritten; look at it. No ring bytes.
    Credit,
    /// A notification from a one-sided write into an exposed buffer: `length` is the
    /// application's 27-bit value. No ring bytes.
    Notify,
    /// The sender is blocked on ring space; `length` is its view of the receiver's
    /// consumed-bytes counter (mod 2^27). No ring bytes.
    StarvedBytes,
    /// The sender is blocked on receive credits; `length` is its view of the receiver's
    /// receives-posted counter (mod 2^27). No ring bytes.
    StarvedRecvs,
    /// A rendezvous: the ring holds a [`crate::rendezvous::Descriptor`] (exactly
    /// [`crate::rendezvous::DESCRIPTOR_LEN`] bytes) naming a registered buffer of the sender
    /// whose bytes the receiver fetches with RDMA READ, in stream order at this point.
    Rendezvous,
    /// The receiver has fetched every byte of a rendezvous; `length` is its number (mod 2^27,
    /// counting from 0). No ring bytes.
    RendezvousDone,
}

impl RecordKind {
    /// The 4-bit code.
    pub fn code(self) -> u8 {
        match self {
            RecordKind::Data => 0,
            RecordKind::MsgPart => 1,
            RecordKind::MsgEnd => 2,
            RecordKind::Close => 3,
            RecordKind::Credit => 4,
            RecordKind::Notify => 5,
            RecordKind::StarvedBytes => 6,
            RecordKind::StarvedRecvs => 7,
            RecordKind::Rendezvous => 8,
            RecordKind::RendezvousDone => 9,
        }
    }

    /// From the 4-bit code; unknown codes are refused.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => RecordKind::Data,
            1 => RecordKind::MsgPart,
            2 => RecordKind::MsgEnd,
            3 => RecordKind::Close,
            4 => RecordKind::Credit,
            5 => RecordKind::Notify,
            6 => RecordKind::StarvedBytes,
            7 => RecordKind::StarvedRecvs,
            8 => RecordKind::Rendezvous,
            9 => RecordKind::RendezvousDone,
            _ => return None,
        })
    }

    /// Whether the record's length counts bytes written into the receiver's ring.
    pub fn uses_ring(self) -> bool {
        matches!(self, RecordKind::Data | RecordKind::MsgPart | RecordKind::MsgEnd | RecordKind::Rendezvous)
    }

    /// Whether the record is part of a message.
    pub fn is_message(self) -> bool {
        matches!(self, RecordKind::MsgPart | RecordKind::MsgEnd)
    }
}

/// A decoded immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Imm {
    /// What the record carries.
    pub kind: RecordKind,
    /// Ring bytes covered, or a control record's value.
    pub len: u32,
    /// A ring-bytes record that starts at the beginning of the receiver's ring: the bytes
    /// between the end of the previous record and the end of the ring are skipped. The sender
    /// sets it only when the receiver had read everything before (see [`crate::Conn`]).
    pub restart: bool,
}

/// An immediate that does not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadImm(pub u32);

impl std::fmt::Display for BadImm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "immediate {:#010x} has an unknown record kind", self.0)
    }
}

impl std::error::Error for BadImm {}

impl Imm {
    /// A record of `kind` covering `len` bytes. `len` above [`MAX_RECORD_LEN`] is truncated to
    /// 27 bits: callers split records before that.
    pub fn new(kind: RecordKind, len: u32) -> Self {
        Self { kind, len: len & MAX_RECORD_LEN, restart: false }
    }

    /// The same record with the restart flag set (`restart`); only a record of a kind that
    /// [`RecordKind::uses_ring`] carries it.
    pub fn restarting(self, restart: bool) -> Self {
        Self { restart: restart && self.kind.uses_ring(), ..self }
    }

    /// The 32-bit immediate.
    pub fn encode(self) -> u32 {
        let flag = if self.restart && self.kind.uses_ring() { RESTART_FLAG } else { 0 };
        (u32::from(self.kind.code()) << KIND_SHIFT) | flag | (self.len & VALUE_MASK)
    }

    /// Decodes an immediate from the peer.
    pub fn decode(raw: u32) -> Result<Self, BadImm> {
        let kind = RecordKind::from_code((raw >> KIND_SHIFT) as u8).ok_or(BadImm(raw))?;
        if kind.uses_ring() {
            Ok(Self { kind, len: raw & MAX_RECORD_LEN, restart: raw & RESTART_FLAG != 0 })
        } else {
            Ok(Self { kind, len: raw & VALUE_MASK, restart: false })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imm_layout() {
        let imm = Imm { kind: RecordKind::MsgEnd, len: 0x123, restart: false };
        assert_eq!(imm.encode(), 0x2000_0123);
        assert_eq!(Imm::decode(0x2000_0123), Ok(imm));
        assert_eq!(Imm::new(RecordKind::Data, MAX_RECORD_LEN).encode(), 0x07FF_FFFF);
        assert_eq!(Imm::decode(0xF000_0000), Err(BadImm(0xF000_0000)));
        assert_eq!(Imm::decode(0x7000_0005), Ok(Imm::new(RecordKind::StarvedRecvs, 5)));
        assert_eq!(Imm::decode(0x8000_0018), Ok(Imm::new(RecordKind::Rendezvous, 24)));
        assert_eq!(Imm::decode(0x9000_0003), Ok(Imm::new(RecordKind::RendezvousDone, 3)));
        assert_eq!(Imm::decode(0xA000_0000), Err(BadImm(0xA000_0000)));
    }

    #[test]
    fn ring_records_carry_the_restart_flag_in_bit_27() {
        let data = Imm::new(RecordKind::Data, 0x40).restarting(true);
        assert_eq!(data.encode(), 0x0800_0040);
        assert_eq!(Imm::decode(0x0800_0040), Ok(data));
        let rendezvous = Imm::new(RecordKind::Rendezvous, 24).restarting(true);
        assert_eq!(Imm::decode(rendezvous.encode()), Ok(rendezvous));
        assert_eq!(Imm::decode(0x2800_0000), Ok(Imm::new(RecordKind::MsgEnd, 0).restarting(true)));
        // Control records keep all 28 bits for their value and never restart.
        let notice = Imm::new(RecordKind::StarvedBytes, 0x07FF_FFFF).restarting(true);
        assert!(!notice.restart);
        assert_eq!(
            Imm::decode(0x6800_0001),
            Ok(Imm { kind: RecordKind::StarvedBytes, len: 0x0800_0001, restart: false })
        );
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0..16u8 {
            match RecordKind::from_code(code) {
                Some(kind) => assert_eq!(kind.code(), code),
                None => assert!(code > 9),
            }
        }
        for raw in [0u32, 1, 0x0800_0000, 0x5FFF_FFFF, 0x3000_0000, 0x6ABC_DEF0] {
            assert_eq!(Imm::decode(raw).map(Imm::encode), Ok(raw));
        }
    }
}
