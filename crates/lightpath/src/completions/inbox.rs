//! One connection's share of a shared completion queue: the completions routed to it, and the
//! eventfd that wakes its owner (a blocked thread, or an event loop that armed it).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use lightpath_verbs::WorkCompletion;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

/// Completions waiting for one connection, in the order the queue produced them.
pub(crate) struct Inbox {
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// Entries in `queue` (updated under its lock), so an empty look takes no lock.
    len: AtomicUsize,
    /// Readable while a wake-up is pending. Shared with the connection's queue pair where the
    /// provider takes it as the queue pair's own doorbell (`QueuePair::set_waiter_fd`).
    event: Arc<OwnedFd>,
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
            .field("poll_fd", &self.poll_fd().map(|fd| fd.as_raw_fd()))
            .finish_non_exhaustive()
    }
}

impl Inbox {
    pub(crate) fn new() -> io::Result<Self> {
        let event = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            event,
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

    /// Makes the eventfd readable.
    pub(super) fn wake(&self) {
        // Fails only when the counter would overflow, i.e. a wake-up is pending anyway.
        let _ = rustix::io::write(&*self.event, &1u64.to_ne_bytes());
    }

    /// Consumes a pending wake-up; returns whether there was one.
    pub(crate) fn take_wake(&self) -> bool {
        let mut value = [0u8; 8];
        matches!(rustix::io::read(&*self.event, &mut value), Ok(8))
    }

    /// Asks for a wake-up on the next completion (for event loops; see `notify_fd`).
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Withdraws `arm` (the queue pair's own doorbell serves the event loop instead).
    pub(crate) fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The eventfd, for epoll: readable once a completion arrives after `arm`.
    pub(crate) fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// The eventfd itself, to share with the queue pair as its own doorbell.
    pub(super) fn shared_event(&self) -> &Arc<OwnedFd> {
        &self.event
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
        self.sleep_watching(timeout, None, still_needed).woken
    }

    /// [`Inbox::sleep_while`], also ended by `watch` turning readable (a stream's TCP
    /// connection, whose news the caller looks at itself: see `RdmaConn::wait_woken_by`).
    pub(super) fn sleep_watching(
        &self,
        timeout: Duration,
        watch: Option<BorrowedFd<'_>>,
        still_needed: impl FnOnce() -> bool,
    ) -> Slept {
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
            let mut fds = [
                PollFd::new(&*self.event, PollFlags::IN),
                PollFd::from_borrowed_fd(own.unwrap_or(self.event.as_fd()), PollFlags::IN),
                PollFd::from_borrowed_fd(watch.unwrap_or(self.event.as_fd()), PollFlags::IN),
            ];
            // The eventfd, then the queue pair's own descriptor and the watched one if there
            // are (a slot without one repeats the eventfd, unwatched).
            if own.is_none() {
                fds.swap(1, 2);
            }
            let count = 1 + usize::from(own.is_some()) + usize::from(watch.is_some());
            let _ = rustix::event::poll(&mut fds[..count], Some(&timeout));
            let fired = |i: usize| i < count && !fds[i].revents().is_empty();
            // News on the queue pair's own descriptor: the caller's next arming takes it in.
            woken |= own.is_some() && fired(1);
            watched = watch.is_some() && fired(if own.is_some() { 2 } else { 1 });
            // The eventfd is read only when it fired (a wake-up by the queue pair's own
            // descriptor alone, or by none, costs no read). A write it missed (after the sleep
            // ended, or while the arming looked and found work without sleeping) stays
            // pending: the next sleep returns at once and takes it, one more look at most.
            if fired(0) {
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
        assert!(!inbox.take_wake());
        inbox.wake();
        inbox.wake();
        assert!(inbox.take_wake());
        assert!(!inbox.take_wake());
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
