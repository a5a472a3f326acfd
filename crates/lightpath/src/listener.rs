//! [`Listener`]: one thread accepts connections and negotiates all of them at once, each as
//! far as its socket allows (a `poll` loop over the listening socket and every negotiation in
//! progress), so a slow or silent client never holds up the others and no connection costs a
//! thread. (The tokio listener, `crate::tokio::Listener`, runs the same negotiation as a task
//! per connection instead.)

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};

use rustix::event::{PollFd, PollFlags};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::negotiate::{self, Advanced, Handshake};
use crate::options::Options;
use crate::stream::Stream;

/// Negotiations running at once; further clients wait in the kernel's backlog.
const MAX_NEGOTIATING: usize = 256;

/// A listening Lightpath endpoint.
pub struct Listener {
    local: SocketAddr,
    ready: Mutex<mpsc::Receiver<io::Result<Stream>>>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("local", &self.local).finish()
    }
}

impl Listener {
    /// Listens on `addr` with default options.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(addr, Options::default())
    }

    /// Listens with the given options.
    pub fn bind_with(addr: impl ToSocketAddrs, options: Options) -> io::Result<Listener> {
        let tcp = TcpListener::bind(addr)?;
        let local = tcp.local_addr()?;
        let (sender, receiver) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("lightpath-accept".into())
                .spawn(move || accept_loop(tcp, options, sender, stop))?
        };
        Ok(Listener { local, ready: Mutex::new(receiver), stop, acceptor: Some(acceptor) })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Waits for the next negotiated connection and its peer's address. Clients that fail
    /// negotiation (garbage, vanished) are dropped and never returned.
    pub fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        let ready = self.ready.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let stream = ready.recv().map_err(|_| io::Error::other("lightpath: the listener stopped"))??;
        let peer = stream.peer_addr()?;
        Ok((stream, peer))
    }

    /// Like [`Listener::accept`] but gives up after `timeout` with `TimedOut`.
    pub fn accept_timeout(&self, timeout: Duration) -> io::Result<(Stream, SocketAddr)> {
        let ready = self.ready.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let stream = match ready.recv_timeout(timeout) {
            Ok(result) => result?,
            Err(mpsc::RecvTimeoutError::Timeout) => return Err(io::ErrorKind::TimedOut.into()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(io::Error::other("lightpath: the listener stopped"))
            }
        };
        let peer = stream.peer_addr()?;
        Ok((stream, peer))
    }

    /// An iterator over accepted streams.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<Stream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(stream, _)| stream)))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the acceptor blocked in accept(2) with a connection of our own.
        let _ = std::net::TcpStream::connect_timeout(&wake_addr(self.local), Duration::from_millis(200));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn wake_addr(local: SocketAddr) -> SocketAddr {
    let ip = match local.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    SocketAddr::new(ip, local.port())
}

/// A descriptor a listener holds back for the moment the process runs out of them.
///
/// Out of descriptors, `accept(2)` fails and a client in the backlog stays there: it connected
/// (the kernel completed the handshake), sent its hello and waits for an answer that never
/// comes — a Lightpath client gives up after the negotiation timeout (5 s) with "the server is
/// not a Lightpath listener (or is stuck)", a plain one hangs. So, when a client is waiting,
/// the listener gives this spare back, takes that client and closes its connection at once (the
/// client reads the end of the stream during the negotiation and says so), then takes the spare
/// again, all in one go: `accept` fails for want of a descriptor even with nobody waiting, and
/// a spare given back then is soon taken by whatever opens a descriptor next (measured with
/// the tokio listener: the registration of the connection accepted last took it, and the next
/// client waited the 5 s). (libuv's servers do the same.)
pub(crate) struct SpareDescriptor(Option<std::fs::File>);

impl SpareDescriptor {
    pub(crate) fn new() -> Self {
        Self(std::fs::File::open("/dev/null").ok())
    }

    /// Whether `err` says the process (or the system) is out of descriptors.
    pub(crate) fn exhausted(err: &io::Error) -> bool {
        let code = err.raw_os_error();
        code == Some(rustix::io::Errno::MFILE.raw_os_error())
            || code == Some(rustix::io::Errno::NFILE.raw_os_error())
    }

    /// If a client waits in `listener`'s backlog and the spare is held: closes the spare,
    /// accepts that client, closes its connection and takes a spare again. Returns whether a
    /// client was turned away.
    pub(crate) fn turn_away_waiting_client(&mut self, listener: BorrowedFd<'_>) -> bool {
        if self.0.is_none() {
            *self = Self::new();
        }
        if self.0.is_none() {
            return false;
        }
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        if !matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(1)) {
            return false;
        }
        self.0 = None;
        // Readable: a connection is queued, so this does not block (a blocking listener's).
        let turned_away = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC).is_ok();
        *self = Self::new();
        turned_away
    }
}

/// One negotiation the acceptor runs: the connection, its state machine, and what it waits for.
struct InFlight {
    tcp: std::net::TcpStream,
    handshake: Handshake,
    /// What wakes it: its socket readable or writable (`PollFlags::IN` or `OUT`)...
    interest: PollFlags,
    /// ... before this, when it gives up waiting.
    deadline: Instant,
}

