//! [`SoftCq`]: a completion queue, with blocking waits and a pollable notification fd.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightpath_roce::CqHandle;
use lightpath_verbs::{CompletionQueue, Error, Result, WorkCompletion};

use crate::config::ProgressMode;
use crate::driver::{CqSignal, DeviceInner, WaitRound};

/// A wait whose spin keeps seeing datagrams spins at most this many times its spin in all.
const SPIN_EXTENSIONS: u32 = 4;

/// How long a spinning waiter polls before it starts yielding the core between rounds.
const PLAIN_SPIN: Duration = Duration::from_micros(4);

/// A completion queue of a [`SoftDevice`](crate::SoftDevice). The engine's queue is destroyed
/// when the last handle and the last queue pair using it are gone.
#[derive(Clone)]
pub struct SoftCq {
    pub(crate) inner: Arc<CqInner>,
}

/// The shared part, held by every queue pair that reports to this queue.
pub(crate) struct CqInner {
    pub(crate) device: Arc<DeviceInner>,
    pub(crate) handle: CqHandle,
    signal: Arc<CqSignal>,
    capacity: u32,
}

impl SoftCq {
    pub(crate) fn new(device: Arc<DeviceInner>, min_entries: u32) -> Result<Self> {
        let signal = Arc::new(CqSignal::new().map_err(Error::Io)?);
        let handle = {
            let mut core = device.lock();
            let handle = core.engine.create_cq(min_entries.max(1))?;
            core.signals.insert(handle, Arc::clone(&signal));
            handle
        };
        Ok(Self { inner: Arc::new(CqInner { device, handle, signal, capacity: min_entries.max(1) }) })
    }

    /// Polling mode: one round of driving the device (see `Shared::poll_round`). Returns
    /// completions taken and the time to the engine's next timer.
    fn drive_and_poll(&self, out: &mut [WorkCompletion]) -> (usize, Option<Duration>) {
        self.inner.device.poll_round(self.inner.handle, out)
    }

    /// With the progress thread: the first waiting thread blocks on the socket as well as on
    /// the queue's wake-up fd and drives the device itself when a datagram arrives (one wake-up
    /// instead of the progress thread's and then its own; see `Shared::try_watch_socket`);
    /// other waiters sleep on their queue's wake-up fd alone.
    fn wait_thread_mode(&self, out: &mut [WorkCompletion], deadline: Option<Instant>) -> Result<usize> {
        let device = &self.inner.device;
        let _waiter = self.inner.signal.register_waiter();
        let watch = device.try_watch_socket();
        // A watcher's first look takes what is queued without a receive call, which would
        // usually find nothing: the spin or the socket wait below finds what arrives.
        let mut look_only = watch.is_some();
        let spin = if watch.is_some() { device.spin_budget() } else { Duration::ZERO };
        // The watcher busy-polls until `spin` has passed without a datagram; `None` once it
        // has slept (or never spins).
        let started = Instant::now();
        let mut spin_until = (!spin.is_zero()).then(|| started + spin);
        let spin_cap = started + spin * SPIN_EXTENSIONS;
        let mut spin_saw_traffic = false;
        loop {
            let round = if look_only {
                self.take_ready(out)
            } else {
                device.wait_round(self.inner.handle, out, watch.is_some())
            };
            if round.completions > 0 {
                if spin_until.is_some() && !look_only {
                    device.record_spin(true);
                }
                return Ok(round.completions);
            }
            let first_look = std::mem::replace(&mut look_only, false);
            let now = Instant::now();
            let remaining = match deadline {
                Some(deadline) => match deadline.checked_duration_since(now) {
                    Some(left) if !left.is_zero() => Some(left),
                    // Time is up, but the device has not been driven yet: one round first.
                    _ if first_look => Some(Duration::ZERO),
                    _ => return Ok(0),
                },
                None => None,
            };
            if let Some(until) = spin_until {
                if round.received > 0 && now < spin_cap {
                    // Traffic flows (this message's first datagrams, or other queues' work):
                    // keep spinning, as long again from now, up to `spin_cap` in all (a slow
                    // sender, such as a peer in an emulated VM, would otherwise keep this
                    // thread on a core it needs).
                    spin_saw_traffic = true;
                    spin_until = Some(now + spin);
                    continue;
                }
                if now < until && remaining != Some(Duration::ZERO) {
                    // Busy-poll: the next round receives and runs the engine itself. Past the
                    // first microseconds, offer the core to whoever else wants it (with more
                    // runnable threads than cores, often the peer this wait is waiting for).
                    if now.duration_since(started) > PLAIN_SPIN {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                device.record_spin(spin_saw_traffic);
                spin_until = None;
            }
            let timeout = match (remaining, round.next_timer) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let signalled = if watch.is_some() {
                device.block_on_socket(&self.inner.signal.wake, timeout)?
            } else {
                device.block_on_signal(&self.inner.signal.wake, timeout)?
            };
            if signalled {
                self.inner.signal.wake.take();
            }
        }
    }

    /// Completions already in the queue, without receiving, and the time to the engine's next
    /// timer. When there are none, what the engine still has to send (answers an earlier
    /// round held back) goes out first: the caller is about to block.
    fn take_ready(&self, out: &mut [WorkCompletion]) -> WaitRound {
        let device = &self.inner.device;
        let mut core = device.lock();
        let completions = core.engine.poll_cq(self.inner.handle, out);
        if completions == 0 {
            device.flush(&mut core);
        }
        WaitRound { completions, received: 0, next_timer: device.until_next_timer(&core) }
    }

    fn wait_polling_mode(
        &self,
        out: &mut [WorkCompletion],
        deadline: Option<Instant>,
        spin: Duration,
    ) -> Result<usize> {
        let spin_until = Instant::now() + spin;
        let _waiter = self.inner.signal.register_waiter();
        loop {
            let (count, next_timer) = self.drive_and_poll(out);
            if count > 0 {
                return Ok(count);
            }
            let now = Instant::now();
            let remaining = match deadline {
                Some(deadline) if deadline <= now => return Ok(0),
                Some(deadline) => Some(deadline - now),
                None => None,
            };
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            let timeout = match (remaining, next_timer) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            self.inner.device.block_on_socket(&self.inner.signal.wake, timeout)?;
            self.inner.signal.wake.take();
        }
    }
}

impl std::fmt::Debug for SoftCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftCq")
            .field("handle", &self.inner.handle)
            .field("capacity", &self.inner.capacity)
            .finish()
    }
}

