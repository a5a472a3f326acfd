//! Verifying an IPv4 ICRC without the IPv4 header: solving for the 16 identification bits and
//! the 3 flag bits over GF(2) (digest §5.1a).
//!
//! CRC-32 is affine: flipping a set of message bits XORs the CRC with a fixed linear function
//! of those bits. So with every other byte known, `crc(id, flags) = crc(0, 0) ⊕ M·x`, where
//! `x` is the 19 unknown bits. A packet is accepted when `crc(0, 0) ⊕ found` lies in the span
//! of `M`'s 19 columns. Only solutions with MF and the reserved flag clear count (no sender
//! sets them on a whole datagram), so a corrupted packet passes with probability
//! 2^17 / 2^32 = 2^-15.
//!
//! Making that cheap: the unknown bits sit at bytes 12..16 of the CRC message, so their effect
//! on the CRC register right after byte 16 is a fixed matrix `A` (precomputed once), and
//! the rest of the message only multiplies that register difference by `x^(8m)` modulo the CRC
//! polynomial, where `m` is the number of bytes that follow. Instead of computing `M = x^(8m)·A`
//! for each length, the difference is multiplied back by `x^(-8m)` (one table lookup and one
//! 32-step carry-less multiply) and solved against the fixed, fully reduced basis of `A`.

use std::sync::OnceLock;

use super::{crc_with_prefix, ipv4_prefix, Endpoints, Family};
use crate::ipv4::FLAG_DONT_FRAG;

/// The reflected CRC-32 polynomial (zlib, IEEE 802.3).
const POLY: u32 = 0xEDB8_8320;
/// The polynomial 1 in the reflected representation (the coefficient of x^0 is bit 31).
const ONE: u32 = 0x8000_0000;
/// Bytes of the CRC message before and including the unknowns: 8 bytes of 0xFF, then IPv4
/// bytes 0..8 (identification at message bytes 12..14, flags at 14..16).
const UNKNOWNS_END: usize = 16;
/// Unknown bits: 16 of identification, then flag bits 13 (MF), 14 (DF), 15 (reserved).
const UNKNOWNS: usize = 19;
/// Message lengths (after [`UNKNOWNS_END`]) whose inverse shift is tabulated: UDP payloads of
/// up to 9 KiB, i.e. any RoCE v2 packet at a PMTU of 4096 on a jumbo-frame link.
const TABLE_LEN: usize = 9 * 1024 + 64;

/// The IPv4 identification and flags/fragment word a received packet was sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4IdFlags {
    /// Identification.
    pub ident: u16,
    /// Flags and fragment offset (the offset is assumed 0).
    pub flags_frag: u16,
}

/// Multiplies two polynomials modulo the CRC polynomial, both in reflected representation.
fn mul_mod_poly(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = ONE;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        // b ← b·x mod P: one step of the reflected CRC register.
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// r ← r·x^-1 mod P: one CRC register step run backwards. The forward step sets bit 31 exactly
/// when it shifted out a 1 and folded in the polynomial, which tells how to undo it.
fn div_x(r: u32) -> u32 {
    if r & ONE != 0 {
        ((r ^ POLY) << 1) | 1
    } else {
        r << 1
    }
}

/// x^-(8m) mod P for one `m`, by square-and-multiply (for lengths beyond the table).
fn inverse_shift_pow(m: usize) -> u32 {
    let mut base = ONE;
    for _ in 0..8 {
        base = div_x(base);
    }
    let mut result = ONE;
    let mut exp = m;
    while exp != 0 {
        if exp & 1 != 0 {
            result = mul_mod_poly(result, base);
        }
        base = mul_mod_poly(base, base);
        exp >>= 1;
    }
    result
}

struct Solver {
    /// Fully reduced basis of the span of `A`: (pivot bit, vector, combination of unknowns).
    /// No vector has another's pivot bit set, so each pivot decides independently.
    basis: Vec<(u32, u32, u32)>,
    /// `inverse_shift[m]` = x^-(8m) mod P.
    inverse_shift: Vec<u32>,
}

impl Solver {
    fn build() -> Solver {
        let zeros = [0u8; UNKNOWNS_END];
        let base = crc32fast::hash(&zeros);
        let mut basis: Vec<(u32, u32, u32)> = Vec::with_capacity(UNKNOWNS);
        for k in 0..UNKNOWNS {
            let mut message = zeros;
            // Bits 0..16: identification (bytes 12..14, big-endian); 16..19: flag bits 13..16
            // of the flags/fragment word (byte 14, bits 5..8).
            let word: u32 = if k < 16 { 1 << (k + 16) } else { 1 << (k - 16 + 13) };
            message[12..16].copy_from_slice(&word.to_be_bytes());
            let mut vector = crc32fast::hash(&message) ^ base;
            let mut combo = 1u32 << k;
            for &(pivot, v, c) in &basis {
                if vector & pivot != 0 {
                    vector ^= v;
                    combo ^= c;
                }
            }
            if vector == 0 {
                continue; // cannot happen for a CRC-32 (19 bits span < 32), but stay total
            }
            let pivot = 1u32 << (31 - vector.leading_zeros());
            for entry in &mut basis {
                if entry.1 & pivot != 0 {
                    entry.1 ^= vector;
                    entry.2 ^= combo;
                }
            }
            basis.push((pivot, vector, combo));
        }
        let mut inverse_shift = Vec::with_capacity(TABLE_LEN);
        let mut value = ONE;
        for _ in 0..TABLE_LEN {
            inverse_shift.push(value);
            for _ in 0..8 {
                value = div_x(value);
            }
        }
        Solver { basis, inverse_shift }
    }

    fn get() -> &'static Solver {
        static SOLVER: OnceLock<Solver> = OnceLock::new();
        SOLVER.get_or_init(Solver::build)
    }

    /// Solves `A·x = d` for the register difference `d` right after the unknowns.
    fn solve(&self, mut d: u32) -> Option<u32> {
        let mut x = 0;
        for &(pivot, vector, combo) in &self.basis {
            if d & pivot != 0 {
                d ^= vector;
                x ^= combo;
            }
        }
        (d == 0).then_some(x)
    }

    fn inverse_shift(&self, m: usize) -> u32 {
        match self.inverse_shift.get(m) {
            Some(&value) => value,
            None => inverse_shift_pow(m),
        }
    }
}