/// Moves a server's negotiation on (see [`negotiate::advance`]): what its socket must be
/// ready for, and until when, or `None` once it is over.
fn advance(handshake: &mut Handshake, tcp: &std::net::TcpStream) -> Option<(PollFlags, Instant)> {
    loop {
        match negotiate::advance(handshake, tcp) {
            Advanced::Wait { write, deadline } => {
                return Some((if write { PollFlags::OUT } else { PollFlags::IN }, deadline))
            }
            // Only a client probes.
            Advanced::Probe { .. } => {
                handshake.probe_finished(Err(io::Error::other("lightpath: a server has no probe")))
            }
            Advanced::Done => return None,
        }
    }
}

/// Takes a negotiation that [`advance`] found over to its end: the stream for `accept`, or
/// nothing for a client that failed (it was told why, if it can parse it).
fn finish(tcp: std::net::TcpStream, handshake: Handshake, options: &Options) -> Option<io::Result<Stream>> {
    // Streams get their connection back in blocking mode, as the blocking driver leaves it (a
    // queue pair's copy of the descriptor shares the flag).
    if let Err(err) = tcp.set_nonblocking(false) {
        return Some(Err(err));
    }
    match handshake.finish(tcp) {
        Ok(negotiated) => Some(Stream::from_negotiated(negotiated, options.spin)),
        Err(_) => None,
    }
}

/// The acceptor thread: one `poll` loop over the listening socket and every negotiation in
/// progress (at most [`MAX_NEGOTIATING`]), each driven as far as its socket allows whenever
/// it is ready. A thread per negotiation cost a thread's creation and exit (stack mapping,
/// and the TLB shootdown of its unmapping) and two more wake-ups for every connection; a
/// silent or slow client still holds up nobody, since nothing here waits for one socket.
fn accept_loop(
    tcp: TcpListener,
    options: Options,
    ready: mpsc::Sender<io::Result<Stream>>,
    stop: Arc<AtomicBool>,
) {
    let mut spare = SpareDescriptor::new();
    if let Err(err) = tcp.set_nonblocking(true) {
        let _ = ready.send(Err(err));
        return;
    }
    let mut flights: Vec<InFlight> = Vec::new();
    // A negotiation's outcome goes to `accept`; false once the listener is gone.
    let hand_over = |tcp, handshake| match finish(tcp, handshake, &options) {
        Some(stream) => ready.send(stream).is_ok(),
        None => true,
    };
    loop {
        // Take every client that waits, as long as there is room, and start on each at once:
        // its hello has usually arrived with its connection.
        let mut accept_failed = false;
        while flights.len() < MAX_NEGOTIATING {
            let conn = match tcp.accept() {
                Ok((conn, _)) => conn,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err)
                    if err.kind() == io::ErrorKind::Interrupted
                        || err.kind() == io::ErrorKind::ConnectionAborted =>
                {
                    continue
                }
                Err(err) => {
                    if SpareDescriptor::exhausted(&err) {
                        // Turn a waiting client away now rather than leave it waiting (see
                        // `SpareDescriptor`).
                        spare.turn_away_waiting_client(tcp.as_fd());
                    }
                    // Out of file descriptors and the like: report it and keep serving.
                    if ready.send(Err(err)).is_err() {
                        return;
                    }
                    accept_failed = true;
                    break;
                }
            };
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let started = conn.set_nonblocking(true).and_then(|()| Handshake::server(&conn, &options));
            let Ok(mut handshake) = started else { continue };
            match advance(&mut handshake, &conn) {
                Some((interest, deadline)) => {
                    flights.push(InFlight { tcp: conn, handshake, interest, deadline })
                }
                None => {
                    if !hand_over(conn, handshake) {
                        return;
                    }
                }
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }

        // Wait for the listener (while there is room), a negotiation's socket, or the
        // earliest deadline; after a failed accept, 10 ms at most before trying again.
        let now = Instant::now();
        let mut until = flights.iter().map(|f| f.deadline).min();
        if accept_failed || flights.len() >= MAX_NEGOTIATING {
            // Full, the listener is not watched: look at `stop` now and then all the same.
            let cap =
                now + if accept_failed { Duration::from_millis(10) } else { Duration::from_millis(100) };
            until = Some(until.map_or(cap, |u| u.min(cap)));
        }
        let mut fds: Vec<PollFd<'_>> = flights.iter().map(|f| PollFd::new(&f.tcp, f.interest)).collect();
        if !accept_failed && flights.len() < MAX_NEGOTIATING {
            fds.push(PollFd::new(&tcp, PollFlags::IN));
        }
        let timeout = until.map(|u| {
            let left = u.saturating_duration_since(now);
            rustix::event::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) }
        });
        if let Err(err) = rustix::event::poll(&mut fds, timeout.as_ref()) {
            if err != rustix::io::Errno::INTR {
                // Nothing a poll over descriptors this thread owns fails with; do not spin.
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let woken: Vec<bool> = fds.iter().take(flights.len()).map(|fd| !fd.revents().is_empty()).collect();
        drop(fds);

        // Move on every negotiation whose socket is ready or whose deadline passed (it then
        // times out in `advance`); those that are over leave the loop.
        let now = Instant::now();
        let mut index = 0;
        let over: Vec<InFlight> = flights
            .extract_if(.., |flight| {
                let woke = woken[index];
                index += 1;
                (woke || flight.deadline <= now)
                    && match advance(&mut flight.handshake, &flight.tcp) {
                        Some((interest, deadline)) => {
                            (flight.interest, flight.deadline) = (interest, deadline);
                            false
                        }
                        None => true,
                    }
            })
            .collect();
        for InFlight { tcp, handshake, .. } in over {
            if !hand_over(tcp, handshake) {
                return;
            }
        }
    }
}
