//! Test payloads and their verification.
//!
//! Payloads are a deterministic function of (size, salt) so that the receiver can verify what
//! arrived without the sender shipping a copy: bandwidth tests compare a CRC-32 of the final
//! receive buffer against the CRC of the expected pattern at the end of every size.

/// Fills `buf` with the pattern for `salt` (bytes differ between positions and between salts,
/// so a misplaced or stale block is detected).
pub fn fill(buf: &mut [u8], salt: u32) {
    let mut state = salt.wrapping_mul(0x9E37_79B9) ^ 0x5bd1_e995;
    for chunk in buf.chunks_mut(4) {
        // xorshift32: cheap, never stuck at zero because the seed mixes in a constant.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let bytes = state.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// A buffer of `len` bytes holding the pattern for `salt`.
pub fn make(len: usize, salt: u32) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    fill(&mut buf, salt);
    buf
}

/// CRC-32 of `bytes`.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_salt_and_position() {
        let a = make(64, 1);
        let b = make(64, 2);
        assert_ne!(a, b);
        assert_ne!(a[0..4], a[4..8]);
        assert_eq!(make(64, 1), a);
        // An odd length fills the tail too.
        let odd = make(7, 1);
        assert_eq!(odd[..], a[..7]);
        assert_ne!(checksum(&a), checksum(&b));
    }
}
