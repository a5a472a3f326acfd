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
//! offset 128   task rung word: 1 while a ring of the task doorbell is pending (rung, and no
//!               dispatch has begun since)
//! offset 192   activity bits: bit s % 64 of word s / 64 is slot s
//! then          waiting bits, two per slot (twice as many words as activity bits): bits
//!               2 (s % 32) and 2 (s % 32) + 1 of word s / 32 are set while a thread of the owner
//!               waits for slot s's queue pair on its own doorbell, for anything or for
//!               arrivals only (see [`Wake`])
//! then          task bits, one per slot (as many words as activity bits): bit s % 64 of
//!               word s / 64 is set by a producer that took slot s's waiting bit when the
//!               queue pair's waiter is a task (see below)
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
//! - **Waiting for one queue pair**: a queue pair whose owner handed the peer a doorbell of its
//!   own (the fourth descriptor of its introduction, an eventfd) can be waited for alone. The
//!   waiting thread sets the slot's *waiting* bit ([`arm_waiter`], `fetch_or` then a `SeqCst`
//!   fence), looks for news once more (at its queue pair alone, under that queue pair's lock,
//!   so a look another thread of the owner began earlier has finished), and sleeps on that
//!   eventfd if there was none. The producer, after publishing and a `SeqCst` fence, takes the
//!   bit ([`take_waiter`]) and, if it was set, writes the queue pair's eventfd without marking
//!   the slot (the waiter looks at its queue pair whatever the marks say; otherwise it marks
//!   as in [`signal`]): the one thread waiting for that
//!   connection wakes, with no driver thread, router or notifier in between. A waiter that
//!   only reads asks to be woken for *arrivals* (records, a NAK, a change of state), not for
//!   acknowledgements or freed ring space: a request/response connection would otherwise wake
//!   once for the request's acknowledgement and once for the response. The same
//!   store-buffer handshake as the sleep word: either the waiter's look finds the news or the
//!   producer sees the bit.
//!
//! - **Waiting as a task**: a queue pair whose owner is an event loop (Lightpath's tokio
//!   streams) hands the peer no doorbell of its own (a descriptor per connection on each side
//!   was what issue 15 counted): its introduction says its waiter is a *task*. The waiting
//!   bit works as above; the producer that takes it sets the slot's task bit ([`mark_task`])
//!   and rings the device's *task doorbell*, one eventfd per device (handed over with every
//!   introduction, kept once per peer device). Whoever reads that doorbell — a task of the
//!   event loop, or a thread blocked on one such queue pair — takes the task bits and wakes
//!   the task of every slot named. One ring can so wake many tasks, and producers ring only
//!   when no ring is pending ([`task_ring_needed`]: the task rung word, which a dispatch
//!   clears before it takes the bits), so a busy device's peers pay fewer eventfd writes
//!   than one per arming, as a doorbell of each queue pair's own cost.
//!
//! `tests/loom.rs` model-checks these handshakes together with the ring (two producers, one
//! consumer that sleeps whenever it finds nothing; two waiters, each for its own queue pair,
//! that take each other's news).
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
    /// Atomically ANDs `bits` in; returns the previous value.
    fn fetch_and(&self, bits: u64, order: Ordering) -> u64;
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

/// What a thread waiting for one queue pair wants to be woken for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// Any news: also acknowledgements of its own requests and freed ring space (a writer).
    Anything,
    /// Arrivals only: the peer's records, a NAK, a change of its state (a reader).
    Arrivals,
}

/// Slots per word of waiting bits (two bits each).
pub const WAITERS_PER_WORD: u32 = 32;

/// The word index of slot `slot`'s waiting bits, and its "anything" bit (the "arrivals" bit is
/// the next one up).
pub fn waiting_position(slot: u32) -> (usize, u64) {
    ((slot / WAITERS_PER_WORD) as usize, 1 << (2 * (slot % WAITERS_PER_WORD)))
}

