//! One connection's share of a shared completion queue: the completions routed to it, and what
//! wakes its owner: an eventfd (a blocked thread, an event loop that watches the connection's
//! notification fd, a queue pair that takes it as its own doorbell) or a task's `Waker` (the
//! tokio driver's streams whose queue pair has no doorbell of its own).
//!
//! The eventfd is made on first use, not with the inbox: a tokio stream whose news reaches it
//! through the completion router wakes its task directly, with no descriptor of its own
//! (issue 15: one descriptor per established stream beyond its TCP socket).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::Waker;
use std::time::Duration;

use lightpath_verbs::WorkCompletion;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

/// How long a sleeper naps when no eventfd can be made for it (the process is out of
/// descriptors): it then looks again.
const NAP_WITHOUT_EVENTFD: Duration = Duration::from_millis(1);

/// Completions waiting for one connection, in the order the queue produced them.
pub(crate) struct Inbox {
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// Entries in `queue` (updated under its lock), so an empty look takes no lock.
    len: AtomicUsize,
    /// Readable while a wake-up is pending; made on first use (see the module docs). Shared
    /// with the connection's queue pair where the provider takes it as the queue pair's own
    /// doorbell (`QueuePair::set_waiter_fd`).
    event: OnceLock<Arc<OwnedFd>>,
    /// The task of an event loop that waits without the eventfd (see [`Inbox::poll_woken`]).
    task: Mutex<Option<Waker>>,
    /// A wake-up for that task is pending.
    task_woken: AtomicBool,
    /// A task has waited through `poll_woken` (set once): wake-ups look at `task` only then.
    task_waits: AtomicBool,
    /// An event loop asked to be told (once) about the next completion.
    armed: AtomicBool,
    /// A thread sleeps on `event`.
    sleeping: AtomicBool,
    /// The sleeper or the armed event loop waits for arrivals only (see
    /// `WorkCompletion::is_arrival`).
    arrivals_only: AtomicBool,
    /// The inbox is in its hub's list of sleepers (see `Hub::hand_off`).
    pub(super) listed: AtomicBool,
    /// A descriptor of the queue pair's that sleepers watch beside `event`
    /// (`QueuePair::waiter_poll_fd`).
    poll_fd: OnceLock<Arc<dyn AsFd + Send + Sync>>,
    /// Completions pushed, pushes that asked for a wake-up, and completions popped since
    /// `diagnostics` were enabled.
    pushed: AtomicU64,
    wakes: AtomicU64,
    popped: AtomicU64,
    /// The owner's state at its last wait for the peer, when `diagnostics` notes are on.
    note: Mutex<String>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("len", &self.len)
            .field("armed", &self.armed)
            .field("sleeping", &self.sleeping)
            .field("event", &self.event.get().map(|fd| fd.as_raw_fd()))
            .field("poll_fd", &self.poll_fd().map(|fd| fd.as_raw_fd()))
            .finish_non_exhaustive()
    }
}

