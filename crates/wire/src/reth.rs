//! The RDMA Extended Transport Header (RETH, 16 bytes, digest §3): the remote buffer of an
//! RDMA WRITE (first/only packet) or READ request.

use crate::error::{ensure_room, Result};
use crate::field::{fixed_len_view, read_u32, read_u64, write_u32, write_u64};

mod field {
    pub const VA: usize = 0;
    pub const RKEY: usize = 8;
    pub const DMA_LEN: usize = 12;
}

fixed_len_view!(
    /// A read/write view of a RETH at the start of a buffer.
    RethPacket,
    RethRepr::LEN
);

impl<T: AsRef<[u8]>> RethPacket<T> {
    /// The remote virtual address.
    pub fn va(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::VA)
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::RKEY)
    }

    /// The length of the whole RDMA operation (not of this packet).
    pub fn dma_len(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::DMA_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RethPacket<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, value: u64) {
        write_u64(self.buffer.as_mut(), field::VA, value);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::RKEY, value);
    }

    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::DMA_LEN, value);
    }
}

/// The parsed fields of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Total length of the RDMA operation.
    pub dma_len: u32,
}

impl RethRepr {
    /// Length of a RETH in bytes.
    pub const LEN: usize = 16;

    /// Reads a RETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &RethPacket<&T>) -> Result<RethRepr> {
        packet.check_len()?;
        Ok(RethRepr { va: packet.va(), rkey: packet.rkey(), dma_len: packet.dma_len() })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes the RETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RethPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_dma_len(self.dma_len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // From the rxe RDMA_READ_REQUEST capture: va 0x5587eca4f000, rkey 0x5cd, length 64.
    const BYTES: [u8; 16] =
        [0x00, 0x00, 0x55, 0x87, 0xec, 0xa4, 0xf0, 0x00, 0x00, 0x00, 0x05, 0xcd, 0x00, 0x00, 0x00, 0x40];

    #[test]
    fn parse_and_emit() {
        let repr = RethRepr::parse(&RethPacket::new_checked(&BYTES[..]).unwrap()).unwrap();
        assert_eq!(repr, RethRepr { va: 0x5587_eca4_f000, rkey: 0x5cd, dma_len: 64 });
        let mut out = [0u8; 16];
        repr.emit(&mut RethPacket::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, BYTES);
        assert!(RethPacket::new_checked(&BYTES[..15]).is_err());
    }
}
