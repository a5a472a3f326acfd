//! The activity area in shared memory (layout in the [module docs](super)): the owner's side
//! ([`OwnArea`], mapped when the device opens) and a peer's ([`PeerArea`], mapped once per
//! peer device however many links lead there, through [`PeerAreas`]).

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, Weak};

use super::{slot_position, waiting_position, AtomicWord, Wake, Word, SLOTS_PER_WORD};
use crate::sync::Ordering;
use crate::sys::{EventFd, Mapping, Memfd};

const OFF_STATE: usize = 0;
const OFF_RUNG: usize = 64;
const OFF_TASK_RUNG: usize = 128;
/// Where the activity bits start (on a cache line of their own: producers write them all the
/// time, while the state word is mostly read).
const BITS_OFFSET: usize = 192;
/// Most slots an area has (queue-pair numbers have 24 bits).
pub(crate) const MAX_SLOTS: u32 = 1 << 24;
/// Fewest slots an area has (one word).
const MIN_SLOTS: u32 = SLOTS_PER_WORD;

/// Activity words for `slots` slots.
fn words_of(slots: u32) -> usize {
    slots.div_ceil(SLOTS_PER_WORD) as usize
}

/// Bytes of an area with `slots` slots: the activity bits, then twice as many words of waiting
/// bits (two per slot), then the task bits (one per slot).
fn area_len(slots: u32) -> usize {
    BITS_OFFSET + AREA_WORDS_PER_ACTIVITY_WORD * words_of(slots) * 8
}

/// Words of an area per word of activity bits: one of activity bits, two of waiting bits, one
/// of task bits.
const AREA_WORDS_PER_ACTIVITY_WORD: usize = 4;

/// Where the waiting bits of an area with `slots` slots start.
fn waiting_offset(slots: u32) -> usize {
    BITS_OFFSET + words_of(slots) * 8
}

/// Where the task bits of an area with `slots` slots start (see
/// [`mark_task`](super::mark_task)).
fn tasks_offset(slots: u32) -> usize {
    BITS_OFFSET + 3 * words_of(slots) * 8
}

/// One word of an area mapping. Accesses outside the mapping cannot happen (offsets are
/// checked against the slot count first); should one anyway, it reads 0 and writes nothing.
#[derive(Clone, Copy, Debug)]
struct AreaWord<'a> {
    map: &'a Mapping,
    offset: usize,
}

impl Word for AreaWord<'_> {
    fn load(&self, order: Ordering) -> u64 {
        self.map.load_u64(self.offset, order).unwrap_or(0)
    }

    fn store(&self, value: u64, order: Ordering) {
        let stored = self.map.store_u64(self.offset, value, order);
        debug_assert!(stored);
    }
}

impl AtomicWord for AreaWord<'_> {
    fn fetch_or(&self, bits: u64, order: Ordering) -> u64 {
        self.map.fetch_or_u64(self.offset, bits, order).unwrap_or(0)
    }

    fn swap(&self, value: u64, order: Ordering) -> u64 {
        self.map.swap_u64(self.offset, value, order).unwrap_or(0)
    }

    fn fetch_and(&self, bits: u64, order: Ordering) -> u64 {
        self.map.fetch_and_u64(self.offset, bits, order).unwrap_or(0)
    }
}

/// This device's own area.
#[derive(Debug)]
pub(crate) struct OwnArea {
    memfd: Memfd,
    map: Mapping,
    slots: u32,
}

impl OwnArea {
    /// Creates an area for `slots` slots (rounded up to whole words, and clamped to what an
    /// area can have). Peers map it writable, so no more seals may be added (a peer could
    /// otherwise forbid new writable mappings and keep other peers from connecting).
    pub(crate) fn create(slots: u32) -> io::Result<Self> {
        let slots = slots.clamp(MIN_SLOTS, MAX_SLOTS).next_multiple_of(SLOTS_PER_WORD);
        let memfd = Memfd::create("lightpath-shm-activity", area_len(slots) as u64)?;
        let map = Mapping::new(&memfd, true)?;
        memfd.seal_seals()?;
        Ok(Self { memfd, map, slots })
    }

