//! Waiting for any of a few descriptors to become readable, with a timeout.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Blocks until one of `fds` is readable or `timeout` passes (`None`: no timeout). Returns a
/// bit mask of the readable ones (bit `i` for `fds[i]`; at most 8 descriptors). Interrupted
/// waits return an empty mask.
pub(crate) fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<u8> {
    const MAX: usize = 8;
    assert!(fds.len() <= MAX, "wait_readable takes at most {MAX} descriptors");
    let mut pollfds = [libc::pollfd { fd: -1, events: 0, revents: 0 }; MAX];
    for (slot, fd) in pollfds.iter_mut().zip(fds) {
        *slot = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    }
    // ppoll rather than poll: engine timers (RNR waits of tens of microseconds) need better
    // than millisecond resolution.
    let spec = timeout.map(|d| libc::timespec {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let spec_ptr = spec.as_ref().map_or(std::ptr::null(), |s| s as *const libc::timespec);
    // SAFETY: `pollfds` is a live array of at least `fds.len()` initialised entries, each
    // descriptor stays open for the call because the caller borrows it, the timeout is null or
    // points to a live timespec, and a null signal mask means "leave the mask alone".
    let ret =
        unsafe { libc::ppoll(pollfds.as_mut_ptr(), fds.len() as libc::nfds_t, spec_ptr, std::ptr::null()) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        return if err.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(err) };
    }
    let mut mask = 0u8;
    for (i, slot) in pollfds[..fds.len()].iter().enumerate() {
        if slot.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
            mask |= 1 << i;
        }
    }
    Ok(mask)
}
