//! The credit word: how a receiver tells the sender what it may send, without a round trip per
//! message.
//!
//! Each side owns an 8-byte *credit slot* in registered memory that the peer writes with RDMA
//! WRITE (usually without immediate, so the write costs the owner nothing). The word packs two
//! running totals of the writer's receive side, both modular:
//!
//! ```text
//!  63                 40 39                                  0
//! +---------------------+-------------------------------------+
//! | receives posted     |  ring bytes consumed by the reader  |
//! |  (mod 2^24)         |  (mod 2^40)                         |
//! +---------------------+-------------------------------------+
//! ```
//!
//! stored little-endian. One 8-byte aligned write is never torn, so the two totals always
//! belong together. The reader of the slot turns the modular values back into full counters
//! with [`Counter::advance`], which only ever moves forward (a stale or repeated word changes
//! nothing).

const CONSUMED_BITS: u32 = 40;
const POSTED_BITS: u32 = 24;

/// What a credit word says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CreditWord {
    /// Ring bytes the reader has consumed, mod 2^40.
    pub consumed: u64,
    /// Receive requests the reader has posted in total, mod 2^24.
    pub recvs_posted: u64,
}

impl CreditWord {
    /// Packs full counters (they are reduced modulo their widths).
    pub fn new(consumed: u64, recvs_posted: u64) -> Self {
        Self { consumed: consumed & mask(CONSUMED_BITS), recvs_posted: recvs_posted & mask(POSTED_BITS) }
    }

    /// The 64-bit value.
    pub fn pack(self) -> u64 {
        (self.recvs_posted << CONSUMED_BITS) | self.consumed
    }

    /// The value as it is stored in the slot.
    pub fn to_bytes(self) -> [u8; 8] {
        self.pack().to_le_bytes()
    }

    /// Reads a slot's bytes (any 64-bit value is a valid word).
    pub fn from_bytes(bytes: [u8; 8]) -> Self {
        let raw = u64::from_le_bytes(bytes);
        Self { consumed: raw & mask(CONSUMED_BITS), recvs_posted: raw >> CONSUMED_BITS }
    }
}

fn mask(bits: u32) -> u64 {
    (1u64 << bits) - 1
}

/// A full 64-bit counter rebuilt from modular observations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter(pub u64);

impl Counter {
    /// Moves forward to the full value whose low `bits` bits are `observed`, taking the smallest
    /// non-negative step; returns the step. A value that would be a step of more than half the
    /// range is taken as stale and ignored (step 0): counters never jump that far between two
    /// observations, because the peer cannot run more than a ring (or a receive queue) ahead.
    pub fn advance(&mut self, observed: u64, bits: u32) -> u64 {
        let step = observed.wrapping_sub(self.0) & mask(bits);
        if step >= 1 << (bits - 1) {
            return 0;
        }
        self.0 += step;
        step
    }
}

/// Width of the consumed-bytes field.
pub const CONSUMED_WIDTH: u32 = CONSUMED_BITS;
/// Width of the receives-posted field.
pub const POSTED_WIDTH: u32 = POSTED_BITS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_layout() {
        let word = CreditWord::new(0x12_3456_789A, 0xABCDEF);
        assert_eq!(word.pack(), 0xABCD_EF12_3456_789A);
        assert_eq!(CreditWord::from_bytes(word.to_bytes()), word);
        assert_eq!(word.to_bytes()[0], 0x9A, "little-endian in memory");
        let wrapped = CreditWord::new((1 << 40) + 5, (1 << 24) + 7);
        assert_eq!((wrapped.consumed, wrapped.recvs_posted), (5, 7));
    }

    #[test]
    fn counters_rebuild_across_wraps() {
        let mut counter = Counter((1 << 24) - 3);
        assert_eq!(counter.advance(2, 24), 5);
        assert_eq!(counter.0, (1 << 24) + 2);
        assert_eq!(counter.advance(2, 24), 0, "a repeated word changes nothing");
        assert_eq!(counter.advance(1, 24), 0, "a stale word is ignored");
        assert_eq!(counter.0, (1 << 24) + 2);
    }
}
