//! [`Stream`]: a connected Lightpath stream, used like `std::net::TcpStream`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use lightpath_stream::negotiate::{FallbackReason, ProviderId};

use crate::completions::PortLook;
use crate::negotiate::{self, Negotiated};
use crate::options::Options;
use crate::rdma::{Deadline, RdmaStream};
use crate::tcp::TcpConn;

/// Which transport carries a stream's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// RDMA with this provider (the TCP connection only watches liveness).
    Rdma(ProviderId),
    /// The TCP connection, with a Lightpath peer that could not use RDMA (and why).
    Tcp(FallbackReason),
    /// The TCP connection, raw: the peer does not speak Lightpath (or no common version).
    PlainTcp,
}

impl Transport {
    /// Whether data moves over RDMA.
    pub fn is_rdma(self) -> bool {
        matches!(self, Transport::Rdma(_))
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Rdma(provider) => write!(f, "rdma/{}", provider.name()),
            Transport::Tcp(reason) => write!(f, "tcp (fallback: {})", reason.describe()),
            Transport::PlainTcp => f.write_str("tcp (plain peer)"),
        }
    }
}

pub(crate) enum Backend {
    Rdma(Box<dyn RdmaStream>),
    Tcp(TcpConn),
    /// Only while the stream is being dropped.
    Closed,
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "lightpath: the stream is closed")
}

/// A connected stream: bytes (`Read`/`Write`) or messages ([`Stream::send_msg`] /
/// [`Stream::recv_msg`]), over RDMA when both sides can, else over the TCP connection the
/// stream started as. A stream carries either bytes or messages: the framing is the
/// application's contract, as with `SOCK_STREAM` versus `SOCK_SEQPACKET`.
///
/// Dropping a stream closes it cleanly: it sends what was written, waits (at most
/// `Options::linger`) for the peer to acknowledge it, then closes the TCP connection. Event
/// loops that must not wait use [`Stream::close_in_background`] instead.
pub struct Stream {
    pub(crate) backend: Backend,
    /// The epoll fd behind [`Stream::readiness_fd`] (RDMA streams; made on first use).
    readiness: crate::readiness::ReadinessEpoll,
    transport: Transport,
    local: SocketAddr,
    peer: SocketAddr,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    nonblocking: bool,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("transport", &self.transport)
            .field("local", &self.local)
            .field("peer", &self.peer)
            .finish()
    }
}

