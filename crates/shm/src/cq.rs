//! [`ShmCq`]: a completion queue. Completion queues never leave the process (peers only ever
//! see queue-pair segments), so this is an ordinary locked queue plus two eventfds: the
//! notification fd applications hand to epoll/poll/tokio, and the one blocked `wait` callers
//! sleep on.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use lightpath_verbs::{CompletionQueue, Result, WorkCompletion};

use crate::device::DeviceInner;
use crate::engine::QpCell;
use crate::sys::EventFd;

/// Longest `wait` spins without giving the core away (see [`ShmCq::wait`]): about what a
/// round trip between two idle processes takes, so an answer that is on its way is caught
/// without a system call.
pub(crate) const PLAIN_SPIN: Duration = Duration::from_micros(4);
/// A `sched_yield` that takes longer than this ran another thread: the core is contended.
const CONTENDED_YIELD: Duration = Duration::from_micros(2);
/// A `sched_yield` that takes longer than this ran a thread that keeps the core (a CPU-bound
/// stranger, not a peer that answers and waits again): yielding to it costs whole time
/// slices (a millisecond or so), so waiters stop yielding. A peer on this core that spins
/// plainly runs at most its spin (`ShmConfig::spin`, 50 µs) before it sleeps: the threshold is
/// well above that, or above twice the spin for longer spins.
const HOGGED_YIELD: Duration = Duration::from_micros(200);
/// How often a spinning waiter yields the core once past its plain spin.
const YIELD_EVERY: Duration = Duration::from_micros(4);
/// `plain_ns` value meaning "never yield: spin plainly for the whole spin".
const NEVER: u32 = u32::MAX;

/// How long waiters of a device spin before they start yielding the core, learnt from how
/// their yields went:
///
/// - a yield that comes back at once (nobody else wants the core) earns back a µs of plain
///   spin, up to [`PLAIN_SPIN`];
/// - one that ran another thread briefly (a peer on this core that answered and waits again)
///   makes later waits yield at once: spinning would only keep that peer off the core;
/// - one that ran a thread for longer than [`HOGGED_YIELD`] (a CPU-bound stranger) stops the
///   yields: each would hand it a time slice, while a plain spin catches an answer from a
///   peer on the other core at once. A wait whose spin then runs out without an answer (the
///   peer may have moved onto this core) tries yielding again.
#[derive(Debug)]
pub(crate) struct SpinPolicy {
    plain_ns: AtomicU32,
    /// A yield longer than this ran a CPU-bound stranger.
    hogged: Duration,
}

impl SpinPolicy {
    /// The policy of waiters that spin for `spin`.
    pub(crate) fn new(spin: Duration) -> Self {
        Self {
            plain_ns: AtomicU32::new(PLAIN_SPIN.as_nanos() as u32),
            hogged: HOGGED_YIELD.max(spin.saturating_mul(2)),
        }
    }

    /// How long to spin before yielding (`None`: do not yield).
    pub(crate) fn plain(&self) -> Option<Duration> {
        match self.plain_ns.load(Ordering::Relaxed) {
            NEVER => None,
            ns => Some(Duration::from_nanos(u64::from(ns))),
        }
    }

    /// Learns from one `sched_yield` that took `took`.
    pub(crate) fn yielded(&self, took: Duration) {
        let plain = if took > self.hogged {
            NEVER
        } else if took > CONTENDED_YIELD {
            0
        } else {
            match self.plain_ns.load(Ordering::Relaxed) {
                NEVER => NEVER,
                ns => ns.saturating_add(1_000).min(PLAIN_SPIN.as_nanos() as u32),
            }
        };
        self.plain_ns.store(plain, Ordering::Relaxed);
    }

    /// A waiter's spin ran out without an answer: if it was not yielding, try again.
    pub(crate) fn spin_ran_out(&self) {
        if self.plain_ns.load(Ordering::Relaxed) == NEVER {
            self.plain_ns.store(PLAIN_SPIN.as_nanos() as u32, Ordering::Relaxed);
        }
    }
}