    /// The memfd to hand to peers.
    pub(crate) fn memfd(&self) -> &Memfd {
        &self.memfd
    }

    /// How many slots the area has.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// Takes the marks of activity word `index` (slots `64 * index ..`); 0 past the end.
    pub(crate) fn take(&self, index: usize) -> u64 {
        if index >= words_of(self.slots) {
            return 0;
        }
        super::take(&self.word(BITS_OFFSET + index * 8))
    }

    /// Takes the mark of `slot` alone (see [`take_slot`](super::take_slot)); false past the end.
    pub(crate) fn take_slot(&self, slot: u32) -> bool {
        if slot >= self.slots {
            return false;
        }
        let (index, _) = slot_position(slot);
        super::take_slot(&self.word(BITS_OFFSET + index * 8), slot)
    }

    /// Whether any of the first `words` activity words has a mark (without taking it).
    pub(crate) fn any_marked(&self, words: usize) -> bool {
        (0..words.min(words_of(self.slots)))
            .any(|index| self.word(BITS_OFFSET + index * 8).load(Ordering::Relaxed) != 0)
    }

    /// Takes every mark.
    pub(crate) fn clear_marks(&self) {
        for index in 0..words_of(self.slots) {
            self.take(index);
        }
    }

    /// Sets the waiting bit of `slot` for `wake` (see [`arm_waiter`](super::arm_waiter)); the
    /// caller then looks for the queue pair's news once more before it sleeps on the queue
    /// pair's doorbell. Nothing happens for a slot past the end.
    pub(crate) fn arm_waiter(&self, slot: u32, wake: Wake) {
        if slot >= self.slots {
            return;
        }
        let (index, _) = waiting_position(slot);
        super::arm_waiter(&self.word(waiting_offset(self.slots) + index * 8), slot, wake);
    }

    /// Takes the waiting bits of `slot` as a producer would, for news this device made itself
    /// (a completion another thread made; `arrival` as in [`take_waiter`](super::take_waiter));
    /// returns whether one was set.
    pub(crate) fn take_waiter(&self, slot: u32, arrival: bool) -> bool {
        if slot >= self.slots {
            return false;
        }
        let (index, _) = waiting_position(slot);
        super::take_waiter(&self.word(waiting_offset(self.slots) + index * 8), slot, arrival)
    }

    /// Before a dispatch takes the task bits: says the task doorbell's next ring is wanted
    /// (see [`task_ring_needed`](super::task_ring_needed)).
    pub(crate) fn rearm_task_ring(&self) {
        super::rearm_task_ring(&self.word(OFF_TASK_RUNG));
    }

    /// For a dispatch that spins: peers set task bits without ringing until the next
    /// [`rearm_task_ring`](Self::rearm_task_ring) (see [`hold_task_ring`](super::hold_task_ring)).
    pub(crate) fn hold_task_ring(&self) {
        super::hold_task_ring(&self.word(OFF_TASK_RUNG));
    }

    /// Takes the task bits of word `index` (slots `64 * index ..`, see
    /// [`take`](super::take)); 0 past the end.
    pub(crate) fn take_tasks(&self, index: usize) -> u64 {
        if index >= words_of(self.slots) {
            return 0;
        }
        super::take(&self.word(tasks_offset(self.slots) + index * 8))
    }

    /// The waiting bits of `slot` (tests): (anything, arrivals).
    #[cfg(test)]
    pub(crate) fn waiter_armed(&self, slot: u32) -> (bool, bool) {
        let (index, bit) = waiting_position(slot);
        let word = self.word(waiting_offset(self.slots) + index * 8).load(Ordering::Relaxed);
        (word & bit != 0, word & bit << 1 != 0)
    }

