//! Memory-region and queue-pair access flags (values as in libibverbs `ibv_access_flags`).

use std::fmt;
use std::ops::{BitAnd, BitOr, BitOrAssign};

/// What a memory region (or a queue pair, as responder) permits.
///
/// Local read access is always implied, as in verbs. Remote write and remote atomic access
/// require local write access on a memory region.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local read.
    pub const NONE: Self = Self(0);
    /// The local side (the provider on behalf of a receive or READ response) may write.
    pub const LOCAL_WRITE: Self = Self(1);
    /// A remote peer may RDMA WRITE.
    pub const REMOTE_WRITE: Self = Self(1 << 1);
    /// A remote peer may RDMA READ.
    pub const REMOTE_READ: Self = Self(1 << 2);
    /// A remote peer may perform atomic operations.
    pub const REMOTE_ATOMIC: Self = Self(1 << 3);
    /// Every flag this crate knows.
    pub const ALL: Self = Self(0b1111);

    /// Builds flags from a raw libibverbs bit mask, refusing unknown bits.
    pub fn from_raw(bits: u32) -> Option<Self> {
        (bits & !Self::ALL.0 == 0).then_some(Self(bits))
    }

    /// The raw libibverbs bit mask.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// The flags of both `self` and `other` (a `const` form of `|`).
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether every flag in `other` is set in `self`.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether the combination is one verbs allows on a memory region: remote write or remote
    /// atomic access requires local write access.
    pub fn is_valid_for_mr(self) -> bool {
        let needs_local_write = self.contains(Self::REMOTE_WRITE) || self.contains(Self::REMOTE_ATOMIC);
        !needs_local_write || self.contains(Self::LOCAL_WRITE)
    }
}

impl BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl BitAnd for AccessFlags {
    type Output = Self;
    fn bitand(self, rhs: Self) -> Self {
        Self(self.0 & rhs.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<&str> = names.iter().filter(|(flag, _)| self.contains(*flag)).map(|(_, n)| *n).collect();
        if set.is_empty() {
            write!(f, "AccessFlags(NONE)")
        } else {
            write!(f, "AccessFlags({})", set.join(" | "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip_and_unknown_bits() {
        let flags = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(flags.bits(), 0b101);
        assert_eq!(AccessFlags::from_raw(0b101), Some(flags));
        assert_eq!(AccessFlags::from_raw(1 << 7), None);
    }

    #[test]
    fn remote_write_needs_local_write() {
        assert!(!AccessFlags::REMOTE_WRITE.is_valid_for_mr());
        assert!(!AccessFlags::REMOTE_ATOMIC.is_valid_for_mr());
        assert!((AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE).is_valid_for_mr());
        assert!(AccessFlags::REMOTE_READ.is_valid_for_mr());
    }

    #[test]
    fn debug_names_flags() {
        assert_eq!(format!("{:?}", AccessFlags::NONE), "AccessFlags(NONE)");
        assert_eq!(
            format!("{:?}", AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC),
            "AccessFlags(LOCAL_WRITE | REMOTE_ATOMIC)"
        );
    }
}