impl Stream {
    /// Connects to a Lightpath listener at `addr` with default options.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(addr, &Options::default())
    }

    /// Connects with the given options.
    pub fn connect_with(addr: impl ToSocketAddrs, options: &Options) -> io::Result<Stream> {
        let tcp = TcpStream::connect(addr)?;
        Self::negotiate_client(tcp, options)
    }

    /// Connects, giving up on the TCP connect after `timeout`.
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration, options: &Options) -> io::Result<Stream> {
        let tcp = TcpStream::connect_timeout(addr, timeout)?;
        Self::negotiate_client(tcp, options)
    }

    /// Runs the client side of the negotiation on a TCP connection made by the caller.
    pub fn negotiate_client(tcp: TcpStream, options: &Options) -> io::Result<Stream> {
        let negotiated = negotiate::client(tcp, options)?;
        Self::from_negotiated(negotiated, options.spin)
    }

    /// Runs the server side of the negotiation on a TCP connection accepted by the caller,
    /// blocking until it is over (what [`crate::Listener`] does for each connection, beside
    /// the others, on its acceptor thread). A client that
    /// does not speak Lightpath gives a plain TCP stream; one that leaves or speaks garbage
    /// gives an error.
    pub fn negotiate_server(tcp: TcpStream, options: &Options) -> io::Result<Stream> {
        match negotiate::server(tcp, options) {
            negotiate::Accepted::Stream(negotiated) => Self::from_negotiated(negotiated, options.spin),
            negotiate::Accepted::Dropped => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "lightpath: the client left or failed the negotiation",
            )),
        }
    }

    pub(crate) fn from_negotiated(negotiated: Negotiated, spin: Duration) -> io::Result<Stream> {
        let (backend, transport) = match negotiated {
            Negotiated::Rdma { conn, provider } => (Backend::Rdma(conn), Transport::Rdma(provider)),
            Negotiated::Tcp { tcp, framed, prefix, transport } => {
                (Backend::Tcp(TcpConn::new(tcp, framed, prefix).with_spin(spin)), transport)
            }
        };
        let tcp = match &backend {
            Backend::Rdma(conn) => conn.tcp(),
            Backend::Tcp(conn) => conn.tcp(),
            Backend::Closed => return Err(closed()),
        };
        let (local, peer) = (tcp.local_addr()?, tcp.peer_addr()?);
        Ok(Stream {
            backend,
            readiness: Default::default(),
            transport,
            local,
            peer,
            read_timeout: None,
            write_timeout: None,
            nonblocking: false,
        })
    }

    /// Which transport carries the data.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The counters of this stream's queue pair when it runs over the soft provider
    /// (datagrams and bytes each way, retransmissions, NAKs, RNR NAKs, ICRC drops); `None`
    /// over TCP and the other providers. The soft device's counters, shared by all its
    /// streams, are [`crate::soft_device_stats`].
    pub fn queue_pair_stats(&self) -> Option<lightpath_soft::QpStats> {
        let Backend::Rdma(conn) = &self.backend else { return None };
        let qp = conn.queue_pair().downcast_ref::<lightpath_soft::SoftQp>()?;
        qp.stats().ok()
    }

    /// The peer's address (of the TCP connection).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.peer)
    }

    /// This side's address (of the TCP connection).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    pub(crate) fn read_deadline(&self) -> Deadline {
        if self.nonblocking {
            Deadline::Now
        } else {
            Deadline::after(self.read_timeout)
        }
    }

    pub(crate) fn write_deadline(&self) -> Deadline {
        if self.nonblocking {
            Deadline::Now
        } else {
            Deadline::after(self.write_timeout)
        }
    }

    /// Sets the read timeout (`None`: block forever). Reads that time out return
    /// `TimedOut` (RDMA) or what the OS returns (TCP).
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        if timeout == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.read_timeout = timeout;
        if let Backend::Tcp(conn) = &self.backend {
            conn.tcp().set_read_timeout(timeout)?;
        }
        Ok(())
    }

    /// Sets the write timeout.
    pub fn set_write_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        if timeout == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.write_timeout = timeout;
        if let Backend::Tcp(conn) = &self.backend {
            conn.tcp().set_write_timeout(timeout)?;
        }
        Ok(())
    }

    /// The read timeout.
    pub fn read_timeout(&self) -> Option<Duration> {
        self.read_timeout
    }

    /// The write timeout.
    pub fn write_timeout(&self) -> Option<Duration> {
        self.write_timeout
    }

    /// Nonblocking mode: calls that would wait return `WouldBlock` instead; none blocks.
    ///
    /// Two kinds of call cannot simply stop half-way, and behave as follows:
    ///
    /// * A message ([`Stream::send_msg`], and [`Stream::send_msg_buf`] / [`Stream::write_buf`]
    ///   below the rendezvous threshold) that does not fit whole is still accepted once part of
    ///   it went: the rest is *kept* (copied) and sent before anything else by later calls on
    ///   the stream (writes, messages, `flush`, `poll_ready`, reads, the close). Until it has
    ///   gone, further writes and messages return `WouldBlock` and [`Stream::poll_ready`]
    ///   reports the stream not writable; `flush` returns `WouldBlock` until it has gone (and,
    ///   over RDMA, been acknowledged). The TCP fallback behaves the same way.
    /// * A zero-copy call that lent its registered buffer to the connection (a rendezvous
    ///   [`Stream::write_buf`] / [`Stream::send_msg_buf`] the peer has not fetched yet, or a
    ///   [`Stream::read_buf`] / [`Stream::recv_msg_buf`] whose RDMA READs are in flight)
    ///   returns `WouldBlock`; repeat the *same* call (same buffer, offset and length) until it
    ///   returns its result, and leave the buffer alone meanwhile. Other receiving calls are
    ///   refused (`InvalidInput`) while such a read is unfinished, and closing the stream while
    ///   such a write is unfinished gives the connection up (the peer gets an error rather than
    ///   a buffer the application may since have reused).
    pub fn set_nonblocking(&mut self, nonblocking: bool) -> io::Result<()> {
        self.nonblocking = nonblocking;
        if let Backend::Tcp(conn) = &mut self.backend {
            conn.tcp().set_nonblocking(nonblocking)?;
            conn.set_nonblocking_mode(nonblocking);
        }
        Ok(())
    }

    /// Holds writes back (`true`) until this is turned off, a flush, or a close: what is
    /// written meanwhile leaves as one record (whole once it reaches 64 KiB), as TCP_CORK
    /// makes a kernel socket send full segments only. For a writer that sends a response in
    /// parts (a header, then a body) and knows when it is done; turn it off then, or the
    /// bytes wait. Over TCP this is `TCP_CORK`.
    pub fn set_hold(&mut self, hold: bool) -> io::Result<()> {
        match &mut self.backend {
            Backend::Rdma(conn) => {
                conn.set_hold(hold);
                Ok(())
            }
            Backend::Tcp(conn) => Ok(rustix::net::sockopt::set_tcp_cork(conn.tcp(), hold)?),
            Backend::Closed => Err(closed()),
        }
    }

    /// Turns corking off (`true`, the default: every write is posted at once) or on (writes
    /// made while earlier ones are in flight are merged and posted as they complete; call
    /// `flush` before going idle). Over TCP this is `TCP_NODELAY`.
    pub fn set_nodelay(&mut self, nodelay: bool) -> io::Result<()> {
        match &mut self.backend {
            Backend::Rdma(conn) => {
                conn.set_cork(!nodelay);
                Ok(())
            }
            Backend::Tcp(conn) => conn.tcp().set_nodelay(nodelay),
            Backend::Closed => Err(closed()),
        }
    }

    /// Shuts down reading, writing or both, as `TcpStream::shutdown`: after `Write` the peer
    /// reads end of stream once it has read everything written before.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        match &mut self.backend {
            Backend::Rdma(conn) => {
                if matches!(how, Shutdown::Read | Shutdown::Both) {
                    conn.shutdown_read();
                }
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    conn.shutdown_write()?;
                }
                Ok(())
            }
            Backend::Tcp(conn) => {
                if matches!(how, Shutdown::Read | Shutdown::Both) {
                    conn.shutdown_read();
                }
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    conn.shutdown_write()?;
                }
                Ok(())
            }
            Backend::Closed => Err(closed()),
        }
    }

    /// Sends one message; the peer's [`Stream::recv_msg`] returns it whole. A message longer
    /// than the peer's ring flows through it in parts; in nonblocking mode (or when the write
    /// timeout expires) a message that has begun to go is accepted and its rest sent by later
    /// calls (see [`Stream::set_nonblocking`]), so it still arrives whole and in order.
    pub fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.send_msg(msg, deadline),
            Backend::Tcp(conn) => conn.send_msg(msg),
            Backend::Closed => Err(closed()),
        }
    }

    /// Receives one message; `Ok(None)` once the peer has closed.
    pub fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.recv_msg(deadline),
            Backend::Tcp(conn) => conn.recv_msg(),
            Backend::Closed => Err(closed()),
        }
    }

    #[cfg(any(feature = "tokio", test))]
    pub(crate) fn backend_mut(&mut self) -> &mut Backend {
        &mut self.backend
    }
}

