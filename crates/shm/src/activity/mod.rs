//! How a device learns *which* of its queue pairs a peer published something for, and how it
//! sleeps, without looking at every queue pair.
//!
//! # Why
//!
//! A peer publishes into shared memory: records into its ring, an acknowledgement count, a NAK,
//! its state, its position in our ring. Looking at every linked queue pair's segment for news
//! made each call that drives a device cost O(queue pairs), and a process with a thousand
//! connections spent most of its time peeking empty rings. Instead each device owns one
//! *activity area*, a memfd every peer maps writable, and every piece of news comes with a mark
//! in it; a call looks only at the queue pairs marked.
//!
//! # The area
//!
//! ```text
//! offset 0     sleep word: odd while a thread of the owner sleeps and wants the doorbell rung
//! offset 64    rung word: the sleep value a peer last rang the doorbell for
//! offset 128   activity bits: bit s % 64 of word s / 64 is slot s
//! ```
//!
//! Every queue pair of the owner has a *slot* (dense, lowest free first, reused after the queue
//! pair is gone), which its introduction tells the peer. The area has no header: its size
//! (sealed) says how many slots it has, so there is nothing a peer could spoil for the others.
//!
//! # The protocol
//!
//! - **Producer** (a peer, after publishing anything for the queue pair in slot `s`): sets the
//!   slot's bit with `mark` (`fetch_or`, `Release`: whoever takes the bit with `Acquire` sees
//!   what was published before it), then asks `ring_needed` whether the owner sleeps and has
//!   not been rung for this sleep yet; if so it rings the owner's doorbell.
//! - **Consumer** (the owner, whenever it drives the device): [`take`]s each bit word
//!   (`swap(0)`, `Acquire`) *before* processing the queue pairs it names, so news published
//!   while it processes sets the bit again and is found next time. A bit set for news already
//!   handled only costs one look.
//! - **Sleeping**: a thread about to block stores a fresh odd value in the sleep word
//!   (`announce_sleep`, with a `SeqCst` fence), then takes the bits once more and blocks only
//!   if none was set. The producer has a `SeqCst` fence between its mark and its load of the
//!   sleep word: of the two, at least one sees the other's store (the store-buffer handshake),
//!   so either the sleeper finds the mark or the producer rings. The rung word lets only the
//!   first of many producers ring for one sleep (one system call, not one per queue pair);
//!   every sleep has its own value, so a new sleep is rung for again. Arming and disarming is
//!   one store, however many queue pairs the device has.
//!
//! `tests/loom.rs` model-checks this handshake together with the ring (two producers, one
//! consumer that sleeps whenever it finds nothing).
//!
//! # Trust
//!
//! Every peer can write the whole area. A hostile peer can set bits (the owner looks at queue
//! pairs for nothing: the old cost, no harm), clear them or fake the rung word (news is found
//! late: the owner falls back on looking at every queue pair now and then, see the engine), or
//! scribble on the sleep word (never read back by the owner; other peers may then ring when
//! there is no need, or not ring: the same harm as a peer draining the doorbell eventfd it was
//! given). The owner never trusts a bit to mean more than "look here": slots are checked
//! against its own table.

pub(crate) mod area;

pub use crate::ring::Word;
use crate::sync::{fence, Ordering};

/// An 8-byte shared word with the read-modify-write operations the protocol needs.
pub trait AtomicWord: Word {
    /// Atomically ORs `bits` in; returns the previous value.
    fn fetch_or(&self, bits: u64, order: Ordering) -> u64;
    /// Atomically replaces the value; returns the previous one.
    fn swap(&self, value: u64, order: Ordering) -> u64;
}

/// Bits in one activity word.
pub const SLOTS_PER_WORD: u32 = 64;

/// The word index and the bit of slot `slot`.
pub fn slot_position(slot: u32) -> (usize, u64) {
    ((slot / SLOTS_PER_WORD) as usize, 1 << (slot % SLOTS_PER_WORD))
}

/// The owner's state word, bit 0: a thread of the owner sleeps and wants the doorbell rung.
pub const SLEEPING: u64 = 1;
/// The owner's state word, bit 1: the owner looks at every queue pair on every call (it has
/// only a few), so producers need not mark while it is awake.
pub const LOOKS_EVERYWHERE: u64 = 2;

