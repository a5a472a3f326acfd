//! One tracked TCP connection of the application, and the switch of its data to a
//! Lightpath stream.
//!
//! # The switch protocol
//!
//! The application's fd is and stays the kernel TCP socket. Until the two sides have paired
//! (see `crate::rendezvous`) every byte goes over it, untouched: a plain peer sees plain TCP.
//! Once a side holds a Lightpath stream to the peer (RDMA over shm on one host), it writes
//! [`READY`] on the stream. A side that has read the peer's READY switches its *sending*
//! direction: it writes on the stream how many bytes it had sent over TCP (big-endian `u64`)
//! and sends everything after that over the stream. The TCP connection never carries a byte
//! the application did not write, and no byte goes to a stream the peer does not read.
//!
//! The receiver reads TCP until it has received exactly that many bytes from it, then reads
//! the stream. Until the count has arrived, it reads TCP and watches the stream too. Each
//! direction switches on its own; nothing waits for the other side, so a server that speaks
//! first and a client that waits to read behave exactly as over TCP.
//!
//! End of stream: a TCP end before the switch point is a reset (the peer died mid-way). After
//! it, the stream's clean end is not yet the connection's: TCP stays the connection's truth,
//! and what the peer's process writes on its socket after its switch point (a fork child, or
//! the image an `execve` started, that inherited the socket and knows nothing of the stream)
//! follows the stream's bytes. Such *late* TCP bytes are read into a buffer as they come
//! (bounded by [`LATE_MAX`], so that a writer never blocks on a full socket while the stream's
//! owner waits for it) and handed out once the stream has ended; the connection ends when TCP
//! does. A stream that fails (not a clean end) is an error, as before. A TCP end while a
//! pairing is still being negotiated waits for the negotiation's outcome (bounded by its
//! timeout), since the peer may have switched.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use libc::c_int;

use crate::real;

/// The first 8 bytes each side writes on its stream once it holds one: "I read this stream".
/// A side switches its sending only after it has read the peer's, so a pairing that one side
/// gave up (a negotiation that timed out there) never strands bytes on a stream nobody reads.
const READY: [u8; 8] = *b"LPPRELD1";

/// Where a connection is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Tracked, not yet offered (pairing starts at the first I/O call, so an accept-then-fork
    /// parent that only closes never pairs).
    Fresh,
    /// Offered: waiting for the peer to turn up on the rendezvous name.
    Waiting,
    /// Paired with the peer: the Lightpath negotiation runs.
    Pairing,
    /// Data moves over a Lightpath stream (the transport's name).
    Rdma(String),
    /// Data stays on TCP, and why.
    Tcp(String),
}

impl Phase {
    /// Whether the connection may still switch (waits are sliced so they notice).
    pub(crate) fn transient(&self) -> bool {
        matches!(self, Phase::Fresh | Phase::Waiting | Phase::Pairing)
    }
}

/// The result of one non-waiting attempt.
pub(crate) enum Io {
    Done(usize),
    WouldBlock,
    Err(c_int),
}

/// What a connection does and knows, under its lock.
pub(crate) struct State {
    /// The application set TCP_CORK, and since when (see [`set_corked`]).
    pub(crate) corked: Option<Instant>,
    /// A send with `MSG_MORE` left bytes held on the stream, and since when (see
    /// [`State::try_send`]).
    more_since: Option<Instant>,
    /// The connection is in the list [`release_stale_corks`] looks at.
    cork_listed: bool,
    pub(crate) phase: Phase,
    pub(crate) stream: Option<lightpath::Stream>,
    /// The application closed its last fd for this connection.
    pub(crate) closed: bool,
    pub(crate) local: Option<SocketAddr>,
    pub(crate) peer: Option<SocketAddr>,
    pub(crate) tcp_sent: u64,
    pub(crate) tcp_recv: u64,
    pub(crate) rdma_sent: u64,
    pub(crate) rdma_recv: u64,
    /// This side sends over the stream (after the header).
    pub(crate) send_switched: bool,
    /// This side's sending went back to TCP before an `execve` (see [`State::send_back`]):
    /// it never switches again.
    sent_back: bool,
    /// READY, then (once the peer's READY arrived) the switch offset.
    hdr_out: [u8; 16],
    hdr_out_len: usize,
    hdr_out_sent: usize,
    hdr_in: [u8; 16],
    hdr_in_len: usize,
    /// The peer's switch point: bytes it sent over TCP before its stream.
    pub(crate) switch_at: Option<u64>,
    /// The stream ended or failed before the peer's header: the peer never switched.
    stream_ended_early: bool,
    /// TCP reported end of stream.
    pub(crate) tcp_eof: bool,
    /// The stream ended cleanly after the peer's switch point: reads continue on TCP (the
    /// `late` bytes first).
    stream_eof: bool,
    /// TCP bytes that came after the peer's switch point while its stream was open (see the
    /// module doc), in order.
    late: Vec<u8>,
    /// The application shut its sending side down.
    shut_wr: bool,
    /// Bytes read from the stream for MSG_PEEK or FIONREAD, handed out first.
    pub(crate) peeked: Vec<u8>,
    /// Application epoll instances this connection is registered in.
    pub(crate) epolls: Vec<c_int>,
}