/// What one [`Stream::drive`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Driven {
    /// A read may find data, end of stream or an error. An RDMA stream says `false` only when
    /// a read would find nothing; a TCP stream always says `true` (its socket knows, and a
    /// nonblocking read asks it in one system call).
    pub readable: bool,
    /// A write would accept bytes (or fail) at once; `true` for a TCP stream, as `readable`.
    /// Unlike [`Stream::poll_ready`], finding no room does not ask the peer for a wake-up.
    pub writable: bool,
    /// Everything written so far is in the transport's hands: no bytes kept from an accepted
    /// write, no records waiting for send-queue room or receive credits. The bytes then reach
    /// the peer without this side calling again (they may not be acknowledged yet).
    pub handed_over: bool,
}

/// Which of a stream's event fds ([`Stream::event_fds`]) signalled since the last look, for
/// [`Stream::poll_ready_signalled`]: an event loop that registers them edge-triggered knows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signalled {
    /// The notification fd (it is read, to take its count, only when this is set).
    pub notify: bool,
    /// The queue pair's own port, if the stream has one (it is received from only when this
    /// is set).
    pub port: bool,
    /// The TCP connection (looked at for the peer's goodbye or death only when this is set).
    pub liveness: bool,
}

/// What a stream can do without blocking, from [`Stream::poll_ready`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// A read (or `recv_msg`) would return data, end of stream or an error at once.
    pub readable: bool,
    /// A write would accept bytes (or fail) at once.
    pub writable: bool,
}

