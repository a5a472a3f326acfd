//! The one file descriptor an event loop waits on for an RDMA stream
//! ([`crate::Stream::readiness_fd`]).
//!
//! An RDMA stream has two sources of events: its completion notification fd (the eventfd of
//! its share of the device's completion queue, see `crate::completions`), readable when a
//! completion arrived (data, a credit wake-up from the peer, an acknowledgement), and its TCP
//! connection (the peer's goodbye, or its death). Event loops want one fd per connection, so
//! the stream owns an epoll instance holding both: an epoll fd is itself pollable and reads
//! as readable while any member has an event, so registering it in the application's epoll
//! (or poll, mio, `AsyncFd`) covers both sources.
//!
//! Why readability only, and no real EPOLLOUT: whether a write fits is decided by the credit
//! word the peer RDMA-writes into this side's memory, which no fd can observe; some code has to
//! look at it. Rather than a thread per stream turning that into an fd state, the stream makes
//! sure an *event* arrives when room returns (`poll_ready` tells the peer, once, that this side
//! is blocked; the peer answers with a wake-up record when it has freed room) and `poll_ready`
//! reads the credit word and says precisely whether a write would fit.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use rustix::event::epoll;

/// The epoll instance of one RDMA stream, created on first use so that streams no event loop
/// watches spend no descriptor on it.
#[derive(Debug, Default)]
pub(crate) struct ReadinessEpoll(OnceLock<OwnedFd>);

impl ReadinessEpoll {
    /// The epoll fd watching `notify` (the connection's completion notification fd), `own`
    /// (its queue pair's own descriptor, if it has one: `QueuePair::waiter_poll_fd`), `tcp`
    /// (the liveness connection) and `tasks` (the device's task doorbell, for a connection made
    /// with `Options::event_loop`: `Stream::poll_ready` reads and dispatches it) for
    /// readability; made on the first call.
    pub(crate) fn get_or_create(
        &self,
        notify: Option<RawFd>,
        own: Option<RawFd>,
        tcp: BorrowedFd<'_>,
        tasks: Option<BorrowedFd<'_>>,
    ) -> io::Result<BorrowedFd<'_>> {
        if let Some(fd) = self.0.get() {
            return Ok(fd.as_fd());
        }
        let notify = notify.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "lightpath: this provider's completion queue has no notification fd",
            )
        })?;
        let epoll_fd = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        // SAFETY: `notify` is the notification fd of the completion queue inside the
        // connection the caller borrows to pass `tcp`, so it is open for this whole call; the
        // borrow ends with the call, and epoll keeps its own reference to the open file
        // rather than to the number.
        let notify = unsafe { BorrowedFd::borrow_raw(notify) };
        epoll::add(&epoll_fd, notify, epoll::EventData::new_u64(0), epoll::EventFlags::IN)?;
        epoll::add(&epoll_fd, tcp, epoll::EventData::new_u64(1), epoll::EventFlags::IN)?;
        if let Some(own) = own {
            // SAFETY: as for `notify`: the queue pair's descriptor lives in the connection the
            // caller borrows, for this whole call; epoll keeps its own reference to the file.
            let own = unsafe { BorrowedFd::borrow_raw(own) };
            epoll::add(&epoll_fd, own, epoll::EventData::new_u64(2), epoll::EventFlags::IN)?;
        }
        if let Some(tasks) = tasks {
            epoll::add(&epoll_fd, tasks, epoll::EventData::new_u64(3), epoll::EventFlags::IN)?;
        }
        Ok(self.0.get_or_init(|| epoll_fd).as_fd())
    }
}

/// Whether `socket` would take bytes now (or fail at once: errors and hang-ups count), without
/// waiting.
pub(crate) fn socket_writable(socket: &impl AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(socket, rustix::event::PollFlags::OUT)];
    let now = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    match rustix::event::poll(&mut fds, Some(&now)) {
        Ok(_) => !fds[0].revents().is_empty(),
        // A socket poll(2) cannot look at is one a write fails on at once.
        Err(_) => true,
    }
}
