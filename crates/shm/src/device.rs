//! [`ShmDevice`]: one shm endpoint of this process — a GID, the abstract socket it listens on,
//! a doorbell eventfd peers ring, an activity area peers mark (see [`crate::activity`]), the
//! engine behind a lock, and two helper threads (see [`crate::helper`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lightpath_verbs::{
    AccessFlags, Device, DeviceAttr, Error, Gid, Mtu, PortAttr, PortState, Result, WorkCompletion,
};
use rustix::event::{PollFd, PollFlags};

use crate::activity::area::{OwnArea, PeerAreas};
use crate::address::{random_gid, rendezvous_name};
use crate::config::ShmConfig;
use crate::cq::{CqShared, ShmCq};
use crate::engine::{lock_qp, DeviceContext, DeviceCore, Event, Hints, QpCell, QpCore, Regions, Tables};
use crate::pd::ShmPd;
use crate::registry::SocketRegistry;
use crate::sys::{poll_fds, EventFd, Listener, Memfd};
use crate::wire::RegionOffer;

/// Of the application's calls that find nothing to do, one in this many takes the engine lock
/// anyway (see [`DeviceShared::drive`]).
const LOCKED_DRIVE_EVERY: u64 = 256;

/// A region other devices may ask about.
#[derive(Debug)]
pub(crate) struct ExportedRegion {
    /// What a peer maps; `None` once the one peer a region is shared with has it (see
    /// `MemoryRegion::share_with_first_peer_only`): later questions are refused.
    pub(crate) memfd: Option<Memfd>,
    /// Shared with the first peer that asks, and with no other.
    pub(crate) first_peer_only: bool,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
    pub(crate) pd: u32,
}

/// What the socket thread answers peers' questions from, without the engine lock (so a peer
/// blocked on an answer while holding its own lock can never deadlock with us).
#[derive(Debug, Default)]
pub(crate) struct Exports {
    /// Regions with some remote access, by rkey.
    pub(crate) regions: HashMap<u32, ExportedRegion>,
    /// The protection domain of each queue pair.
    pub(crate) qp_pds: HashMap<u32, u32>,
    /// A region shared with its first peer only and not handed out yet, per protection domain
    /// (by rkey): the next queue pair of that domain to reach RTR hands it over with its
    /// introduction (so the peer never has to ask, and the memfd goes at once).
    pub(crate) offers: HashMap<u32, u32>,
}

impl Exports {
    /// Takes protection domain `pd`'s offered region, with its memfd, out of the exports
    /// (later questions about it are refused, as after a first answer).
    pub(crate) fn take_offer(&mut self, pd: u32) -> Option<(RegionOffer, Memfd)> {
        let rkey = self.offers.remove(&pd)?;
        let region = self.regions.get_mut(&rkey)?;
        let memfd = region.memfd.take()?;
        let offer = RegionOffer { rkey, addr: region.addr, len: region.len, access: region.access.bits() };
        Some((offer, memfd))
    }

    /// Puts back an offer that did not go (the transition to RTR failed).
    pub(crate) fn return_offer(&mut self, pd: u32, offer: RegionOffer, memfd: Memfd) {
        if let Some(region) = self.regions.get_mut(&offer.rkey) {
            region.memfd = Some(memfd);
            self.offers.entry(pd).or_insert(offer.rkey);
        }
    }
}