impl Stream {
    /// The one file descriptor an event loop (epoll, poll, mio, tokio's `AsyncFd`…) waits on
    /// for this stream. Use the stream in nonblocking mode ([`Stream::set_nonblocking`]).
    ///
    /// The contract, for every transport:
    ///
    /// 1. Call [`Stream::poll_ready`] before the first wait and after every wake-up. It
    ///    consumes the wake-up, re-arms the fd and says precisely whether a read and a write
    ///    would proceed. Act on it (read or write until `WouldBlock`); wait only when it
    ///    reports nothing you want.
    /// 2. An RDMA stream's fd is an epoll instance holding the completion queue's
    ///    notification fd and the TCP liveness connection (and, for a connection made with
    ///    [`Options::event_loop`](crate::Options::event_loop), its device's task doorbell,
    ///    which `poll_ready` reads and dispatches). **Register it for readability
    ///    (`EPOLLIN`) only**, level- or edge-triggered: it becomes readable when the stream
    ///    may have become readable *or* writable (data, a peer's wake-up after it freed room,
    ///    an acknowledgement, the peer's close or death). It never reports `EPOLLOUT`; after
    ///    `poll_ready` said "not writable", the stream has asked the peer to wake it when room
    ///    returns, so readability is the signal for that too.
    /// 3. A TCP stream's fd is its socket: readability and writability (`EPOLLOUT`) are the
    ///    socket's own, and the same loop works unchanged. Still call `poll_ready` before
    ///    waiting: bytes the negotiation read ahead are readable without the socket saying so.
    ///
    /// As with a socket at end of stream, an RDMA fd stays readable once the peer has closed.
    /// The fd is owned by the stream: do not close it or read from it. Why a method rather
    /// than `AsRawFd`/`AsFd`: an RDMA stream's fd is not its data channel (reading it, or
    /// waiting for `EPOLLOUT`, would be wrong), and it is created on first use, which can fail
    /// (`Unsupported` for a provider without a notification fd; `EMFILE`).
    pub fn readiness_fd(&self) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match &self.backend {
            Backend::Rdma(conn) => {
                let tasks = conn.task_doorbell();
                let tasks = tasks.as_ref().map(|doorbell| doorbell.fd());
                self.readiness.get_or_create(conn.notify_fd(), conn.poll_fd(), conn.tcp().as_fd(), tasks)
            }
            Backend::Tcp(conn) => Ok(conn.tcp().as_fd()),
            Backend::Closed => Err(closed()),
        }
    }

    /// The descriptors behind [`Stream::readiness_fd`], separately: for an RDMA stream the
    /// completion queue's notification fd, then (a soft queue pair with a UDP port of its own,
    /// see [`Options::soft_qp_port`](crate::Options::soft_qp_port)) that port's socket, and
    /// last the TCP connection (liveness); for a TCP stream its socket alone. Wait for
    /// readability on all of them, with the same `poll_ready` protocol (a wake-up by any but
    /// the last is a notification, `poll_ready_after(true, ..)`).
    ///
    /// Superseded by [`Stream::readiness_fd`] (one fd per stream); kept for loops that already
    /// register them all. Not for connections made with
    /// [`Options::event_loop`](crate::Options::event_loop): their device's task doorbell is
    /// not among these (use `readiness_fd`, or the tokio driver).
    pub fn event_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match &self.backend {
            Backend::Rdma(conn) => {
                conn.notify_fd().into_iter().chain(conn.poll_fd()).chain([conn.tcp().as_raw_fd()]).collect()
            }
            Backend::Tcp(conn) => vec![conn.tcp().as_raw_fd()],
            Backend::Closed => Vec::new(),
        }
    }

    /// What an armed RDMA stream can do now: readable, and writable (kept bytes pushed first).
    fn look(conn: &mut Box<dyn RdmaStream>) -> (bool, bool) {
        let readable = conn.readable_now();
        // Bytes kept from an accepted message go out first, and until they have the stream
        // is not writable (an empty write pushes them; see `set_nonblocking`). Room the peer
        // returns while this looks (a credit word, which raises no event) is used before
        // reporting, never slept through: asking the peer for a wake-up re-reads the credit
        // word, and finding room then means looking again.
        let mut writable = false;
        for _ in 0..4 {
            let kept_out = !would_block(&conn.write(&[], Deadline::Now));
            if conn.writable_now() {
                writable = kept_out;
                if kept_out {
                    break;
                }
                continue;
            }
            conn.note_write_blocked();
            if !conn.writable_now() {
                break;
            }
        }
        (readable, writable)
    }

    /// Consumes any wake-up, arms the readiness fd and reports what the stream can do now.
    /// When it reports "not writable" on an RDMA stream, it also makes sure the peer will wake
    /// this side once room returns (see [`Stream::readiness_fd`]).
    pub fn poll_ready(&mut self) -> io::Result<Readiness> {
        self.poll_ready_after(true, true)
    }

    /// [`Stream::poll_ready`] for an event loop that waits on the descriptors of
    /// [`Stream::event_fds`] itself, each registered **edge-triggered**, and so knows which of
    /// them signalled since its last call: `notified` for the notification fd, `liveness` for
    /// the TCP connection. A descriptor that did not signal is not read (`poll_ready` reads
    /// both: a system call each that finds nothing on most wake-ups). Reading neither is right
    /// only when neither had an edge since the last look; with edge-triggered registrations a
    /// later write raises a new edge whether or not the counter was drained, and the arming
    /// below looks at everything the notification fd can have been rung for (the queue pair's
    /// port, the completions routed here, the queue), so a caller whose registrations are all
    /// edge-triggered may pass `notified` false always (the tokio driver does the same). One
    /// that also waits on the fds level-triggered (`poll`) must pass it when they signalled,
    /// or a notification left pending keeps them readable. Over TCP it is `poll_ready`.
    pub fn poll_ready_after(&mut self, notified: bool, liveness: bool) -> io::Result<Readiness> {
        self.poll_ready_signalled(Signalled { notify: notified, port: true, liveness })
    }

    /// [`Stream::poll_ready_after`] for an event loop that also registers the stream's own
    /// port (the middle one of three [`Stream::event_fds`]) edge-triggered under a token of
    /// its own, and says in `signalled.port` whether it signalled since the last call: when
    /// it did not, nothing arrived there since the look that last took it in (an edge comes
    /// with every datagram), and this look skips receiving from it — the one system call a
    /// level-triggered loop's repeated look at a quiet connection made (the tokio driver does
    /// the same).
    pub fn poll_ready_signalled(&mut self, signalled: Signalled) -> io::Result<Readiness> {
        let Signalled { notify: notified, port, liveness } = signalled;
        match &mut self.backend {
            Backend::Rdma(conn) => {
                if notified {
                    conn.take_notify();
                }
                // A connection made with `Options::event_loop` (its queue pair's news rings the
                // device's task doorbell, which the readiness fd watches): rings are read and
                // dispatched here, which writes this connection's notification fd if one was
                // for it (and wakes whoever else it was for). No ring, no dispatch: every ring
                // is dispatched by whoever consumed it (or by an edge-triggered dispatcher).
                if let Some(doorbell) = conn.task_doorbell() {
                    if doorbell.take_rings() {
                        doorbell.dispatch();
                    }
                }
                if liveness {
                    conn.poll_tcp();
                }
                // Armed before looking, so that what changes after the look raises an event;
                // for what the peer sends only, unless this side needs its own requests'
                // completions to go on (a later call that waits for them widens the arming:
                // see `RdmaConn::widen_arming`).
                let wake = conn.reader_wake();
                conn.arm(wake, if port { PortLook::TakeIn } else { PortLook::Skip })?;
                let (mut readable, mut writable) = Self::look(conn);
                if wake == lightpath_verbs::WakeFor::Arrivals
                    && (!writable || conn.reader_wake() == lightpath_verbs::WakeFor::Anything)
                {
                    // The look queued requests whose completions this side needs, or a write
                    // would not fit: room may come back with this side's own completions (the
                    // peer is asked for a wake-up only once nothing of ours is in flight), so
                    // those wake it too. Arming takes what arrived meanwhile, which raises no
                    // event: if it took something, look again (still armed). The port was
                    // taken in just now; what reached it since is an edge for the caller.
                    if !conn.arm(lightpath_verbs::WakeFor::Anything, PortLook::Skip)? {
                        (readable, writable) = Self::look(conn);
                    }
                }
                Ok(Readiness { readable, writable })
            }
            Backend::Tcp(conn) => {
                let kept_out = conn.push_kept().unwrap_or(true);
                let readable = conn.readable_now(self.nonblocking)?;
                Ok(Readiness {
                    readable,
                    writable: kept_out && crate::readiness::socket_writable(conn.tcp()),
                })
            }
            Backend::Closed => Err(closed()),
        }
    }

    /// One nonblocking step for a driver that busy-polls several streams between
    /// [`Stream::poll_ready`] waits (the collectives' mesh): pushes kept bytes, reaps
    /// completions and posts queued records, without a system call on an RDMA stream's TCP
    /// liveness connection (a nonblocking `read` that finds nothing makes one). A peer that
    /// died is noticed by `poll_ready`, `read` and `flush`, not here. Errors are the
    /// connection's failure, as `read` or `write` would report it, once it leaves nothing to
    /// report: while bytes that arrived before it wait to be read, or when everything written
    /// had been handed to the transport before it, this returns `Ok` (readable and writable:
    /// the read returns those bytes, then the error) and `handed_over` says the latter.
    pub fn drive(&mut self) -> io::Result<Driven> {
        match &mut self.backend {
            Backend::Rdma(conn) => conn.drive(),
            Backend::Tcp(conn) => {
                Ok(Driven { readable: true, writable: true, handed_over: conn.push_kept()? })
            }
            Backend::Closed => Err(closed()),
        }
    }

    /// Whether everything written so far is in the transport's hands (as [`Stream::drive`]'s
    /// `handed_over` says), from what the stream knows without looking at the transport: no
    /// completions reaped, nothing posted, no system call. For a busy-polling driver that has
    /// just written: a write posts what fits at once, so this is usually `true` right after
    /// it; `false` means a look is needed (`drive`), not that something is held back. Always
    /// `false` on a TCP stream.
    pub fn handed_over_now(&self) -> bool {
        match &self.backend {
            Backend::Rdma(conn) => conn.handed_over_now(),
            Backend::Tcp(_) | Backend::Closed => false,
        }
    }

    /// Whether the peer ended its sending side cleanly (its close record or its goodbye
    /// arrived), whether or not this side has read up to it yet. Always `false` over TCP (the
    /// socket's own end of stream says it there).
    pub fn peer_closed_its_side(&self) -> bool {
        matches!(&self.backend, Backend::Rdma(conn) if conn.peer_closed_its_side())
    }

    /// Whether a failed half close (`err`) only met a peer that had closed its own side first
    /// and then went away before acknowledging this side's close: a TCP socket's `shutdown`
    /// after the peer's FIN succeeds in that case, whether or not the peer's process is still
    /// there, and so does the tokio driver's (see `AsyncWrite::poll_shutdown` there).
    #[cfg(feature = "tokio")]
    pub(crate) fn close_met_a_closed_peer(&self, err: &io::Error) -> bool {
        let reset = matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe);
        matches!(&self.backend, Backend::Rdma(conn) if reset && conn.peer_closed_its_side())
    }

    /// Hands everything written to the transport without waiting for the peer: posts corked
    /// records and pushes kept bytes; `WouldBlock` while some wait for room (send-queue slots,
    /// receive credits or ring space). What the tokio driver's `poll_flush` does: as for a
    /// kernel socket, flushed bytes are on their way but not yet acknowledged; `Stream::close`
    /// and `shutdown` wait for the acknowledgement. Over TCP: the socket's flush.
    #[cfg(feature = "tokio")]
    pub(crate) fn hand_over(&mut self) -> io::Result<()> {
        match &mut self.backend {
            Backend::Rdma(conn) => match conn.hand_over()? {
                true => Ok(()),
                false => Err(io::ErrorKind::WouldBlock.into()),
            },
            Backend::Tcp(conn) => conn.flush(),
            Backend::Closed => Err(closed()),
        }
    }

    /// A read into memory not yet initialised, over RDMA (see `RdmaConn::read_uninit`):
    /// `None`, with nothing written, where only [`Read::read`] can take what comes next (a TCP
    /// stream, a rendezvous at the head of the stream).
    #[cfg(feature = "tokio")]
    pub(crate) fn read_uninit(&mut self, buf: &mut [std::mem::MaybeUninit<u8>]) -> io::Result<Option<usize>> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.read_uninit(buf, deadline),
            Backend::Tcp(_) | Backend::Closed => Ok(None),
        }
    }

    /// How many bytes a read should offer room for (at least 1): an RDMA stream's readable
    /// bytes as last seen, or [`RDMA_READ_PROBE`] when none were (the read looks for more
    /// first, and a later read takes whatever did not fit, sized exactly); over the TCP
    /// fallback the rest of the current record, its header read first (`WouldBlock` if it has
    /// not arrived: the read would fail the same way), else [`TCP_READ_SIZE`]. Lets the tokio
    /// driver zero only what a read can fill.
    #[cfg(feature = "tokio")]
    pub(crate) fn read_size_hint(&mut self) -> io::Result<usize> {
        match &mut self.backend {
            Backend::Rdma(conn) => Ok(match conn.readable_bytes() {
                0 => RDMA_READ_PROBE,
                n => n,
            }),
            Backend::Tcp(conn) => conn.read_size_hint(TCP_READ_SIZE),
            Backend::Closed => Ok(1),
        }
    }

    /// A TCP stream whose next read is answered without its socket (bytes read during the
    /// negotiation, reading shut down, the peer's close record taken in): an event loop must
    /// not wait for the socket before that read.
    #[cfg(feature = "tokio")]
    pub(crate) fn tcp_input_without_socket(&self) -> bool {
        matches!(&self.backend, Backend::Tcp(conn) if conn.input_without_socket())
    }

    /// Pushes bytes kept from an accepted message without waiting: `Ok(true)` once none are
    /// kept, `Ok(false)` while some are (see [`Stream::set_nonblocking`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn push_kept(&mut self) -> io::Result<bool> {
        match &mut self.backend {
            Backend::Rdma(conn) => match conn.write(&[], Deadline::Now) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(false),
                other => other.map(|_| true),
            },
            Backend::Tcp(conn) => conn.push_kept(),
            Backend::Closed => Err(closed()),
        }
    }
}