/// The eventfd in `cell`, made now if it is not yet (in semaphore mode if `semaphore`).
fn made_on_first_use(cell: &OnceLock<EventFd>, semaphore: bool) -> std::io::Result<&EventFd> {
    if let Some(fd) = cell.get() {
        return Ok(fd);
    }
    // Two threads may both make one; the one that loses closes its own.
    let _ = cell.set(EventFd::new(semaphore)?);
    Ok(cell.get().expect("set above or by another thread"))
}

/// The part of a completion queue that queue pairs hold.
#[derive(Debug)]
pub(crate) struct CqShared {
    pub(crate) capacity: u32,
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// Entries in `queue` (updated under its lock), so an empty poll takes no lock.
    len: AtomicUsize,
    /// Readable after `request_notify` once a completion is added. Made when first asked for
    /// (`notify_fd`): a connection whose thread blocks in `wait`, or that waits through its
    /// queue pair's own doorbell, never needs it, and an eventfd per connection is a
    /// descriptor per connection (issue 15).
    notify: OnceLock<EventFd>,
    armed: AtomicBool,
    /// Semaphore eventfd for blocked waiters; each takes one unit when it wakes. Made by the
    /// first waiter, before it counts itself (see [`CqShared::wake`]): an event loop's queue
    /// never has one (a descriptor per connection less, issue 15).
    wake: OnceLock<EventFd>,
    waiters: AtomicU32,
    /// The queue pairs reporting here (as send or receive queue), so a poll can move them
    /// forward alone, under their own locks (see [`ShmCq::poll`]).
    attached: Mutex<Vec<Weak<QpCell>>>,
}

/// Up to this many queue pairs on a queue, a poll that finds nothing first looks at them
/// alone before it drives the whole device.
const ALONE_MAX: usize = 4;

impl CqShared {
    pub(crate) fn new(capacity: u32) -> std::io::Result<Self> {
        Ok(Self {
            capacity,
            queue: Mutex::new(VecDeque::with_capacity(capacity.min(4096) as usize)),
            len: AtomicUsize::new(0),
            notify: OnceLock::new(),
            armed: AtomicBool::new(false),
            wake: OnceLock::new(),
            waiters: AtomicU32::new(0),
            attached: Mutex::new(Vec::new()),
        })
    }

    /// Notes that the queue pair `cell` reports here.
    pub(crate) fn attach(&self, cell: &Arc<QpCell>) {
        let mut attached = self.attached.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        attached.retain(|qp| qp.strong_count() > 0);
        attached.push(Arc::downgrade(cell));
    }

    /// Forgets the queue pair `cell` (it is being destroyed).
    pub(crate) fn detach(&self, cell: &Arc<QpCell>) {
        let target = Arc::downgrade(cell);
        let mut attached = self.attached.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        attached.retain(|qp| qp.strong_count() > 0 && !qp.ptr_eq(&target));
    }

    /// The queue pairs reporting here, if there are at most [`ALONE_MAX`].
    fn few_attached(&self) -> Option<[Option<Arc<QpCell>>; ALONE_MAX]> {
        let attached = self.attached.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if attached.is_empty() || attached.len() > ALONE_MAX {
            return None;
        }
        let mut few: [Option<Arc<QpCell>>; ALONE_MAX] = Default::default();
        for (slot, qp) in few.iter_mut().zip(attached.iter()) {
            *slot = qp.upgrade();
        }
        Some(few)
    }

    /// The wake-up fd blocked waiters sleep on, made on first use. A waiter makes it before it
    /// registers, so a completion added once the waiter is counted signals it.
    pub(crate) fn wake(&self) -> std::io::Result<&EventFd> {
        made_on_first_use(&self.wake, true)
    }

