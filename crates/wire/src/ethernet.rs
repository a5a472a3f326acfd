//! Ethernet II frames with an optional 802.1Q VLAN tag, for decoding captures (a capture has
//! no FCS; the NIC adds and strips it).

use core::fmt;

use crate::error::{ensure_room, Error, Result};
use crate::field::{read_u16, write_u16};

/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETHERTYPE_IPV6: u16 = 0x86DD;
/// EtherType (TPID) of an 802.1Q VLAN tag.
pub const ETHERTYPE_VLAN: u16 = 0x8100;
/// EtherType of RoCE v1 (RoCE v2 never uses it).
pub const ETHERTYPE_ROCE_V1: u16 = 0x8915;

/// Length of an untagged Ethernet II header.
pub const HEADER_LEN: usize = 14;
/// Length of the 802.1Q tag.
pub const VLAN_TAG_LEN: usize = 4;

mod field {
    pub const DST: usize = 0;
    pub const SRC: usize = 6;
    pub const ETHERTYPE: usize = 12;
    pub const TCI: usize = 14;
    pub const INNER_ETHERTYPE: usize = 16;
}

/// A 48-bit MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EthernetAddress(pub [u8; 6]);

impl fmt::Display for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EthernetAddress({self})")
    }
}

/// The fields of an 802.1Q tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VlanTag {
    /// Priority code point (3 bits).
    pub pcp: u8,
    /// Drop-eligible indicator.
    pub dei: bool,
    /// VLAN identifier (12 bits).
    pub vid: u16,
}

impl VlanTag {
    fn from_tci(tci: u16) -> VlanTag {
        VlanTag { pcp: (tci >> 13) as u8, dei: tci & 0x1000 != 0, vid: tci & 0x0FFF }
    }

    fn to_tci(self) -> u16 {
        (u16::from(self.pcp & 7) << 13) | (u16::from(self.dei) << 12) | (self.vid & 0x0FFF)
    }
}

/// A read/write view of an Ethernet II frame.
#[derive(Debug, Clone)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> EthernetFrame<T> {
        EthernetFrame { buffer }
    }

    /// Wraps a buffer after [`EthernetFrame::check_len`].
    pub fn new_checked(buffer: T) -> Result<EthernetFrame<T>> {
        let frame = Self::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Checks that the header (with its tag, if any) fits; after this no accessor panics.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN || len < self.header_len() {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Destination MAC.
    pub fn dst_addr(&self) -> EthernetAddress {
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&self.buffer.as_ref()[field::DST..field::DST + 6]);
        EthernetAddress(mac)
    }

    /// Source MAC.
    pub fn src_addr(&self) -> EthernetAddress {
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&self.buffer.as_ref()[field::SRC..field::SRC + 6]);
        EthernetAddress(mac)
    }

    fn outer_ethertype(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::ETHERTYPE)
    }

    /// The 802.1Q tag, if the frame carries one.
    pub fn vlan(&self) -> Option<VlanTag> {
        (self.outer_ethertype() == ETHERTYPE_VLAN)
            .then(|| VlanTag::from_tci(read_u16(self.buffer.as_ref(), field::TCI)))
    }

    /// The EtherType of the payload (after the tag, if any).
    pub fn ethertype(&self) -> u16 {
        if self.outer_ethertype() == ETHERTYPE_VLAN {
            read_u16(self.buffer.as_ref(), field::INNER_ETHERTYPE)
        } else {
            self.outer_ethertype()
        }
    }

    /// Header length: 14, or 18 with a VLAN tag.
    pub fn header_len(&self) -> usize {
        let data = self.buffer.as_ref();
        if data.len() >= HEADER_LEN && read_u16(data, field::ETHERTYPE) == ETHERTYPE_VLAN {
            HEADER_LEN + VLAN_TAG_LEN
        } else {
            HEADER_LEN
        }
    }

    /// The payload (the rest of the buffer; it may include trailer padding).
    pub fn payload(&self) -> &[u8] {
        let data = self.buffer.as_ref();
        &data[self.header_len().min(data.len())..]
    }
}

/// The parsed fields of an Ethernet II header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EthernetRepr {
    /// Destination MAC.
    pub dst_addr: EthernetAddress,
    /// Source MAC.
    pub src_addr: EthernetAddress,
    /// The 802.1Q tag, if any.
    pub vlan: Option<VlanTag>,
    /// EtherType of the payload.
    pub ethertype: u16,
}

impl EthernetRepr {
    /// Reads a checked view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(frame: &EthernetFrame<&T>) -> Result<EthernetRepr> {
        frame.check_len()?;
        Ok(EthernetRepr {
            dst_addr: frame.dst_addr(),
            src_addr: frame.src_addr(),
            vlan: frame.vlan(),
            ethertype: frame.ethertype(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        if self.vlan.is_some() {
            HEADER_LEN + VLAN_TAG_LEN
        } else {
            HEADER_LEN
        }
    }

    /// Writes the header into the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        ensure_room(self.buffer_len(), buf.len())?;
        buf[field::DST..field::DST + 6].copy_from_slice(&self.dst_addr.0);
        buf[field::SRC..field::SRC + 6].copy_from_slice(&self.src_addr.0);
        match self.vlan {
            Some(tag) => {
                write_u16(buf, field::ETHERTYPE, ETHERTYPE_VLAN);
                write_u16(buf, field::TCI, tag.to_tci());
                write_u16(buf, field::INNER_ETHERTYPE, self.ethertype);
            }
            None => write_u16(buf, field::ETHERTYPE, self.ethertype),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The Ethernet header of the rxe captures.
    const UNTAGGED: [u8; 16] =
        [0x52, 0x54, 0x00, 0x77, 0x00, 0x02, 0x52, 0x54, 0x00, 0x77, 0x00, 0x03, 0x08, 0x00, 0x45, 0];

    #[test]
    fn untagged() {
        let frame = EthernetFrame::new_checked(&UNTAGGED[..]).unwrap();
        let repr = EthernetRepr::parse(&frame).unwrap();
        assert_eq!(repr.dst_addr.to_string(), "52:54:00:77:00:02");
        assert_eq!(repr.src_addr.to_string(), "52:54:00:77:00:03");
        assert_eq!((repr.vlan, repr.ethertype), (None, ETHERTYPE_IPV4));
        assert_eq!(frame.payload(), &[0x45, 0]);
        let mut out = [0u8; 14];
        repr.emit(&mut out).unwrap();
        assert_eq!(out[..], UNTAGGED[..14]);
    }

    #[test]
    fn tagged() {
        let mut bytes = UNTAGGED[..12].to_vec();
        bytes.extend_from_slice(&[0x81, 0x00, 0x60, 0x64, 0x86, 0xDD, 0x60]);
        let frame = EthernetFrame::new_checked(&bytes[..]).unwrap();
        let repr = EthernetRepr::parse(&frame).unwrap();
        assert_eq!(repr.vlan, Some(VlanTag { pcp: 3, dei: false, vid: 100 }));
        assert_eq!(repr.ethertype, ETHERTYPE_IPV6);
        assert_eq!(frame.payload(), &[0x60]);
        let mut out = [0u8; 18];
        repr.emit(&mut out).unwrap();
        assert_eq!(out[..], bytes[..18]);
        assert_eq!(EthernetFrame::new_checked(&bytes[..17]).err(), Some(Error::Truncated));
        assert_eq!(EthernetFrame::new_checked(&bytes[..13]).err(), Some(Error::Truncated));
    }
}