/// Room an RDMA stream's read offers when nothing was seen waiting (see
/// `Stream::read_size_hint`): an event loop's read usually finds nothing (then it waits) or
/// one small message. It was 16 KiB, zeroed by tokio's `ReadBuf` on every read that found
/// nothing: hyper polls a read before every wait (memset was the top symbol, 8% of a
/// server's CPU, over shm with 64 connections and 100-byte bodies).
#[cfg(feature = "tokio")]
const RDMA_READ_PROBE: usize = 1 << 10;

/// Room a TCP stream's read offers when it cannot tell how much the next read returns (a raw
/// stream, a message record); a data record's read offers the rest of the record. Zeroing
/// 64 KiB for every read was about 2 us of a 100-byte request's cost over the fallback.
#[cfg(feature = "tokio")]
const TCP_READ_SIZE: usize = 64 << 10;

fn would_block<T>(result: &io::Result<T>) -> bool {
    matches!(result, Err(err) if err.kind() == io::ErrorKind::WouldBlock)
}

/// What a `WouldBlock` carries when the call waits for the peer to acknowledge (`flush`) or to
/// fetch a rendezvous, not for room: a driver then sleeps until a completion arrives rather
/// than until the stream is writable (which it may well be all along).
#[derive(Debug)]
pub(crate) struct AwaitingPeer;

