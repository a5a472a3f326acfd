//! The provider-independent face of an RDMA connection: [`RdmaStream`] is what the
//! [`crate::Stream`] and the tokio driver call, implemented once for [`RdmaConn`] of every
//! provider's device, so the rest of the crate never names a provider type. [`PendingSetup`]
//! does the same for a connection still being negotiated.

use super::*;
use crate::remote::RegisteredBuf;

/// An established RDMA connection of any provider.
pub(crate) trait RdmaStream: crate::reaper::Parked {
    fn read(&mut self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize>;
    /// See `RdmaConn::read_uninit`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn read_uninit(
        &mut self,
        buf: &mut [std::mem::MaybeUninit<u8>],
        deadline: Deadline,
    ) -> io::Result<Option<usize>>;
    fn write(&mut self, buf: &[u8], deadline: Deadline) -> io::Result<usize>;
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>], deadline: Deadline) -> io::Result<usize>;
    fn send_msg(&mut self, msg: &[u8], deadline: Deadline) -> io::Result<()>;
    fn recv_msg(&mut self, deadline: Deadline) -> io::Result<Option<Vec<u8>>>;
    fn flush(&mut self, deadline: Deadline) -> io::Result<()>;
    /// A nonblocking call's step after it found nothing (`RdmaConn::wait` without a deadline).
    #[cfg(test)]
    fn look_without_waiting(&mut self) -> io::Result<()>;
    fn set_cork(&mut self, cork: bool);
    fn set_hold(&mut self, hold: bool);
    /// Posts corked records and pushes kept bytes without waiting (see `RdmaConn::hand_over`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn hand_over(&mut self) -> io::Result<bool>;
    fn shutdown_write(&mut self) -> io::Result<()>;
    fn shutdown_read(&mut self);
    fn close(&mut self);
    fn closed_cleanly(&self) -> bool;
    /// The peer closed its sending side (its close record or its goodbye arrived).
    fn peer_closed_its_side(&self) -> bool;
    fn linger(&self) -> Duration;
    fn tcp(&self) -> &TcpStream;
    fn arm(&mut self, wake: WakeFor, look: PortLook) -> io::Result<bool>;
    /// What a reader that found nothing would wait for (see `RdmaConn::reader_wake`).
    fn reader_wake(&self) -> WakeFor;
    /// Bytes a read could take now, as last polled (no completion is handled): the ring bytes
    /// received and not yet read, or `usize::MAX` when a rendezvous is at the head (its bytes
    /// are fetched straight into the reader's buffer, as many as it offers).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn readable_bytes(&self) -> usize;
    fn notify_fd(&self) -> Option<std::os::fd::RawFd>;
    /// Whether an event loop's task can wait without `notify_fd` (see
    /// `ConnCompletions::wakes_tasks`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn wakes_tasks(&self) -> bool;
    /// See `ConnCompletions::task_doorbell`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn task_doorbell(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskDoorbell>>;
    /// See `RdmaConn::event_loop_spin`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn event_loop_spin(&self) -> std::time::Duration;
    /// See `RdmaConn::task_spin`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn task_spin(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskSpin>>;
    /// See `ConnCompletions::poll_woken`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn poll_woken(&self, waker: &std::task::Waker) -> bool;
    /// The queue pair's own descriptor, watched beside `notify_fd` (see
    /// `ConnCompletions::poll_fd`).
    fn poll_fd(&self) -> Option<std::os::fd::RawFd>;
    /// Consumes a pending notification; returns whether there was one.
    fn take_notify(&mut self) -> bool;
    fn readable_now(&self) -> bool;
    /// Whether everything written is in the transport's hands, from what is known without a
    /// look (see `Stream::handed_over_now`).
    fn handed_over_now(&self) -> bool;
    fn writable_now(&mut self) -> bool;
    fn poll_tcp(&mut self);
    /// See `RdmaConn::set_tcp_watched`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn set_tcp_watched(&mut self, watched: bool);
    /// The TCP connection ended, as last looked at (see `RdmaConn::tcp_ended`).
    #[cfg_attr(not(any(feature = "tokio", test)), allow(dead_code))] // the tokio driver, tests
    fn tcp_ended(&self) -> bool;
    /// Completions and credit returns handled so far (see `RdmaConn::events`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn events(&self) -> u64;
    /// The part of those a reader waits for (see `RdmaConn::arrivals`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn arrivals(&self) -> u64;
    /// Posts the probe (see `RdmaConn::start_probe`).
    fn start_probe(&mut self) -> io::Result<()>;
    /// The probe's outcome once its completion came; never waits.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn probe_outcome(&mut self) -> Option<io::Result<()>>;
    /// Waits at most `timeout` for the probe's outcome.
    fn wait_probe(&mut self, timeout: Duration) -> io::Result<()>;
    /// Asks for the notification fds ([`RdmaStream::notification_fds`]) to become readable on
    /// the next completion, without handling any (an event loop arms, then looks, then waits).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn request_notify(&mut self) -> io::Result<()>;
    /// Descriptors of the connection's completion notification fd and of its queue pair's own
    /// descriptor if it has one, for an event loop to wait on (any of them) before the stream
    /// exists (the negotiation's probe).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    fn notification_fds(&self) -> io::Result<Vec<std::os::fd::OwnedFd>>;
    fn activate(&mut self) -> io::Result<()>;
    /// One nonblocking drive without looking at the TCP connection (see `RdmaConn::drive`).
    fn drive(&mut self) -> io::Result<crate::stream::Driven>;
    fn register(&self, len: usize) -> io::Result<RegisteredBuf>;
    #[allow(clippy::too_many_arguments)]
    fn write_remote(
        &mut self,
        local: &RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        notify: Option<u32>,
        deadline: Deadline,
    ) -> io::Result<()>;
    fn read_remote(
        &mut self,
        local: &RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        deadline: Deadline,
    ) -> io::Result<()>;
    fn write_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()>;
    fn recv_notify(&mut self, deadline: Deadline) -> io::Result<u32>;
    fn read_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<usize>;
    fn send_msg_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()>;
    fn recv_msg_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        deadline: Deadline,
    ) -> io::Result<Option<usize>>;
    /// Hands the connection to the reaper (see [`crate::reaper`]).
    fn into_parked(self: Box<Self>) -> Box<dyn crate::reaper::Parked>;
    /// If no write would fit now, tells the peer (once) so that it wakes this side when room
    /// returns: credit returns alone raise no completion here (see `crate::readiness`).
    fn note_write_blocked(&mut self);
    /// One nonblocking step of a clean close: queues the close record, posts what it can and
    /// reads the TCP connection; true once [`RdmaStream::close`] would not wait.
    fn close_would_finish(&mut self) -> bool;
    /// The connection's queue pair, for provider-specific queries (counters).
    fn queue_pair(&self) -> &dyn std::any::Any;
}

