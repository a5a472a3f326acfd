//! Waiting for several descriptors at once, with a timeout.

use std::io;
use std::time::Duration;

use rustix::event::Timespec;
use rustix::event::{poll, PollFd};

/// Blocks until one of `fds` has an event or `timeout` passes (`None`: no timeout); returns
/// how many have events. An interrupted wait returns 0.
pub(crate) fn poll_fds(fds: &mut [PollFd<'_>], timeout: Option<Duration>) -> io::Result<usize> {
    let spec = timeout.map(|d| Timespec {
        tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(d.subsec_nanos()),
    });
    match poll(fds, spec.as_ref()) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(err) => Err(err.into()),
    }
}