    /// The notification fd, made on first use.
    fn notify(&self) -> std::io::Result<&EventFd> {
        made_on_first_use(&self.notify, false)
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<WorkCompletion>> {
        // Completions are plain data; a holder that panicked left the queue consistent.
        self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a completion and wakes whoever waits for one. The queue is not bounded by its
    /// capacity (a verbs CQ overrun is an asynchronous error; here entries are kept instead).
    pub(crate) fn push(&self, wc: WorkCompletion) {
        {
            let mut queue = self.queue();
            queue.push_back(wc);
            self.len.store(queue.len(), Ordering::Release);
        }
        if self.armed.swap(false, Ordering::AcqRel) {
            if let Some(notify) = self.notify.get() {
                notify.signal(1);
            }
        }
        // Waiters register before they last look at the queue, so a waiter either sees this
        // entry or is counted here; and each made the wake-up fd before it counted itself.
        let waiters = self.waiters.load(Ordering::SeqCst);
        if let Some(wake) = self.wake.get().filter(|_| waiters > 0) {
            wake.signal(u64::from(waiters));
        }
    }

    /// Moves up to `out.len()` completions into `out`.
    pub(crate) fn pop(&self, out: &mut [WorkCompletion]) -> usize {
        if self.len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut queue = self.queue();
        let count = out.len().min(queue.len());
        for (slot, wc) in out.iter_mut().zip(queue.drain(..count)) {
            *slot = wc;
        }
        self.len.store(queue.len(), Ordering::Release);
        count
    }

    pub(crate) fn register_waiter(&self) -> WaiterGuard<'_> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        WaiterGuard(self)
    }
}

/// Keeps a waiter counted while it exists.
pub(crate) struct WaiterGuard<'a>(&'a CqShared);

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A completion queue of an [`ShmDevice`](crate::ShmDevice).
#[derive(Clone)]
pub struct ShmCq {
    pub(crate) device: Arc<DeviceInner>,
    pub(crate) shared: Arc<CqShared>,
}

impl std::fmt::Debug for ShmCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmCq").field("capacity", &self.shared.capacity).finish()
    }
}

impl ShmCq {
    /// `CompletionQueue::wait` but for the hand-over of the doorbell watch when it leaves.
    fn wait_for(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let spin = self.device.shared.ctx.config.spin;
        let spin_until = start + spin;
        let policy = &self.device.shared.spin_policy;
        let plain = policy.plain();
        let yield_from = start + spin.min(plain.unwrap_or(spin));
        // Spinning pays only with a core to spin on: past as many spinners as half the cores,
        // a thread sleeps at once instead of taking CPU from the threads that have work.
        let mut spinning = self.device.shared.start_spinning();
        let mut next_yield = yield_from;
        // With many queue pairs this thread waits as the watcher of many connections (the
        // stream layer's leader), routing for threads of its own process: yielding to them
        // only delays everyone's completions, and only one thread per half core spins anyway.
        let yields = plain.is_some() && self.device.shared.tables.hints.few_queue_pairs();
        loop {
            let count = self.poll(out)?;
            if count > 0 {
                return Ok(count);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(0);
            }
            if spinning.is_some() && now < spin_until {
                if now < next_yield || !yields {
                    std::hint::spin_loop();
                    continue;
                }
                // Now and then the spin offers the core to whoever else can use it: on a busy
                // machine the peer we wait for may be queued behind us on this very core, and
                // a plain spin would hold it off for the whole spin (a round trip of 50 µs
                // instead of one or two). How long the yield took says who else wants the
                // core (see `SpinPolicy`): a peer that answers (later waits yield at once),
                // or a CPU-bound stranger (later waits stop yielding, as each yield would
                // hand it a time slice).
                std::thread::yield_now();
                let took = now.elapsed();
                policy.yielded(took);
                next_yield = Instant::now() + YIELD_EVERY;
                continue;
            }
            if spinning.take().is_some() {
                policy.spin_ran_out();
            }
            let remaining = deadline.map(|d| d.saturating_duration_since(now));
            self.shared.wake().map_err(lightpath_verbs::Error::Io)?;
            let _waiter = self.shared.register_waiter();
            let count = self.device.shared.sleep_until_rung(&self.shared, out, remaining)?;
            if count > 0 {
                return Ok(count);
            }
        }
    }
}