/// Finds the IPv4 identification and flags (fragment offset 0, MF and the reserved flag clear,
/// DF either way) under which the datagram's ICRC is correct, or `None` if there are none (a
/// corrupted packet, or IPv6 endpoints).
///
/// Since the 19 unknown bits lie within 32 consecutive message bits, different values always
/// give different CRCs: a solution, when there is one, is unique.
pub fn solve_ipv4_id_flags(endpoints: &Endpoints, datagram: &[u8]) -> Option<Ipv4IdFlags> {
    let Family::V4(src, dst) = endpoints.family() else {
        return None;
    };
    let udp_len = super::udp_len(datagram, crate::ipv4::HEADER_LEN).ok()?;
    let prefix = ipv4_prefix(src, dst, 0, 0, endpoints.src_port, endpoints.dst_port, udp_len);
    let delta = crc_with_prefix(&prefix, datagram) ^ super::found(datagram)?;
    // The CRC message is prefix + datagram without ICRC; m bytes follow the unknowns.
    let m = prefix.len() + datagram.len() - super::ICRC_LEN - UNKNOWNS_END;
    let solver = Solver::get();
    let x = solver.solve(mul_mod_poly(delta, solver.inverse_shift(m)))?;
    let flags_frag = ((x >> 16) as u16) << 13;
    // A whole datagram is never sent with MF or the reserved flag set: refusing those
    // solutions leaves 2^17 acceptable headers, a false-accept rate of 2^-15.
    if flags_frag & !FLAG_DONT_FRAG != 0 {
        return None;
    }
    Some(Ipv4IdFlags { ident: x as u16, flags_frag })
}

impl Ipv4IdFlags {
    /// What a socket with `IP_PMTUDISC_DO` sends: ID 0, DF.
    pub const SOCKET_DEFAULT: Ipv4IdFlags = Ipv4IdFlags { ident: 0, flags_frag: FLAG_DONT_FRAG };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_shift_undoes_the_shift() {
        let solver = Solver::get();
        for m in [0usize, 1, 7, 100, 4096, TABLE_LEN - 1] {
            // x^(8m) in reflected form: ONE shifted forward 8m register steps.
            let mut forward = ONE;
            for _ in 0..8 * m {
                forward = if forward & 1 != 0 { (forward >> 1) ^ POLY } else { forward >> 1 };
            }
            assert_eq!(mul_mod_poly(forward, solver.inverse_shift(m)), ONE, "m = {m}");
            assert_eq!(inverse_shift_pow(m), solver.inverse_shift(m), "m = {m}");
        }
    }

    #[test]
    fn lengths_beyond_the_table_use_powers() {
        let m = TABLE_LEN + 5;
        let mut forward = ONE;
        for _ in 0..8 * m {
            forward = if forward & 1 != 0 { (forward >> 1) ^ POLY } else { forward >> 1 };
        }
        assert_eq!(mul_mod_poly(forward, Solver::get().inverse_shift(m)), ONE);
    }

    #[test]
    fn basis_has_full_rank() {
        let solver = Solver::get();
        assert_eq!(solver.basis.len(), UNKNOWNS);
        let all: u32 = solver.basis.iter().fold(0, |acc, b| acc | b.2);
        assert_eq!(all, (1 << UNKNOWNS) - 1);
    }

    #[test]
    fn zero_difference_solves_to_zero() {
        assert_eq!(Solver::get().solve(0), Some(0));
    }
}