/// Everything the device's objects and its helper threads share.
#[derive(Debug)]
pub(crate) struct DeviceShared {
    pub(crate) name: String,
    pub(crate) ctx: DeviceContext,
    pub(crate) core: Mutex<DeviceCore>,
    /// The region table and agenda, shared with calls that lock one queue pair only, and the
    /// hints that say without any lock whether the engine has anything to do.
    pub(crate) tables: Arc<Tables>,
    pub(crate) exports: Mutex<Exports>,
    /// Peer devices' activity areas, mapped once each (the socket thread maps them).
    pub(crate) peer_areas: PeerAreas,
    /// Events the socket thread learned, applied by whoever next holds the engine lock.
    mailbox: Mutex<Vec<Event>>,
    /// Bumped by every post and by every application of posted events, always with the
    /// mailbox locked (so a waiter that checks it under that lock misses no bump), and read
    /// without the lock by [`DeviceShared::mail_seen`] (a shm write asks on every call).
    mail_changes: AtomicU64,
    /// Signalled after a bump of `mail_changes` when `mail_waiters` says a thread waits for
    /// an event to take effect (see [`DeviceShared::wait_for_mail`]).
    mail_changed: Condvar,
    /// Threads in [`DeviceShared::wait_for_mail`], counted with the mailbox locked: a signal
    /// nobody waits for is still a `futex` system call, and every post and every application
    /// of posted events would pay it.
    mail_waiters: AtomicU32,
    mailbox_pending: AtomicBool,
    /// Rung by the socket thread after it posted an event, so the driver thread applies it
    /// even while the application is idle.
    pub(crate) events_bell: EventFd,
    pub(crate) listener: Listener,
    /// Stops both helper threads.
    pub(crate) stop: EventFd,
    /// Tells the driver thread the application is about to wait on a notification fd, so it
    /// takes over at once instead of after `idle_after`.
    pub(crate) kick: EventFd,
    /// Bumped by every application call that drives the device; the driver thread compares it
    /// between its rounds (cheaper on the hot path than reading a clock).
    drives: AtomicU64,
    next_key: AtomicU32,
    key_mask: u32,
    next_id: AtomicU32,
    /// Whether a thread blocked in `CompletionQueue::wait` watches the doorbell (see
    /// [`DeviceShared::sleep_until_rung`]).
    doorbell_watched: AtomicBool,
    /// The queues of the waiters sleeping on their own queue while another thread watches
    /// the doorbell, oldest first: a watcher that leaves wakes the first, which takes the
    /// watch over (see [`DeviceShared::sleep_until_rung`]).
    on_queue: Mutex<VecDeque<Arc<CqShared>>>,
    /// Entries of `on_queue`, read without its lock (the hand-over's common case is none).
    on_queue_len: AtomicU32,
    /// Threads spinning in `CompletionQueue::wait`, and how many may.
    spinners: AtomicU32,
    max_spinners: u32,
    /// How long waiters spin before they yield the core between looks.
    pub(crate) spin_policy: crate::cq::SpinPolicy,
    /// The wake-ups of queue pairs whose waiters are tasks, by activity slot (see
    /// [`DeviceShared::dispatch_tasks`]).
    task_wakes: Mutex<TaskWakes>,
}

/// The task wake-ups of a device's queue pairs, by activity slot (slots are dense, lowest
/// reused first).
#[derive(Default)]
struct TaskWakes {
    by_slot: Vec<Option<lightpath_verbs::TaskWake>>,
    /// How many entries of `by_slot` are set.
    registered: usize,
}

impl TaskWakes {
    /// Task-bit words that can have a bit set for a registered slot.
    fn words(&self) -> usize {
        self.by_slot.len().div_ceil(crate::activity::SLOTS_PER_WORD as usize)
    }
}

impl std::fmt::Debug for TaskWakes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let registered = self.by_slot.iter().filter(|wake| wake.is_some()).count();
        f.debug_struct("TaskWakes").field("registered", &registered).finish()
    }
}

/// A device's doorbell for tasks ([`lightpath_verbs::TaskDoorbell`]): the task doorbell
/// eventfd peers ring, and the dispatch of the task bits they set.
#[derive(Debug)]
pub(crate) struct ShmTaskDoorbell(pub(crate) Arc<DeviceShared>);

impl lightpath_verbs::TaskDoorbell for ShmTaskDoorbell {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.0.ctx.task_doorbell)
    }

    fn dispatch(&self) {
        self.0.dispatch_tasks();
    }

    fn take_rings(&self) -> bool {
        self.0.ctx.task_doorbell.take() > 0
    }

    fn tasks(&self) -> usize {
        self.0.task_wakes.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).registered
    }

    fn hold_rings(&self) {
        self.0.ctx.activity.hold_task_ring();
    }

    fn dispatch_held(&self) -> bool {
        self.0.dispatch_task_bits(false)
    }
}

