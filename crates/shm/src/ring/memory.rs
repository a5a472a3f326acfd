//! What the ring needs from the memory it lives in, so the same code runs over a shared mapping
//! (the provider) and over `loom`'s checked cells (the model check).

use crate::sync::Ordering;

/// The bytes of a ring. Offsets are relative to the start of the ring and always inside it.
pub trait RingMemory {
    /// Atomically loads the 8-byte-aligned word at `offset` (a record stamp).
    fn load_word(&self, offset: usize, order: Ordering) -> u64;
    /// Atomically stores the 8-byte-aligned word at `offset` (a record stamp).
    fn store_word(&self, offset: usize, value: u64, order: Ordering);
    /// Copies bytes out of the ring (header words after the stamp, payload).
    fn read_bytes(&self, offset: usize, dst: &mut [u8]);
    /// Copies bytes into the ring (producer only).
    fn write_bytes(&self, offset: usize, src: &[u8]);
    /// A hint that the producer will write at `offset` soon (see `Producer::try_push`); does
    /// nothing unless the memory can act on it.
    fn prepare_write(&self, _offset: usize) {}
}

/// One shared 8-byte word outside the ring: a consumer position or a wake word.
pub trait Word {
    /// Atomically loads the word.
    fn load(&self, order: Ordering) -> u64;
    /// Atomically stores the word.
    fn store(&self, value: u64, order: Ordering);
}