    /// The state word as last announced (tests).
    #[cfg(test)]
    pub(crate) fn state(&self) -> u64 {
        self.word(OFF_STATE).load(Ordering::Relaxed)
    }

    /// Marks `slot` as a peer would, whatever the owner's state: the owner could not look at
    /// its queue pair just now (another thread held it), and tests.
    pub(crate) fn mark(&self, slot: u32) {
        if slot >= self.slots {
            return;
        }
        let (index, bit) = slot_position(slot);
        self.word(BITS_OFFSET + index * 8).fetch_or(bit, Ordering::Release);
    }

    /// The whole area, for fault injection (which writes it as a hostile peer could).
    pub(crate) fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// Publishes the device's state (see [`announce`](super::announce)); `value` from
    /// [`state_value`](super::state_value).
    pub(crate) fn announce(&self, value: u64) {
        super::announce(&self.word(OFF_STATE), value);
    }

    fn word(&self, offset: usize) -> AreaWord<'_> {
        AreaWord { map: &self.map, offset }
    }
}

/// Which file a descriptor refers to: the same memfd received twice has the same identity.
type FileIdentity = (u64, u64);

fn identity(memfd: &Memfd) -> io::Result<FileIdentity> {
    let stat = rustix::fs::fstat(memfd)?;
    Ok((stat.st_dev, stat.st_ino))
}

/// How a peer queue pair's waiter wants to hear of news for it (see `crate::activity`).
#[derive(Debug)]
pub(crate) enum PeerWaiter {
    /// Nobody waits for it alone: news rings the device if it sleeps.
    Device,
    /// A thread waits for it alone on this eventfd, the queue pair's own doorbell.
    Own(EventFd),
    /// A task of an event loop waits for it: news sets its task bit and rings the device's
    /// task doorbell, whose reader wakes the task.
    Task,
}

/// A peer device's area, mapped here, with that device's two doorbells (the device's and its
/// tasks'): one descriptor each per peer device, however many links lead there (the first
/// introduction's; later ones' duplicates are closed). A hostile process that holds the area
/// and introduces itself first with eventfds of its own only keeps that device's sleepers or
/// tasks from being rung (they find news by the safety net, or when their connection's TCP
/// socket or next call shows it), the same harm as clearing its marks.
#[derive(Debug)]
pub(crate) struct PeerArea {
    map: Mapping,
    slots: u32,
    doorbell: EventFd,
    task_doorbell: EventFd,
}

