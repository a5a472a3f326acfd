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
    /// socket could block our writes forever, a file would take them), and it is made
    /// non-blocking for the same reason.
    ///
    /// The check is one `fstat`: the file must be the kernel's shared anonymous inode, as this
    /// process's own eventfds are. Besides eventfds, only files whose `write` fails at once
    /// share it (epoll, timerfd, signalfd, inotify), which a doorbell ring then does harmlessly.
    /// Where that inode is not shared (a kernel that gives eventfds inodes of their own), the
    /// name under `/proc/self/fd` decides, as it always did before: the `readlink` cost ~2% of
    /// the CPU of connection set-up (two doorbells per connection).
    pub(crate) fn from_peer(fd: OwnedFd) -> io::Result<Self> {
        let anonymous = |stat: rustix::fs::Stat| Some((stat.st_dev, stat.st_ino)) == *own_eventfd_inode();
        if !rustix::fs::fstat(&fd).is_ok_and(anonymous) {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
            if link.as_os_str() != "anon_inode:[eventfd]" {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "peer doorbell is not an eventfd"));
            }
        }
        let flags = fcntl_getfl(&fd)?;
        if !flags.contains(OFlags::NONBLOCK) {
            fcntl_setfl(&fd, flags | OFlags::NONBLOCK)?;
        }
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

/// The device and inode number of an eventfd of this process (`None` if one could not be
/// made or looked at), found once.
fn own_eventfd_inode() -> &'static Option<(u64, u64)> {
    static INODE: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    INODE.get_or_init(|| {
        let fd = eventfd(0, EventfdFlags::CLOEXEC).ok()?;
        let stat = rustix::fs::fstat(&fd).ok()?;
        Some((stat.st_dev, stat.st_ino))
    })
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
        let (socket, _other) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        assert!(EventFd::from_peer(OwnedFd::from(socket)).is_err(), "a socket is refused");
        let memfd =
            rustix::fs::memfd_create("lightpath-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        assert!(EventFd::from_peer(memfd).is_err(), "a file is refused");
        let blocking = eventfd(0, EventfdFlags::CLOEXEC).expect("a blocking eventfd");
        let peer = EventFd::from_peer(blocking).expect("an eventfd is accepted");
        assert!(fcntl_getfl(&peer.0).expect("flags").contains(OFlags::NONBLOCK), "left blocking");
    }
}