/// A tracked connection: the application's fd numbers point at it (several after `dup`).
pub(crate) struct Conn {
    pub(crate) id: u64,
    /// The process that accepted or connected it; a fork child is not it.
    pub(crate) owner: u32,
    /// Application fds naming it.
    pub(crate) fds: AtomicUsize,
    /// The connection left [`Phase::Fresh`] (it was offered for pairing), and a stream was
    /// installed on it: kept outside the lock for a fork child, which must not take a lock
    /// another thread of its parent may have held at the fork (it would wait for ever).
    offered: AtomicBool,
    streamed: AtomicBool,
    /// Whether the open file is nonblocking, as last asked of the kernel (`NONBLOCKING_*`):
    /// every read and write needs it, and `fcntl(F_SETFL)` / `ioctl(FIONBIO)` through any of
    /// its fds (all intercepted) forget it.
    nonblocking: AtomicU8,
    state: Mutex<State>,
}

const NONBLOCKING_UNKNOWN: u8 = 0;
const NONBLOCKING_NO: u8 = 1;
const NONBLOCKING_YES: u8 = 2;

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("id", &self.id).finish()
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// This process's id, cached (every call on a tracked connection asks whose it is: a system
/// call each time cost four per redis request). A fork child forgets the parent's value in
/// its `pthread_atfork` handler, registered with the first look.
pub(crate) fn pid() -> u32 {
    static PID: AtomicU32 = AtomicU32::new(0);
    static REGISTER: std::sync::Once = std::sync::Once::new();
    extern "C" fn forget_in_child() {
        PID.store(0, Ordering::Relaxed);
    }
    let cached = PID.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    REGISTER.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe, as a
        // fork child's handler must be); no prepare or parent handler.
        unsafe { libc::pthread_atfork(None, None, Some(forget_in_child)) };
    });
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() as u32 };
    PID.store(pid, Ordering::Relaxed);
    pid
}

impl Conn {
    pub(crate) fn new() -> Conn {
        Conn {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            owner: pid(),
            fds: AtomicUsize::new(1),
            offered: AtomicBool::new(false),
            streamed: AtomicBool::new(false),
            nonblocking: AtomicU8::new(NONBLOCKING_UNKNOWN),
            state: Mutex::new(State {
                corked: None,
                more_since: None,
                cork_listed: false,
                phase: Phase::Fresh,
                stream: None,
                closed: false,
                local: None,
                peer: None,
                tcp_sent: 0,
                tcp_recv: 0,
                rdma_sent: 0,
                rdma_recv: 0,
                send_switched: false,
                sent_back: false,
                hdr_out: [0; 16],
                hdr_out_len: 0,
                hdr_out_sent: 0,
                hdr_in: [0; 16],
                hdr_in_len: 0,
                switch_at: None,
                stream_ended_early: false,
                tcp_eof: false,
                stream_eof: false,
                late: Vec::new(),
                shut_wr: false,
                peeked: Vec::new(),
                epolls: Vec::new(),
            }),
        }
    }