impl PeerArea {
    /// Maps an area a peer handed over. Its slot count follows from the file's size (sealed,
    /// so it cannot change); there is no header a peer could spoil for the others.
    fn map(memfd: &Memfd, doorbell: EventFd, task_doorbell: EventFd) -> Result<Self, &'static str> {
        let len = usize::try_from(memfd.len()).unwrap_or(usize::MAX);
        if !(area_len(MIN_SLOTS)..=area_len(MAX_SLOTS)).contains(&len) {
            return Err("the peer's activity area has an impossible size");
        }
        let slots = ((len - BITS_OFFSET) / (AREA_WORDS_PER_ACTIVITY_WORD * 8)) as u32 * SLOTS_PER_WORD;
        let map = Mapping::peer(memfd, area_len(slots) as u64, true)
            .map_err(|_| "the peer's activity area cannot be mapped writable")?;
        Ok(Self { map, slots, doorbell, task_doorbell })
    }

    /// Rings the peer device's doorbell.
    pub(crate) fn ring(&self) {
        self.doorbell.signal(1);
    }

    /// Whether the area has slot `slot`.
    pub(crate) fn has_slot(&self, slot: u32) -> bool {
        slot < self.slots
    }

    /// Tells the peer device that the queue pair in `slot` (which it was introduced with) has
    /// news (see [`signal`](super::signal)); returns whether to ring the device's doorbell.
    #[cfg(test)]
    fn signal(&self, slot: u32) -> bool {
        self.mark(slot) && self.ring_needed()
    }

    /// After publishing news for the queue pair in `slot`: marks the slot, then wakes whoever
    /// the news is for, once — the thread waiting for that queue pair alone if one waits for
    /// such news (writing `waiter`, the queue pair's own doorbell; `arrival` as in
    /// [`take_waiter`](super::take_waiter)), else the device if it sleeps and nobody rang for
    /// this sleep yet. Not both: the woken waiter looks at its queue pair itself (taking the
    /// mark), so ringing the device too would only wake its driver thread (asleep, armed,
    /// while the application waits on queue pairs' doorbells) to contend for the engine; hyper
    /// over shm paid one eventfd write here and one driver wake-up there per message for it.
    ///
    /// The mark is made even when a waiter is woken: a waiting bit stays set after its thread
    /// stopped waiting (only a producer clears it), so the thread rung may be gone, on to wait
    /// for another connection. Without the mark, news rung to such a stale bit stayed
    /// invisible to the owner's device until one of its drives looked at every queue pair
    /// (every 256th): a peer waiting for that queue pair's acknowledgement stalled. Seen with
    /// 8 collective ranks setting up at once under load (1 run in 12 to 30): each rank blocked
    /// in a flush waiting for the acknowledgement of a peer blocked in a flush of its own,
    /// for the whole set-up deadline.
    ///
    /// A waiter that is a task ([`PeerWaiter::Task`]) is told through the device's task
    /// doorbell instead of a doorbell of its own: its task bit is set, then the task doorbell
    /// rung (whoever reads that doorbell takes the task bits and wakes their tasks).
    pub(crate) fn notify(&self, slot: u32, waiter: &PeerWaiter, arrival: bool) {
        // `mark` fences after marking: what was published before is seen by a waiter that
        // armed before the load in `take_waiter` (it fences between arming and its last look).
        let marked = self.mark(slot);
        match waiter {
            PeerWaiter::Own(waiter) if self.take_waiter(slot, arrival) => {
                waiter.signal(1);
                return;
            }
            PeerWaiter::Task if self.take_waiter(slot, arrival) => {
                let (index, _) = slot_position(slot);
                super::mark_task(&self.word(tasks_offset(self.slots) + index * 8), slot);
                if super::task_ring_needed(&self.word(OFF_TASK_RUNG)) {
                    self.task_doorbell.signal(1);
                }
                return;
            }
            _ => {}
        }
        if marked && self.ring_needed() {
            self.ring();
        }
    }

    /// The first half of [`signal`](super::signal) for this area (see [`mark`](super::mark)): marks `slot`;
    /// false if there is nothing to ring for.
    pub(crate) fn mark(&self, slot: u32) -> bool {
        if !self.has_slot(slot) {
            return false;
        }
        let (index, _) = slot_position(slot);
        super::mark(&self.word(BITS_OFFSET + index * 8), slot, &self.word(OFF_STATE))
    }

    /// The second half of [`signal`](super::signal) for this area (see
    /// [`ring_needed`](super::ring_needed)).
    pub(crate) fn ring_needed(&self) -> bool {
        super::ring_needed(&self.word(OFF_STATE), &self.word(OFF_RUNG))
    }

    /// After [`PeerArea::signal`]: takes the waiting bits of `slot` that the news answers (see
    /// [`take_waiter`](super::take_waiter)); returns whether to write the queue pair's own
    /// doorbell (a thread of the owner waits for it alone).
    pub(crate) fn take_waiter(&self, slot: u32, arrival: bool) -> bool {
        if !self.has_slot(slot) {
            return false;
        }
        let (index, _) = waiting_position(slot);
        super::take_waiter(&self.word(waiting_offset(self.slots) + index * 8), slot, arrival)
    }

    fn word(&self, offset: usize) -> AreaWord<'_> {
        AreaWord { map: &self.map, offset }
    }
}