impl Inbox {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            event: OnceLock::new(),
            task: Mutex::new(None),
            task_woken: AtomicBool::new(false),
            task_waits: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            arrivals_only: AtomicBool::new(false),
            listed: AtomicBool::new(false),
            poll_fd: OnceLock::new(),
            pushed: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            popped: AtomicU64::new(0),
            note: Mutex::new(String::new()),
        })
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<WorkCompletion>> {
        // Completions are plain data: a holder that panicked left the queue consistent.
        self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds completions (the hub's router holds the routing lock, so per-connection order is
    /// the queue's order) and returns whether the owner must be woken.
    pub(super) fn push(&self, wcs: &[WorkCompletion]) -> bool {
        {
            let mut queue = self.queue();
            queue.extend(wcs.iter().copied());
            self.len.store(queue.len(), Ordering::SeqCst);
        }
        let counting = super::diagnostics::enabled();
        if counting {
            self.pushed.fetch_add(wcs.len() as u64, Ordering::Relaxed);
        }
        // A reader is not woken for the acknowledgement of its own request (its completion
        // stays queued for its next look).
        if self.arrivals_only.load(Ordering::SeqCst) && !wcs.iter().any(WorkCompletion::is_arrival) {
            return false;
        }
        // Pairs with the SeqCst store of `sleeping` before the owner's last look at `len`:
        // either the owner sees the entries, or this sees it asleep.
        let wake = self.sleeping.load(Ordering::SeqCst) | self.armed.swap(false, Ordering::SeqCst);
        if wake && counting {
            self.wakes.fetch_add(1, Ordering::Relaxed);
        }
        wake
    }

    /// Sets what the next sleep or armed wait is for: arrivals only, or anything.
    pub(super) fn set_arrivals_only(&self, arrivals_only: bool) {
        if self.arrivals_only.load(Ordering::Relaxed) != arrivals_only {
            self.arrivals_only.store(arrivals_only, Ordering::SeqCst);
        }
    }

    /// Whether completions are waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.len.load(Ordering::SeqCst) == 0
    }

    /// Moves up to `out.len()` completions into `out`.
    pub(crate) fn pop(&self, out: &mut [WorkCompletion]) -> usize {
        if self.is_empty() || out.is_empty() {
            return 0;
        }
        let mut queue = self.queue();
        let count = out.len().min(queue.len());
        for (slot, wc) in out.iter_mut().zip(queue.drain(..count)) {
            *slot = wc;
        }
        self.len.store(queue.len(), Ordering::SeqCst);
        if super::diagnostics::enabled() {
            self.popped.fetch_add(count as u64, Ordering::Relaxed);
        }
        count
    }

    /// Keeps `note` as the owner's state at its latest wait (see `diagnostics`).
    pub(super) fn set_note(&self, note: String) {
        *self.note.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = note;
    }

    /// One line for `diagnostics`: what is queued, the flags, the counters and the note.
    pub(super) fn describe(&self, out: &mut String) {
        use std::fmt::Write as _;
        let queued: Vec<String> =
            self.queue().iter().map(|wc| format!("{:?}/{:?}#{}", wc.opcode, wc.status, wc.wr_id)).collect();
        let note = self.note.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let _ = write!(
            out,
            "queued=[{}] armed={} sleeping={} arrivals_only={} listed={} pushed={} wakes={} popped={}",
            queued.join(" "),
            self.armed.load(Ordering::SeqCst),
            self.sleeping.load(Ordering::SeqCst),
            self.arrivals_only.load(Ordering::SeqCst),
            self.listed.load(Ordering::SeqCst),
            self.pushed.load(Ordering::Relaxed),
            self.wakes.load(Ordering::Relaxed),
            self.popped.load(Ordering::Relaxed),
        );
        if !note.is_empty() {
            let _ = write!(out, " last wait: {note}");
        }
    }

    /// A fresh eventfd of the kind the inbox uses, for [`Inbox::adopt_event`].
    pub(crate) fn new_event() -> io::Result<Arc<OwnedFd>> {
        Ok(Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?))
    }

    /// The eventfd, made now if it is not yet.
    fn event(&self) -> io::Result<&Arc<OwnedFd>> {
        if let Some(event) = self.event.get() {
            return Ok(event);
        }
        let made = Self::new_event()?;
        // Another thread may have made one meanwhile: theirs is kept, this one closed.
        Ok(self.event.get_or_init(|| made))
    }

    /// Takes `event` (made by [`Inbox::new_event`] and given to the queue pair as its own
    /// doorbell) as the inbox's eventfd. False if the inbox has one already.
    pub(super) fn adopt_event(&self, event: Arc<OwnedFd>) -> bool {
        self.event.set(event).is_ok()
    }

    /// The eventfd if the inbox has one, to share with the queue pair as its own doorbell.
    pub(super) fn shared_event(&self) -> Option<&Arc<OwnedFd>> {
        self.event.get()
    }

    /// Whether the inbox has its eventfd (made by a sleeper, an event loop that asked for the
    /// notification fd, or adopted as the queue pair's doorbell).
    #[cfg(test)]
    pub(crate) fn has_event(&self) -> bool {
        self.event.get().is_some()
    }

    /// Wakes the owner: makes the eventfd readable if there is one, and wakes the task that
    /// waits through [`Inbox::poll_woken`] if one does.
    pub(super) fn wake(&self) {
        if let Some(event) = self.event.get() {
            // Fails only when the counter would overflow, i.e. a wake-up is pending anyway.
            let _ = rustix::io::write(&**event, &1u64.to_ne_bytes());
        }
        // Kept for a task's next look even if none has looked yet (a task may arm before its
        // first `poll_woken`, as the tokio connect's probe wait does). Pairs with
        // `poll_woken`, which stores its waker and `task_waits` before it swaps the flag:
        // either it sees the flag, or this sees `task_waits` and wakes its waker.
        self.task_woken.store(true, Ordering::SeqCst);
        if !self.task_waits.load(Ordering::SeqCst) {
            return;
        }
        let waker = self.task.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// For an event loop's task that waits without the eventfd: whether a wake-up came since
    /// the last call (consumed), leaving `waker` to be woken by the next one otherwise.
    pub(crate) fn poll_woken(&self, waker: &Waker) -> bool {
        {
            let mut task = self.task.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if !task.as_ref().is_some_and(|held| held.will_wake(waker)) {
                *task = Some(waker.clone());
            }
        }
        self.task_waits.store(true, Ordering::SeqCst);
        self.task_woken.swap(false, Ordering::SeqCst)
    }

    /// Consumes a pending wake-up of the eventfd; returns whether there was one.
    pub(crate) fn take_wake(&self) -> bool {
        let Some(event) = self.event.get() else { return false };
        let mut value = [0u8; 8];
        matches!(rustix::io::read(&**event, &mut value), Ok(8))
    }

    /// Asks for a wake-up on the next completion (for event loops; see `notify_fd`).
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Withdraws `arm` (the queue pair's own doorbell serves the event loop instead).
    pub(crate) fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The eventfd, for epoll (made now if it is not yet): readable once a completion arrives
    /// after `arm`.
    pub(crate) fn event_fd(&self) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        Ok(self.event()?.as_fd())
    }

    /// Has sleepers watch `fd` too (readable when the queue pair has news that its next arming
    /// takes in).
    pub(super) fn set_poll_fd(&self, fd: Arc<dyn AsFd + Send + Sync>) {
        let _ = self.poll_fd.set(fd);
    }

    /// The queue pair's descriptor sleepers watch beside the eventfd, if any.
    pub(crate) fn poll_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.poll_fd.get().map(|fd| fd.as_fd())
    }

    /// Whether a thread sleeps on the eventfd right now.
    pub(super) fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::SeqCst)
    }

    /// Sleeps until a completion is routed here, a wake-up is signalled, or `timeout` passes;
    /// does not sleep at all if completions are waiting or, once this thread counts as
    /// asleep, `still_needed` says no. Returns whether it was woken (or found completions)
    /// rather than timed out.
    pub(super) fn sleep_while(&self, timeout: Duration, still_needed: impl FnOnce() -> bool) -> bool {
        self.sleep_watching(timeout, None, None, still_needed).woken
    }

    /// [`Inbox::sleep_while`], also ended by `watch` turning readable (a stream's TCP
    /// connection, whose news the caller looks at itself: see `RdmaConn::wait_woken_by`).
    /// With `tasks` (the device's task doorbell the queue pair's news rings, see
    /// `ConnCompletions::attach`), the sleeper watches that doorbell too and dispatches it
    /// when it fires: the dispatch writes this inbox's eventfd if the ring was for it.
    pub(super) fn sleep_watching(
        &self,
        timeout: Duration,
        watch: Option<BorrowedFd<'_>>,
        tasks: Option<&dyn lightpath_verbs::TaskDoorbell>,
        still_needed: impl FnOnce() -> bool,
    ) -> Slept {
        // The eventfd exists before this thread counts as asleep: whoever sees it asleep then
        // finds the eventfd to write. Without one (no descriptor left) the sleep is a short
        // nap, and the caller looks again.
        let event = match self.event() {
            Ok(event) => event,
            Err(_) => {
                std::thread::sleep(timeout.min(NAP_WITHOUT_EVENTFD));
                return Slept { woken: !self.is_empty(), watched: false };
            }
        };
        self.sleeping.store(true, Ordering::SeqCst);
        let mut woken = !self.is_empty();
        let mut watched = false;
        if !woken && still_needed() {
            let timeout = Timespec {
                tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
                tv_nsec: i64::from(timeout.subsec_nanos()),
            };
            // EINTR or a failure both just end this sleep; the caller looks again.
            let own = self.poll_fd();
            // The eventfd, then the queue pair's own descriptor, the watched one and the task
            // doorbell, those there are.
            let mut fds: [PollFd<'_>; 4] = std::array::from_fn(|_| PollFd::new(&**event, PollFlags::IN));
            let mut count = 1;
            let mut at = [None; 3];
            for (slot, fd) in at.iter_mut().zip([own, watch, tasks.map(|doorbell| doorbell.fd())]) {
                if let Some(fd) = fd {
                    fds[count] = PollFd::from_borrowed_fd(fd, PollFlags::IN);
                    *slot = Some(count);
                    count += 1;
                }
            }
            let [own_at, watch_at, tasks_at] = at;
            let _ = rustix::event::poll(&mut fds[..count], Some(&timeout));
            let fired = |at: Option<usize>| at.is_some_and(|i| !fds[i].revents().is_empty());
            // News on the queue pair's own descriptor: the caller's next arming takes it in.
            woken |= fired(own_at);
            watched = fired(watch_at);
            let rung_for_tasks = fired(tasks_at);
            if rung_for_tasks {
                if let Some(doorbell) = tasks {
                    // Watched level-triggered: consumed first, or it stays readable. The
                    // dispatch writes the eventfd if the ring was for this connection.
                    doorbell.take_rings();
                    doorbell.dispatch();
                }
            }
            // The eventfd is read only when it fired or a dispatch may have written it (a
            // wake-up by the queue pair's own descriptor alone, or by none, costs no read). A
            // write it missed (after the sleep ended, or while the arming looked and found work
            // without sleeping) stays pending: the next sleep returns at once and takes it, one
            // more look at most.
            if fired(Some(0)) || rung_for_tasks {
                woken |= self.take_wake();
            }
        }
        self.sleeping.store(false, Ordering::SeqCst);
        Slept { woken: woken || !self.is_empty(), watched }
    }
}

