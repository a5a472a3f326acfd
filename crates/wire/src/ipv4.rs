//! The IPv4 header, for decoding captures and building whole packets in tests.
//!
//! RoCE v2 never uses IPv4 options: the ICRC pseudo-header assumes a 20-byte header, so
//! [`Ipv4Repr::parse`] rejects options with a clear error (the view still reads them).

use std::net::Ipv4Addr;

use crate::error::{ensure_room, Error, Result};
use crate::field::{read_u16, write_u16};

mod field {
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const TOTAL_LEN: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
}

/// Length of an IPv4 header without options.
pub const HEADER_LEN: usize = 20;
/// IP protocol number of UDP.
pub const PROTOCOL_UDP: u8 = 17;
/// Don't-fragment bit of the flags/fragment-offset word.
pub const FLAG_DONT_FRAG: u16 = 0x4000;
/// More-fragments bit of the flags/fragment-offset word.
pub const FLAG_MORE_FRAGS: u16 = 0x2000;
/// Byte offset of the TOS byte, masked in the ICRC.
pub const TOS_OFFSET: usize = field::TOS;
/// Byte offset of the TTL byte, masked in the ICRC.
pub const TTL_OFFSET: usize = field::TTL;
/// Byte offset of the header checksum, masked in the ICRC.
pub const CHECKSUM_OFFSET: usize = field::CHECKSUM;

/// A read/write view of an IPv4 packet.
#[derive(Debug, Clone)]
pub struct Ipv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Ipv4Packet<T> {
        Ipv4Packet { buffer }
    }

    /// Wraps a buffer after [`Ipv4Packet::check_len`].
    pub fn new_checked(buffer: T) -> Result<Ipv4Packet<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Checks the version, the header length and that the buffer holds `total_len` bytes (it
    /// may hold more, e.g. Ethernet padding); after this no accessor panics.
    pub fn check_len(&self) -> Result<()> {
        let data = self.buffer.as_ref();
        if data.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 4 {
            return Err(Error::Malformed("IP version is not 4"));
        }
        let header_len = self.header_len();
        let total_len = usize::from(self.total_len());
        if header_len < HEADER_LEN {
            Err(Error::Malformed("IPv4 header length below 20 bytes"))
        } else if total_len < header_len {
            Err(Error::Malformed("IPv4 total length shorter than its header"))
        } else if total_len > data.len() {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The IP version (4).
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL × 4).
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::VER_IHL] & 0x0F) * 4
    }

    /// The TOS byte (DSCP and ECN).
    pub fn tos(&self) -> u8 {
        self.buffer.as_ref()[field::TOS]
    }

    /// DSCP (top six bits of TOS).
    pub fn dscp(&self) -> u8 {
        self.tos() >> 2
    }

    /// ECN (low two bits of TOS).
    pub fn ecn(&self) -> u8 {
        self.tos() & 3
    }

    /// Total length of header and payload.
    pub fn total_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::TOTAL_LEN)
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::IDENT)
    }

    /// The whole flags and fragment-offset word.
    pub fn flags_frag(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::FLAGS_FRAG)
    }

    /// Don't-fragment flag.
    pub fn dont_frag(&self) -> bool {
        self.flags_frag() & FLAG_DONT_FRAG != 0
    }

    /// More-fragments flag.
    pub fn more_frags(&self) -> bool {
        self.flags_frag() & FLAG_MORE_FRAGS != 0
    }

    /// Fragment offset in bytes.
    pub fn frag_offset(&self) -> u16 {
        (self.flags_frag() & 0x1FFF) << 3
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }

    /// Payload protocol (17 = UDP).
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }

    /// Header checksum.
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv4Addr {
        let d = self.buffer.as_ref();
        Ipv4Addr::new(d[field::SRC], d[field::SRC + 1], d[field::SRC + 2], d[field::SRC + 3])
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Addr {
        let d = self.buffer.as_ref();
        Ipv4Addr::new(d[field::DST], d[field::DST + 1], d[field::DST + 2], d[field::DST + 3])
    }

    /// True if the header checksum is correct.
    pub fn verify_checksum(&self) -> bool {
        let data = self.buffer.as_ref();
        internet_checksum(&data[..self.header_len().min(data.len())]) == 0
    }

    /// The payload, as delimited by the header and total lengths.
    pub fn payload(&self) -> &[u8] {
        let data = self.buffer.as_ref();
        let end = usize::from(self.total_len()).min(data.len());
        let start = self.header_len().min(end);
        &data[start..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    /// Sets version 4 and the header length in bytes (a multiple of 4).
    pub fn set_version_and_header_len(&mut self, header_len: usize) {
        self.buffer.as_mut()[field::VER_IHL] = 0x40 | ((header_len / 4) as u8 & 0x0F);
    }

    /// Sets the TOS byte.
    pub fn set_tos(&mut self, value: u8) {
        self.buffer.as_mut()[field::TOS] = value;
    }

    /// Sets the total length.
    pub fn set_total_len(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::TOTAL_LEN, value);
    }

    /// Sets the identification.
    pub fn set_ident(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::IDENT, value);
    }

    /// Sets the flags and fragment-offset word.
    pub fn set_flags_frag(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::FLAGS_FRAG, value);
    }

    /// Sets the TTL.
    pub fn set_ttl(&mut self, value: u8) {
        self.buffer.as_mut()[field::TTL] = value;
    }

    /// Sets the protocol.
    pub fn set_protocol(&mut self, value: u8) {
        self.buffer.as_mut()[field::PROTOCOL] = value;
    }

    /// Sets the checksum field.
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, value: Ipv4Addr) {
        self.buffer.as_mut()[field::SRC..field::SRC + 4].copy_from_slice(&value.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, value: Ipv4Addr) {
        self.buffer.as_mut()[field::DST..field::DST + 4].copy_from_slice(&value.octets());
    }

    /// Computes and stores the header checksum.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let header_len = self.header_len().min(self.buffer.as_ref().len());
        let sum = internet_checksum(&self.buffer.as_ref()[..header_len]);
        self.set_checksum(sum);
    }
}