    /// A connection an exec handed over (`crate::handover`): plain TCP from here, whose
    /// first reads return `unread` (what the peer had sent over the stream), named by `fds`
    /// descriptors.
    pub(crate) fn inherited(unread: Vec<u8>, fds: usize) -> Conn {
        let conn = Conn::new();
        conn.fds.store(fds, Ordering::Relaxed);
        conn.offered.store(true, Ordering::Relaxed);
        {
            let mut state = conn.lock();
            state.phase = Phase::Tcp(format!("inherited over exec with {} unread bytes", unread.len()));
            state.peeked = unread;
            state.sent_back = true;
        }
        conn
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether this process owns the connection (not a fork child holding a copy).
    pub(crate) fn owned(&self) -> bool {
        self.owner == pid()
    }

    /// Whether the connection was offered for pairing (no lock taken: see `offered`).
    pub(crate) fn was_offered(&self) -> bool {
        self.offered.load(Ordering::Acquire)
    }

    /// Whether a stream was ever installed on it (no lock taken: see `offered`).
    pub(crate) fn was_streamed(&self) -> bool {
        self.streamed.load(Ordering::Acquire)
    }

    /// Whether the application made the connection's open file nonblocking (asked of the
    /// kernel once, then cached until the flags change).
    pub(crate) fn nonblocking(&self, fd: c_int) -> bool {
        match self.nonblocking.load(Ordering::Relaxed) {
            NONBLOCKING_YES => true,
            NONBLOCKING_NO => false,
            _ => {
                let yes = nonblocking(fd);
                self.nonblocking.store(if yes { NONBLOCKING_YES } else { NONBLOCKING_NO }, Ordering::Relaxed);
                yes
            }
        }
    }

    /// The file status flags may have changed: ask the kernel again next time.
    pub(crate) fn forget_nonblocking(&self) {
        self.nonblocking.store(NONBLOCKING_UNKNOWN, Ordering::Relaxed);
    }
}

/// The errno for a stream error.
pub(crate) fn errno_of(err: &io::Error) -> c_int {
    match err.kind() {
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::UnexpectedEof => {
            libc::ECONNRESET
        }
        io::ErrorKind::NotConnected => libc::ENOTCONN,
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        _ => err.raw_os_error().unwrap_or(libc::EIO),
    }
}

fn would_block(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::WouldBlock
}

/// The local or peer address of `fd`.
pub(crate) fn socket_addr(fd: c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: zeroed sockaddr_storage is a valid value of the type.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let address = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr>();
    // SAFETY: `address` points at `len` writable bytes.
    let rc = unsafe {
        if peer {
            libc::getpeername(fd, address, &mut len)
        } else {
            libc::getsockname(fd, address, &mut len)
        }
    };
    if rc != 0 {
        return None;
    }
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let v4 = unsafe { &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(v4.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let v6 = unsafe { &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
            // An IPv4 peer of a dual-stack socket is named as IPv4, as the peer names itself.
            let ip = ip.to_ipv4_mapped().map_or(std::net::IpAddr::V6(ip), std::net::IpAddr::V4);
            Some(SocketAddr::new(ip, u16::from_be(v6.sin6_port)))
        }
        _ => None,
    }
}

/// Whether `fd` is a TCP socket (AF_INET or AF_INET6, SOCK_STREAM, IPPROTO_TCP).
pub(crate) fn is_tcp(fd: c_int) -> bool {
    let get = |option: c_int| -> Option<c_int> {
        let mut value: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
        // SAFETY: `value` is a writable int of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, option, (&mut value as *mut c_int).cast(), &mut len)
        };
        (rc == 0).then_some(value)
    };
    matches!(get(libc::SO_DOMAIN), Some(libc::AF_INET | libc::AF_INET6))
        && get(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && get(libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Whether the application made `fd` nonblocking.
fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no argument.
    let flags = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

impl State {
    /// Starts pairing if this is the connection's first I/O.
    pub(crate) fn offer(&mut self, conn: &std::sync::Arc<Conn>, fd: c_int) {
        if self.phase != Phase::Fresh || !conn.owned() {
            return;
        }
        let Some(peer) = socket_addr(fd, true) else {
            // Not connected yet (a nonblocking connect in progress): offer at the next call.
            return;
        };
        self.peer = Some(peer);
        self.local = socket_addr(fd, false);
        // Every way on from here leaves `Fresh`.
        conn.offered.store(true, Ordering::Release);
        if self.local.is_none() {
            self.phase = Phase::Tcp("no local address".into());
            return;
        }
        match crate::rendezvous::why_not() {
            Some(reason) => self.phase = Phase::Tcp(reason),
            None => {
                self.phase = Phase::Waiting;
                crate::rendezvous::register(std::sync::Arc::clone(conn));
            }
        }
    }

    /// Reads the peer's READY and switch offset off the stream, as far as they have arrived;
    /// on the peer's READY this side switches its sending.
    fn learn_switch(&mut self) {
        if self.switch_at.is_none() && !self.stream_ended_early {
            if let Some(stream) = self.stream.as_mut() {
                while self.hdr_in_len < 16 {
                    match io::Read::read(stream, &mut self.hdr_in[self.hdr_in_len..]) {
                        Ok(0) => {
                            self.stream_ended_early = true;
                            break;
                        }
                        Ok(n) => self.hdr_in_len += n,
                        Err(err) if would_block(&err) => break,
                        Err(_) => {
                            self.stream_ended_early = true;
                            break;
                        }
                    }
                }
                if self.hdr_in_len >= 8 && self.hdr_in[..8] != READY {
                    // Not a Lightpath preload peer's stream: never read it.
                    self.stream_ended_early = true;
                }
                if self.hdr_in_len == 16 && !self.stream_ended_early {
                    let mut at = [0u8; 8];
                    at.copy_from_slice(&self.hdr_in[8..]);
                    self.switch_at = Some(u64::from_be_bytes(at));
                    crate::report::debug(format_args!(
                        "peer {:?} switched at tcp byte {} (received {} so far)",
                        self.peer,
                        u64::from_be_bytes(at),
                        self.tcp_recv
                    ));
                }
            }
        }
        let peer_ready = self.hdr_in_len >= 8 && !self.stream_ended_early;
        if peer_ready && !self.send_switched && !self.sent_back && self.stream.is_some() {
            // The peer reads its stream: everything from now on goes there.
            self.hdr_out[8..].copy_from_slice(&self.tcp_sent.to_be_bytes());
            self.hdr_out_len = 16;
            self.send_switched = true;
            let pushed = self.push_header();
            // Corked by the application: its writes from now on wait for the uncork (the
            // header above left at once: the peer switches its reading on it).
            if self.corked.is_some() {
                self.apply_cork();
            }
            crate::report::debug(format_args!(
                "to {:?}: sending switched at tcp byte {} (header pushed: {pushed:?})",
                self.peer, self.tcp_sent
            ));
            if self.shut_wr {
                if let Some(stream) = self.stream.as_mut() {
                    let _ = stream.shutdown(std::net::Shutdown::Write);
                }
            }
        }
    }

    /// Holds the stream's writes while the application keeps TCP_CORK set or its last send
    /// said `MSG_MORE`, once the connection sends over its stream (before that its writes go
    /// to the socket, which honours both itself).
    fn apply_cork(&mut self) {
        if self.send_switched {
            let hold = self.corked.is_some() || self.more_since.is_some();
            if let Some(stream) = self.stream.as_mut() {
                let _ = stream.set_hold(hold);
            }
        }
    }

    /// Whether writes are held now for TCP_CORK or `MSG_MORE`, and since when (the earlier).
    fn held_since(&self) -> Option<Instant> {
        match (self.corked, self.more_since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Bytes still to come over TCP before the stream's (`u64::MAX`: until the peer's header
    /// says, and once the stream has ended).
    fn tcp_left(&self) -> u64 {
        match self.switch_at {
            Some(_) if self.stream_eof => u64::MAX,
            Some(at) => at.saturating_sub(self.tcp_recv),
            None => u64::MAX,
        }
    }

    /// Whether reads look at the TCP socket: what it has is the application's to read now.
    pub(crate) fn tcp_readable_matters(&self) -> bool {
        self.tcp_left() > 0 && !self.tcp_eof
    }

    /// Whether the TCP socket is watched for late bytes (see the module doc): the connection
    /// reads its stream, and what TCP has waits for the stream's end.
    pub(crate) fn late_tcp_watched(&self) -> bool {
        self.switch_at.is_some()
            && !self.stream_eof
            && self.tcp_left() == 0
            && !self.tcp_eof
            && self.late.len() < LATE_MAX
    }

    /// Takes in what TCP has after the peer's switch point while the stream is open (called
    /// when a wait saw the socket readable, so a connection whose TCP carries nothing makes no
    /// extra system call): kept for after the stream's end, or the end noted.
    pub(crate) fn take_late_tcp(&mut self, fd: c_int) {
        let mut chunk = [0u8; 16 << 10];
        while self.late_tcp_watched() {
            let room = (LATE_MAX - self.late.len()).min(chunk.len());
            // SAFETY: `chunk` has `room` writable bytes.
            let got = unsafe { real::recv(fd, chunk.as_mut_ptr().cast(), room, libc::MSG_DONTWAIT) };
            match got {
                n if n > 0 => self.late.extend_from_slice(&chunk[..n as usize]),
                0 => self.tcp_eof = true,
                // Nothing more now, or an error the read after the stream's end reports.
                _ => break,
            }
        }
    }

    /// Late bytes a read hands out next (once the stream has ended; 0 before).
    pub(crate) fn late_pending(&self) -> usize {
        if self.stream_eof {
            self.late.len()
        } else {
            0
        }
    }

    /// A read once the stream has ended cleanly: the late bytes, then TCP.
    fn try_recv_late(&mut self, fd: c_int, buf: &mut [u8], peek: bool) -> Io {
        if !self.late.is_empty() {
            let n = buf.len().min(self.late.len());
            buf[..n].copy_from_slice(&self.late[..n]);
            if !peek {
                self.late.drain(..n);
                self.tcp_recv += n as u64;
            }
            return Io::Done(n);
        }
        if self.tcp_eof {
            return Io::Done(0);
        }
        let flags = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
        // SAFETY: `buf` has `buf.len()` writable bytes.
        let got = unsafe { real::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        match got {
            n if n > 0 => {
                if !peek {
                    self.tcp_recv += n as u64;
                }
                Io::Done(n as usize)
            }
            0 => {
                self.tcp_eof = true;
                Io::Done(0)
            }
            _ => match real::errno() {
                libc::EAGAIN => Io::WouldBlock,
                errno => Io::Err(errno),
            },
        }
    }

    /// The stream ended cleanly after the switch point: from now on reads go to TCP.
    fn stream_ended(&mut self, fd: c_int, buf: &mut [u8], peek: bool) -> Io {
        if !self.stream_eof {
            self.stream_eof = true;
            crate::report::debug(format_args!(
                "from {:?}: stream ended at tcp byte {}; {} late tcp bytes so far",
                self.peer,
                self.tcp_recv,
                self.late.len()
            ));
        }
        self.try_recv_late(fd, buf, peek)
    }

    /// One read attempt that never waits.
    pub(crate) fn try_recv(&mut self, fd: c_int, buf: &mut [u8], peek: bool) -> Io {
        if !self.peeked.is_empty() {
            let n = buf.len().min(self.peeked.len());
            buf[..n].copy_from_slice(&self.peeked[..n]);
            if !peek {
                self.peeked.drain(..n);
            }
            return Io::Done(n);
        }
        self.learn_switch();
        if self.stream_eof {
            return self.try_recv_late(fd, buf, peek);
        }
        let left = self.tcp_left();
        if left > 0 && !self.tcp_eof {
            let len = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let flags = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
            // SAFETY: `buf` has `len` writable bytes.
            let got = unsafe { real::recv(fd, buf.as_mut_ptr().cast(), len, flags) };
            if got > 0 {
                if !peek {
                    self.tcp_recv += got as u64;
                }
                return Io::Done(got as usize);
            }
            if got == 0 {
                self.tcp_eof = true;
            } else {
                let errno = real::errno();
                if errno != libc::EAGAIN && errno != libc::EWOULDBLOCK {
                    return Io::Err(errno);
                }
            }
        }
        if self.switch_at.is_some() && self.tcp_left() > 0 {
            // TCP ended before the switch point: the peer is gone.
            return if self.tcp_eof { Io::Err(libc::ECONNRESET) } else { Io::WouldBlock };
        }
        if self.switch_at.is_none() {
            if !self.tcp_eof {
                return Io::WouldBlock;
            }
            // TCP ended: the end, unless the peer may have switched.
            let header_may_come = self.stream.is_some() && !self.stream_ended_early;
            return if header_may_come || self.phase == Phase::Pairing {
                Io::WouldBlock
            } else {
                Io::Done(0)
            };
        }
        let Some(stream) = self.stream.as_mut() else { return Io::Err(libc::EIO) };
        if peek {
            let mut chunk = vec![0u8; buf.len()];
            return match io::Read::read(stream, &mut chunk) {
                Ok(0) if !buf.is_empty() => self.stream_ended(fd, buf, peek),
                Ok(n) => {
                    self.rdma_recv += n as u64;
                    buf[..n].copy_from_slice(&chunk[..n]);
                    self.peeked.extend_from_slice(&chunk[..n]);
                    Io::Done(n)
                }
                Err(err) if would_block(&err) => Io::WouldBlock,
                Err(err) => Io::Err(errno_of(&err)),
            };
        }
        match io::Read::read(stream, buf) {
            Ok(0) if !buf.is_empty() => self.stream_ended(fd, buf, peek),
            Ok(n) => {
                self.rdma_recv += n as u64;
                Io::Done(n)
            }
            Err(err) if would_block(&err) => Io::WouldBlock,
            Err(err) => Io::Err(errno_of(&err)),
        }
    }

    /// Pushes the switch header; true once it has gone.
    fn push_header(&mut self) -> Result<bool, c_int> {
        let Some(stream) = self.stream.as_mut() else { return Ok(false) };
        while self.hdr_out_sent < self.hdr_out_len {
            match io::Write::write(stream, &self.hdr_out[self.hdr_out_sent..self.hdr_out_len]) {
                Ok(n) => self.hdr_out_sent += n,
                Err(err) if would_block(&err) => return Ok(false),
                Err(err) => return Err(errno_of(&err)),
            }
        }
        Ok(true)
    }

    /// One write attempt that never waits.
    pub(crate) fn try_send(&mut self, fd: c_int, data: &[u8], flags: c_int) -> Io {
        self.learn_switch();
        if self.send_switched {
            match self.push_header() {
                Ok(true) => {}
                Ok(false) => return Io::WouldBlock,
                Err(errno) => return Io::Err(errno),
            }
            // `MSG_MORE`: these bytes wait for the next send without it (as the kernel holds
            // a partial segment), or for [`CORK_LIMIT`]; that send's bytes leave with them.
            let more = flags & libc::MSG_MORE != 0;
            if more && self.more_since.is_none() {
                self.more_since = Some(Instant::now());
                self.apply_cork();
            }
            let Some(stream) = self.stream.as_mut() else { return Io::Err(libc::EIO) };
            let written = match io::Write::write(stream, data) {
                Ok(n) => {
                    self.rdma_sent += n as u64;
                    Io::Done(n)
                }
                Err(err) if would_block(&err) => Io::WouldBlock,
                Err(_) if !self.shut_wr && (self.stream_eof || stream.peer_closed_its_side()) => {
                    // The peer's library ended its stream cleanly and the stream is gone
                    // while its socket may live on (a program it exec'd, see `send_back`):
                    // from here this side sends on TCP, where a live socket's reader finds it
                    // and a closed one answers as TCP answers a write to a closed peer. (A
                    // peer that vanished without a clean end is an error, as before.)
                    self.send_switched = false;
                    self.sent_back = true;
                    crate::report::debug(format_args!(
                        "to {:?}: the peer closed its stream; sending on tcp from byte {}",
                        self.peer, self.tcp_sent
                    ));
                    return self.try_send(fd, data, flags);
                }
                Err(err) => Io::Err(errno_of(&err)),
            };
            if !more && self.more_since.is_some() && matches!(written, Io::Done(n) if n == data.len()) {
                self.more_since = None;
                self.apply_cork();
            }
            return written;
        }
        // SAFETY: `data` has `data.len()` readable bytes.
        let sent = unsafe { real::send(fd, data.as_ptr().cast(), data.len(), flags | libc::MSG_DONTWAIT) };
        if sent >= 0 {
            self.tcp_sent += sent as u64;
            return Io::Done(sent as usize);
        }
        match real::errno() {
            libc::EAGAIN => Io::WouldBlock,
            errno => Io::Err(errno),
        }
    }

    /// Takes a negotiated stream for `conn` (whose state this is): this side's sending
    /// switches now.
    pub(crate) fn install(&mut self, conn: &Conn, mut stream: lightpath::Stream) {
        let transport = stream.transport();
        if !transport.is_rdma() {
            self.phase = Phase::Tcp(format!("negotiated {transport}"));
            stream.close_in_background();
            return;
        }
        if let Err(err) = stream.set_nonblocking(true) {
            self.phase = Phase::Tcp(format!("stream set-up failed: {err}"));
            stream.close_in_background();
            return;
        }
        self.hdr_out[..8].copy_from_slice(&READY);
        self.hdr_out_len = 8;
        self.hdr_out_sent = 0;
        self.stream = Some(stream);
        conn.streamed.store(true, Ordering::Release);
        self.phase = Phase::Rdma(transport.to_string());
        let _ = self.push_header();
        // The peer's READY may be there already.
        self.learn_switch();
    }

    /// The application shut a direction down (`how` as shutdown(2) takes it).
    pub(crate) fn shutdown(&mut self, how: c_int) {
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.shut_wr = true;
            if self.send_switched {
                let _ = self.push_header();
                if let Some(stream) = self.stream.as_mut() {
                    let _ = stream.shutdown(std::net::Shutdown::Write);
                }
            }
        }
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            if let Some(stream) = self.stream.as_mut() {
                let _ = stream.shutdown(std::net::Shutdown::Read);
            }
        }
    }

    /// What the connection can do now apart from its TCP socket's own readiness: whether a
    /// read would return at once (stream data, the peer's end or an error, bytes kept by a
    /// peek) and whether a write to the stream would. The peer's switch header is taken off
    /// the stream first, so its 8 bytes never count as readable data.
    pub(crate) fn stream_readiness(&mut self) -> (bool, bool) {
        self.stream_readiness_after(lightpath::Signalled { notify: true, port: true, liveness: true })
    }

    /// [`State::stream_readiness`] for a caller that watches the stream's event fds
    /// edge-triggered and knows which signalled (see `lightpath::Stream::poll_ready_signalled`):
    /// one that did not is not read.
    pub(crate) fn stream_readiness_after(&mut self, signalled: lightpath::Signalled) -> (bool, bool) {
        self.learn_switch();
        let mut ready = self.stream.as_mut().map(|stream| stream.poll_ready_signalled(signalled));
        // The look takes in what reached the queue pair's own port, the peer's READY and
        // switch offset among it, and what it took in raises no event afterwards: learn them
        // now (and look again, for what follows them), or the switch waits for the next full
        // look (`wait::RECHECK_MS`, 100 ms). Seen between two namespaces: wrk against nginx
        // had 2-3 of 10 connections stall for 80-180 ms at their switch.
        let learning = self.switch_at.is_none() && !self.stream_ended_early;
        if learning && matches!(ready, Some(Ok(lightpath::Readiness { readable: true, .. }))) {
            let before = (self.hdr_in_len, self.stream_ended_early);
            self.learn_switch();
            if (self.hdr_in_len, self.stream_ended_early) != before {
                // Nothing signalled since the look just made: no descriptor is read.
                let quiet = lightpath::Signalled::default();
                ready = self.stream.as_mut().map(|stream| stream.poll_ready_signalled(quiet));
            }
        }
        let mut readable = !self.peeked.is_empty() || (self.stream_eof && !self.late.is_empty());
        if self.tcp_eof {
            let reset = self.switch_at.is_some() && self.tcp_left() > 0;
            let ended = self.switch_at.is_none()
                && (self.stream.is_none() || self.stream_ended_early)
                && self.phase != Phase::Pairing;
            readable |= reset || ended;
        }
        let reads_stream = self.switch_at.is_some() && self.tcp_left() == 0;
        let send_switched = self.send_switched;
        let mut writable = false;
        match ready {
            Some(Ok(ready)) => {
                readable |= ready.readable && reads_stream;
                writable = ready.writable && send_switched;
            }
            Some(Err(_)) => {
                // Once the stream has ended cleanly its later failure says nothing of TCP.
                readable |= !self.stream_eof;
                writable = send_switched;
            }
            None => {}
        }
        (readable, writable)
    }

    /// What a wait for `want_read`/`want_write` should watch, or `None` when the stream can
    /// proceed now: (fd, poll events) pairs.
    pub(crate) fn wait_set(
        &mut self,
        fd: c_int,
        want_read: bool,
        want_write: bool,
    ) -> Option<Vec<(c_int, i16)>> {
        let mut set = Vec::with_capacity(2);
        let mut tcp_events = 0;
        if want_read && (self.tcp_readable_matters() || self.late_tcp_watched()) {
            tcp_events |= libc::POLLIN;
        }
        if want_write && !self.send_switched {
            tcp_events |= libc::POLLOUT;
        }
        if tcp_events != 0 {
            set.push((fd, tcp_events));
        }
        let (readable, writable) = self.stream_readiness();
        if (want_read && readable) || (want_write && writable) {
            return None;
        }
        if self.stream_watched(want_read, want_write) {
            if let Some(stream) = self.stream.as_ref() {
                if let Ok(ready_fd) = stream.readiness_fd() {
                    set.push((ready_fd.as_raw_fd(), libc::POLLIN));
                }
            }
        }
        Some(set)
    }

    /// Whether a wait for `want_read`/`want_write` watches the stream: not for reading once
    /// it has ended (its end stays readable; TCP is watched then).
    pub(crate) fn stream_watched(&self, want_read: bool, want_write: bool) -> bool {
        (want_read && !self.stream_eof) || (want_write && self.send_switched)
    }

    /// Before an `execve`: this side's sending goes back to TCP. What was written reaches the
    /// peer over the stream (waiting at most `limit` for its acknowledgement), the stream's
    /// sending side ends cleanly, and what follows (the new program's writes on the inherited
    /// socket, or this process's if the exec fails) goes over TCP, which the peer reads after
    /// the stream's end (the late bytes of the module doc). Once this side had read up to the
    /// peer's switch point, its reading goes back to TCP as well: the stream's unread bytes
    /// are kept for this process's reads (lost to a new program: it cannot have them), and
    /// the stream is closed cleanly, so that the peer's next write finds it closed and goes
    /// over TCP, where the new program reads it. What the peer writes between that look and
    /// the close reaching it is lost.
    pub(crate) fn send_back(&mut self, limit: Duration) {
        if !self.send_switched {
            return;
        }
        if let Some(stream) = self.stream.as_mut() {
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(limit));
            let _ = stream.set_hold(false);
        }
        let _ = self.push_header();
        if let Some(stream) = self.stream.as_mut() {
            let _ = stream.shutdown(std::net::Shutdown::Write);
            let _ = io::Write::flush(stream);
            let _ = stream.set_write_timeout(None);
            let _ = stream.set_nonblocking(true);
        }
        self.send_switched = false;
        self.sent_back = true;
        // Reading goes to TCP too: what the peer sent over the stream and the application
        // has not read is kept for its reads (if the exec fails; a new program cannot have
        // it), and the stream is closed cleanly, so that the peer's next write fails at once
        // and goes to TCP (see `try_send`), where the new program reads it.
        self.learn_switch();
        if self.switch_at.is_some() && self.tcp_left() == 0 && !self.stream_eof {
            if let Some(stream) = self.stream.as_mut() {
                let mut chunk = vec![0u8; 64 << 10];
                loop {
                    match io::Read::read(stream, &mut chunk) {
                        Ok(n) if n > 0 => {
                            self.rdma_recv += n as u64;
                            self.peeked.extend_from_slice(&chunk[..n]);
                        }
                        _ => break,
                    }
                }
            }
            self.stream_eof = true;
        }
        if self.stream_eof {
            if let Some(mut stream) = self.stream.take() {
                // A clean close that waits (at most the stream's linger) for its goodbye to
                // be taken: this process's threads end with the exec.
                let _ = stream.set_nonblocking(false);
                drop(stream);
            }
        }
        crate::report::debug(format_args!(
            "to {:?}: sending back on tcp at byte {} before exec",
            self.peer, self.tcp_sent
        ));
    }

    /// Closes the stream side (the application closed its last fd), cleanly in the
    /// background.
    pub(crate) fn close(&mut self) {
        self.closed = true;
        if self.send_switched {
            let _ = self.push_header();
        }
        if let Some(stream) = self.stream.take() {
            stream.close_in_background();
        }
    }

    /// Closes the stream side and waits (at most the stream's linger) until the peer has
    /// everything written: for process exit, when no background thread would finish it.
    pub(crate) fn close_and_wait(&mut self) {
        self.closed = true;
        let _ = self.push_header();
        if let Some(mut stream) = self.stream.take() {
            let _ = stream.set_nonblocking(false);
            drop(stream);
        }
    }

    /// The transport this connection ended on, for the report.
    pub(crate) fn describe(&self) -> String {
        let transport = match &self.phase {
            Phase::Rdma(name) => name.clone(),
            Phase::Tcp(why) => format!("tcp ({why})"),
            Phase::Fresh => "tcp (no I/O through the library)".into(),
            Phase::Waiting => "tcp (no Lightpath peer answered yet)".into(),
            Phase::Pairing => "tcp (negotiation unfinished)".into(),
        };
        let addr = |a: Option<SocketAddr>| a.map_or_else(|| "?".to_string(), |a| a.to_string());
        format!(
            "local={} peer={} transport={} tcp_out={} tcp_in={} rdma_out={} rdma_in={}",
            addr(self.local),
            addr(self.peer),
            transport,
            self.tcp_sent,
            self.tcp_recv,
            self.rdma_sent,
            self.rdma_recv
        )
    }
}

/// Most late TCP bytes a connection keeps while its stream is open (see the module doc);
/// beyond it the socket is left to fill, as a reader that does not read leaves it.
pub(crate) const LATE_MAX: usize = 16 << 20;

/// Connections whose writes are held (TCP_CORK, `MSG_MORE`), for [`release_stale_corks`].
static CORKED: Mutex<Vec<std::sync::Weak<Conn>>> = Mutex::new(Vec::new());

/// How long TCP_CORK or `MSG_MORE` holds a switched connection's writes at most, as Linux
/// holds a corked socket's partial segment.
pub(crate) const CORK_LIMIT: Duration = Duration::from_millis(200);

/// The application set TCP_CORK (`on`) or cleared it: once the connection sends over its
/// stream, writes are held until it is cleared (then they leave as one record), or
/// [`CORK_LIMIT`] passes (see [`release_stale_corks`]).
pub(crate) fn set_corked(conn: &Arc<Conn>, on: bool) {
    let mut state = conn.lock();
    state.corked = on.then(Instant::now);
    state.apply_cork();
    drop(state);
    if on {
        list_held(conn);
    }
}

/// Puts a connection whose writes are held (TCP_CORK, `MSG_MORE`) in the list
/// [`release_stale_corks`] looks at: once however often it holds (nginx corks every
/// response); the list lets a connection go once it is found holding nothing.
pub(crate) fn list_held(conn: &Arc<Conn>) {
    let mut state = conn.lock();
    if state.cork_listed || state.held_since().is_none() {
        return;
    }
    state.cork_listed = true;
    drop(state);
    let mut corked = CORKED.lock().unwrap_or_else(|p| p.into_inner());
    corked.push(Arc::downgrade(conn));
}

/// Sends what a cork held for longer than [`CORK_LIMIT`] (the hold stays for later writes,
/// as a corked socket keeps corking); forgets connections no longer corked or gone. Called
/// by the rendezvous watcher on every turn (at least every 100 ms).
pub(crate) fn release_stale_corks() {
    let mut corked = CORKED.lock().unwrap_or_else(|p| p.into_inner());
    if corked.is_empty() {
        return;
    }
    corked.retain(|weak| {
        let Some(conn) = weak.upgrade() else { return false };
        let mut state = conn.lock();
        let Some(since) = state.held_since() else {
            state.cork_listed = false;
            return false;
        };
        if since.elapsed() >= CORK_LIMIT && state.send_switched {
            // What waited goes; a cork still set holds later writes again, a `MSG_MORE`
            // hold is over.
            if let Some(stream) = state.stream.as_mut() {
                let _ = stream.set_hold(false);
            }
            state.more_since = None;
            state.corked = state.corked.map(|_| Instant::now());
            state.apply_cork();
        }
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two installed ends of a soft stream on loopback (queue pairs with ports of their own,
    /// as between two hosts).
    fn soft_pair() -> (Conn, Conn) {
        let options =
            lightpath::Options { providers: vec![lightpath::ProviderId::Soft], ..Default::default() };
        let listener = lightpath::Listener::bind_with(("127.0.0.1", 0), options.clone()).expect("listen");
        let at = listener.local_addr().expect("address");
        let accepting = std::thread::spawn(move || listener.accept().expect("accept").0);
        let client = lightpath::Stream::connect_with(at, &options).expect("connect");
        let server = accepting.join().expect("accept thread");
        assert_eq!(client.transport(), lightpath::Transport::Rdma(lightpath::ProviderId::Soft));
        let (a, b) = (Conn::new(), Conn::new());
        a.lock().install(&a, server);
        b.lock().install(&b, client);
        (a, b)
    }

    /// The peer's READY arrives on the stream, in the queue pair's own port: the look that
    /// takes the port in must learn it, not leave it in the ring unread until a later full look
    /// (which for an event loop came up to 100 ms later: `wait::RECHECK_MS`).
    #[test]
    fn a_look_learns_the_peers_ready_it_takes_in() {
        let (a, b) = soft_pair();
        let mut state = a.lock();
        // `b`'s READY went out when it was installed, after `a` was: wait until it is in
        // `a`'s port (the middle one of the stream's event fds), then look once.
        let fds = state.stream.as_ref().expect("installed").event_fds();
        assert_eq!(fds.len(), 3, "a soft queue pair with a port of its own: {fds:?}");
        // SAFETY: the fd belongs to the stream, which `state` keeps open during the call.
        let port = unsafe { std::os::fd::BorrowedFd::borrow_raw(fds[1]) };
        let mut poll = [rustix::event::PollFd::new(&port, rustix::event::PollFlags::IN)];
        let a_while = rustix::event::Timespec { tv_sec: 1, tv_nsec: 0 };
        let in_port = rustix::event::poll(&mut poll, Some(&a_while)).expect("poll") == 1;
        // (On a loaded machine the device's progress thread may take the port in first, a
        // tick later: then the READY waits in the queue, where any look finds it, and only
        // the second assertion below means something.)
        assert_eq!(state.hdr_in_len, 0, "the READY was read before it was looked for");
        state.stream_readiness_after(lightpath::Signalled { notify: true, port: true, liveness: true });
        let learned = state.hdr_in_len >= 8;
        assert!(learned || !in_port, "the look took the peer's READY in from the port but did not learn it");
        if !learned {
            // Taken in by the progress thread after the poll gave up: one more look.
            std::thread::sleep(std::time::Duration::from_millis(20));
            state.stream_readiness_after(lightpath::Signalled { notify: true, port: true, liveness: true });
        }
        assert!(state.hdr_in_len >= 8, "the peer's READY was never learned");
        assert!(state.send_switched, "a READY learned switches this side's sending");
        drop(state);
        drop(b);
    }

    /// Looks at both ends until each has switched its sending and learned the other's switch
    /// point (both headers crossed).
    fn switch_both(a: &Conn, b: &Conn) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let signalled = lightpath::Signalled { notify: true, port: true, liveness: true };
        loop {
            let mut done = true;
            for end in [a, b] {
                let mut state = end.lock();
                state.stream_readiness_after(signalled);
                done &= state.send_switched && state.switch_at.is_some();
            }
            if done {
                return;
            }
            assert!(Instant::now() < deadline, "the two ends did not switch within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Reads what `end` receives within `limit` (no TCP: both switch points are 0).
    fn received_within(end: &Conn, limit: Duration) -> Vec<u8> {
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while Instant::now() < deadline {
            match end.lock().try_recv(-1, &mut buf, false) {
                Io::Done(0) => break,
                Io::Done(n) => got.extend_from_slice(&buf[..n]),
                Io::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Io::Err(errno) => panic!("receive failed: errno {errno}"),
            }
        }
        got
    }

    /// `MSG_MORE` on a switched connection: the bytes wait for the next send without it and
    /// leave with it (as the kernel holds a partial segment); bytes a `MSG_MORE` send left
    /// with no send after it go after [`CORK_LIMIT`], never stay.
    #[test]
    fn msg_more_holds_until_the_next_send_or_the_cork_limit() {
        let (a, b) = soft_pair();
        switch_both(&a, &b);
        let a = Arc::new(a);
        assert!(matches!(a.lock().try_send(-1, b"head ", libc::MSG_MORE), Io::Done(5)));
        list_held(&a);
        assert_eq!(received_within(&b, Duration::from_millis(50)), b"", "a MSG_MORE send left at once");
        assert!(matches!(a.lock().try_send(-1, b"body", 0), Io::Done(4)));
        assert_eq!(received_within(&b, Duration::from_millis(300)), b"head body");
        // A MSG_MORE send that nothing follows: released by the watcher's look.
        assert!(matches!(a.lock().try_send(-1, b"tail", libc::MSG_MORE), Io::Done(4)));
        list_held(&a);
        release_stale_corks();
        assert_eq!(received_within(&b, Duration::from_millis(50)), b"", "released before the limit");
        std::thread::sleep(CORK_LIMIT);
        release_stale_corks();
        assert_eq!(received_within(&b, Duration::from_millis(300)), b"tail");
        // The hold is over: a plain send leaves at once.
        assert!(matches!(a.lock().try_send(-1, b"!", 0), Io::Done(1)));
        assert_eq!(received_within(&b, Duration::from_millis(300)), b"!");
    }
}