/// The peer areas mapped by a device, by file, so a thousand links to one peer device share one
/// mapping. Entries die with their last link.
#[derive(Debug, Default)]
pub(crate) struct PeerAreas {
    mapped: Mutex<HashMap<FileIdentity, Weak<PeerArea>>>,
}

impl PeerAreas {
    /// The mapping of the area `memfd` holds (made now, with `doorbell` and `task_doorbell`, if
    /// no live link has it mapped; otherwise they are closed).
    pub(crate) fn get(
        &self,
        memfd: &Memfd,
        doorbell: EventFd,
        task_doorbell: EventFd,
    ) -> Result<Arc<PeerArea>, &'static str> {
        let id = identity(memfd).map_err(|_| "cannot identify the peer's activity area")?;
        let mut mapped = self.mapped.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(area) = mapped.get(&id).and_then(Weak::upgrade) {
            return Ok(area);
        }
        let area = Arc::new(PeerArea::map(memfd, doorbell, task_doorbell)?);
        mapped.retain(|_, area| area.strong_count() > 0);
        mapped.insert(id, Arc::downgrade(&area));
        Ok(area)
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::activity::state_value;

    fn bell() -> EventFd {
        EventFd::new(false).expect("eventfd")
    }

    fn peer_memfd(own: &OwnArea) -> Memfd {
        let fd = own.memfd().as_fd().try_clone_to_owned().expect("dup");
        Memfd::from_peer(fd, 1).expect("memfd")
    }

    #[test]
    fn a_peer_marks_slots_the_owner_takes() {
        let own = OwnArea::create(200).expect("area");
        assert_eq!(own.slots(), 256);
        let areas = PeerAreas::default();
        let peer = areas.get(&peer_memfd(&own), bell(), bell()).expect("peer view");
        assert!(!peer.signal(70), "rang an owner that is awake");
        assert!(!peer.signal(199));
        assert!(!peer.signal(256), "slot past the end");
        assert_eq!((own.take(0), own.take(1), own.take(3)), (0, 1 << 6, 1 << 7));
        assert_eq!(own.take(1), 0, "marks taken twice");
        assert_eq!(own.take(4), 0, "word past the end");

        own.announce(state_value(5, true, false));
        assert!(peer.signal(1), "did not ring a sleeping owner");
        assert!(!peer.signal(2), "rang twice for one sleep");
        own.announce(state_value(5, false, true));
        assert!(!peer.signal(3), "rang an owner that is awake");
        assert_eq!(own.take(0), 0b110, "marked an owner that looks everywhere");

        assert!(!peer.take_waiter(130, true), "nobody waits for slot 130");
        own.arm_waiter(130, Wake::Anything);
        own.arm_waiter(200, Wake::Arrivals);
        own.arm_waiter(256, Wake::Anything);
        assert_eq!(own.waiter_armed(130), (true, false));
        assert_eq!(own.waiter_armed(200), (false, true));
        assert!(!peer.take_waiter(131, true), "rang the wrong waiter");
        assert!(peer.take_waiter(130, false), "did not ring the waiter");
        assert!(!peer.take_waiter(130, true), "rang twice for one arming");
        assert!(!peer.take_waiter(200, false), "an acknowledgement rang a reader");
        assert!(peer.take_waiter(200, true), "an arrival did not ring the reader");
        assert!(!peer.take_waiter(256, true), "slot past the end");
        assert_eq!(own.take(2), 0, "a waiting bit showed up as a mark");
        assert_eq!(own.take(3), 0, "a waiting bit showed up as a mark");
    }

