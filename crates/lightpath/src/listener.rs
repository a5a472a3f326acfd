//! [`Listener`]: accepts connections and negotiates each one on its own thread, so a slow or
//! silent client never holds up the others. (The tokio listener, `crate::tokio::Listener`,
//! runs the same negotiation as a task per connection instead.)

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};

use rustix::event::{PollFd, PollFlags};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::negotiate::{self, Accepted};
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

fn accept_loop(
    tcp: TcpListener,
    options: Options,
    ready: mpsc::Sender<io::Result<Stream>>,
    stop: Arc<AtomicBool>,
) {
    let options = Arc::new(options);
    let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut spare = SpareDescriptor::new();
    loop {
        let accepted = tcp.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (conn, _) = match accepted {
            Ok(accepted) => accepted,
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
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        while running.load(Ordering::SeqCst) >= MAX_NEGOTIATING {
            std::thread::sleep(Duration::from_millis(1));
        }
        running.fetch_add(1, Ordering::SeqCst);
        let (options, ready, counter) = (Arc::clone(&options), ready.clone(), Arc::clone(&running));
        let spawned = std::thread::Builder::new().name("lightpath-negotiate".into()).spawn(move || {
            if let Accepted::Stream(negotiated) = negotiate::server(conn, &options) {
                let _ = ready.send(Stream::from_negotiated(negotiated, options.spin));
            }
            counter.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            running.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
