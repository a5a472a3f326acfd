//! The driver thread: moves the engine forward while the application does not.
//!
//! It applies the events the socket thread posts (introductions, hang-ups) as soon as the bell
//! rings, and once the application has not driven the device for `ShmConfig::idle_after` (or
//! armed a notification) it sleeps *armed* — peers ring the doorbell when they publish
//! something — and processes what arrived each time it is rung or an RNR timer expires. It
//! watches the doorbell only while armed, and always looks for news after taking a ring:
//! peers ring once per sleep, so a ring it swallowed without looking could leave a blocked
//! waiter, for whom it was meant, asleep. It never blocks on the engine lock; it may block in a region question to a peer device, which
//! is why it is not the thread that answers them (see the [module docs](super)).

use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::config::ShmConfig;
use crate::device::DeviceShared;
use crate::engine::DeviceCore;
use crate::sys::poll_fds;

/// How soon to retry when the engine lock was busy.
const LOCK_RETRY: Duration = Duration::from_micros(100);

/// The thread's state between rounds.
struct Driver<'a> {
    shared: &'a DeviceShared,
    /// This thread counts as a sleeper (peers ring).
    armed: bool,
    /// It took a ring of the doorbell and has not looked at the marks since: whoever takes a
    /// ring must (it may have been meant for another sleeper, and peers ring once per sleep).
    rung: bool,
    retry_lock: bool,
    deadline: Option<Instant>,
    /// The application's drive counter as last seen, and when it last changed.
    drives_seen: u64,
    last_activity: Option<Instant>,
    /// When the application last armed a notification (see `app_active`).
    kicked_at: Option<Instant>,
}

/// The thread body; returns when the device's stop fd is signalled.
pub(super) fn run(shared: &DeviceShared) {
    let mut driver = Driver {
        shared,
        armed: false,
        rung: false,
        retry_lock: false,
        deadline: None,
        drives_seen: 0,
        last_activity: None,
        kicked_at: None,
    };
    while driver.round() {}
    if driver.armed {
        shared.lock_core().disarm();
    }
}

/// Which descriptors had events in one `poll`.
struct Ready {
    stop: bool,
    kick: bool,
    doorbell: bool,
    bell: bool,
}