impl<D: Device + 'static> RdmaStream for RdmaConn<D>
where
    MrOf<D>: crate::remote::BufRegion + 'static,
{
    fn queue_pair(&self) -> &dyn std::any::Any {
        self.queue_pair_ref()
    }
    fn read(&mut self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        RdmaConn::read(self, buf, deadline)
    }
    fn read_uninit(
        &mut self,
        buf: &mut [std::mem::MaybeUninit<u8>],
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        RdmaConn::read_uninit(self, buf, deadline)
    }
    fn write(&mut self, buf: &[u8], deadline: Deadline) -> io::Result<usize> {
        RdmaConn::write(self, buf, deadline)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>], deadline: Deadline) -> io::Result<usize> {
        RdmaConn::write_vectored(self, bufs, deadline)
    }
    fn send_msg(&mut self, msg: &[u8], deadline: Deadline) -> io::Result<()> {
        RdmaConn::send_msg(self, msg, deadline)
    }
    fn recv_msg(&mut self, deadline: Deadline) -> io::Result<Option<Vec<u8>>> {
        RdmaConn::recv_msg(self, deadline)
    }
    fn flush(&mut self, deadline: Deadline) -> io::Result<()> {
        RdmaConn::flush(self, deadline)
    }
    #[cfg(test)]
    fn look_without_waiting(&mut self) -> io::Result<()> {
        RdmaConn::wait(self, Deadline::Now)
    }
    fn set_cork(&mut self, cork: bool) {
        RdmaConn::set_cork(self, cork)
    }
    fn set_hold(&mut self, hold: bool) {
        RdmaConn::set_hold(self, hold)
    }
    fn hand_over(&mut self) -> io::Result<bool> {
        RdmaConn::hand_over(self)
    }
    fn shutdown_write(&mut self) -> io::Result<()> {
        RdmaConn::shutdown_write(self)
    }
    fn shutdown_read(&mut self) {
        RdmaConn::shutdown_read(self)
    }
    fn close(&mut self) {
        RdmaConn::close(self)
    }
    fn closed_cleanly(&self) -> bool {
        RdmaConn::closed_cleanly(self)
    }
    fn peer_closed_its_side(&self) -> bool {
        self.core.at_eof() || self.peer_bye.is_some()
    }
    fn linger(&self) -> Duration {
        RdmaConn::linger(self)
    }
    fn tcp(&self) -> &TcpStream {
        RdmaConn::tcp(self)
    }
    fn arm(&mut self, wake: WakeFor, look: PortLook) -> io::Result<bool> {
        RdmaConn::arm(self, wake, look)
    }
    fn reader_wake(&self) -> WakeFor {
        RdmaConn::reader_wake(self)
    }
    fn readable_bytes(&self) -> usize {
        match self.core.front() {
            Some(front) if front.kind == RecordKind::Rendezvous => usize::MAX,
            _ => usize::try_from(self.core.readable_bytes()).unwrap_or(usize::MAX),
        }
    }
    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        RdmaConn::notify_fd(self)
    }
    fn wakes_tasks(&self) -> bool {
        RdmaConn::wakes_tasks(self)
    }
    fn poll_woken(&self, waker: &std::task::Waker) -> bool {
        RdmaConn::poll_woken(self, waker)
    }
    fn task_doorbell(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskDoorbell>> {
        RdmaConn::task_doorbell(self)
    }
    fn event_loop_spin(&self) -> std::time::Duration {
        RdmaConn::event_loop_spin(self)
    }
    fn task_spin(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskSpin>> {
        RdmaConn::task_spin(self)
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        RdmaConn::poll_fd(self)
    }
    fn take_notify(&mut self) -> bool {
        RdmaConn::take_notify(self)
    }
    fn readable_now(&self) -> bool {
        RdmaConn::readable_now(self)
    }
    fn handed_over_now(&self) -> bool {
        RdmaConn::handed_over_now(self)
    }
    fn writable_now(&mut self) -> bool {
        RdmaConn::writable_now(self)
    }
    fn poll_tcp(&mut self) {
        RdmaConn::poll_tcp(self)
    }
    fn set_tcp_watched(&mut self, watched: bool) {
        RdmaConn::set_tcp_watched(self, watched)
    }
    fn tcp_ended(&self) -> bool {
        RdmaConn::tcp_ended(self)
    }
    fn events(&self) -> u64 {
        RdmaConn::events(self)
    }
    fn arrivals(&self) -> u64 {
        RdmaConn::arrivals(self)
    }
    fn start_probe(&mut self) -> io::Result<()> {
        RdmaConn::start_probe(self)
    }
    fn probe_outcome(&mut self) -> Option<io::Result<()>> {
        RdmaConn::probe_outcome(self)
    }
    fn wait_probe(&mut self, timeout: Duration) -> io::Result<()> {
        RdmaConn::wait_probe(self, timeout)
    }
    fn request_notify(&mut self) -> io::Result<()> {
        // No room for completions: whatever is there is routed to the inbox, for the look.
        self.cq.request_notify(&self.qp, &mut [], WakeFor::Anything, PortLook::TakeIn).map(drop)
    }
    fn notification_fds(&self) -> io::Result<Vec<std::os::fd::OwnedFd>> {
        self.cq.notification_fds()
    }
    fn activate(&mut self) -> io::Result<()> {
        RdmaConn::activate(self)
    }
    fn drive(&mut self) -> io::Result<crate::stream::Driven> {
        RdmaConn::drive(self)
    }
    fn register(&self, len: usize) -> io::Result<RegisteredBuf> {
        let mr = RdmaConn::register(self, len)?;
        Ok(RegisteredBuf::new(Box::new(mr), self.id))
    }
    fn write_remote(
        &mut self,
        local: &RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        notify: Option<u32>,
        deadline: Deadline,
    ) -> io::Result<()> {
        let local = local.region_for(self.id)?;
        RdmaConn::write_remote(self, local, local_offset, remote, remote_offset, len, notify, deadline)
    }
    fn read_remote(
        &mut self,
        local: &RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        deadline: Deadline,
    ) -> io::Result<()> {
        let local = local.region_for(self.id)?;
        RdmaConn::read_remote(self, local, local_offset, remote, remote_offset, len, deadline)
    }
    fn write_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()> {
        let local = local.region_for(self.id)?;
        RdmaConn::write_buf(self, local, offset, len, deadline)
    }
    fn recv_notify(&mut self, deadline: Deadline) -> io::Result<u32> {
        RdmaConn::recv_notify(self, deadline)
    }
    fn read_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<usize> {
        let local = local.region_for(self.id)?;
        RdmaConn::read_buf(self, local, offset, len, deadline)
    }
    fn send_msg_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()> {
        let local = local.region_for(self.id)?;
        RdmaConn::send_msg_buf(self, local, offset, len, deadline)
    }
    fn recv_msg_buf(
        &mut self,
        local: &RegisteredBuf,
        offset: usize,
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        let local = local.region_for(self.id)?;
        RdmaConn::recv_msg_buf(self, local, offset, deadline)
    }
    fn into_parked(self: Box<Self>) -> Box<dyn crate::reaper::Parked> {
        self
    }
    fn note_write_blocked(&mut self) {
        self.read_slot();
        if self.core.send_room(RecordKind::Data, 1).is_none() {
            self.core.note_blocked();
            self.post_ops();
        }
    }
    fn close_would_finish(&mut self) -> bool {
        if self.failed.is_some() || self.peer_vanished() {
            return true;
        }
        self.core.uncork();
        self.core.shutdown();
        if self.core.has_pending() {
            self.pump();
        } else {
            // All our records are posted: only collect their acknowledgements. Answering a
            // peer that keeps writing would post a new signaled record every step, and the
            // close would never look flushed.
            self.collect_completions();
        }
        self.check_tcp();
        self.failed.is_some() || self.core.is_flushed() || self.tcp_eof
    }
}

/// A connection being negotiated: verbs objects made, the peer's endpoint not yet known.
pub(crate) trait PendingSetup: Send {
    /// What the peer needs to reach this side.
    fn endpoint(&self) -> RdmaEndpoint;
    /// Connects to the peer (see [`RdmaSetup::connect`]).
    fn connect(
        self: Box<Self>,
        peer: &RdmaEndpoint,
        tcp: TcpStream,
        version: u8,
    ) -> io::Result<Box<dyn RdmaStream>>;
}

impl<D: Device + 'static> PendingSetup for RdmaSetup<D>
where
    MrOf<D>: crate::remote::BufRegion + 'static,
{
    fn endpoint(&self) -> RdmaEndpoint {
        RdmaSetup::endpoint(self)
    }
    fn connect(
        self: Box<Self>,
        peer: &RdmaEndpoint,
        tcp: TcpStream,
        version: u8,
    ) -> io::Result<Box<dyn RdmaStream>> {
        Ok(Box::new(RdmaSetup::connect(*self, peer, tcp, version)?))
    }
}
