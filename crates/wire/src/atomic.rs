//! The atomic extension headers: AtomicETH (28 bytes) of COMPARE_SWAP / FETCH_ADD requests
//! and AtomicAckETH (8 bytes) of ATOMIC_ACKNOWLEDGE responses.

use crate::error::{ensure_room, Result};
use crate::field::{fixed_len_view, read_u32, read_u64, write_u32, write_u64};

mod field {
    pub const VA: usize = 0;
    pub const RKEY: usize = 8;
    pub const SWAP_ADD: usize = 12;
    pub const COMPARE: usize = 20;
    pub const ORIG: usize = 0;
}

fixed_len_view!(
    /// A read/write view of an AtomicETH at the start of a buffer.
    AtomicEthPacket,
    AtomicEthRepr::LEN
);

impl<T: AsRef<[u8]>> AtomicEthPacket<T> {
    /// The remote virtual address (must be 8-byte aligned).
    pub fn va(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::VA)
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::RKEY)
    }

    /// The swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::SWAP_ADD)
    }

    /// The compare value (COMPARE_SWAP; ignored by FETCH_ADD).
    pub fn compare(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::COMPARE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEthPacket<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, value: u64) {
        write_u64(self.buffer.as_mut(), field::VA, value);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::RKEY, value);
    }

    /// Sets the swap value or addend.
    pub fn set_swap_add(&mut self, value: u64) {
        write_u64(self.buffer.as_mut(), field::SWAP_ADD, value);
    }

    /// Sets the compare value.
    pub fn set_compare(&mut self, value: u64) {
        write_u64(self.buffer.as_mut(), field::COMPARE, value);
    }
}

/// The parsed fields of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Length of an AtomicETH in bytes.
    pub const LEN: usize = 28;

    /// Reads an AtomicETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &AtomicEthPacket<&T>) -> Result<AtomicEthRepr> {
        packet.check_len()?;
        Ok(AtomicEthRepr {
            va: packet.va(),
            rkey: packet.rkey(),
            swap_add: packet.swap_add(),
            compare: packet.compare(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes the AtomicETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AtomicEthPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_swap_add(self.swap_add);
        packet.set_compare(self.compare);
        Ok(())
    }
}

fixed_len_view!(
    /// A read/write view of an AtomicAckETH at the start of a buffer.
    AtomicAckEthPacket,
    AtomicAckEthRepr::LEN
);

impl<T: AsRef<[u8]>> AtomicAckEthPacket<T> {
    /// The original remote value.
    pub fn orig(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::ORIG)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEthPacket<T> {
    /// Sets the original remote value.
    pub fn set_orig(&mut self, value: u64) {
        write_u64(self.buffer.as_mut(), field::ORIG, value);
    }
}

/// The parsed field of an AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicAckEthRepr {
    /// The value the remote location held before the atomic operation.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Length of an AtomicAckETH in bytes.
    pub const LEN: usize = 8;

    /// Reads an AtomicAckETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &AtomicAckEthPacket<&T>) -> Result<AtomicAckEthRepr> {
        packet.check_len()?;
        Ok(AtomicAckEthRepr { orig: packet.orig() })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes the AtomicAckETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AtomicAckEthPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        packet.set_orig(self.orig);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_eth_layout() {
        let bytes: [u8; 28] = [
            0, 0, 0, 0, 0x12, 0x34, 0x56, 0x78, // va
            0, 0, 0x01, 0x00, // rkey
            0, 0, 0, 0, 0, 0, 0, 0x2A, // swap/add
            0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFE, // compare
        ];
        let repr = AtomicEthRepr::parse(&AtomicEthPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr, AtomicEthRepr { va: 0x1234_5678, rkey: 0x100, swap_add: 42, compare: u64::MAX - 1 });
        let mut out = [0u8; 28];
        repr.emit(&mut AtomicEthPacket::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(AtomicEthPacket::new_checked(&bytes[..27]).is_err());
    }

    #[test]
    fn atomic_ack_eth_layout() {
        let bytes = [0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08];
        let packet = AtomicAckEthPacket::new_checked(&bytes[..]).unwrap();
        assert_eq!(AtomicAckEthRepr::parse(&packet).unwrap().orig, 0x0102_0304_0506_0708);
        let mut out = [0u8; 8];
        AtomicAckEthRepr { orig: 0x0102_0304_0506_0708 }
            .emit(&mut AtomicAckEthPacket::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(out, bytes);
        assert!(AtomicAckEthPacket::new_checked(&bytes[..7]).is_err());
    }
}
