//! The UDP header (8 bytes) that carries RoCE v2 on destination port 4791.

use crate::error::{ensure_room, Error, Result};
use crate::field::{read_u16, write_u16};

/// The IANA port of RoCE v2; every RoCE v2 packet, request or response, goes to it.
pub const ROCE_V2_PORT: u16 = 4791;

mod field {
    pub const SRC_PORT: usize = 0;
    pub const DST_PORT: usize = 2;
    pub const LENGTH: usize = 4;
    pub const CHECKSUM: usize = 6;
}

/// Length of a UDP header in bytes.
pub const HEADER_LEN: usize = 8;

/// A read/write view of a UDP datagram (header and payload).
#[derive(Debug, Clone)]
pub struct UdpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> UdpPacket<T> {
        UdpPacket { buffer }
    }

    /// Wraps a buffer after [`UdpPacket::check_len`].
    pub fn new_checked(buffer: T) -> Result<UdpPacket<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Checks that the buffer holds the header and the length field's worth of bytes (it may
    /// hold more, e.g. Ethernet padding); after this no accessor panics.
    pub fn check_len(&self) -> Result<()> {
        let data = self.buffer.as_ref();
        if data.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let len = usize::from(read_u16(data, field::LENGTH));
        if len < HEADER_LEN {
            Err(Error::Malformed("UDP length shorter than its header"))
        } else if len > data.len() {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::SRC_PORT)
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::DST_PORT)
    }

    /// Length of header plus payload.
    pub fn len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::LENGTH)
    }

    /// True if the datagram has no payload.
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) <= HEADER_LEN
    }

    /// The checksum (RoCE v2 senders use 0; the ICRC masks it).
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// The payload, as delimited by the length field.
    pub fn payload(&self) -> &[u8] {
        let data = self.buffer.as_ref();
        let end = usize::from(self.len()).clamp(HEADER_LEN, data.len());
        &data[HEADER_LEN..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
    /// Sets the source port.
    pub fn set_src_port(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::SRC_PORT, value);
    }

    /// Sets the destination port.
    pub fn set_dst_port(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::DST_PORT, value);
    }

    /// Sets the length field.
    pub fn set_len(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::LENGTH, value);
    }

    /// Sets the checksum field.
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// The payload, mutable, as delimited by the length field.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = usize::from(self.len()).clamp(HEADER_LEN, self.buffer.as_ref().len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }
}

/// The parsed fields of a UDP header. The checksum is emitted as 0, as RoCE v2 senders do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port (flow entropy for RoCE v2).
    pub src_port: u16,
    /// Destination port (4791 for RoCE v2).
    pub dst_port: u16,
    /// Payload length in bytes.
    pub payload_len: usize,
}

impl UdpRepr {
    /// Reads a checked UDP view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &UdpPacket<&T>) -> Result<UdpRepr> {
        packet.check_len()?;
        Ok(UdpRepr {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            payload_len: usize::from(packet.len()) - HEADER_LEN,
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header (checksum 0); the payload is the caller's.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut UdpPacket<T>) -> Result<()> {
        ensure_room(HEADER_LEN, packet.buffer.as_ref().len())?;
        let len = u16::try_from(HEADER_LEN + self.payload_len)
            .map_err(|_| Error::Malformed("UDP payload longer than 65527 bytes"))?;
        packet.set_src_port(self.src_port);
        packet.set_dst_port(self.dst_port);
        packet.set_len(len);
        packet.set_checksum(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // UDP header of the rxe ACK capture: 49441 -> 4791, length 28, checksum 0.
    const HEADER: [u8; 8] = [0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00];

    #[test]
    fn parse_and_emit() {
        let mut bytes = HEADER.to_vec();
        bytes.resize(28 + 3, 0xEE); // 3 bytes of trailing padding beyond the UDP length
        let packet = UdpPacket::new_checked(&bytes[..]).unwrap();
        assert_eq!(packet.payload().len(), 20);
        let repr = UdpRepr::parse(&packet).unwrap();
        assert_eq!(repr, UdpRepr { src_port: 49441, dst_port: ROCE_V2_PORT, payload_len: 20 });
        let mut out = [0xFFu8; 8];
        repr.emit(&mut UdpPacket::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, HEADER);
    }

    #[test]
    fn rejects_bad_lengths() {
        assert_eq!(UdpPacket::new_checked(&HEADER[..7]).err(), Some(Error::Truncated));
        assert_eq!(UdpPacket::new_checked(&HEADER[..]).err(), Some(Error::Truncated));
        let tiny = [0, 0, 0, 0, 0, 7, 0, 0];
        assert!(matches!(UdpPacket::new_checked(&tiny[..]), Err(Error::Malformed(_))));
        let repr = UdpRepr { src_port: 1, dst_port: 2, payload_len: 65_528 };
        let mut out = [0u8; 8];
        assert!(repr.emit(&mut UdpPacket::new_unchecked(&mut out[..])).is_err());
    }
}