impl std::fmt::Display for AwaitingPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("lightpath: waiting for the peer (acknowledgement or fetch)")
    }
}

impl std::error::Error for AwaitingPeer {}

impl AwaitingPeer {
    /// The `WouldBlock` error carrying it.
    pub(crate) fn would_block() -> io::Error {
        io::Error::new(io::ErrorKind::WouldBlock, AwaitingPeer)
    }

    /// Whether `err` is such a `WouldBlock`.
    #[cfg(feature = "tokio")]
    pub(crate) fn is(err: &io::Error) -> bool {
        err.kind() == io::ErrorKind::WouldBlock
            && err.get_ref().is_some_and(|inner| inner.is::<AwaitingPeer>())
    }
}

fn rdma_only() -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, "lightpath: remote buffers need an RDMA transport")
}

impl Stream {
    /// Registers a zero-filled buffer of `len` bytes with this stream's RDMA device, for
    /// one-sided transfers. RDMA streams only (`Unsupported` over TCP).
    pub fn register_buf(&self, len: usize) -> io::Result<crate::RegisteredBuf> {
        match &self.backend {
            Backend::Rdma(conn) => conn.register(len),
            _ => Err(rdma_only()),
        }
    }

    /// Writes `len` bytes of `local` (from `local_offset`) into the peer's buffer `remote` at
    /// `remote_offset`, without the peer's application taking part; with `notify`, the peer's
    /// [`Stream::recv_notify`] returns that value (27 bits) after the bytes have landed.
    /// Returns once the peer has acknowledged the write.
    pub fn write_remote(
        &mut self,
        local: &crate::RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        notify: Option<u32>,
    ) -> io::Result<()> {
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => {
                conn.write_remote(local, local_offset, remote, remote_offset, len, notify, deadline)
            }
            _ => Err(rdma_only()),
        }
    }

    /// Reads `len` bytes of the peer's buffer `remote` (from `remote_offset`) into `local` at
    /// `local_offset`; returns once they have arrived.
    pub fn read_remote(
        &mut self,
        local: &crate::RegisteredBuf,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
    ) -> io::Result<()> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => {
                conn.read_remote(local, local_offset, remote, remote_offset, len, deadline)
            }
            _ => Err(rdma_only()),
        }
    }

    /// Writes `len` bytes of the registered buffer `local` (from `offset`) into the stream.
    /// From `Options::rendezvous_min` bytes on (per provider, see
    /// `Options::rendezvous_min_for`) nothing is copied: the peer RDMA-READs them straight
    /// from the buffer (into its own registered buffer with [`Stream::read_buf`]); smaller
    /// writes are copied into the staging ring, which is cheaper there. Either way it returns
    /// when the buffer may be reused, and the peer reads the bytes as ordinary stream bytes, in
    /// order. RDMA streams only (registered buffers exist only there).
    ///
    /// In nonblocking mode a rendezvous returns `WouldBlock` until the peer has fetched the
    /// bytes: repeat the same call until it returns `Ok` (see [`Stream::set_nonblocking`]).
    pub fn write_buf(&mut self, local: &crate::RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.write_buf(local, offset, len, deadline),
            _ => Err(rdma_only()),
        }
    }

    /// Waits for the next notification of a peer's [`Stream::write_remote`].
    pub fn recv_notify(&mut self) -> io::Result<u32> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.recv_notify(deadline),
            _ => Err(rdma_only()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.read(buf, deadline),
            Backend::Tcp(conn) => conn.read(buf),
            Backend::Closed => Err(closed()),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)])
    }

    /// Writes the slices in turn, as far as they fit, as one record (RDMA: one write with
    /// immediate; TCP fallback: one record header and one `writev`).
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        if bufs.iter().all(|buf| buf.is_empty()) {
            return Ok(0);
        }
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.write_vectored(bufs, deadline),
            Backend::Tcp(conn) => conn.write_vectored(bufs),
            Backend::Closed => Err(closed()),
        }
    }

    /// Waits until the peer has acknowledged everything written (RDMA), or flushes the
    /// socket (TCP).
    fn flush(&mut self) -> io::Result<()> {
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.flush(deadline),
            Backend::Tcp(conn) => conn.flush(),
            Backend::Closed => Err(closed()),
        }
    }
}