/// A value of the owner's state word: the flags, and above them `epoch`, which counts sleeps
/// so that each sleep has its own value (producers ring once per value).
pub fn state_value(epoch: u64, sleeping: bool, looks_everywhere: bool) -> u64 {
    let mut value = epoch << 2;
    if sleeping {
        value |= SLEEPING;
    }
    if looks_everywhere {
        value |= LOOKS_EVERYWHERE;
    }
    value
}

/// Owner side: publishes a new state. After announcing a sleep, or that it stopped looking
/// everywhere, the owner must look for news once more before it relies on marks alone (take
/// the marks; after a change of mode, look everywhere once): the fence makes sure that a
/// producer which saw the old state published before that look.
pub fn announce<W: Word>(state: &W, value: u64) {
    state.store(value, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Producer side, after publishing anything for the queue pair in `slot`: marks the slot in
/// `bits` (its activity word, see [`slot_position`]) unless the owner is awake and looks
/// everywhere anyway; returns whether to ring the owner's doorbell now (it sleeps, and no
/// producer rang for this sleep yet).
pub fn signal<W: AtomicWord>(bits: &W, slot: u32, state: &W, rung: &W) -> bool {
    fence(Ordering::SeqCst);
    let seen = state.load(Ordering::Relaxed);
    if seen & LOOKS_EVERYWHERE != 0 && seen & SLEEPING == 0 {
        return false;
    }
    bits.fetch_or(slot_position(slot).1, Ordering::Release);
    fence(Ordering::SeqCst);
    let value = state.load(Ordering::Relaxed);
    value & SLEEPING != 0
        && rung.load(Ordering::Relaxed) != value
        && rung.swap(value, Ordering::Relaxed) != value
}

/// Consumer side: takes the marks of one activity word (each set bit is a slot to look at).
pub fn take<W: AtomicWord>(word: &W) -> u64 {
    // Most words are empty most of the time: a plain load keeps the line shared with the
    // producers instead of taking it exclusively.
    if word.load(Ordering::Relaxed) == 0 {
        return 0;
    }
    word.swap(0, Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[derive(Default)]
    struct CellWord(Cell<u64>);

    impl Word for CellWord {
        fn load(&self, _: Ordering) -> u64 {
            self.0.get()
        }

        fn store(&self, value: u64, _: Ordering) {
            self.0.set(value);
        }
    }

    impl AtomicWord for CellWord {
        fn fetch_or(&self, bits: u64, _: Ordering) -> u64 {
            let old = self.0.get();
            self.0.set(old | bits);
            old
        }

        fn swap(&self, value: u64, _: Ordering) -> u64 {
            self.0.replace(value)
        }
    }

    /// Words of one owner: its state, its rung word and one activity word.
    #[derive(Default)]
    struct Owner {
        state: CellWord,
        rung: CellWord,
        bits: CellWord,
    }

    impl Owner {
        fn signal(&self, slot: u32) -> bool {
            signal(&self.bits, slot, &self.state, &self.rung)
        }
    }

    #[test]
    fn marks_are_taken_once() {
        let owner = Owner::default();
        for slot in [3, 40, 3] {
            assert!(!owner.signal(slot), "rang an owner that is awake");
        }
        assert_eq!(take(&owner.bits), 1 << 3 | 1 << 40);
        assert_eq!(take(&owner.bits), 0, "marks taken twice");
        assert_eq!(slot_position(70), (1, 1 << 6));
    }

    #[test]
    fn one_ring_per_sleep_among_all_producers() {
        let owner = Owner::default();
        announce(&owner.state, state_value(1, true, false));
        assert!(owner.signal(1), "first producer");
        assert!(!owner.signal(2), "a second producer rang for the same sleep");
        announce(&owner.state, state_value(2, true, false));
        assert!(owner.signal(1), "did not ring for the next sleep");
        announce(&owner.state, state_value(2, false, false));
        assert!(!owner.signal(1), "rang after the owner woke");
        assert_eq!(take(&owner.bits), 0b110);
    }

    #[test]
    fn an_owner_looking_everywhere_is_marked_only_while_it_sleeps() {
        let owner = Owner::default();
        announce(&owner.state, state_value(0, false, true));
        assert!(!owner.signal(5));
        assert_eq!(take(&owner.bits), 0, "marked an owner that looks everywhere");
        announce(&owner.state, state_value(1, true, true));
        assert!(owner.signal(5), "did not ring a sleeping owner");
        assert_eq!(take(&owner.bits), 1 << 5, "did not mark a sleeping owner");
    }
}