/// The one's-complement checksum of RFC 791/1071 (0 when a correct checksum is included).
pub fn internet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = data.chunks_exact(2);
    for pair in &mut chunks {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// The parsed fields of an option-less IPv4 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src_addr: Ipv4Addr,
    /// Destination address.
    pub dst_addr: Ipv4Addr,
    /// Payload protocol.
    pub protocol: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// TOS (DSCP and ECN).
    pub tos: u8,
    /// TTL.
    pub ttl: u8,
    /// Identification.
    pub ident: u16,
    /// Don't-fragment flag.
    pub dont_frag: bool,
}

impl Ipv4Repr {
    /// Reads a checked view; rejects options and fragments, which RoCE v2 never uses. The
    /// header checksum is not checked here (captures taken on a sender with checksum offload
    /// show wrong ones); see [`Ipv4Packet::verify_checksum`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Ipv4Packet<&T>) -> Result<Ipv4Repr> {
        packet.check_len()?;
        if packet.header_len() != HEADER_LEN {
            return Err(Error::Malformed(
                "IPv4 options present: RoCE v2 never sends them and the ICRC assumes a 20-byte header",
            ));
        }
        if packet.more_frags() || packet.frag_offset() != 0 {
            return Err(Error::Malformed("fragmented IPv4 packet"));
        }
        Ok(Ipv4Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            protocol: packet.protocol(),
            payload_len: usize::from(packet.total_len()) - HEADER_LEN,
            tos: packet.tos(),
            ttl: packet.ttl(),
            ident: packet.ident(),
            dont_frag: packet.dont_frag(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with a correct checksum; the payload is the caller's.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Ipv4Packet<T>) -> Result<()> {
        ensure_room(HEADER_LEN, packet.buffer.as_ref().len())?;
        let total = u16::try_from(HEADER_LEN + self.payload_len)
            .map_err(|_| Error::Malformed("IPv4 payload longer than 65515 bytes"))?;
        packet.set_version_and_header_len(HEADER_LEN);
        packet.set_tos(self.tos);
        packet.set_total_len(total);
        packet.set_ident(self.ident);
        packet.set_flags_frag(if self.dont_frag { FLAG_DONT_FRAG } else { 0 });
        packet.set_ttl(self.ttl);
        packet.set_protocol(self.protocol);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        packet.fill_checksum();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // IPv4 header of the rxe ACK capture (10.77.0.2 -> 10.77.0.3, ID 0x031f, DF, TTL 64).
    const HEADER: [u8; 20] = [
        0x45, 0x00, 0x00, 0x30, 0x03, 0x1f, 0x40, 0x00, 0x40, 0x11, 0x23, 0x00, 0x0a, 0x4d, 0x00, 0x02, 0x0a,
        0x4d, 0x00, 0x03,
    ];

    fn with_payload(header: &[u8]) -> Vec<u8> {
        let mut bytes = header.to_vec();
        bytes.resize(48, 0);
        bytes
    }

    #[test]
    fn parses_rxe_header() {
        let bytes = with_payload(&HEADER);
        let packet = Ipv4Packet::new_checked(&bytes[..]).unwrap();
        assert!(packet.verify_checksum());
        assert_eq!(packet.payload().len(), 28);
        let repr = Ipv4Repr::parse(&packet).unwrap();
        assert_eq!(
            repr,
            Ipv4Repr {
                src_addr: Ipv4Addr::new(10, 77, 0, 2),
                dst_addr: Ipv4Addr::new(10, 77, 0, 3),
                protocol: PROTOCOL_UDP,
                payload_len: 28,
                tos: 0,
                ttl: 64,
                ident: 0x031f,
                dont_frag: true,
            }
        );
        let mut out = [0u8; 20];
        repr.emit(&mut Ipv4Packet::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, HEADER);
    }

    #[test]
    fn rejects_options_fragments_and_short_buffers() {
        let mut bytes = with_payload(&HEADER);
        bytes[0] = 0x46;
        let packet = Ipv4Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(packet.header_len(), 24);
        assert!(matches!(Ipv4Repr::parse(&packet), Err(Error::Malformed(m)) if m.contains("options")));
        let mut bytes = with_payload(&HEADER);
        bytes[6] = 0x20;
        let packet = Ipv4Packet::new_checked(&bytes[..]).unwrap();
        assert!(matches!(Ipv4Repr::parse(&packet), Err(Error::Malformed(_))));
        assert_eq!(Ipv4Packet::new_checked(&HEADER[..]).err(), Some(Error::Truncated));
        assert_eq!(Ipv4Packet::new_checked(&HEADER[..19]).err(), Some(Error::Truncated));
        let mut bytes = with_payload(&HEADER);
        bytes[0] = 0x44;
        assert!(Ipv4Packet::new_checked(&bytes[..]).is_err());
        bytes[0] = 0x65;
        assert!(Ipv4Packet::new_checked(&bytes[..]).is_err());
    }

    #[test]
    fn checksum_detects_corruption() {
        let mut bytes = with_payload(&HEADER);
        bytes[8] = 0x3F;
        assert!(!Ipv4Packet::new_unchecked(&bytes[..]).verify_checksum());
        Ipv4Packet::new_unchecked(&mut bytes[..]).fill_checksum();
        assert!(Ipv4Packet::new_unchecked(&bytes[..]).verify_checksum());
    }
}