impl DeviceShared {
    /// Calls `wake` when a peer rings the task doorbell for the queue pair in `slot` (see
    /// [`lightpath_verbs::QueuePair::set_waiter_task`]).
    pub(crate) fn register_task(&self, slot: u32, wake: lightpath_verbs::TaskWake) {
        let mut wakes = self.task_wakes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let slot = slot as usize;
        if wakes.by_slot.len() <= slot {
            wakes.by_slot.resize(slot + 1, None);
        }
        if wakes.by_slot[slot].replace(wake).is_none() {
            wakes.registered += 1;
        }
    }

    /// Forgets the task wake-up of `slot` (its queue pair is gone).
    pub(crate) fn unregister_task(&self, slot: u32) {
        let mut wakes = self.task_wakes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if wakes.by_slot.get_mut(slot as usize).and_then(Option::take).is_some() {
            wakes.registered -= 1;
        }
        while wakes.by_slot.last().is_some_and(Option::is_none) {
            wakes.by_slot.pop();
        }
    }

    /// Takes the task bits peers set and wakes the task of each slot named. A bit of a slot
    /// whose queue pair is gone, or reused by one that has no task, wakes nobody. The wake-ups
    /// run under the table's lock, which they never take (`TaskWake` must not call into the
    /// provider).
    pub(crate) fn dispatch_tasks(&self) {
        self.dispatch_task_bits(true);
    }

    /// [`DeviceShared::dispatch_tasks`], re-arming the task doorbell's ring first (`rearm`)
    /// or leaving it held (a spinning dispatch, see
    /// [`lightpath_verbs::TaskDoorbell::hold_rings`]); whether any bit was set.
    pub(crate) fn dispatch_task_bits(&self, rearm: bool) -> bool {
        let wakes = self.task_wakes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if rearm {
            self.ctx.activity.rearm_task_ring();
        }
        let mut any = false;
        for index in 0..wakes.words() {
            let mut bits = self.ctx.activity.take_tasks(index);
            any |= bits != 0;
            while bits != 0 {
                let slot = index * crate::activity::SLOTS_PER_WORD as usize + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(Some(wake)) = wakes.by_slot.get(slot) {
                    wake();
                }
            }
        }
        any
    }

    /// The engine, locked.
    pub(crate) fn lock_core(&self) -> MutexGuard<'_, DeviceCore> {
        // The engine never panics while holding the lock by design; if a bug made it do so,
        // the state is still memory-safe to use, and refusing every later call would turn one
        // failed request into a dead device.
        self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn lock_exports(&self) -> MutexGuard<'_, Exports> {
        self.exports.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_mailbox(&self) -> MutexGuard<'_, Vec<Event>> {
        self.mailbox.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues something the socket thread learned, rings the driver thread and wakes the
    /// application threads waiting for mail.
    pub(crate) fn post_event(&self, event: Event) {
        let mut mailbox = self.lock_mailbox();
        mailbox.push(event);
        self.mailbox_pending.store(true, Ordering::Release);
        self.mail_changed_locked(mailbox);
        self.events_bell.signal(1);
    }

    /// Bumps `mail_changes` with the mailbox locked (by `mailbox`), then wakes the threads
    /// waiting for mail, if any.
    fn mail_changed_locked(&self, mailbox: MutexGuard<'_, Vec<Event>>) {
        self.mail_changes.fetch_add(1, Ordering::Release);
        let waiters = self.mail_waiters.load(Ordering::Relaxed);
        drop(mailbox);
        if waiters > 0 {
            self.mail_changed.notify_all();
        }
    }

    /// How often mail was posted or applied so far: read before a look that may find the
    /// result of an event missing, then handed to [`DeviceShared::wait_for_mail`].
    pub(crate) fn mail_seen(&self) -> u64 {
        self.mail_changes.load(Ordering::Acquire)
    }

    /// Blocks until mail is posted or applied after `seen` changes (at once if it was
    /// already) or `timeout` passes. Both count: the caller's next look applies what was posted
    /// (every engine call does first), and what another thread took out of the mailbox is in
    /// effect once that thread says it applied it.
    pub(crate) fn wait_for_mail(&self, seen: u64, timeout: Duration) {
        let mailbox = self.lock_mailbox();
        self.mail_waiters.fetch_add(1, Ordering::Relaxed);
        let (mailbox, _) = self
            .mail_changed
            .wait_timeout_while(mailbox, timeout, |_| self.mail_changes.load(Ordering::Acquire) == seen)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.mail_waiters.fetch_sub(1, Ordering::Relaxed);
        drop(mailbox);
    }

