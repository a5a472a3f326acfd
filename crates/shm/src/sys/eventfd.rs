//! Eventfds: the doorbells of the shm provider. A device's doorbell is handed to every peer,
//! which writes it when the device asked to be woken; a completion queue's notification fd is
//! what epoll/poll/tokio wait on.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use rustix::event::{eventfd, EventfdFlags};
use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};

/// A non-blocking eventfd.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd at 0. In semaphore mode each read takes one unit instead of all.
    pub(crate) fn new(semaphore: bool) -> io::Result<Self> {
        let mut flags = EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC;
        if semaphore {
            flags |= EventfdFlags::SEMAPHORE;
        }
        Ok(Self(eventfd(0, flags)?))
    }

    /// Accepts a descriptor from a peer as its doorbell: it must be an eventfd (a pipe or
    /// socket could block our writes forever), and it is made non-blocking for the same reason.
    pub(crate) fn from_peer(fd: OwnedFd) -> io::Result<Self> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if link.as_os_str() != "anon_inode:[eventfd]" {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "peer doorbell is not an eventfd"));
        }
        let flags = fcntl_getfl(&fd)?;
        fcntl_setfl(&fd, flags | OFlags::NONBLOCK)?;
        Ok(Self(fd))
    }

    /// Adds `n` to the counter, making the fd readable.
    pub(crate) fn signal(&self, n: u64) {
        // The write fails only if the counter would overflow (EAGAIN), in which case the fd is
        // readable already, which is all a signal has to achieve.
        let _ = rustix::io::write(&self.0, &n.to_ne_bytes());
    }

    /// Takes the counter (one unit in semaphore mode) without blocking; 0 if it was 0.
    pub(crate) fn take(&self) -> u64 {
        let mut bytes = [0u8; 8];
        match rustix::io::read(&self.0, &mut bytes) {
            Ok(8) => u64::from_ne_bytes(bytes),
            _ => 0,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_and_take() {
        let fd = EventFd::new(false).expect("eventfd");
        assert_eq!(fd.take(), 0);
        fd.signal(2);
        fd.signal(3);
        assert_eq!(fd.take(), 5);
        let semaphore = EventFd::new(true).expect("eventfd");
        semaphore.signal(2);
        assert_eq!((semaphore.take(), semaphore.take(), semaphore.take()), (1, 1, 0));
    }

    #[test]
    fn only_eventfds_are_accepted_from_peers() {
        let own = EventFd::new(false).expect("eventfd");
        let copy = own.0.try_clone().expect("dup");
        let peer = EventFd::from_peer(copy).expect("an eventfd is accepted");
        peer.signal(1);
        assert_eq!(own.take(), 1);
        let (reader, _writer) = std::io::pipe().expect("pipe");
        assert!(EventFd::from_peer(OwnedFd::from(reader)).is_err(), "a pipe is refused");
    }
}
