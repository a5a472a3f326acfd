//! The ACK Extended Transport Header (AETH, 4 bytes, digest §3.1): syndrome and MSN, carried
//! by ACKs, NAKs, RNR NAKs, atomic ACKs and the first/last/only READ responses.

use core::fmt;

use crate::error::{ensure_room, Result};
use crate::field::{fixed_len_view, read_u24, write_u24};

mod field {
    pub const SYNDROME: usize = 0;
    pub const MSN: usize = 1;
}

fixed_len_view!(
    /// A read/write view of an AETH at the start of a buffer.
    AethPacket,
    AethRepr::LEN
);

impl<T: AsRef<[u8]>> AethPacket<T> {
    /// The raw syndrome byte.
    pub fn syndrome_byte(&self) -> u8 {
        self.buffer.as_ref()[field::SYNDROME]
    }

    /// The classified syndrome.
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from_byte(self.syndrome_byte())
    }

    /// The 24-bit message sequence number.
    pub fn msn(&self) -> u32 {
        read_u24(self.buffer.as_ref(), field::MSN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AethPacket<T> {
    /// Sets the syndrome.
    pub fn set_syndrome(&mut self, value: Syndrome) {
        self.buffer.as_mut()[field::SYNDROME] = value.to_byte();
    }

    /// Sets the MSN (low 24 bits).
    pub fn set_msn(&mut self, value: u32) {
        write_u24(self.buffer.as_mut(), field::MSN, value);
    }
}

/// The NAK codes of a syndrome of type 11 (digest §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// 0x60: PSN sequence error (the NAK's PSN is the responder's expected PSN).
    PsnSequenceError,
    /// 0x61: invalid request.
    InvalidRequest,
    /// 0x62: remote access error.
    RemoteAccessError,
    /// 0x63: remote operational error.
    RemoteOperationalError,
    /// 0x64: invalid RD request (RD only).
    InvalidRdRequest,
    /// Any syndrome byte with no defined meaning (another NAK code, type 10, or bit 7 set),
    /// holding the whole byte so that it round-trips. rxe treats these as a remote operational
    /// error.
    Reserved(u8),
}

/// The AETH syndrome byte, classified. Every byte maps to exactly one value and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// A positive acknowledgement with an end-to-end credit code (31 = no flow control).
    Ack {
        /// Credit code, 0..=31.
        credit_code: u8,
    },
    /// Receiver not ready: retry after the encoded RNR timer.
    RnrNak {
        /// RNR timer code, 0..=31 (see [`rnr_timer_micros`]).
        timer_code: u8,
    },
    /// A negative acknowledgement.
    Nak(NakCode),
}

const TYPE_MASK: u8 = 0xE0;
const VALUE_MASK: u8 = 0x1F;
const TYPE_ACK: u8 = 0x00;
const TYPE_RNR_NAK: u8 = 0x20;
const TYPE_NAK: u8 = 0x60;

impl Syndrome {
    /// ACK with credit code 31 ("invalid / unlimited"): what rxe always sends (byte 0x1F).
    pub const ACK_UNLIMITED: Syndrome = Syndrome::Ack { credit_code: 31 };

    /// Classifies a syndrome byte. Total: bytes without a defined meaning become
    /// `Nak(NakCode::Reserved(byte))`.
    pub const fn from_byte(byte: u8) -> Syndrome {
        let value = byte & VALUE_MASK;
        // Bit 7 is reserved; a set bit 7 makes the type 1xx, which is never ACK or RNR NAK.
        match byte & TYPE_MASK {
            TYPE_ACK => Syndrome::Ack { credit_code: value },
            TYPE_RNR_NAK => Syndrome::RnrNak { timer_code: value },
            TYPE_NAK => Syndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => NakCode::Reserved(byte),
            }),
            _ => Syndrome::Nak(NakCode::Reserved(byte)),
        }
    }

    /// The syndrome byte (codes are masked to their 5 bits).
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack { credit_code } => TYPE_ACK | (credit_code & VALUE_MASK),
            Syndrome::RnrNak { timer_code } => TYPE_RNR_NAK | (timer_code & VALUE_MASK),
            Syndrome::Nak(NakCode::PsnSequenceError) => TYPE_NAK,
            Syndrome::Nak(NakCode::InvalidRequest) => TYPE_NAK | 1,
            Syndrome::Nak(NakCode::RemoteAccessError) => TYPE_NAK | 2,
            Syndrome::Nak(NakCode::RemoteOperationalError) => TYPE_NAK | 3,
            Syndrome::Nak(NakCode::InvalidRdRequest) => TYPE_NAK | 4,
            Syndrome::Nak(NakCode::Reserved(byte)) => byte,
        }
    }

    /// True for a positive acknowledgement.
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