impl CompletionQueue for SoftCq {
    fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if self.inner.device.is_polling() {
            return Ok(self.drive_and_poll(out).0);
        }
        // Empty (as of the last change, made under the lock): no lock taken. With many
        // connections' threads polling their shared queues, the lock was most of a poll.
        let signal = &self.inner.signal;
        if out.is_empty() || !signal.maybe_nonempty.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(0);
        }
        let mut core = self.inner.device.lock();
        let count = core.engine.poll_cq(self.inner.handle, out);
        if count < out.len() {
            signal.maybe_nonempty.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(count)
    }

    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = Instant::now().checked_add(timeout);
        match self.inner.device.config.mode {
            ProgressMode::Thread => self.wait_thread_mode(out, deadline),
            ProgressMode::Polling { spin, .. } => self.wait_polling_mode(out, deadline, spin),
        }
    }

    /// The eventfd that becomes readable after `request_notify` once a completion arrives.
    ///
    /// With the progress thread this works like a completion channel. In polling mode nothing
    /// runs in the background except the helper thread, so the fd fires when some thread's
    /// `poll`/`wait` processes the arrival, or the helper: at once after `consumer_idle` (an
    /// event loop about to sleep on this fd says so; the helper then reads the socket until
    /// the application looks again), else after `assist_after` without a look.
    fn notify_fd(&self) -> Option<RawFd> {
        self.inner.signal.notify_fd().ok()
    }

    fn request_notify(&self) -> Result<()> {
        // The fd exists before the queue is armed: a completion after the arming signals it,
        // whenever the caller asks for the fd.
        self.inner.signal.notify_fd().map_err(Error::Io)?;
        self.inner.signal.arm();
        Ok(())
    }

    fn take_notify(&self) -> Result<bool> {
        Ok(self.inner.signal.take_notify())
    }

    /// Installed once per queue (a second hook is refused: `Ok(false)`). The hook runs in the
    /// thread whose engine work added the entries — the progress thread for what arrives by
    /// the network — after it released the engine.
    fn set_completion_hook(&self, hook: lightpath_verbs::CompletionHook) -> Result<bool> {
        Ok(self.inner.signal.set_hook(hook))
    }

    /// Sends the answers the progress thread holds for an event loop's reply (see
    /// `Shared::drive_for_progress`): the event loop goes to sleep without one. And since it
    /// sleeps on its notification, not on the socket, makes sure somebody reads the socket
    /// (see `Shared::socket_relied_on`).
    fn consumer_idle(&self) {
        let device = &self.inner.device;
        // The event loop sleeps on its notification, not on the socket: someone must read it.
        device.shared.socket_relied_on();
        if !device.answers_held.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let mut core = device.lock();
        if device.answers_held.load(std::sync::atomic::Ordering::Relaxed) {
            device.flush(&mut core);
        }
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        let mut core = self.device.lock();
        core.signals.remove(&self.handle);
        // Every queue pair using this queue held a reference, so none is left: this succeeds.
        let _ = core.engine.destroy_cq(self.handle);
    }
}