    #[test]
    fn news_wakes_its_waiter_or_else_the_sleeping_device_never_both() {
        let own = OwnArea::create(64).expect("area");
        let device_bell = bell();
        let peer = PeerAreas::default()
            .get(
                &peer_memfd(&own),
                EventFd::from_peer(device_bell.as_fd().try_clone_to_owned().expect("dup"))
                    .expect("an eventfd"),
                bell(),
            )
            .expect("peer view");
        let waiter = PeerWaiter::Own(bell());
        let own_bell = |waiter: &PeerWaiter| match waiter {
            PeerWaiter::Own(bell) => bell.take(),
            _ => unreachable!(),
        };
        own.announce(state_value(7, true, false));
        own.arm_waiter(5, Wake::Arrivals);
        // An arrival for the waiting reader: its doorbell only.
        peer.notify(5, &waiter, true);
        assert_eq!((own_bell(&waiter), device_bell.take()), (1, 0), "the reader's arrival");
        // Marked too: the waiting bit outlives the wait (only a producer clears it), so the
        // thread rung may have stopped waiting; the mark makes the device's next drive look.
        assert_eq!(own.take(0), 1 << 5, "news a waiter was rung for is marked as well");
        // An acknowledgement the reader does not wait for: the sleeping device, once per sleep.
        own.arm_waiter(5, Wake::Arrivals);
        peer.notify(5, &waiter, false);
        peer.notify(6, &PeerWaiter::Device, true);
        assert_eq!((own_bell(&waiter), device_bell.take()), (0, 1), "the acknowledgement");
        // A new sleep is rung again; a queue pair without a doorbell rings the device.
        own.announce(state_value(8, true, false));
        peer.notify(6, &PeerWaiter::Device, true);
        assert_eq!((own_bell(&waiter), device_bell.take()), (0, 1), "a queue pair with no waiter");
        // An owner awake and looking everywhere is neither marked nor rung; its waiter still is.
        own.announce(state_value(9, false, true));
        own.take(0);
        peer.notify(5, &waiter, true);
        assert_eq!((own_bell(&waiter), device_bell.take(), own.take(0)), (1, 0, 0), "an awake owner");
    }

    /// An area of 128 slots, a peer's view of it, and the device's doorbell and task doorbell
    /// the peer rings (the owner's copies).
    fn area_with_task_doorbell() -> (OwnArea, Arc<PeerArea>, EventFd, EventFd) {
        let own = OwnArea::create(128).expect("area");
        let (device_bell, task_bell) = (bell(), bell());
        let dup = |bell: &EventFd| {
            EventFd::from_peer(bell.as_fd().try_clone_to_owned().expect("dup")).expect("eventfd")
        };
        let peer =
            PeerAreas::default().get(&peer_memfd(&own), dup(&device_bell), dup(&task_bell)).expect("view");
        (own, peer, device_bell, task_bell)
    }

    #[test]
    fn news_for_a_waiting_task_sets_its_bit_and_rings_the_task_doorbell_once_per_dispatch() {
        let (own, peer, device_bell, task_bell) = area_with_task_doorbell();
        own.announce(state_value(3, true, false));
        // Nobody armed: the sleeping device is rung, as for any queue pair.
        peer.notify(70, &PeerWaiter::Task, true);
        assert_eq!((task_bell.take(), device_bell.take(), own.take_tasks(1)), (0, 1, 0), "an unarmed task");
        // Armed: its task bit and the task doorbell, not the device's.
        own.arm_waiter(70, Wake::Arrivals);
        own.arm_waiter(71, Wake::Anything);
        peer.notify(70, &PeerWaiter::Task, true);
        peer.notify(71, &PeerWaiter::Task, false);
        assert_eq!(task_bell.take(), 1, "two tasks' news before a dispatch: one ring");
        assert_eq!(device_bell.take(), 0, "the device was rung for a waiting task");
        own.rearm_task_ring();
        assert_eq!(own.take_tasks(1), 0b1100_0000, "slots 70 and 71 not named");
        assert_eq!(own.take_tasks(1), 0, "task bits taken twice");
        // After the dispatch cleared the pending ring, the next news rings again.
        own.arm_waiter(70, Wake::Arrivals);
        peer.notify(70, &PeerWaiter::Task, false);
        assert_eq!(task_bell.take(), 0, "an acknowledgement rang a reading task");
        peer.notify(70, &PeerWaiter::Task, true);
        assert_eq!((task_bell.take(), own.take_tasks(1)), (1, 1 << 6), "no ring after the dispatch");
        assert_eq!(own.take_tasks(2), 0, "word past the end");
    }

