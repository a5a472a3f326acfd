//! [`DeviceCore`]: the device's mutable state — its table of queue pairs (each behind a lock of
//! its own, [`QpCell`]), activity slots and sleepers — and which queue pairs a call looks at,
//! so that a call costs in proportion to the queue pairs that have something to do, not to all
//! of them. [`Tables`] holds what calls on one queue pair share with it without the device
//! lock: the region table and the agenda.
//!
//! A call looks at the queue pairs peers marked in the activity area (see
//! [`crate::activity`]), those the [`Agenda`] owes a look (records left over, an RNR deadline
//! passed), and, as a safety net for marks a hostile peer cleared, every queue pair at most
//! every [`FULL_SCAN_INTERVAL`]. A device with at most [`LOOK_EVERYWHERE_MAX`] queue pairs
//! looks at all of them on every call instead and tells peers not to mark. Work the
//! application starts (posting, connecting) is done in its own call.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use super::agenda::Agenda;
use super::{Event, IdMap, QpCore, Regions};
use crate::activity::area::OwnArea;
use crate::activity::{state_value, SLOTS_PER_WORD};

/// How often at most every queue pair is looked at, marked or not, while marks are in use:
/// the safety net for news whose mark was lost (only a hostile peer clears marks). Rare
/// enough that a thousand queue pairs cost ten thousand looks a second, whatever the call
/// rate.
pub(crate) const FULL_SCAN_INTERVAL: Duration = Duration::from_millis(100);
/// How soon a round that skipped a queue pair (another thread held it) wants another: a
/// waiter that ran the round sleeps no longer than this.
const SKIPPED_RETRY: Duration = Duration::from_micros(50);
/// Calls of [`DeviceCore::progress`] between two readings of the clock for that.
const CLOCK_EVERY: u32 = 256;
/// Up to this many queue pairs, a device looks at every one of them on every call and tells
/// peers not to mark (see [`crate::activity::LOOKS_EVERYWHERE`]): a look at a quiet queue pair
/// is a few cached loads, cheaper than the cache line a mark moves between the processes.
pub(crate) const LOOK_EVERYWHERE_MAX: usize = 4;

/// What a caller can learn without the device lock: whether a call would find anything to do.
/// An application polling an idle device then costs a few loads, not a lock round trip that
/// every other polling thread contends for.
#[derive(Debug, Default)]
pub(crate) struct Hints {
    /// Activity words covering the slots in use.
    words: AtomicUsize,
    /// The device looks everywhere (always, or once).
    local: AtomicBool,
    /// Looks are owed (the agenda is not empty).
    owed: AtomicBool,
    /// The device has at most [`LOOK_EVERYWHERE_MAX`] queue pairs.
    few: AtomicBool,
}

impl Hints {
    /// Whether the device has at most [`LOOK_EVERYWHERE_MAX`] queue pairs (a waiter then
    /// waits for one of few connections, not as the watcher of many; see `ShmCq::wait`).
    pub(crate) fn few_queue_pairs(&self) -> bool {
        self.few.load(Ordering::Relaxed)
    }

    /// Whether nothing is marked and no look is owed. Relaxed loads: news published just now
    /// may be missed, and is found by the caller's next call (pollers poll again; sleepers
    /// look under the lock after arming).
    pub(crate) fn nothing_to_do(&self, activity: &OwnArea) -> bool {
        !self.local.load(Ordering::Relaxed)
            && !self.owed.load(Ordering::Relaxed)
            && !activity.any_marked(self.words.load(Ordering::Relaxed))
    }
}

/// One queue pair's state behind its own lock (see the engine's lock order).
pub(crate) type QpCell = Mutex<QpCore>;

/// Locks a queue pair. The engine never panics while holding it by design; if a bug made it
/// do so, the state is still memory-safe to use, and refusing every later call would turn one
/// failed request into a dead connection.
pub(crate) fn lock_qp(cell: &QpCell) -> MutexGuard<'_, QpCore> {
    cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a call on one queue pair shares with the rest of the device without taking the device
