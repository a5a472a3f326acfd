//! The known values of the interop protocol (interop/PROTOCOL.md, "Buffers and known
//! values"): data patterns, immediates and the atomic sequences. `verbs_peer.c` computes the
//! same numbers; the tests hold vectors taken from its functions, so the two sides agree byte
//! for byte.

use super::op::Op;

/// Initial value of the responder's CMP_SWAP word, `V(0)`.
pub const CMP_SWAP_INITIAL: u64 = 0x1122_3344_5566_7788;
/// Initial value of the responder's FETCH_ADD word, `F0`.
pub const FETCH_ADD_INITIAL: u64 = 0xFFFF_FFFF_FFFF_FF00;
/// What the swap of the final, failing CMP_SWAP would write if it wrongly succeeded.
pub const CMP_SWAP_DECOY: u64 = 0xDEAD_DEAD_DEAD_DEAD;
/// Every byte of a buffer nobody has written yet.
pub const POISON_BYTE: u8 = 0xE5;

/// Byte `i` of the pattern with seed `seed` (u32 arithmetic, wrapping).
pub fn pattern_byte(seed: u32, i: u32) -> u8 {
    let x = i.wrapping_mul(0x9E37_79B1).wrapping_add(seed.wrapping_mul(0x85EB_CA77));
    (x ^ (x >> 15)) as u8
}

/// The seed of iteration `k` of `op`: `(opnum << 24) | k`.
pub fn pattern_seed(op: Op, k: u32) -> u32 {
    (op.number() << 24) | k
}

/// `len` bytes of the pattern with seed `seed`.
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(seed, i as u32)).collect()
}

/// The offset of the first byte of `bytes` that differs from the pattern, if any.
pub fn first_mismatch(bytes: &[u8], seed: u32) -> Option<usize> {
    bytes.iter().enumerate().position(|(i, &b)| b != pattern_byte(seed, i as u32))
}

/// The immediate of iteration `k`: `0x1F000000 | (opnum << 16) | (k & 0xFFFF)`. Carried
/// big-endian on the wire; the verbs layer's `imm` fields hold the value itself.
pub fn imm_value(op: Op, k: u32) -> u32 {
    0x1F00_0000 | (op.number() << 16) | (k & 0xFFFF)
}

/// `V(k)`: the CMP_SWAP word before iteration `k`.
pub fn cmp_swap_value(k: u32) -> u64 {
    CMP_SWAP_INITIAL ^ u64::from(k).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `D(k)`: the addend of FETCH_ADD iteration `k`.
pub fn fetch_add_addend(k: u32) -> u64 {
    u64::from(k).wrapping_add(1).wrapping_mul(0x0000_0001_0000_0001).wrapping_add(0x80)
}

/// The FETCH_ADD word before iteration `k`: `F0 + D(0) + … + D(k-1)`.
pub fn fetch_add_before(k: u32) -> u64 {
    (0..k).fold(FETCH_ADD_INITIAL, |sum, j| sum.wrapping_add(fetch_add_addend(j)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn patterns_match_verbs_peer() {
        // The protocol document's example.
        assert_eq!(hex(&pattern(0x0300_0001, 8)), "a0 6e 6c ae a8 ee ec ae");
        // Computed with verbs_peer.c's pattern functions.
        let vectors = [
            (Op::Send, 1007, "1b bb 9b 63 63 a3 a3 fb db bb 5b 73 53 b3 d3 fb"),
            (Op::SendImm, 2007, "d1 2d ad 69 69 2d ad e1 e1 2d ad 69 6e 2c ae f0"),
            (Op::Write, 1, "a0 6e 6c ae a8 ee ec ae b0 0e 4c 8e c9 0d cd 81"),
            (Op::WriteImm, 4007, "fd 99 39 1c 72 90 32 1c fa 98 3a 1c 62 60 22 dc"),
            (Op::Read, 5007, "00 c2 8c 4a 08 4a 8c d2 f0 d2 ac 2a 68 6a ac 22"),
            (Op::CmpSwap, 6007, "c6 04 c6 80 46 04 46 88 d6 f4 d6 b0 56 77 57 a7"),
            (Op::FetchAdd, 7007, "9c fe 18 3e 9c 7e 00 be 9d f9 19 bd 9d 71 11 bd"),
        ];
        for (op, k, expected) in vectors {
            assert_eq!(hex(&pattern(pattern_seed(op, k), 16)), expected, "{op} {k}");
        }
        assert_eq!(pattern_seed(Op::Send, 1007), 0x0100_03ef);
        // Far into a 1 MiB slot, where i * 0x9E3779B1 has wrapped many times.
        assert_eq!(pattern_byte(0x0500_0004, 1_048_575), 0x24);
    }

    #[test]
    fn mismatches_are_located() {
        let mut bytes = pattern(7, 100);
        assert_eq!(first_mismatch(&bytes, 7), None);
        bytes[42] ^= 1;
        assert_eq!(first_mismatch(&bytes, 7), Some(42));
        assert_eq!(first_mismatch(&bytes, 8), Some(0));
    }

    #[test]
    fn immediates_and_atomics_match_verbs_peer() {
        assert_eq!(imm_value(Op::SendImm, 0), 0x1f02_0000);
        assert_eq!(imm_value(Op::WriteImm, 65535), 0x1f04_ffff);
        assert_eq!(imm_value(Op::WriteImm, 70000), 0x1f04_1170);
        assert_eq!(cmp_swap_value(0), 0x1122_3344_5566_7788);
        assert_eq!(cmp_swap_value(1), 0x8f15_4afd_2a2c_0b9d);
        assert_eq!(cmp_swap_value(5), 0x0637_53db_2912_1be1);
        assert_eq!(fetch_add_addend(0), 0x0000_0001_0000_0081);
        assert_eq!(fetch_add_addend(4), 0x0000_0005_0000_0085);
        assert_eq!(fetch_add_before(5), 0x0000_000f_0000_018f);
        assert_eq!(fetch_add_before(0), FETCH_ADD_INITIAL);
    }
}