impl fmt::Display for Syndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Syndrome::Ack { credit_code } => match credit_count(credit_code) {
                Some(credits) => write!(f, "ACK, {credits} credits (code {credit_code})"),
                None => write!(f, "ACK, no credit limit (code 31)"),
            },
            Syndrome::RnrNak { timer_code } => write!(
                f,
                "RNR NAK, retry after {} µs (timer code {timer_code})",
                rnr_timer_micros(timer_code)
            ),
            Syndrome::Nak(code) => match code {
                NakCode::PsnSequenceError => f.write_str("NAK: PSN sequence error"),
                NakCode::InvalidRequest => f.write_str("NAK: invalid request"),
                NakCode::RemoteAccessError => f.write_str("NAK: remote access error"),
                NakCode::RemoteOperationalError => f.write_str("NAK: remote operational error"),
                NakCode::InvalidRdRequest => f.write_str("NAK: invalid RD request"),
                NakCode::Reserved(byte) => write!(f, "reserved syndrome {byte:#04x}"),
            },
        }
    }
}

/// Credit counts of credit codes 0..=30 (IBA; code 31 means "no flow control").
const CREDITS: [u32; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
    4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

/// The number of receive credits a credit code advertises; `None` for 31 (unlimited).
pub fn credit_count(credit_code: u8) -> Option<u32> {
    CREDITS.get(usize::from(credit_code & VALUE_MASK)).copied()
}

/// RNR timer codes in microseconds (digest §6.8); code 0 is the longest, 655.36 ms.
const RNR_TIMER_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680,
    10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
];

/// The minimum RNR wait an RNR timer code encodes, in microseconds (low 5 bits used).
pub fn rnr_timer_micros(timer_code: u8) -> u32 {
    RNR_TIMER_MICROS[usize::from(timer_code & VALUE_MASK)]
}

/// The parsed fields of an AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// The syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl AethRepr {
    /// Length of an AETH in bytes.
    pub const LEN: usize = 4;

    /// Reads an AETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &AethPacket<&T>) -> Result<AethRepr> {
        packet.check_len()?;
        Ok(AethRepr { syndrome: packet.syndrome(), msn: packet.msn() })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes the AETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AethPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        packet.set_syndrome(self.syndrome);
        packet.set_msn(self.msn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_digest_table() {
        assert_eq!(Syndrome::from_byte(0x1F), Syndrome::ACK_UNLIMITED);
        assert_eq!(Syndrome::from_byte(0x00), Syndrome::Ack { credit_code: 0 });
        assert_eq!(Syndrome::from_byte(0x2C), Syndrome::RnrNak { timer_code: 12 });
        assert_eq!(Syndrome::from_byte(0x60), Syndrome::Nak(NakCode::PsnSequenceError));
        assert_eq!(Syndrome::from_byte(0x61), Syndrome::Nak(NakCode::InvalidRequest));
        assert_eq!(Syndrome::from_byte(0x62), Syndrome::Nak(NakCode::RemoteAccessError));
        assert_eq!(Syndrome::from_byte(0x63), Syndrome::Nak(NakCode::RemoteOperationalError));
        assert_eq!(Syndrome::from_byte(0x64), Syndrome::Nak(NakCode::InvalidRdRequest));
        assert_eq!(Syndrome::from_byte(0x65), Syndrome::Nak(NakCode::Reserved(0x65)));
        assert_eq!(Syndrome::from_byte(0x45), Syndrome::Nak(NakCode::Reserved(0x45)));
        assert_eq!(Syndrome::from_byte(0x9F), Syndrome::Nak(NakCode::Reserved(0x9F)));
    }

    #[test]
    fn every_byte_round_trips() {
        for byte in 0..=u8::MAX {
            assert_eq!(Syndrome::from_byte(byte).to_byte(), byte);
        }
    }

    #[test]
    fn meanings() {
        assert_eq!(Syndrome::ACK_UNLIMITED.to_string(), "ACK, no credit limit (code 31)");
        assert_eq!(Syndrome::from_byte(0x05).to_string(), "ACK, 6 credits (code 5)");
        assert_eq!(Syndrome::from_byte(0x2E).to_string(), "RNR NAK, retry after 1280 µs (timer code 14)");
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(rnr_timer_micros(12), 640);
        assert_eq!(credit_count(30), Some(32768));
        assert_eq!(credit_count(31), None);
    }

    #[test]
    fn parse_and_emit_rxe_ack() {
        // AETH of the rxe ACK capture: syndrome 0x1F, MSN 1.
        let bytes = [0x1F, 0x00, 0x00, 0x01];
        let repr = AethRepr::parse(&AethPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr, AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 });
        let mut out = [0u8; 4];
        repr.emit(&mut AethPacket::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(AethPacket::new_checked(&bytes[..3]).is_err());
    }
}
