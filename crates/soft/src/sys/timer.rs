//! A one-shot monotonic timer behind a file descriptor (Linux `timerfd`), so that a thread
//! asleep in `ppoll` can be woken at a moment another thread chose, without a wake-up now.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec,
};

/// A non-blocking, close-on-exec one-shot timer; readable once it has expired.
#[derive(Debug)]
pub(crate) struct OneShotTimer(OwnedFd);

impl OneShotTimer {
    pub(crate) fn new() -> io::Result<Self> {
        let fd = timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC)?;
        Ok(Self(fd))
    }

    /// Expires `after` from now, replacing any earlier setting (a zero duration disarms).
    pub(crate) fn arm(&self, after: Duration) {
        let value = Timespec {
            tv_sec: after.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: after.subsec_nanos().into(),
        };
        let spec = Itimerspec { it_interval: Timespec { tv_sec: 0, tv_nsec: 0 }, it_value: value };
        // Fails only on a bad descriptor or value, neither of which can happen here; a timer
        // that did not arm costs at most a late hand-over, never a lost datagram.
        let _ = timerfd_settime(&self.0, TimerfdTimerFlags::empty(), &spec);
    }

    /// Consumes an expiry, if any, so the fd is no longer readable.
    pub(crate) fn take(&self) {
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&self.0, &mut count);
    }
}

impl AsFd for OneShotTimer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expires_once_after_the_delay_and_rearming_postpones() {
        let timer = OneShotTimer::new().expect("timerfd");
        timer.arm(Duration::from_millis(30));
        let fds = [timer.as_fd()];
        assert_eq!(crate::sys::wait_readable(&fds, Some(Duration::ZERO)).expect("poll"), 0, "not yet");
        timer.arm(Duration::from_millis(60));
        assert_eq!(crate::sys::wait_readable(&fds, Some(Duration::from_secs(5))).expect("poll"), 1);
        timer.take();
        assert_eq!(crate::sys::wait_readable(&fds, Some(Duration::ZERO)).expect("poll"), 0, "taken");
        timer.arm(Duration::from_millis(20));
        timer.arm(Duration::ZERO);
        assert_eq!(
            crate::sys::wait_readable(&fds, Some(Duration::from_millis(50))).expect("poll"),
            0,
            "disarmed"
        );
    }
}