impl Stream {
    /// Closes the stream without waiting: the clean close (send what was written, wait at most
    /// `Options::linger` for the peer's acknowledgements, say goodbye, keep the queue pair
    /// until the peer closes too) finishes on Lightpath's background thread. Written bytes are
    /// still delivered if the peer is alive — as long as this process runs: a process that
    /// exits at once may cut the close short (the peer then sees `ConnectionReset`). To know
    /// the bytes arrived, `shutdown(Write)` and `flush` first, or drop the stream (which
    /// waits). The tokio stream closes this way when dropped.
    pub fn close_in_background(mut self) {
        self.hand_off_close();
    }

    /// Hands the backend to the reaper's background close; the stream is `Closed` afterwards.
    pub(crate) fn hand_off_close(&mut self) {
        if !matches!(self.backend, Backend::Closed) {
            tracing::debug!(transport = ?self.transport, peer = %self.peer, "stream closing in the background");
        }
        match std::mem::replace(&mut self.backend, Backend::Closed) {
            Backend::Rdma(mut conn) => {
                // Nobody watches its TCP connection any more (an event loop may have).
                conn.set_tcp_watched(false);
                crate::reaper::close_rdma(conn)
            }
            Backend::Tcp(conn) => crate::reaper::close_tcp(conn),
            Backend::Closed => {}
        }
    }
}