/// How a sleep on an inbox ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Slept {
    /// Woken for the connection (or completions were waiting), rather than timed out.
    pub(super) woken: bool,
    /// The watched descriptor turned readable.
    pub(super) watched: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use lightpath_verbs::{WcOpcode, WcStatus};

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion::new(id, WcStatus::Success, WcOpcode::Send, 7)
    }

    #[test]
    fn keeps_order_and_reports_who_to_wake() {
        let inbox = Inbox::new().unwrap();
        assert!(!inbox.push(&[wc(1), wc(2)]), "nobody sleeps or armed: no wake-up");
        inbox.arm();
        assert!(inbox.push(&[wc(3)]), "armed: wake once");
        assert!(!inbox.push(&[wc(4)]), "the arm was consumed");
        let mut out = [wc(0); 3];
        assert_eq!(inbox.pop(&mut out), 3);
        assert_eq!(out.map(|w| w.wr_id), [1, 2, 3]);
        assert_eq!(inbox.pop(&mut out), 1);
        assert_eq!(out[0].wr_id, 4);
        assert!(inbox.is_empty());
        assert_eq!(inbox.pop(&mut out), 0);
    }

    #[test]
    fn a_reader_is_not_woken_by_acknowledgements() {
        let inbox = Inbox::new().unwrap();
        inbox.set_arrivals_only(true);
        inbox.arm();
        let mut ack = wc(1);
        ack.opcode = WcOpcode::RdmaWrite;
        assert!(!inbox.push(&[wc(1), ack]), "woken for acknowledgements");
        let mut arrival = wc(2);
        arrival.opcode = WcOpcode::RecvRdmaWithImm;
        assert!(inbox.push(&[ack, arrival]), "not woken for an arrival");
        inbox.arm();
        let mut failed = ack;
        failed.status = WcStatus::RetryExcErr;
        assert!(inbox.push(&[failed]), "not woken for an error");
        inbox.set_arrivals_only(false);
        inbox.arm();
        assert!(inbox.push(&[ack]), "a writer was not woken for an acknowledgement");
        let mut out = [wc(0); 8];
        assert_eq!(inbox.pop(&mut out), 6, "a completion was lost");
    }

    #[test]
    fn wake_is_seen_once() {
        let inbox = Inbox::new().unwrap();
        assert!(!inbox.has_event(), "the eventfd was made before anyone needed it");
        inbox.event_fd().unwrap();
        assert!(!inbox.take_wake());
        inbox.wake();
        inbox.wake();
        assert!(inbox.take_wake());
        assert!(!inbox.take_wake());
    }

    /// Wakes the test when woken.
    struct Flag(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_task_is_woken_without_an_eventfd() {
        let inbox = Inbox::new().unwrap();
        let flag = std::sync::Arc::new(Flag(std::sync::atomic::AtomicUsize::new(0)));
        let waker = Waker::from(std::sync::Arc::clone(&flag));
        assert!(!inbox.poll_woken(&waker), "woken before anything came");
        inbox.arm();
        assert!(inbox.push(&[wc(1)]), "armed: wake once");
        inbox.wake();
        assert_eq!(flag.0.load(Ordering::SeqCst), 1, "the task was not woken");
        assert!(inbox.poll_woken(&waker), "the wake-up was not kept for the task's next look");
        assert!(!inbox.poll_woken(&waker), "one wake-up seen twice");
        // A wake-up while the task runs (its waker taken) is kept for its next look.
        inbox.wake();
        assert!(inbox.poll_woken(&waker));
        assert!(!inbox.has_event(), "waking a task made an eventfd");
        // So is one before the task's first look (it armed, then looked: the probe's wait).
        let fresh = Inbox::new().unwrap();
        fresh.arm();
        assert!(fresh.push(&[wc(2)]));
        fresh.wake();
        assert!(fresh.poll_woken(&waker), "a wake-up before the first look was lost");
    }

    #[test]
    fn a_sleeper_is_woken_by_a_push() {
        let inbox = std::sync::Arc::new(Inbox::new().unwrap());
        let sleeper = {
            let inbox = std::sync::Arc::clone(&inbox);
            // An hour: the sleep must end by the push, not by its timeout.
            std::thread::spawn(move || inbox.sleep_while(Duration::from_secs(3600), || true))
        };
        while !inbox.sleeping.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        if inbox.push(&[wc(9)]) {
            inbox.wake();
        }
        assert!(sleeper.join().unwrap(), "the sleep ended without a wake-up");
        assert!(!inbox.is_empty());
    }
}