/// Owner side, before a thread looks for news of one queue pair a last time and sleeps on its
/// doorbell: sets the queue pair's waiting bit for `wake` in `waiting` (its word, see
/// [`waiting_position`]). After this the caller must look (the fence makes a producer that did
/// not see the bit publish before that look).
pub fn arm_waiter<W: AtomicWord>(waiting: &W, slot: u32, wake: Wake) {
    let anything = waiting_position(slot).1;
    let bit = match wake {
        Wake::Anything => anything,
        Wake::Arrivals => anything << 1,
    };
    waiting.fetch_or(bit, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Producer side, after [`signal`] (whose fence orders what was published before this load):
/// takes the waiting bits of `slot` that what was published answers (`arrival`: records, a
/// NAK or a state change, which answer both; otherwise only "anything"); returns whether one
/// was set, i.e. whether to write the queue pair's own doorbell. Only the producer that clears
/// a bit rings.
pub fn take_waiter<W: AtomicWord>(waiting: &W, slot: u32, arrival: bool) -> bool {
    let anything = waiting_position(slot).1;
    let bits = if arrival { anything | anything << 1 } else { anything };
    // Mostly nobody waits: a plain load keeps the line shared.
    waiting.load(Ordering::Relaxed) & bits != 0 && waiting.fetch_and(!bits, Ordering::Relaxed) & bits != 0
}

/// Producer side, after [`take_waiter`] returned true for a queue pair whose waiter is a task
/// (it handed over no doorbell of its own): sets the slot's task bit in `tasks` (its word, see
/// [`slot_position`]), `Release`, before the producer rings the owner's task doorbell. The
/// owner's reader of that doorbell takes the task bits ([`take`]) after the ring and wakes
/// each task named, which then looks at its queue pair: what was published is seen.
pub fn mark_task<W: AtomicWord>(tasks: &W, slot: u32) {
    tasks.fetch_or(slot_position(slot).1, Ordering::Release);
}

/// Producer side, after [`mark_task`]: whether to ring the task doorbell (no ring is pending:
/// the word was 0, and this producer claimed it). The `SeqCst` swap orders the task bit
/// before it: a dispatch that clears the word after this ([`rearm_task_ring`]) takes the bit.
pub fn task_ring_needed<W: AtomicWord>(rung: &W) -> bool {
    // The store-buffer handshake with `rearm_task_ring`: the task bit, then this load; the
    // dispatch's clear, then its takes. Of the two, one sees the other's store.
    fence(Ordering::SeqCst);
    // Mostly a ring is pending on a busy device: a plain load keeps the line shared.
    rung.load(Ordering::Relaxed) == 0 && rung.swap(1, Ordering::SeqCst) == 0
}

/// Owner side, before a dispatch takes the task bits: clears the task rung word, so the next
/// producer rings. Bits set before a producer found the word set are taken by this dispatch
/// (the fence orders the clear before the takes); bits set after the clear come with a ring.
pub fn rearm_task_ring<W: AtomicWord>(rung: &W) {
    rung.store(0, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Owner side, for a dispatch that keeps looking for a while (spins) instead of waiting for
/// the doorbell: marks a ring as pending, so producers set task bits without ringing (each
/// ring costs the producer a system call and the owner a wake-up). The owner then takes the
/// bits itself, and ends with [`rearm_task_ring`] and one more take before it waits again:
/// from the producers' side a held ring is one that was rung and not yet dispatched.
pub fn hold_task_ring<W: AtomicWord>(rung: &W) {
    // Mostly it is held already (a ring pending, or an earlier hold): a plain load keeps the
    // line shared.
    if rung.load(Ordering::Relaxed) == 0 {
        rung.swap(1, Ordering::Relaxed);
    }
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
/// producer rang for this sleep yet). [`mark`] then [`ring_needed`].
pub fn signal<W: AtomicWord>(bits: &W, slot: u32, state: &W, rung: &W) -> bool {
    mark(bits, slot, state) && ring_needed(state, rung)
}

/// Producer side, the first half of [`signal`]: marks the slot unless the owner is awake and
/// looks everywhere anyway (`false`: nothing to ring for), and fences. A producer that hands
/// the news to a waiter of the queue pair ([`take_waiter`], after this fence) need not ask
/// [`ring_needed`]: the woken thread drives the device and takes the mark.
pub fn mark<W: AtomicWord>(bits: &W, slot: u32, state: &W) -> bool {
    fence(Ordering::SeqCst);
    let seen = state.load(Ordering::Relaxed);
    if seen & LOOKS_EVERYWHERE != 0 && seen & SLEEPING == 0 {
        return false;
    }
    bits.fetch_or(slot_position(slot).1, Ordering::Release);
    fence(Ordering::SeqCst);
    true
}

/// Producer side, after [`mark`] returned true: whether to ring the owner's doorbell (it
/// sleeps, and no producer rang for this sleep yet; the first to ask claims the ring).
pub fn ring_needed<W: AtomicWord>(state: &W, rung: &W) -> bool {
    let value = state.load(Ordering::Relaxed);
    value & SLEEPING != 0
        && rung.load(Ordering::Relaxed) != value
        && rung.swap(value, Ordering::Relaxed) != value
}

/// Consumer side: takes the mark of one slot only (a thread about to look at that queue pair
/// alone); returns whether it was marked. The other slots' marks stay for whoever looks at
/// them.
pub fn take_slot<W: AtomicWord>(word: &W, slot: u32) -> bool {
    let (_, bit) = slot_position(slot);
    if word.load(Ordering::Relaxed) & bit == 0 {
        return false;
    }
    word.fetch_and(!bit, Ordering::Acquire) & bit != 0
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

        fn fetch_and(&self, bits: u64, _: Ordering) -> u64 {
            let old = self.0.get();
            self.0.set(old & bits);
            old
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
    fn a_waiter_is_rung_once_per_arming() {
        let waiting = CellWord::default();
        assert!(!take_waiter(&waiting, 3, true), "rang a queue pair nobody waits for");
        arm_waiter(&waiting, 3, Wake::Anything);
        arm_waiter(&waiting, 70 % 32, Wake::Anything);
        assert!(!take_waiter(&waiting, 4, true), "rang the wrong queue pair");
        assert!(take_waiter(&waiting, 3, false), "did not ring the waiter");
        assert!(!take_waiter(&waiting, 3, true), "rang twice for one arming");
        assert!(take_waiter(&waiting, 6, true), "the other waiter's bit was lost");
        assert_eq!(waiting.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_reader_is_rung_for_arrivals_only() {
        let waiting = CellWord::default();
        arm_waiter(&waiting, 31, Wake::Arrivals);
        assert_eq!(waiting_position(31), (0, 1 << 62));
        assert!(!take_waiter(&waiting, 31, false), "an acknowledgement woke a reader");
        assert!(take_waiter(&waiting, 31, true), "an arrival did not wake the reader");
        assert_eq!(waiting.load(Ordering::Relaxed), 0);
        arm_waiter(&waiting, 5, Wake::Arrivals);
        arm_waiter(&waiting, 5, Wake::Anything);
        assert!(take_waiter(&waiting, 5, false), "a writer waiting too was not woken");
        assert!(take_waiter(&waiting, 5, true), "the reader's bit went with the writer's");
        assert!(!take_waiter(&waiting, 5, true));
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