    #[test]
    fn a_held_task_ring_is_not_rung_until_rearmed() {
        let (own, peer, device_bell, task_bell) = area_with_task_doorbell();
        own.announce(state_value(3, true, false));
        // A spinning dispatch holds the ring: news sets the task bit, rings nothing.
        own.hold_task_ring();
        own.arm_waiter(5, Wake::Arrivals);
        peer.notify(5, &PeerWaiter::Task, true);
        assert_eq!((task_bell.take(), device_bell.take()), (0, 0), "rung while held");
        assert_eq!(own.take_tasks(0), 1 << 5, "the held news was not marked");
        // Still held after a look.
        own.arm_waiter(5, Wake::Arrivals);
        peer.notify(5, &PeerWaiter::Task, true);
        assert_eq!(task_bell.take(), 0, "rung while held, after a look");
        // The spin's end re-arms it: the bit set meanwhile is there, the next news rings.
        own.rearm_task_ring();
        assert_eq!(own.take_tasks(0), 1 << 5, "news during the spin lost");
        own.arm_waiter(5, Wake::Arrivals);
        peer.notify(5, &PeerWaiter::Task, true);
        assert_eq!((task_bell.take(), own.take_tasks(0)), (1, 1 << 5), "no ring once re-armed");
    }

    #[test]
    fn links_to_one_device_share_its_mapping() {
        let own = OwnArea::create(64).expect("area");
        let areas = PeerAreas::default();
        let first = areas.get(&peer_memfd(&own), bell(), bell()).expect("first");
        let second = areas.get(&peer_memfd(&own), bell(), bell()).expect("second");
        assert!(Arc::ptr_eq(&first, &second), "mapped twice");
        let other = OwnArea::create(64).expect("another device's area");
        let third = areas.get(&peer_memfd(&other), bell(), bell()).expect("third");
        assert!(!Arc::ptr_eq(&first, &third), "two devices' areas confused");
        drop((first, second));
        let again = areas.get(&peer_memfd(&own), bell(), bell()).expect("remapped");
        assert!(!Arc::ptr_eq(&again, &third));
    }

    #[test]
    fn areas_of_impossible_sizes_are_refused() {
        for len in [0, BITS_OFFSET as u64, area_len(MAX_SLOTS) as u64 + 8] {
            let memfd = Memfd::create("lightpath-shm-test", len.max(1)).expect("memfd");
            let fd = memfd.as_fd().try_clone_to_owned().expect("dup");
            let received = Memfd::from_peer(fd, 1).expect("memfd");
            assert!(PeerArea::map(&received, bell(), bell()).is_err(), "an area of {len} bytes was mapped");
        }
        let memfd = Memfd::create("lightpath-shm-test", area_len(128) as u64 + 13).expect("memfd");
        let fd = memfd.as_fd().try_clone_to_owned().expect("dup");
        let area =
            PeerArea::map(&Memfd::from_peer(fd, 1).expect("memfd"), bell(), bell()).expect("a two-word area");
        assert!(area.has_slot(127) && !area.has_slot(128), "slots of a file with a partial word");
    }

    #[test]
    fn slot_counts_round_up_to_words() {
        assert_eq!(OwnArea::create(1).expect("area").slots(), 64);
        assert_eq!(OwnArea::create(65).expect("area").slots(), 128);
        assert_eq!(OwnArea::create(u32::MAX).expect("area").slots(), MAX_SLOTS);
    }
}