    /// Whether the socket thread queued events not yet applied.
    pub(crate) fn has_events(&self) -> bool {
        self.mailbox_pending.load(Ordering::Relaxed)
    }

    /// Applies queued events (with the engine locked).
    pub(crate) fn apply_events(&self, core: &mut DeviceCore) {
        if !self.mailbox_pending.load(Ordering::Relaxed)
            || !self.mailbox_pending.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let events = std::mem::take(&mut *self.lock_mailbox());
        for event in events {
            core.apply(event);
        }
        self.mail_changed_locked(self.lock_mailbox());
    }

    /// Notes that the application is driving the device (so the driver thread stays out);
    /// returns the new count. Not an atomic increment: concurrent callers may lose a count, but
    /// any change is all the driver thread looks for.
    pub(crate) fn touch(&self) -> u64 {
        let drives = self.drives.load(Ordering::Relaxed).wrapping_add(1);
        self.drives.store(drives, Ordering::Relaxed);
        drives
    }

    /// The drive counter (see [`DeviceShared::touch`]).
    pub(crate) fn drives(&self) -> u64 {
        self.drives.load(Ordering::Relaxed)
    }

    /// One round of work for the application: apply events, move forward the queue pairs that
    /// have something to do.
    pub(crate) fn drive(&self) {
        self.drive_waiting(true);
    }

    /// As [`DeviceShared::drive`], unless another thread holds the engine lock: that thread
    /// is working for the device (a caller whose own queue pairs were just looked at loses
    /// nothing by not queueing up behind it, and polls again anyway).
    pub(crate) fn try_drive(&self) {
        self.drive_waiting(false);
    }

    /// [`DeviceShared::drive`] (`wait`: for the engine lock) or [`DeviceShared::try_drive`].
    fn drive_waiting(&self, wait: bool) {
        let drives = self.touch();
        if self.idle(drives) {
            return;
        }
        let core = if wait { Some(self.lock_core()) } else { crate::engine::try_lock(&self.core) };
        let Some(mut core) = core else { return };
        self.apply_events(&mut core);
        core.progress();
    }

    /// Applies what the socket thread learned, if anything (only then taking the engine lock):
    /// for calls that otherwise lock one queue pair only.
    pub(crate) fn apply_pending_events(&self) {
        if self.has_events() {
            let mut core = self.lock_core();
            self.apply_events(&mut core);
        }
    }

    /// Moves the queue pair `cell` forward alone, under its own lock (the device lock only to
    /// apply pending events first): takes its mark, reads what its peer published (a few
    /// batches at most) and notes what it needs next. `arming`: the caller is the queue pair's
    /// waiter taking its last look before it sleeps (it needs no ring of its own doorbell for
    /// what it finds). Counts as the application driving the device.
    pub(crate) fn progress_alone(&self, cell: &QpCell, arming: bool) {
        /// Batches read in one go while records are left.
        const ROUNDS: usize = 8;
        self.with_qp_alone(cell, arming, |qp, regions| {
            self.ctx.activity.take_slot(qp.slot);
            for _ in 0..ROUNDS {
                qp.progress(regions);
                if !qp.more_to_read {
                    break;
                }
            }
        });
    }

    /// Runs `f` on the queue pair `cell` with that queue pair locked, not the device (after
    /// applying what the socket thread learned, which takes the device lock only when there is
    /// some); `f` also gets the region table. Afterwards notes what the queue pair needs next
    /// and tells its waiter of new completions, unless `arming` (see `Tables::after_call`).
    /// Counts as the application driving the device.
    pub(crate) fn with_qp_alone<R>(
        &self,
        cell: &QpCell,
        arming: bool,
        f: impl FnOnce(&mut QpCore, &Regions) -> R,
    ) -> R {
        self.touch();
        self.apply_pending_events();
        let regions = self.tables.regions();
        let mut qp = lock_qp(cell);
        let result = f(&mut qp, &regions);
        let qpn = qp.qpn;
        self.tables.after_call(&mut qp, arming.then_some(qpn));
        result
    }