impl CompletionQueue for ShmCq {
    fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    /// Takes completions; if there are none, first processes whatever arrived from peers: on
    /// a queue with few queue pairs, those alone (their own locks, not the device's: the
    /// threads of a server with a connection each do not queue up behind one another), and if
    /// that made none, everything the device has to do (skipped while another thread holds
    /// the device lock: it is doing that work).
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let count = self.shared.pop(out);
        if count > 0 || out.is_empty() {
            return Ok(count);
        }
        if let Some(few) = self.shared.few_attached() {
            for cell in few.iter().flatten() {
                self.device.shared.progress_alone(cell, false);
            }
            let count = self.shared.pop(out);
            if count > 0 {
                return Ok(count);
            }
            self.device.shared.try_drive();
            return Ok(self.shared.pop(out));
        }
        self.device.shared.drive();
        Ok(self.shared.pop(out))
    }

    /// What the queue holds, without a look at any queue pair: after an arming (which looked
    /// at its queue pair alone, see `ShmQp::arm_waiter`) the look `poll` makes on an empty
    /// queue would take that queue pair's lock and read its ring a second time, and then drive
    /// the device: one of the ~4.3 polls per request of a 16-connection `stream_rr` event-loop
    /// server (`scripts/instructions.sh`), now ~3.2.
    fn take_queued(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        Ok(self.shared.pop(out))
    }

    /// Polls for `ShmConfig::spin` (if few enough other threads of the device are spinning),
    /// then sleeps until a peer rings the device's doorbell or a completion is added by another
    /// thread. Past the first few µs (at once while the core is contended) the spin yields the
    /// core every few µs, so a thread that has work on this core (the peer, on a busy machine)
    /// runs at once instead of after the spin; how long each yield took teaches the later
    /// waits of the device when to yield (see `SpinPolicy`).
    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let result = self.wait_for(out, timeout);
        // Whichever way this waiter leaves, a waiter sleeping on its own queue takes the
        // doorbell watch over if nobody holds it (see `DeviceShared::hand_over_watch`).
        self.device.shared.hand_over_watch();
        result
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.shared.notify().ok()?.as_fd().as_raw_fd())
    }

    /// Arms the queue and tells the device's driver thread that the application is about to
    /// wait on the fd: the driver takes over progress at once (until the application shows it
    /// keeps polling), so arrivals become completions and the fd fires without the application
    /// polling.
    fn request_notify(&self) -> Result<()> {
        // The fd exists before the queue is armed: a completion after the arming signals it,
        // whenever the caller asks for the fd.
        self.shared.notify().map_err(lightpath_verbs::Error::Io)?;
        self.shared.armed.store(true, Ordering::Release);
        self.device.shared.kick.signal(1);
        Ok(())
    }

    fn take_notify(&self) -> Result<bool> {
        Ok(self.shared.notify.get().is_some_and(|notify| notify.take() > 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yields_learn_who_else_wants_the_core() {
        let policy = SpinPolicy::new(Duration::from_micros(50));
        assert_eq!(policy.plain(), Some(PLAIN_SPIN));
        policy.yielded(Duration::from_micros(5));
        assert_eq!(policy.plain(), Some(Duration::ZERO), "a peer on this core: yield at once");
        policy.yielded(Duration::from_nanos(300));
        assert_eq!(policy.plain(), Some(Duration::from_micros(1)), "a quick yield earns a µs");
        for _ in 0..10 {
            policy.yielded(Duration::from_nanos(300));
        }
        assert_eq!(policy.plain(), Some(PLAIN_SPIN), "capped at PLAIN_SPIN");
        policy.yielded(Duration::from_micros(90));
        assert_eq!(policy.plain(), Some(Duration::ZERO), "a peer that spun plainly (50 µs) first");
        policy.yielded(HOGGED_YIELD + Duration::from_micros(1));
        assert_eq!(policy.plain(), None, "a CPU-bound stranger: stop yielding");
        policy.yielded(Duration::from_nanos(300));
        assert_eq!(policy.plain(), None, "quick yields do not undo it (none happen)");
        policy.spin_ran_out();
        assert_eq!(policy.plain(), Some(PLAIN_SPIN), "a spin that ran out tries yielding again");
        policy.yielded(CONTENDED_YIELD + Duration::from_nanos(1));
        assert_eq!(policy.plain(), Some(Duration::ZERO));
        policy.spin_ran_out();
        assert_eq!(policy.plain(), Some(Duration::ZERO), "only the stranger mode is reset");
    }
}