/// lock: the region table (read by every call, written when regions come and go), the agenda
/// of owed looks, and what callers read without any lock.
#[derive(Debug)]
pub(crate) struct Tables {
    regions: RwLock<Regions>,
    agenda: Mutex<Agenda>,
    pub(crate) hints: Arc<Hints>,
    pub(crate) activity: Arc<OwnArea>,
}

impl Tables {
    pub(crate) fn new(activity: Arc<OwnArea>, hints: Arc<Hints>) -> Self {
        Self {
            regions: RwLock::new(Regions::default()),
            agenda: Mutex::new(Agenda::default()),
            hints,
            activity,
        }
    }

    /// The region table, for a call (taken before the queue pair's lock).
    pub(crate) fn regions(&self) -> RwLockReadGuard<'_, Regions> {
        self.regions.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The region table, to add or remove a region (with no queue pair locked).
    pub(crate) fn regions_mut(&self) -> RwLockWriteGuard<'_, Regions> {
        self.regions.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` on the agenda, then publishes whether looks are owed.
    fn with_agenda<R>(&self, f: impl FnOnce(&mut Agenda) -> R) -> R {
        let mut agenda = self.agenda.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let result = f(&mut agenda);
        let owed = !agenda.is_empty();
        if self.hints.owed.load(Ordering::Relaxed) != owed {
            self.hints.owed.store(owed, Ordering::Relaxed);
        }
        result
    }

    /// After a call worked on `qp` (locked): notes what it needs next (the agenda's lock only
    /// when it needs a look) and tells its waiter of new completions, unless that waiter is
    /// the one looking (`arming`).
    pub(crate) fn after_call(&self, qp: &mut QpCore, arming: Option<u32>) {
        if Agenda::wants(qp) {
            self.with_agenda(|agenda| agenda.note(qp));
        }
        tell_waiter(qp, &self.activity, arming);
    }
}

/// The device's mutable state.
#[derive(Debug)]
pub(crate) struct DeviceCore {
    pub(crate) qps: IdMap<Arc<QpCell>>,
    tables: Arc<Tables>,
    /// The queue pair in each activity slot (0: free; queue-pair numbers start at 2).
    slots: Vec<u32>,
    /// Free slots below `slots.len()`.
    free_slots: BTreeSet<u32>,
    /// The device has few queue pairs and looks at every one on every call.
    everywhere: bool,
    /// The next call looks at every queue pair (the device just stopped doing so always).
    everywhere_once: bool,
    /// When every queue pair was last looked at while marks were in use.
    last_full_scan: Instant,
    /// Calls since the clock was last read for that.
    since_clock: u32,
    /// Queue pairs looked at, and looks at all of them while marks were in use (the safety
    /// net), since the device opened (for tests).
    pub(crate) looks: u64,
    pub(crate) full_scans: u64,
    /// Threads sleeping until a peer rings (the driver thread, blocked waiters).
    sleepers: u32,
    /// Counts sleeps, so each one has its own state value.
    epoch: u64,
    next_qpn: u32,
}

impl DeviceCore {
    pub(crate) fn new(tables: Arc<Tables>) -> Self {
        let core = Self {
            qps: IdMap::default(),
            tables,
            slots: Vec::new(),
            free_slots: BTreeSet::new(),
            everywhere: true,
            everywhere_once: false,
            last_full_scan: Instant::now(),
            since_clock: 0,
            looks: 0,
            full_scans: 0,
            sleepers: 0,
            epoch: 0,
            next_qpn: 2,
        };
        core.announce_state();
        core.publish_hints();
        core
    }

    /// A queue-pair number not in use (2 … 2^24 − 1; 0 and 1 are reserved in verbs).
    pub(crate) fn alloc_qpn(&mut self) -> Option<u32> {
        for _ in 0..(1u32 << 24) {
            let qpn = self.next_qpn;
            self.next_qpn = if qpn >= 0xFF_FFFF { 2 } else { qpn + 1 };
            if !self.qps.contains_key(&qpn) {
                return Some(qpn);
            }
        }
        None
    }

    /// A free activity slot for queue pair `qpn` (the lowest numbers are reused first, so the
    /// words a call looks at stay few); `None` when the area is full.
    pub(crate) fn alloc_slot(&mut self, qpn: u32) -> Option<u32> {
        let slot = match self.free_slots.pop_first() {
            Some(slot) => slot,
            None => {
                let slot =
                    u32::try_from(self.slots.len()).ok().filter(|&s| s < self.tables.activity.slots())?;
                self.slots.push(0);
                slot
            }
        };
        self.slots[slot as usize] = qpn;
        self.publish_hints();
        Some(slot)
    }

    /// Adds a queue pair (its slot from [`DeviceCore::alloc_slot`]); returns its cell, which
    /// its handle keeps for calls that take only its lock.
    pub(crate) fn insert_qp(&mut self, qp: QpCore) -> Arc<QpCell> {
        let qpn = qp.qpn;
        let cell = Arc::new(Mutex::new(qp));
        self.qps.insert(qpn, Arc::clone(&cell));
        self.update_mode();
        cell
    }

    /// Removes queue pair `qpn` and frees its slot. A peer may still mark the slot for a while
    /// (it learns of the end through its socket): at worst the slot's next owner gets one look
    /// for nothing.
    pub(crate) fn remove_qp(&mut self, qpn: u32) -> Option<Arc<QpCell>> {
        let qp = self.qps.remove(&qpn)?;
        let slot = lock_qp(&qp).slot;
        if let Some(entry) = self.slots.get_mut(slot as usize).filter(|entry| **entry == qpn) {
            *entry = 0;
            self.free_slots.insert(slot);
        }
        // The table shrinks from its end, so calls look at as few activity words as queue
        // pairs need.
        while self.slots.last() == Some(&0) {
            self.slots.pop();
            self.free_slots.remove(&(self.slots.len() as u32));
        }
        self.update_mode();
        self.publish_hints();
        Some(qp)
    }

    /// Runs `f` on queue pair `qpn` (locking it), then notes what it needs next.
    pub(crate) fn with_qp<R>(&mut self, qpn: u32, f: impl FnOnce(&mut QpCore, &Regions) -> R) -> Option<R> {
        let cell = self.qps.get(&qpn)?;
        let regions = self.tables.regions();
        let mut qp = lock_qp(cell);
        let result = f(&mut qp, &regions);
        self.tables.after_call(&mut qp, None);
        Some(result)
    }

    /// Looks at every queue pair on every call while there are few, relies on marks otherwise
    /// (see [`LOOK_EVERYWHERE_MAX`]), and tells peers which.
    fn update_mode(&mut self) {
        let everywhere = self.qps.len() <= LOOK_EVERYWHERE_MAX;
        if everywhere == self.everywhere {
            return;
        }
        self.everywhere = everywhere;
        // Peers that saw the old state did not mark what they published: one look at
        // everything, after the announcement, finds it.
        self.everywhere_once = !everywhere;
        self.announce_state();
        self.publish_hints();
    }

    /// Publishes whether anyone sleeps and whether the device looks everywhere.
    fn announce_state(&self) {
        self.tables.activity.announce(state_value(self.epoch, self.sleepers > 0, self.everywhere));
    }

    /// Moves forward every queue pair that has something to do; returns the earliest time one
    /// needs attention again.
    pub(crate) fn progress(&mut self) -> Option<Instant> {
        self.since_clock += 1;
        if self.since_clock >= CLOCK_EVERY {
            return self.progress_checking_clock();
        }
        let everything = self.everywhere || self.everywhere_once;
        self.progress_with(everything)
    }

    /// As [`DeviceCore::progress`], also looking at every queue pair if that is due (see
    /// [`FULL_SCAN_INTERVAL`]). For a waiter whose wait ran out without a ring too: while
    /// everyone sleeps, no call counts towards the next clock reading.
    pub(crate) fn progress_checking_clock(&mut self) -> Option<Instant> {
        self.since_clock = 0;
        let due = self.last_full_scan.elapsed() >= FULL_SCAN_INTERVAL;
        let everything = self.everywhere || self.everywhere_once || due;
        self.progress_with(everything)
    }

    fn progress_with(&mut self, everything: bool) -> Option<Instant> {
        let tables = Arc::clone(&self.tables);
        let regions = tables.regions();
        let skipped =
            if everything { self.look_everywhere(&regions) } else { self.progress_marked(&regions) };
        self.progress_ready(&regions);
        let next = self.progress_timers(&regions);
        self.publish_hints();
        if skipped {
            let retry = Instant::now() + SKIPPED_RETRY;
            return Some(next.map_or(retry, |next| next.min(retry)));
        }
        next
    }

    /// Locks queue pair `cell` for a round of progress unless another thread holds it (its
    /// owner posting or looking at it alone, which will not take long): then its slot is
    /// marked again, for the next round, and `None` says so. A round does not queue up behind
    /// the connections it passes by.
    fn try_lock_for_round<'c>(&self, cell: &'c QpCell, slot: u32) -> Option<MutexGuard<'c, QpCore>> {
        let qp = super::try_lock(cell);
        if qp.is_none() {
            self.tables.activity.mark(slot);
        }
        qp
    }

    /// Moves forward the queue pair in `slot` (number `qpn`), unless another thread holds it
    /// (see [`DeviceCore::try_lock_for_round`]); returns whether it passed it by.
    fn look_at_slot(&mut self, slot: usize, qpn: u32, regions: &Regions) -> bool {
        let Some(cell) = self.qps.get(&qpn) else { return false };
        let Some(mut qp) = self.try_lock_for_round(cell, slot as u32) else { return true };
        self.looks += 1;
        qp.progress(regions);
        self.tables.after_call(&mut qp, None);
        false
    }

    /// Looks at every queue pair, marked or not: always while the device has few, else as the
    /// safety net for lost marks. Returns whether it passed one by (another thread held it).
    fn look_everywhere(&mut self, regions: &Regions) -> bool {
        if !self.everywhere {
            self.last_full_scan = Instant::now();
            self.full_scans += 1;
        }
        self.everywhere_once = false;
        // The marks are taken first, as a call that finds them would (a mark past the slots
        // in use is for a queue pair that is gone).
        for index in 0..self.words_in_use() {
            self.tables.activity.take(index);
        }
        let mut skipped = false;
        for slot in 0..self.slots.len() {
            skipped |= self.look_at_slot(slot, self.slots[slot], regions);
        }
        skipped
    }

    /// Activity words covering the slots in use.
    fn words_in_use(&self) -> usize {
        self.slots.len().div_ceil(SLOTS_PER_WORD as usize)
    }

    /// The queue pairs peers marked. Returns whether it passed one by (another thread held it).
    fn progress_marked(&mut self, regions: &Regions) -> bool {
        let mut skipped = false;
        for index in 0..self.words_in_use() {
            let mut bits = self.tables.activity.take(index);
            while bits != 0 {
                let slot = index * SLOTS_PER_WORD as usize + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                // A mark on a free slot (its queue pair is gone) or a slot past the table (a
                // hostile peer) is nothing to do.
                match self.slots.get(slot) {
                    Some(&qpn) if qpn != 0 => skipped |= self.look_at_slot(slot, qpn, regions),
                    _ => {}
                }
            }
        }
        skipped
    }

    /// The queue pairs that stopped with records left.
    fn progress_ready(&mut self, regions: &Regions) {
        for qpn in self.tables.with_agenda(Agenda::take_ready) {
            self.progress_qp(qpn, regions, |qp| {
                qp.queued = false;
                true
            });
        }
    }

    /// The queue pairs whose RNR deadline passed; returns the next deadline.
    fn progress_timers(&mut self, regions: &Regions) -> Option<Instant> {
        if !self.tables.with_agenda(|agenda| agenda.has_timers()) {
            return None;
        }
        let now = Instant::now();
        while let Some((at, qpn)) = self.tables.with_agenda(|agenda| agenda.pop_due(now)) {
            self.progress_qp(qpn, regions, |qp| {
                let due = qp.timer == Some(at);
                if due {
                    qp.timer = None;
                }
                due
            });
        }
        self.tables.with_agenda(|agenda| agenda.next_deadline())
    }

    /// Moves queue pair `qpn` forward (if it exists and `first`, given it locked, says so) and
    /// notes what it needs next.
    fn progress_qp(&mut self, qpn: u32, regions: &Regions, first: impl FnOnce(&mut QpCore) -> bool) {
        let Some(cell) = self.qps.get(&qpn) else { return };
        let mut qp = lock_qp(cell);
        if !first(&mut qp) {
            return;
        }
        self.looks += 1;
        qp.progress(regions);
        self.tables.after_call(&mut qp, None);
    }

    /// Updates what callers see without the lock (see [`Hints`]), writing only what changed:
    /// every polling thread reads these.
    fn publish_hints(&self) {
        let words = self.words_in_use();
        if self.tables.hints.words.load(Ordering::Relaxed) != words {
            self.tables.hints.words.store(words, Ordering::Relaxed);
        }
        let hints = &self.tables.hints;
        hints.few.store(self.everywhere, Ordering::Relaxed);
        let local = self.everywhere || self.everywhere_once;
        if hints.local.load(Ordering::Relaxed) != local {
            hints.local.store(local, Ordering::Relaxed);
        }
    }

    /// Applies something the socket thread learned.
    pub(crate) fn apply(&mut self, event: Event) {
        match event {
            Event::Attach(attach) => {
                let qpn = attach.qpn;
                self.with_qp(qpn, |qp, regions| qp.offer_attach(attach, regions));
            }
            Event::SocketClosed(id) => {
                let qpns: Vec<u32> = self.qps.keys().copied().collect();
                for qpn in qpns {
                    self.with_qp(qpn, |qp, regions| qp.socket_closed(id, regions));
                }
            }
            Event::PeerLeft { link, qpn, from_qpn } => {
                self.with_qp(qpn, |qp, regions| qp.peer_left(link, from_qpn, regions));
            }
        }
    }

    /// A thread is about to sleep: ask peers to ring (with a new state value, so peers that
    /// rang for an earlier sleep ring again). The caller must look for work once more before
    /// it blocks.
    pub(crate) fn arm(&mut self) {
        self.sleepers += 1;
        self.epoch += 1;
        self.announce_state();
    }

    /// A sleeper woke up; when none is left, peers stop ringing. While others still sleep
    /// they get a new state value: the doorbell this sleeper took may have been rung for them
    /// too, and peers ring only once per value.
    pub(crate) fn disarm(&mut self) {
        self.sleepers = self.sleepers.saturating_sub(1);
        if self.sleepers > 0 {
            self.epoch += 1;
        }
        self.announce_state();
    }
}

/// After a call on `qp`: if it made completions and a thread waits for it alone (its waiting
/// bit is set), writes its own doorbell (or wakes its task), unless that thread is the one
/// looking (`arming`).
/// The fence pairs with the waiter's (`arm_waiter`): it stores its bit, fences and then looks
/// at the queue; this call added the completions, fences and then loads the bit. Either the
/// waiter's look finds them or this sees the bit.
fn tell_waiter(qp: &mut QpCore, activity: &OwnArea, arming: Option<u32>) {
    let arrival = std::mem::take(&mut qp.completed_arrival);
    if !std::mem::take(&mut qp.completed) || arming == Some(qp.qpn) {
        return;
    }
    if let Some(fd) = &qp.waiter_fd {
        crate::sync::fence(crate::sync::Ordering::SeqCst);
        if activity.take_waiter(qp.slot, arrival) {
            // Fails only if the counter would overflow: it is readable anyway.
            let _ = rustix::io::write(&**fd, &1u64.to_ne_bytes());
        }
    } else if let Some(wake) = &qp.waiter_task {
        crate::sync::fence(crate::sync::Ordering::SeqCst);
        if activity.take_waiter(qp.slot, arrival) {
            (wake.0)();
        }
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::QpCaps;

    use super::*;
    use crate::activity::LOOKS_EVERYWHERE;
    use crate::cq::CqShared;

    fn device() -> (Arc<OwnArea>, DeviceCore) {
        let area = Arc::new(OwnArea::create(256).expect("area"));
        let core = DeviceCore::new(Arc::new(Tables::new(Arc::clone(&area), Arc::new(Hints::default()))));
        (area, core)
    }

    /// Adds queue pair `qpn`; returns its slot.
    fn add(core: &mut DeviceCore, qpn: u32) -> u32 {
        let cq = Arc::new(CqShared::new(16).expect("cq"));
        let slot = core.alloc_slot(qpn).expect("a free slot");
        core.insert_qp(QpCore::new(qpn, slot, 1, QpCaps::default(), Arc::clone(&cq), cq, 0));
        slot
    }

    #[test]
    fn slots_are_dense_reused_lowest_first_and_shrink_from_the_end() {
        let (_, mut core) = device();
        let slots: Vec<u32> = (10..16).map(|qpn| add(&mut core, qpn)).collect();
        assert_eq!(slots, [0, 1, 2, 3, 4, 5]);
        for qpn in [12, 11] {
            assert!(core.remove_qp(qpn).is_some());
        }
        assert_eq!(add(&mut core, 20), 1, "the lowest free slot first");
        assert_eq!(add(&mut core, 21), 2);
        for qpn in [13, 14, 15, 21] {
            assert!(core.remove_qp(qpn).is_some());
        }
        assert_eq!(core.slots, [10, 20], "free slots at the end of the table are dropped");
        assert!(core.free_slots.is_empty(), "{:?}", core.free_slots);
        assert!(core.remove_qp(99).is_none());
    }

    #[test]
    fn past_a_few_queue_pairs_the_device_relies_on_marks_and_says_so() {
        let (area, mut core) = device();
        for qpn in 2..2 + LOOK_EVERYWHERE_MAX as u32 {
            add(&mut core, qpn);
        }
        assert!(core.everywhere && area.state() & LOOKS_EVERYWHERE != 0);
        add(&mut core, 100);
        assert!(!core.everywhere && area.state() & LOOKS_EVERYWHERE == 0, "state {:#x}", area.state());
        assert!(core.everywhere_once, "no look at everything after the switch");
        core.progress();
        assert_eq!(core.looks, LOOK_EVERYWHERE_MAX as u64 + 1, "the look at everything");
        assert!(!core.everywhere_once);

        // Marks: one on a queue pair, one on a free slot, one past the table.
        area.mark(2);
        area.mark(200);
        area.mark(60);
        core.progress();
        assert_eq!(core.looks, LOOK_EVERYWHERE_MAX as u64 + 2, "looked at more than the marked queue pair");
        core.progress();
        assert_eq!(core.looks, LOOK_EVERYWHERE_MAX as u64 + 2, "a mark was taken twice");

        core.remove_qp(100);
        assert!(core.everywhere && area.state() & LOOKS_EVERYWHERE != 0, "back to looking everywhere");
    }

    #[test]
    fn the_hints_say_whether_the_device_has_few_queue_pairs() {
        let area = Arc::new(OwnArea::create(256).expect("area"));
        let hints = Arc::new(Hints::default());
        let mut core = DeviceCore::new(Arc::new(Tables::new(area, Arc::clone(&hints))));
        assert!(hints.few_queue_pairs(), "a new device");
        for qpn in 2..2 + LOOK_EVERYWHERE_MAX as u32 {
            add(&mut core, qpn);
        }
        assert!(hints.few_queue_pairs());
        add(&mut core, 100);
        assert!(!hints.few_queue_pairs(), "past LOOK_EVERYWHERE_MAX");
        core.remove_qp(100);
        assert!(hints.few_queue_pairs(), "back to few");
    }

    #[test]
    fn sleeping_is_announced_with_a_new_value_for_each_sleep() {
        let (area, mut core) = device();
        let awake = area.state();
        assert_eq!(awake & crate::activity::SLEEPING, 0);
        core.arm();
        let first = area.state();
        core.arm();
        let second = area.state();
        assert!(first & second & crate::activity::SLEEPING != 0 && first != second);
        core.disarm();
        let third = area.state();
        assert!(third & crate::activity::SLEEPING != 0 && third != second, "one sleeper left, same value");
        core.disarm();
        assert_eq!(area.state() & crate::activity::SLEEPING, 0, "still sleeping with no sleeper");
    }
}