    /// Whether a call that drives the device (the `drives`-th) may skip the engine: no marks,
    /// no local work and no events, except now and then (a call under the lock counts towards
    /// the look at every queue pair that finds lost marks).
    pub(crate) fn idle(&self, drives: u64) -> bool {
        !drives.is_multiple_of(LOCKED_DRIVE_EVERY)
            && !self.has_events()
            && self.tables.hints.nothing_to_do(&self.ctx.activity)
    }

    /// A fresh local key, and the matching remote key (distinct values, unique per device).
    pub(crate) fn alloc_keys(&self) -> (u32, u32) {
        let lkey = self.next_key.fetch_add(1, Ordering::Relaxed);
        (lkey, lkey ^ self.key_mask)
    }

    /// A fresh id for a protection domain.
    pub(crate) fn alloc_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A place among the spinning waiters, if one is free (see [`ShmConfig::spin`]).
    pub(crate) fn start_spinning(&self) -> Option<Spinning<'_>> {
        let taken = self.spinners.fetch_add(1, Ordering::Relaxed) < self.max_spinners;
        // The guard is made either way: without a free place, dropping it at once undoes the
        // count.
        let spinning = Spinning(&self.spinners);
        taken.then_some(spinning)
    }

    /// Blocks a `wait` caller until a peer rings the doorbell, a completion lands on `cq`, or
    /// `timeout` passes; returns the completions found.
    pub(crate) fn sleep_until_rung(
        &self,
        cq: &Arc<CqShared>,
        out: &mut [WorkCompletion],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        // One blocked thread watches the doorbell and drives arrivals; the others sleep on
        // their own queue's wake-up, which the watcher signals as their completions land. With
        // every sleeper on the doorbell, each ring woke them all: a thousand blocked
        // connections, a thousand wake-ups. A watcher that leaves wakes the oldest of the
        // others, which takes the watch over: else news that came after the watcher's last
        // look waited for the driver thread to find the application idle (`idle_after`), or,
        // with the driver kept out, for the sleeper's own timeout (a blocked waiter of 8 on a
        // device with 40 queue pairs slept through its completion for its whole 30 s wait in
        // about one run in fifteen of `blocked_waiters_on_many_queue_pairs_each_get_theirs`).
        loop {
            if self
                .doorbell_watched
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                break;
            }
            {
                let mut list = self.on_queue();
                list.push_back(Arc::clone(cq));
                self.on_queue_len.store(list.len() as u32, Ordering::SeqCst);
            }
            // Listed first, then the flag looked at again (both sequentially consistent, as the
            // watcher's clearing of the flag and its look at the list length are): a watcher
            // that left before this thread was listed gave the flag back before it looked, so
            // this thread sees the flag free and tries again.
            if self.doorbell_watched.load(Ordering::SeqCst) {
                let result = self.sleep_on_queue(cq, out, timeout);
                self.leave_queue_list(cq);
                return result;
            }
            self.leave_queue_list(cq);
        }
        // Made only by the thread that won the flag: the guard's drop gives the flag back and
        // wakes the oldest waiter on its own queue, if any.
        let _watch = DoorbellWatch(self);
        let deadline = {
            let mut core = self.lock_core();
            self.apply_events(&mut core);
            core.arm();
            let deadline = core.progress();
            let count = cq.pop(out);
            if count > 0 {
                core.disarm();
                return Ok(count);
            }
            deadline
        };
        let until_timer = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let timeout = match (timeout, until_timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let wake = cq.wake().map_err(Error::Io)?;
        let mut fds = [PollFd::new(&self.ctx.doorbell, PollFlags::IN), PollFd::new(wake, PollFlags::IN)];
        let result = poll_fds(&mut fds, timeout);
        self.ctx.doorbell.take();
        wake.take();
        let mut core = self.lock_core();
        core.disarm();
        self.apply_events(&mut core);
        if matches!(result, Ok(0)) {
            // Nothing rang for a whole wait: a mark may have been lost.
            core.progress_checking_clock();
        } else {
            core.progress();
        }
        drop(core);
        result?;
        Ok(cq.pop(out))
    }

    fn on_queue(&self) -> MutexGuard<'_, VecDeque<Arc<CqShared>>> {
        // A list of queues; a holder that panicked left it consistent.
        self.on_queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// While nobody watches the doorbell, wakes the oldest waiter sleeping on its own queue
    /// (one spurious wake-up of that queue), which comes back to `sleep_until_rung` and takes
    /// the watch. Called by a watcher that gives the watch back, and by every waiter leaving
    /// `CompletionQueue::wait`: a waiter so woken that then found its completion leaves
    /// without watching, and must pass the hand-over on.
    pub(crate) fn hand_over_watch(&self) {
        if self.doorbell_watched.load(Ordering::SeqCst) || self.on_queue_len.load(Ordering::SeqCst) == 0 {
            return;
        }
        let next = self.on_queue().front().cloned();
        if let Some(cq) = next {
            if let Ok(wake) = cq.wake() {
                wake.signal(1);
            }
        }
    }

    /// Takes `cq` (one entry of it) off the list of queues whose waiters sleep on them alone.
    fn leave_queue_list(&self, cq: &Arc<CqShared>) {
        let mut list = self.on_queue();
        if let Some(at) = list.iter().position(|listed| Arc::ptr_eq(listed, cq)) {
            list.remove(at);
        }
        self.on_queue_len.store(list.len() as u32, Ordering::SeqCst);
    }

    /// Sleeps on the queue's own wake-up only (the doorbell has a watcher).
    fn sleep_on_queue(
        &self,
        cq: &CqShared,
        out: &mut [WorkCompletion],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let deadline = {
            let mut core = self.lock_core();
            self.apply_events(&mut core);
            let deadline = core.progress();
            let count = cq.pop(out);
            if count > 0 {
                return Ok(count);
            }
            deadline
        };
        let until_timer = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let timeout = match (timeout, until_timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let wake = cq.wake().map_err(Error::Io)?;
        let mut fds = [PollFd::new(wake, PollFlags::IN)];
        let result = poll_fds(&mut fds, timeout);
        wake.take();
        result?;
        Ok(cq.pop(out))
    }
}

