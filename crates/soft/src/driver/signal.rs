//! Per-completion-queue wake-up state: the user-visible notification fd (armed by
//! `request_notify`, one shot) and the internal fd blocked `wait` callers sleep on.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

use lightpath_verbs::CompletionHook;

use crate::sys::EventFd;

/// How completions on one queue wake whoever waits for them.
pub(crate) struct CqSignal {
    /// Readable after `request_notify` once a completion is added (what `notify_fd` returns).
    /// Made when first asked for: a queue whose waiters block in `wait` never needs it, and an
    /// eventfd per queue is a descriptor per connection (issue 15).
    notify: OnceLock<EventFd>,
    armed: AtomicBool,
    /// Semaphore eventfd blocked waiters sleep on; each waiter takes one unit when it wakes.
    pub(crate) wake: EventFd,
    waiters: AtomicU32,
    /// Called once the engine is unlocked after the queue gained entries (see
    /// `CompletionQueue::set_completion_hook` and `CoreGuard`).
    hook: OnceLock<CompletionHook>,
    /// The queue may hold entries: set (with the engine locked) when it gains some, cleared
    /// (locked too) by a poll that emptied it, so a poll of an empty queue takes no lock.
    pub(crate) maybe_nonempty: AtomicBool,
}

impl std::fmt::Debug for CqSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqSignal")
            .field("armed", &self.armed)
            .field("waiters", &self.waiters)
            .field("hook", &self.hook.get().is_some())
            .finish()
    }
}

impl CqSignal {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            notify: OnceLock::new(),
            armed: AtomicBool::new(false),
            wake: EventFd::new(true)?,
            waiters: AtomicU32::new(0),
            hook: OnceLock::new(),
            maybe_nonempty: AtomicBool::new(false),
        })
    }

    /// Installs the completion hook; `false` if one is installed already.
    pub(crate) fn set_hook(&self, hook: CompletionHook) -> bool {
        self.hook.set(hook).is_ok()
    }

    /// The completion hook, if one is installed.
    pub(crate) fn hook(&self) -> Option<&CompletionHook> {
        self.hook.get()
    }

    /// Called (with the engine locked) whenever the queue gained entries; `by_waiter`: by one
    /// of the queue's registered waiters, which polls the queue next (so it needs no wake-up
    /// of its own when it is the only one).
    pub(crate) fn completion_added(&self, by_waiter: bool) {
        self.maybe_nonempty.store(true, Ordering::SeqCst);
        if self.armed.swap(false, Ordering::AcqRel) {
            if let Some(notify) = self.notify.get() {
                notify.signal(1);
            }
        }
        // The waiter count is raised before a waiter checks the queue (both under the engine
        // lock for the check), so a waiter either sees the entries or is counted here.
        let waiters = self.waiters.load(Ordering::SeqCst);
        let others = if by_waiter { waiters.saturating_sub(1) } else { waiters };
        if others > 0 {
            self.wake.signal(u64::from(others));
        }
    }

    /// The notification fd, made on first use.
    pub(crate) fn notify_fd(&self) -> std::io::Result<RawFd> {
        if let Some(notify) = self.notify.get() {
            return Ok(notify.as_raw_fd());
        }
        // Two threads may both make one; the one that loses closes its own.
        let _ = self.notify.set(EventFd::new(false)?);
        Ok(self.notify.get().expect("set above or by another thread").as_raw_fd())
    }

    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Consumes a pending user notification.
    pub(crate) fn take_notify(&self) -> bool {
        self.notify.get().is_some_and(|notify| notify.take() > 0)
    }

    /// Registers a blocked waiter until the guard is dropped.
    pub(crate) fn register_waiter(&self) -> WaiterGuard<'_> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        WaiterGuard(self)
    }
}

/// Keeps a waiter counted while it exists.
pub(crate) struct WaiterGuard<'a>(&'a CqSignal);

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}
