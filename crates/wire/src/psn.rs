//! 24-bit packet sequence numbers (BTH PSN, AETH MSN) and their circular arithmetic.
//!
//! PSNs wrap modulo 2^24, so "later" is only meaningful within half the space: `a` is after `b`
//! when the signed 24-bit difference `a − b` is positive (digest §2). That is why [`Psn`] has no
//! `Ord`: a total order would be wrong across the wrap.

use core::fmt;

/// A 24-bit packet sequence number; every constructor masks to 24 bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The mask of the 24 significant bits.
    pub const MASK: u32 = 0x00FF_FFFF;
    /// The largest representable PSN.
    pub const MAX: Psn = Psn(Self::MASK);

    /// Creates a PSN from the low 24 bits of `value`.
    pub const fn new(value: u32) -> Psn {
        Psn(value & Self::MASK)
    }

    /// The PSN as a number in `0..2^24`.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n`, wrapping modulo 2^24.
    #[allow(clippy::should_implement_trait)] // the contract names it `add`; `Add<u32>` exists too
    pub const fn add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & Self::MASK)
    }

    /// `self − n`, wrapping modulo 2^24.
    #[allow(clippy::should_implement_trait)] // the contract names it `sub`; `Sub<u32>` exists too
    pub const fn sub(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n) & Self::MASK)
    }

    /// The signed 24-bit difference `self − other`, in `−2^23..2^23`.
    ///
    /// Shifting the 24-bit difference into the top of an `i32` and back sign-extends it.
    pub const fn distance_from(self, other: Psn) -> i32 {
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// True if `self` comes strictly after `other` (within the ±2^23 window).
    pub const fn is_after(self, other: Psn) -> bool {
        self.distance_from(other) > 0
    }

    /// True if `self` comes strictly before `other` (within the ±2^23 window).
    ///
    /// Two PSNs exactly 2^23 apart are each "before" the other: the window cannot decide.
    pub const fn is_before(self, other: Psn) -> bool {
        self.distance_from(other) < 0
    }

    /// True if `self` equals `other` or comes after it.
    pub const fn is_after_or_eq(self, other: Psn) -> bool {
        self.distance_from(other) >= 0
    }
}

impl core::ops::Add<u32> for Psn {
    type Output = Psn;
    fn add(self, n: u32) -> Psn {
        Psn::add(self, n)
    }
}

impl core::ops::Sub<u32> for Psn {
    type Output = Psn;
    fn sub(self, n: u32) -> Psn {
        Psn::sub(self, n)
    }
}

impl From<Psn> for u32 {
    fn from(psn: Psn) -> u32 {
        psn.0
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({:#08x})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_masks_to_24_bits() {
        assert_eq!(Psn::new(0x1234_5678).value(), 0x34_5678);
        assert_eq!(Psn::new(0xFF_FFFF).value(), 0xFF_FFFF);
    }

    #[test]
    fn add_and_sub_wrap() {
        assert_eq!(Psn::new(0xFF_FFFF).add(1), Psn::new(0));
        assert_eq!(Psn::new(0xFF_FFFE).add(5), Psn::new(3));
        assert_eq!(Psn::new(0).sub(1), Psn::MAX);
        assert_eq!(Psn::new(2) - 5, Psn::new(0xFF_FFFD));
        assert_eq!(Psn::new(10) + u32::MAX, Psn::new(9));
    }

    #[test]
    fn distance_is_signed_across_the_wrap() {
        assert_eq!(Psn::new(1).distance_from(Psn::new(0xFF_FFFF)), 2);
        assert_eq!(Psn::new(0xFF_FFFF).distance_from(Psn::new(1)), -2);
        assert_eq!(Psn::new(0x80_0000).distance_from(Psn::new(0)), -0x80_0000);
        assert_eq!(Psn::new(0x7F_FFFF).distance_from(Psn::new(0)), 0x7F_FFFF);
    }

    #[test]
    fn ordering_predicates() {
        let a = Psn::new(0xFF_FFF0);
        let b = a.add(0x20);
        assert!(b.is_after(a) && a.is_before(b));
        assert!(!a.is_after(b) && !b.is_before(a));
        assert!(a.is_after_or_eq(a) && !a.is_after(a) && !a.is_before(a));
    }

    #[test]
    fn formats_as_six_hex_digits() {
        assert_eq!(Psn::new(0x123).to_string(), "0x000123");
        assert_eq!(format!("{:?}", Psn::new(0xABCDEF)), "Psn(0xabcdef)");
    }
}