/// A waiter's place among the spinners, given back when dropped.
pub(crate) struct Spinning<'a>(&'a AtomicU32);

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Held by the thread that watches the doorbell while it sleeps (see
/// [`DeviceShared::sleep_until_rung`]).
struct DoorbellWatch<'a>(&'a DeviceShared);

impl Drop for DoorbellWatch<'_> {
    /// Gives the watch back, then hands it over (see [`DeviceShared::hand_over_watch`]).
    /// The flag is cleared before the list is read: a waiter listed after that read sees
    /// the flag free (it looks after listing itself).
    fn drop(&mut self) {
        self.0.doorbell_watched.store(false, Ordering::SeqCst);
        self.0.hand_over_watch();
    }
}

/// The device as its objects hold it: the shared part plus the helper threads, which are
/// stopped and joined when the last object goes.
#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) shared: Arc<DeviceShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // The stop fd is never taken, so it stays readable for both threads.
        self.shared.stop.signal(1);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// An shm device: verbs between processes of one host through shared memory.
///
/// Cloning gives another handle to the same device. Opening a device picks a fresh random GID
/// (see [`crate::address`]), so every opened device is a distinct endpoint; peers reach it by
/// that GID.
#[derive(Clone, Debug)]
pub struct ShmDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

impl ShmDevice {
    /// Opens a device with `config`.
    pub fn open(config: ShmConfig) -> Result<Self> {
        config.validate().map_err(Error::InvalidAttribute)?;
        let name = config.name.clone().unwrap_or_else(|| "shm".to_string());
        let (gid, listener) = bind_fresh_gid()?;
        let activity = Arc::new(OwnArea::create(config.max_qps)?);
        let tables = Arc::new(Tables::new(Arc::clone(&activity), Arc::new(Hints::default())));
        let spin_policy = crate::cq::SpinPolicy::new(config.spin);
        let ctx = DeviceContext {
            gid,
            uid: rustix::process::getuid().as_raw(),
            config,
            doorbell: EventFd::new(false)?,
            task_doorbell: EventFd::new(false)?,
            activity,
            registry: Arc::new(SocketRegistry::new()?),
            links: crate::engine::Links::default(),
        };
        let shared = Arc::new(DeviceShared {
            name,
            ctx,
            core: Mutex::new(DeviceCore::new(Arc::clone(&tables))),
            tables,
            exports: Mutex::new(Exports::default()),
            peer_areas: PeerAreas::default(),
            mailbox: Mutex::new(Vec::new()),
            mail_changes: AtomicU64::new(0),
            mail_changed: Condvar::new(),
            mail_waiters: AtomicU32::new(0),
            mailbox_pending: AtomicBool::new(false),
            events_bell: EventFd::new(false)?,
            listener,
            stop: EventFd::new(false)?,
            kick: EventFd::new(false)?,
            drives: AtomicU64::new(0),
            next_key: AtomicU32::new(0x100),
            key_mask: (crate::sys::random_u64() as u32) | 0x8000_0000,
            next_id: AtomicU32::new(1),
            doorbell_watched: AtomicBool::new(false),
            on_queue: Mutex::new(VecDeque::new()),
            on_queue_len: AtomicU32::new(0),
            spinners: AtomicU32::new(0),
            spin_policy,
            max_spinners: (lightpath_verbs::available_cores() / 2).max(1) as u32,
            task_wakes: Mutex::new(TaskWakes::default()),
        });
        let threads = crate::helper::start(&shared)?;
        Ok(Self { inner: Arc::new(DeviceInner { shared, threads }) })
    }

