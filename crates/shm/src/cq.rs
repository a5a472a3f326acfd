//! [`ShmCq`]: a completion queue. Completion queues never leave the process (peers only ever
//! see queue-pair segments), so this is an ordinary locked queue plus two eventfds: the
//! notification fd applications hand to epoll/poll/tokio, and the one blocked `wait` callers
//! sleep on.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lightpath_verbs::{CompletionQueue, Result, WorkCompletion};

use crate::device::DeviceInner;
use crate::sys::EventFd;

/// The part of a completion queue that queue pairs hold.
#[derive(Debug)]
pub(crate) struct CqShared {
    pub(crate) capacity: u32,
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// Entries in `queue` (updated under its lock), so an empty poll takes no lock.
    len: AtomicUsize,
    /// Readable after `request_notify` once a completion is added.
    pub(crate) notify: EventFd,
    armed: AtomicBool,
    /// Semaphore eventfd for blocked waiters; each takes one unit when it wakes.
    pub(crate) wake: EventFd,
    waiters: AtomicU32,
}

impl CqShared {
    pub(crate) fn new(capacity: u32) -> std::io::Result<Self> {
        Ok(Self {
            capacity,
            queue: Mutex::new(VecDeque::with_capacity(capacity.min(4096) as usize)),
            len: AtomicUsize::new(0),
            notify: EventFd::new(false)?,
            armed: AtomicBool::new(false),
            wake: EventFd::new(true)?,
            waiters: AtomicU32::new(0),
        })
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
            self.notify.signal(1);
        }
        // Waiters register before they last look at the queue, so a waiter either sees this
        // entry or is counted here.
        let waiters = self.waiters.load(Ordering::SeqCst);
        if waiters > 0 {
            self.wake.signal(u64::from(waiters));
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

impl CompletionQueue for ShmCq {
    fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    /// Takes completions; if there are none, first processes whatever arrived from peers.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let count = self.shared.pop(out);
        if count > 0 || out.is_empty() {
            return Ok(count);
        }
        self.device.shared.drive();
        Ok(self.shared.pop(out))
    }

    /// Polls for `ShmConfig::spin` (if few enough other threads of the device are spinning),
    /// then sleeps until a peer rings the device's doorbell or a completion is added by another
    /// thread.
    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let spin_until = start + self.device.shared.ctx.config.spin;
        // Spinning pays only with a core to spin on: past as many spinners as half the cores,
        // a thread sleeps at once instead of taking CPU from the threads that have work.
        let mut spinning = self.device.shared.start_spinning();
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
                std::hint::spin_loop();
                continue;
            }
            spinning = None;
            let remaining = deadline.map(|d| d.saturating_duration_since(now));
            let _waiter = self.shared.register_waiter();
            let count = self.device.shared.sleep_until_rung(&self.shared, out, remaining)?;
            if count > 0 {
                return Ok(count);
            }
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.shared.notify.as_fd().as_raw_fd())
    }

    /// Arms the queue and tells the device's driver thread that the application is about to
    /// wait on the fd: the driver takes over progress at once (until the application shows it
    /// keeps polling), so arrivals become completions and the fd fires without the application
    /// polling.
    fn request_notify(&self) -> Result<()> {
        self.shared.armed.store(true, Ordering::Release);
        self.device.shared.kick.signal(1);
        Ok(())
    }

    fn take_notify(&self) -> Result<bool> {
        Ok(self.shared.notify.take() > 0)
    }
}
