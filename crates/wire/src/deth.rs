//! The Datagram Extended Transport Header (DETH, 8 bytes, UD only): Q_Key and source QP.

use crate::error::{ensure_room, Result};
use crate::field::{fixed_len_view, read_u24, read_u32, write_u24, write_u32};

mod field {
    pub const QKEY: usize = 0;
    pub const RESERVED: usize = 4;
    pub const SRC_QPN: usize = 5;
}

fixed_len_view!(
    /// A read/write view of a DETH at the start of a buffer.
    DethPacket,
    DethRepr::LEN
);

impl<T: AsRef<[u8]>> DethPacket<T> {
    /// The queue key.
    pub fn qkey(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::QKEY)
    }

    /// The reserved byte (should be 0).
    pub fn reserved(&self) -> u8 {
        self.buffer.as_ref()[field::RESERVED]
    }

    /// The 24-bit source QP number.
    pub fn src_qpn(&self) -> u32 {
        read_u24(self.buffer.as_ref(), field::SRC_QPN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DethPacket<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::QKEY, value);
    }

    /// Sets the reserved byte.
    pub fn set_reserved(&mut self, value: u8) {
        self.buffer.as_mut()[field::RESERVED] = value;
    }

    /// Sets the source QP number (low 24 bits).
    pub fn set_src_qpn(&mut self, value: u32) {
        write_u24(self.buffer.as_mut(), field::SRC_QPN, value);
    }
}

/// The parsed fields of a DETH; the reserved byte is emitted as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// Queue key.
    pub qkey: u32,
    /// Source QP number (24 bits).
    pub src_qpn: u32,
}

impl DethRepr {
    /// Length of a DETH in bytes.
    pub const LEN: usize = 8;
    /// The Q_Key of the GSI QP (QP1), used by CM MADs.
    pub const GSI_QKEY: u32 = 0x8001_0000;

    /// Reads a DETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &DethPacket<&T>) -> Result<DethRepr> {
        packet.check_len()?;
        Ok(DethRepr { qkey: packet.qkey(), src_qpn: packet.src_qpn() })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes the DETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut DethPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        packet.set_qkey(self.qkey);
        packet.set_reserved(0);
        packet.set_src_qpn(self.src_qpn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A CM MAD's DETH as rxe sends it: GSI Q_Key, source QP 1.
    const BYTES: [u8; 8] = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];

    #[test]
    fn parse_and_emit() {
        let packet = DethPacket::new_checked(&BYTES[..]).unwrap();
        assert_eq!(packet.reserved(), 0);
        let repr = DethRepr::parse(&packet).unwrap();
        assert_eq!(repr, DethRepr { qkey: DethRepr::GSI_QKEY, src_qpn: 1 });
        let mut out = [0xFFu8; 8];
        repr.emit(&mut DethPacket::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, BYTES);
        assert!(DethPacket::new_checked(&BYTES[..7]).is_err());
    }
}