    /// The device's GID: also its address (see [`crate::address::rendezvous_name`]).
    pub fn gid(&self) -> Gid {
        self.inner.shared.ctx.gid
    }

    /// The configuration in force.
    pub fn config(&self) -> &ShmConfig {
        &self.inner.shared.ctx.config
    }

    /// Queue pairs currently open on this device.
    pub fn qp_count(&self) -> usize {
        self.inner.shared.lock_core().qps.len()
    }
}

/// Binds the rendezvous socket of a new random GID (retrying on the astronomically unlikely
/// collision with another device).
fn bind_fresh_gid() -> Result<(Gid, Listener)> {
    let mut last_error = None;
    for _ in 0..8 {
        let gid = random_gid()?;
        match Listener::bind_abstract(&rendezvous_name(gid)) {
            Ok(listener) => return Ok((gid, listener)),
            Err(err) => last_error = Some(err),
        }
    }
    Err(Error::Io(last_error.unwrap_or_else(|| std::io::Error::other("cannot bind a rendezvous socket"))))
}

fn check_port(port_num: u8) -> Result<()> {
    if port_num == 1 {
        Ok(())
    } else {
        Err(Error::InvalidAttribute("port number: an shm device has one port, number 1"))
    }
}

impl Device for ShmDevice {
    type Pd = ShmPd;
    type Cq = ShmCq;

    fn name(&self) -> &str {
        &self.inner.shared.name
    }

    fn query(&self) -> Result<DeviceAttr> {
        let config = &self.inner.shared.ctx.config;
        Ok(DeviceAttr {
            phys_port_cnt: 1,
            max_qp: config.max_qps,
            max_qp_wr: 16_384,
            max_sge: 32,
            max_cq: u32::MAX,
            max_cqe: config.max_cqe,
            max_mr: config.max_mrs,
            max_mr_size: 1 << 40,
            max_pd: u32::MAX,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_inline_data: crate::MAX_INLINE,
            atomics: true,
        })
    }