/// Dropping closes cleanly and *waits* (at most `Options::linger`) until the peer has
/// acknowledged everything written, so the bytes are known to be delivered when `drop`
/// returns; see [`Stream::close_in_background`] for the variant that does not wait.
///
/// Bytes the peer sent that were never read are discarded. A peer that keeps writing into the
/// closing stream is not answered any more (no credits, no wake-ups): its flow control stops
/// it, the close finishes once this side's own bytes are acknowledged, and the peer's writes
/// then fail with `BrokenPipe` (it reads what was sent to it, then end of stream). Over TCP the
/// kernel resets a socket closed with unread bytes, so such a peer gets `ConnectionReset` or
/// `BrokenPipe`.
impl Drop for Stream {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.backend, Backend::Closed) {
            Backend::Rdma(mut conn) => {
                conn.close();
                tracing::debug!(
                    transport = ?self.transport,
                    peer = %self.peer,
                    clean = conn.closed_cleanly(),
                    "stream closed"
                );
                if conn.closed_cleanly() {
                    let linger = conn.linger();
                    crate::reaper::park(conn.into_parked(), linger);
                }
            }
            Backend::Tcp(mut conn) => {
                conn.close();
                tracing::debug!(transport = ?self.transport, peer = %self.peer, "stream closed");
            }
            Backend::Closed => {}
        }
    }
}
