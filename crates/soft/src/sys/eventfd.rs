//! Linux eventfds: a counter behind a file descriptor, used to wake the progress thread and
//! blocked waiters, and as the pollable readiness fd of a completion queue.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use super::check;

/// A non-blocking, close-on-exec eventfd.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd at 0. In semaphore mode each read takes one unit instead of all.
    pub(crate) fn new(semaphore: bool) -> io::Result<Self> {
        let mut flags = libc::EFD_NONBLOCK | libc::EFD_CLOEXEC;
        if semaphore {
            flags |= libc::EFD_SEMAPHORE;
        }
        // SAFETY: eventfd takes no pointers; on success it returns a new descriptor we own.
        let fd = check(unsafe { libc::eventfd(0, flags) })?;
        // SAFETY: `fd` was just returned by eventfd, is open, and nothing else owns it.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds `n` to the counter, making the fd readable.
    pub(crate) fn signal(&self, n: u64) {
        let bytes = n.to_ne_bytes();
        // SAFETY: the descriptor is open (we own it) and `bytes` is a live 8-byte buffer.
        let ret = unsafe { libc::write(self.0.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        // The write fails only if the counter would overflow (EAGAIN), in which case the fd is
        // readable already, which is all a signal needs to achieve.
        let _ = ret;
    }

    /// Takes the counter (or one unit in semaphore mode) without blocking; 0 if it was 0.
    pub(crate) fn take(&self) -> u64 {
        let mut bytes = [0u8; 8];
        // SAFETY: the descriptor is open and `bytes` is a live, writable 8-byte buffer.
        let ret = unsafe { libc::read(self.0.as_raw_fd(), bytes.as_mut_ptr().cast(), bytes.len()) };
        if ret == 8 {
            u64::from_ne_bytes(bytes)
        } else {
            0
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