    fn query_port(&self, port_num: u8) -> Result<PortAttr> {
        check_port(port_num)?;
        Ok(PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu4096,
            gid_tbl_len: 1,
        })
    }

    fn gids(&self, port_num: u8) -> Result<Vec<Gid>> {
        check_port(port_num)?;
        Ok(vec![self.gid()])
    }

    fn alloc_pd(&self) -> Result<ShmPd> {
        Ok(ShmPd::new(Arc::clone(&self.inner)))
    }

    fn create_cq(&self, min_entries: u32) -> Result<ShmCq> {
        let max = self.inner.shared.ctx.config.max_cqe;
        if min_entries > max {
            return Err(Error::InvalidAttribute("more completion queue entries than max_cqe"));
        }
        let shared = Arc::new(CqShared::new(min_entries.max(1))?);
        Ok(ShmCq { device: Arc::clone(&self.inner), shared })
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::{WcOpcode, WcStatus};

    use super::*;

    fn out() -> [WorkCompletion; 1] {
        [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)]
    }

    #[test]
    fn only_the_watcher_gives_the_doorbell_watch_back() {
        let device = ShmDevice::open(ShmConfig::default()).expect("device");
        let shared = &device.inner.shared;
        let cq = Arc::new(CqShared::new(4).expect("cq"));
        // Another thread watches: this waiter sleeps on its queue and must leave the watch be.
        shared.doorbell_watched.store(true, Ordering::Relaxed);
        assert_eq!(shared.sleep_until_rung(&cq, &mut out(), Some(Duration::ZERO)).expect("wait"), 0);
        assert!(
            shared.doorbell_watched.load(Ordering::Relaxed),
            "a waiter that did not watch ended the watch"
        );
        // Nobody watches: this waiter does, and gives the watch back when it leaves.
        shared.doorbell_watched.store(false, Ordering::Relaxed);
        assert_eq!(shared.sleep_until_rung(&cq, &mut out(), Some(Duration::ZERO)).expect("wait"), 0);
        assert!(!shared.doorbell_watched.load(Ordering::Relaxed), "the watcher kept the watch");
    }

    #[test]
    fn a_wait_for_mail_ends_with_a_post_or_an_application_after_the_look() {
        let device = ShmDevice::open(ShmConfig::default()).expect("device");
        let shared = &device.inner.shared;
        // Nothing posted since the look: the wait lasts its timeout.
        let seen = shared.mail_seen();
        let started = Instant::now();
        shared.wait_for_mail(seen, Duration::from_millis(30));
        assert!(started.elapsed() >= Duration::from_millis(30), "a wait with no mail ended early");
        // Mail posted between the look and the wait: the wait ends at once.
        let seen = shared.mail_seen();
        shared.post_event(Event::SocketClosed(u64::MAX));
        let started = Instant::now();
        shared.wait_for_mail(seen, Duration::from_secs(10));
        assert!(started.elapsed() < Duration::from_secs(5), "a wait missed the post before it");
        // Mail another thread took out and applied after the look (the driver thread holding
        // the engine lock, say): that ends the wait too, though nothing is posted any more.
        // The applying thread holds the engine lock from before the post, so the device's own
        // driver thread (which only try-locks it) cannot apply the mail first.
        let (locked_tx, locked) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let mut core = shared.lock_core();
                locked_tx.send(()).expect("main thread");
                go_rx.recv().expect("main thread");
                std::thread::sleep(Duration::from_millis(20));
                shared.apply_events(&mut core);
            });
            locked.recv().expect("applying thread");
            shared.post_event(Event::SocketClosed(u64::MAX));
            let seen = shared.mail_seen();
            go.send(()).expect("applying thread");
            let started = Instant::now();
            shared.wait_for_mail(seen, Duration::from_secs(10));
            assert!(started.elapsed() < Duration::from_secs(5), "a wait missed mail applied after its look");
        });
        assert!(!shared.has_events());
    }

    #[test]
    fn spinning_places_are_limited_and_given_back() {
        let device = ShmDevice::open(ShmConfig::default()).expect("device");
        let shared = &device.inner.shared;
        let places: Vec<_> = (0..shared.max_spinners).map(|_| shared.start_spinning()).collect();
        assert!(places.iter().all(Option::is_some), "fewer places than max_spinners");
        assert!(shared.start_spinning().is_none(), "a spinner past the limit");
        assert!(shared.start_spinning().is_none(), "a refused spinner kept its count");
        drop(places);
        assert!(shared.start_spinning().is_some(), "places were not given back");
        assert_eq!(shared.spinners.load(Ordering::Relaxed), 0);
    }
}
