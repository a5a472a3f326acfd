//! The two 4-byte extension headers that carry a single opaque word: ImmDt (immediate data)
//! and IETH (the R_Key a SEND with invalidate revokes).
//!
//! Their reprs are plain `u32`s read with `u32::from_be_bytes`, so the bytes travel unchanged
//! from one application's `imm_data` (already big-endian in verbs) to the other's.

use crate::error::{ensure_room, Result};
use crate::field::{fixed_len_view, read_u32, write_u32};

/// Length of an ImmDt header in bytes.
pub const IMM_DT_LEN: usize = 4;
/// Length of an IETH in bytes.
pub const IETH_LEN: usize = 4;

fixed_len_view!(
    /// A read/write view of an ImmDt header at the start of a buffer.
    ImmDtPacket,
    IMM_DT_LEN
);

impl<T: AsRef<[u8]>> ImmDtPacket<T> {
    /// The immediate data.
    pub fn imm(&self) -> u32 {
        read_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDtPacket<T> {
    /// Sets the immediate data.
    pub fn set_imm(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), 0, value);
    }
}

fixed_len_view!(
    /// A read/write view of an IETH at the start of a buffer.
    IethPacket,
    IETH_LEN
);

impl<T: AsRef<[u8]>> IethPacket<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        read_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IethPacket<T> {
    /// Sets the R_Key to invalidate.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), 0, value);
    }
}

/// Writes a 4-byte word header (ImmDt or IETH) at the start of `buf`.
pub(crate) fn emit_word(value: u32, buf: &mut [u8]) -> Result<()> {
    ensure_room(4, buf.len())?;
    write_u32(buf, 0, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_big_endian() {
        let bytes = [0xde, 0xad, 0xbe, 0xef];
        assert_eq!(ImmDtPacket::new_checked(&bytes[..]).unwrap().imm(), 0xdead_beef);
        assert_eq!(IethPacket::new_checked(&bytes[..]).unwrap().rkey(), 0xdead_beef);
        let mut out = [0u8; 4];
        ImmDtPacket::new_unchecked(&mut out[..]).set_imm(0x0102_0304);
        assert_eq!(out, [1, 2, 3, 4]);
        IethPacket::new_unchecked(&mut out[..]).set_rkey(0x0A0B_0C0D);
        assert_eq!(out, [0x0A, 0x0B, 0x0C, 0x0D]);
        assert!(ImmDtPacket::new_checked(&bytes[..3]).is_err());
        assert!(emit_word(1, &mut out[..3]).is_err());
    }
}