impl Driver<'_> {
    fn config(&self) -> &ShmConfig {
        &self.shared.ctx.config
    }

    /// Whether the application drove the device within the last `idle_after`.
    ///
    /// For `idle_after` after the application armed a notification it counts as idle whatever
    /// it does: the notification protocol polls the queue empty right after arming and then
    /// waits on the fd, and those last polls must not keep the driver napping while the
    /// application sleeps. An application that keeps polling after that is active again.
    fn app_active(&mut self) -> bool {
        let now = Instant::now();
        let drives = self.shared.drives();
        if let Some(kicked) = self.kicked_at {
            self.drives_seen = drives;
            if now.duration_since(kicked) >= self.config().idle_after {
                self.kicked_at = None;
            }
            return false;
        }
        if drives != self.drives_seen {
            self.drives_seen = drives;
            self.last_activity = Some(now);
        }
        self.last_activity.is_some_and(|last| now.duration_since(last) < self.config().idle_after)
    }

    fn timeout(&mut self) -> Option<Duration> {
        let active = self.app_active();
        if self.retry_lock {
            Some(LOCK_RETRY)
        } else if active {
            Some(self.config().idle_after)
        } else if !self.armed {
            // The application went idle since the last round, which left the work to it and
            // did not arm: arm (and look) now. Sleeping unarmed without a timeout would wait
            // for a ring no peer sends — a peer rings only sleepers — while what the peers
            // published sits unprocessed (seen: a WRITE with immediate never acknowledged,
            // its requester blocked for good, about once in a hundred runs of `many_links`
            // on a loaded machine).
            Some(Duration::ZERO)
        } else {
            self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
        }
    }

    fn wait(&mut self) -> Ready {
        let timeout = self.timeout();
        let shared = self.shared;
        let mut fds = vec![
            PollFd::new(&shared.stop, PollFlags::IN),
            PollFd::new(&shared.kick, PollFlags::IN),
            PollFd::new(&shared.events_bell, PollFlags::IN),
        ];
        // Only a sleeper may take the doorbell: peers ring once per sleep, so a ring taken by
        // a thread that then does not look at the marks would leave the sleeper it was meant
        // for (a blocked waiter) asleep.
        if self.armed {
            fds.push(PollFd::new(&shared.ctx.doorbell, PollFlags::IN));
        }
        if poll_fds(&mut fds, timeout).is_err() {
            // Only EINVAL/ENOMEM are possible here; back off instead of spinning.
            std::thread::sleep(Duration::from_millis(1));
            return Ready { stop: false, kick: false, doorbell: false, bell: false };
        }
        let has = |index: usize| fds.get(index).is_some_and(|fd: &PollFd<'_>| !fd.revents().is_empty());
        Ready { stop: has(0), kick: has(1), bell: has(2), doorbell: has(3) }
    }

    /// One round: wait, take what rang, drive the engine. Returns false to stop.
    fn round(&mut self) -> bool {
        let ready = self.wait();
        if ready.stop {
            return false;
        }
        if ready.doorbell {
            self.shared.ctx.doorbell.take();
            self.rung = true;
        }
        if ready.bell {
            // The events themselves are taken from the mailbox under the engine lock.
            self.shared.events_bell.take();
        }
        if ready.kick {
            // The application armed a notification and is about to wait for it: treat it as
            // idle from now on (its next call that drives the device makes it active again).
            self.shared.kick.take();
            self.kicked_at = Some(Instant::now());
            self.last_activity = None;
        }
        self.drive();
        true
    }

    /// Applies events and, when the application is idle, processes arrivals and sleeps armed.
    fn drive(&mut self) {
        if !self.armed && self.app_active() && !self.shared.has_events() {
            // The application polls: it applies events and does the work itself; taking its
            // lock here would only get in its way.
            self.retry_lock = false;
            self.deadline = None;
            return;
        }
        let Some(mut core) = crate::engine::try_lock(&self.shared.core) else {
            self.retry_lock = true;
            return;
        };
        self.retry_lock = false;
        self.shared.apply_events(&mut core);
        self.step(&mut core);
    }

    fn step(&mut self, core: &mut DeviceCore) {
        let rung = std::mem::take(&mut self.rung);
        if self.app_active() {
            // The application polls: it does the work, and peers need not ring this thread.
            if self.armed {
                core.disarm();
                self.armed = false;
            }
            if rung {
                core.progress();
            }
            self.deadline = None;
            return;
        }
        // A fresh sleep each round, so peers that rang for the last one ring again.
        if self.armed {
            core.disarm();
        }
        core.arm();
        self.armed = true;
        self.deadline = core.progress();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ShmDevice;

    fn driver(shared: &DeviceShared) -> Driver<'_> {
        Driver {
            shared,
            armed: false,
            rung: false,
            retry_lock: false,
            deadline: None,
            drives_seen: shared.drives(),
            last_activity: None,
            kicked_at: None,
        }
    }

    #[test]
    fn an_idle_application_makes_the_thread_arm_before_it_sleeps() {
        let device = ShmDevice::open(ShmConfig::default()).expect("device");
        let shared = &device.inner.shared;
        let idle_after = shared.ctx.config.idle_after;
        // The last round saw the application active (so it neither armed nor set a deadline);
        // it has been idle since.
        let mut driver = driver(shared);
        driver.last_activity = Some(Instant::now() - idle_after * 2);
        assert_eq!(driver.timeout(), Some(Duration::ZERO), "an unarmed idle thread would sleep for good");
        // Armed with nothing due: it sleeps until rung.
        driver.armed = true;
        assert_eq!(driver.timeout(), None);
        // While the application drives the device the thread naps for idle_after.
        driver.armed = false;
        shared.touch();
        assert_eq!(driver.timeout(), Some(idle_after));
    }
}
