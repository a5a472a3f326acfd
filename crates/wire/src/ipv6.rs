//! The IPv6 fixed header (40 bytes), for RoCE v2 over IPv6 (non-v4-mapped GIDs).
//!
//! Extension headers are not followed: RoCE v2 senders put UDP right after the fixed header.

use std::net::Ipv6Addr;

use crate::error::{ensure_room, Error, Result};
use crate::field::{read_u16, write_u16};

mod field {
    pub const VER_TC_FL: usize = 0;
    pub const PAYLOAD_LEN: usize = 4;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: usize = 8;
    pub const DST: usize = 24;
}

/// Length of the IPv6 fixed header.
pub const HEADER_LEN: usize = 40;
/// Byte offset of the hop limit, masked in the ICRC.
pub const HOP_LIMIT_OFFSET: usize = field::HOP_LIMIT;

/// A read/write view of an IPv6 packet.
#[derive(Debug, Clone)]
pub struct Ipv6Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Ipv6Packet<T> {
        Ipv6Packet { buffer }
    }

    /// Wraps a buffer after [`Ipv6Packet::check_len`].
    pub fn new_checked(buffer: T) -> Result<Ipv6Packet<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Checks the version and that the buffer holds the header plus the payload length (it may
    /// hold more); after this no accessor panics.
    pub fn check_len(&self) -> Result<()> {
        let data = self.buffer.as_ref();
        if data.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 6 {
            return Err(Error::Malformed("IP version is not 6"));
        }
        if HEADER_LEN + usize::from(self.payload_len()) > data.len() {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn first_word(&self) -> u32 {
        let d = self.buffer.as_ref();
        u32::from_be_bytes([d[0], d[1], d[2], d[3]])
    }

    /// The IP version (6).
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_TC_FL] >> 4
    }

    /// Traffic class (DSCP and ECN).
    pub fn traffic_class(&self) -> u8 {
        (self.first_word() >> 20) as u8
    }

    /// Flow label (20 bits; rxe sends 0).
    pub fn flow_label(&self) -> u32 {
        self.first_word() & 0x000F_FFFF
    }

    /// Payload length.
    pub fn payload_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }

    /// Next header (17 = UDP).
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NEXT_HEADER]
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv6Addr {
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&self.buffer.as_ref()[field::SRC..field::SRC + 16]);
        Ipv6Addr::from(octets)
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv6Addr {
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&self.buffer.as_ref()[field::DST..field::DST + 16]);
        Ipv6Addr::from(octets)
    }

    /// The payload, as delimited by the payload length.
    pub fn payload(&self) -> &[u8] {
        let data = self.buffer.as_ref();
        let end = (HEADER_LEN + usize::from(self.payload_len())).min(data.len());
        &data[HEADER_LEN.min(end)..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    /// Sets version 6, traffic class and flow label (low 20 bits).
    pub fn set_version_class_flow(&mut self, traffic_class: u8, flow_label: u32) {
        let word = (6u32 << 28) | (u32::from(traffic_class) << 20) | (flow_label & 0x000F_FFFF);
        self.buffer.as_mut()[..4].copy_from_slice(&word.to_be_bytes());
    }

    /// Sets the payload length.
    pub fn set_payload_len(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::PAYLOAD_LEN, value);
    }

    /// Sets the next header.
    pub fn set_next_header(&mut self, value: u8) {
        self.buffer.as_mut()[field::NEXT_HEADER] = value;
    }

    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, value: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = value;
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, value: Ipv6Addr) {
        self.buffer.as_mut()[field::SRC..field::SRC + 16].copy_from_slice(&value.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, value: Ipv6Addr) {
        self.buffer.as_mut()[field::DST..field::DST + 16].copy_from_slice(&value.octets());
    }
}

/// The parsed fields of an IPv6 fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Repr {
    /// Source address.
    pub src_addr: Ipv6Addr,
    /// Destination address.
    pub dst_addr: Ipv6Addr,
    /// Next header.
    pub next_header: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
}

impl Ipv6Repr {
    /// Reads a checked view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Ipv6Packet<&T>) -> Result<Ipv6Repr> {
        packet.check_len()?;
        Ok(Ipv6Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            next_header: packet.next_header(),
            payload_len: usize::from(packet.payload_len()),
            traffic_class: packet.traffic_class(),
            flow_label: packet.flow_label(),
            hop_limit: packet.hop_limit(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header; the payload is the caller's.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Ipv6Packet<T>) -> Result<()> {
        ensure_room(HEADER_LEN, packet.buffer.as_ref().len())?;
        let len = u16::try_from(self.payload_len)
            .map_err(|_| Error::Malformed("IPv6 payload longer than 65535 bytes"))?;
        packet.set_version_class_flow(self.traffic_class, self.flow_label);
        packet.set_payload_len(len);
        packet.set_next_header(self.next_header);
        packet.set_hop_limit(self.hop_limit);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_emit() {
        let mut bytes = vec![
            0x6A, 0xB1, 0x23, 0x45, 0x00, 0x04, 0x11, 0x40, // TC 0xAB, flow 0x12345
        ];
        bytes.extend_from_slice(&Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1).octets());
        bytes.extend_from_slice(&Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2).octets());
        bytes.extend_from_slice(&[1, 2, 3, 4, 0xEE]);
        let packet = Ipv6Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(packet.payload(), &[1, 2, 3, 4]);
        let repr = Ipv6Repr::parse(&packet).unwrap();
        assert_eq!((repr.traffic_class, repr.flow_label), (0xAB, 0x12345));
        assert_eq!((repr.next_header, repr.hop_limit, repr.payload_len), (17, 64, 4));
        let mut out = [0u8; 40];
        repr.emit(&mut Ipv6Packet::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out[..], bytes[..40]);
    }

    #[test]
    fn rejects_short_or_wrong_version() {
        let mut bytes = [0u8; 44];
        bytes[0] = 0x60;
        bytes[5] = 5;
        assert_eq!(Ipv6Packet::new_checked(&bytes[..]).err(), Some(Error::Truncated));
        bytes[5] = 4;
        assert!(Ipv6Packet::new_checked(&bytes[..]).is_ok());
        assert_eq!(Ipv6Packet::new_checked(&bytes[..39]).err(), Some(Error::Truncated));
        bytes[0] = 0x40;
        assert!(Ipv6Packet::new_checked(&bytes[..]).is_err());
    }
}
