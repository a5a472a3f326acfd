//! The notifier: a thread per hub, started when the first connection arms its inbox for an
//! event loop, that keeps the shared queue's notification armed and routes every completion
//! as it lands. An event loop's task cannot lead (it must not block), and waking every armed
//! connection whenever the shared queue fires would wake a thousand tasks for one
//! completion; this thread turns one queue event into exactly the inbox wake-ups it is for.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use lightpath_verbs::{CompletionQueue, Device};
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

use super::hub::Hub;

/// How often the thread looks whether its hub is gone, if nothing wakes it.
const CHECK_GONE: Duration = Duration::from_secs(1);
/// How long to wait between polls when the provider has no notification fd.
const NO_FD_NAP: Duration = Duration::from_millis(1);

/// Owns the stop signal of a hub's notifier thread (which is detached: it may be the one
/// dropping the hub, so nobody joins it).
pub(super) struct Notifier {
    stop: Arc<OwnedFd>,
}

impl Drop for Notifier {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &1u64.to_ne_bytes());
    }
}

impl Notifier {
    /// Starts the thread for `hub`.
    pub(super) fn start<D: Device + 'static>(hub: &Arc<Hub<D>>) -> io::Result<Notifier> {
        let stop = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        let notify = match hub.cq().notify_fd() {
            Some(raw) => {
                // SAFETY: `raw` is the notification fd of the queue `hub` owns, open while we
                // hold `hub`; the duplicate made here is a descriptor of its own for the same
                // open file, so the thread may sleep on it without keeping the hub alive.
                let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
                Some(borrowed.try_clone_to_owned()?)
            }
            None => None,
        };
        let weak = Arc::downgrade(hub);
        let thread_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("lightpath-cq-notifier".into())
            .spawn(move || run(weak, notify, &thread_stop))?;
        Ok(Notifier { stop })
    }
}

fn run<D: Device>(hub: Weak<Hub<D>>, notify: Option<OwnedFd>, stop: &OwnedFd) {
    loop {
        {
            let Some(hub) = hub.upgrade() else { return };
            // Arm first, then route: a completion that lands after the last poll raises the
            // notification; one before it is routed here.
            let armed = hub.cq().request_notify().is_ok();
            let _ = hub.route_now();
            if !armed {
                std::thread::sleep(NO_FD_NAP);
                continue;
            }
        }
        let timeout = match notify {
            Some(_) => CHECK_GONE,
            None => NO_FD_NAP,
        };
        let stop_fd = stop.as_fd();
        let mut fds = vec![PollFd::new(&stop_fd, PollFlags::IN)];
        if let Some(notify) = &notify {
            fds.push(PollFd::new(notify, PollFlags::IN));
        }
        let timespec =
            Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
        let _ = rustix::event::poll(&mut fds, Some(&timespec));
        if !fds[0].revents().is_empty() {
            return;
        }
        if let Some(hub) = hub.upgrade() {
            let _ = hub.cq().take_notify();
        }
    }
}
