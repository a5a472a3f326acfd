//! How the two ends of a TCP connection learn that both run Lightpath, and get a stream.
//!
//! On one host, both ends' processes share the network namespace's abstract Unix socket
//! names. Each end, at its first I/O on the connection, derives the same name from the
//! connection's two addresses (a hash of the sorted pair): `lightpath-preload-1-<hash>`.
//! It tries to connect to that name; if nobody listens it binds the name and listens; if the
//! bind finds the name taken (the peer just bound it), it connects again. So exactly one
//! end listens and the other connects, without any daemon or configuration. A peer that
//! does not run Lightpath never connects: after [`PEER_WAIT`] the listening end gives the
//! name up and the connection simply stays TCP (it always was).
//!
//! Once paired on the Unix socket (the listener checks the caller's uid), the listening end
//! opens a TCP listener on its connection's local address, says its port, and the two run
//! Lightpath's ordinary negotiation over that side connection ([`lightpath::Stream`]): shm
//! between processes of one host. The side TCP connection then serves as the stream's
//! liveness channel. Each pairing runs on a short-lived thread of its own (two processes may
//! pair several connections with each other at once, each side in either role); one thread
//! per process watches the listening names.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::conn::{pid, Conn, Phase};
use crate::remote;

/// How long a listening end waits for its peer to turn up.
pub(crate) const PEER_WAIT: Duration = Duration::from_secs(2);
/// How long one pairing step (port, TCP accept) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(2);

struct Watcher {
    pid: u32,
    queue: Arc<Mutex<Vec<Arc<Conn>>>>,
    wake: Arc<OwnedFd>,
}

static WATCHER: Mutex<Option<Watcher>> = Mutex::new(None);

/// The process (pid) whose shm device Lightpath opened; a fork child of it does not
/// accelerate (the device's threads did not survive the fork).
static DEVICE_PID: Mutex<u32> = Mutex::new(0);

/// The stream options of this process's connections: the defaults with the `LIGHTPATH_*`
/// settings of the environment as it was when the library loaded (see `init`: a server that
/// clears its environment for its workers keeps them).
pub(crate) fn base_options() -> &'static lightpath::Options {
    static OPTIONS: OnceLock<lightpath::Options> = OnceLock::new();
    OPTIONS.get_or_init(lightpath::Options::default)
}

/// Why connections of this process stay TCP, if they do.
pub(crate) fn why_not() -> Option<String> {
    static PROVIDERS: OnceLock<Result<(), String>> = OnceLock::new();
    let providers = PROVIDERS.get_or_init(|| {
        if std::env::var("LIGHTPATH_PRELOAD").is_ok_and(|v| v == "off" || v == "0") {
            return Err("LIGHTPATH_PRELOAD=off".into());
        }
        let options = base_options();
        let usable =
            [lightpath::ProviderId::Shm, lightpath::ProviderId::Soft, lightpath::ProviderId::Ibverbs];
        if options.providers.iter().any(|p| usable.contains(p)) {
            Ok(())
        } else {
            Err("LIGHTPATH_PROVIDERS names no RDMA provider".into())
        }
    });
    if let Err(reason) = providers {
        return Some(reason.clone());
    }
    let device_pid = *DEVICE_PID.lock().unwrap_or_else(|p| p.into_inner());
    if device_pid != 0 && device_pid != pid() {
        return Some("fork child of a process that already used Lightpath".into());
    }
    None
}

/// The rendezvous name of the connection between `a` and `b`, the same from both ends.
fn name(a: SocketAddr, b: SocketAddr) -> String {
    let (a, b) = (a.to_string(), b.to_string());
    let (low, high) = if a <= b { (a, b) } else { (b, a) };
    // FNV-1a, 64 bits: the name must fit a sun_path; collisions only cost a failed pairing.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in low.bytes().chain([b'|']).chain(high.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("lightpath-preload-2-{hash:016x}")
}

/// Offers `conn` (its addresses are known): pairing goes on in the background.
pub(crate) fn register(conn: Arc<Conn>) {
    let mut watcher = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
    let me = pid();
    if watcher.as_ref().is_none_or(|w| w.pid != me) {
        match start_watcher(me) {
            Ok(started) => *watcher = Some(started),
            Err(err) => {
                conn.lock().phase = Phase::Tcp(format!("could not start the rendezvous thread: {err}"));
                return;
            }
        }
    }
    let Some(w) = watcher.as_ref() else { return };
    w.queue.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
    let _ = rustix::io::write(&*w.wake, &1u64.to_ne_bytes());
}

fn start_watcher(me: u32) -> io::Result<Watcher> {
    let wake = Arc::new(crate::guard::high(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?));
    let queue = Arc::new(Mutex::new(Vec::new()));
    let (thread_wake, thread_queue) = (Arc::clone(&wake), Arc::clone(&queue));
    std::thread::Builder::new().name("lightpath-rendezvous".into()).spawn(move || {
        crate::guard::mark_internal();
        if let Err(err) = watch(&thread_wake, &thread_queue) {
            crate::report::line(format_args!("rendezvous thread stopped: {err}"));
        }
    })?;
    Ok(Watcher { pid: me, queue, wake })
}

/// One end waiting for its peer.
struct Waiting {
    conn: Arc<Conn>,
    listening: Listening,
    deadline: Instant,
}

/// Where a waiting end listens.
enum Listening {
    /// On the connection's abstract name: a peer of this namespace, or the relay for a peer
    /// on another host (`remote`: then this namespace's rendezvous port must be held).
    Name { listener: UnixListener, remote: bool },
    /// The lower end of a connection to another host: its side listener, and the hello it
    /// repeats to the peer's rendezvous port until the peer connects (`gap` after the last
    /// one, see [`FIRST_HELLO_GAP`]).
    Side {
        listener: TcpListener,
        hello: [u8; remote::Hello::LEN],
        to: SocketAddr,
        next_hello: Instant,
        gap: Duration,
        /// Hellos sent so far, and when the first went (for `LIGHTPATH_PRELOAD_DEBUG`).
        sent: u32,
        since: Instant,
    },
}

impl Listening {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listening::Name { listener, .. } => listener.as_fd(),
            Listening::Side { listener, .. } => listener.as_fd(),
        }
    }
}

/// How often the lower end repeats its hello, at most.
const HELLO_EVERY: Duration = Duration::from_millis(100);
/// The lower end's first repeat comes this soon, and each gap doubles up to [`HELLO_EVERY`]:
/// a hello that reaches the peer's host before the peer's end bound its name (it does at its
/// first I/O on the connection, on its watcher thread) is lost, and with a fixed 100 ms gap
/// every connection whose peer lost that race (9 of 30 of wrk's against nginx between two
/// namespaces) waited 100 ms more for its switch.
const FIRST_HELLO_GAP: Duration = Duration::from_millis(1);

const WAKE_TOKEN: u64 = u64::MAX;
const RELAY_TOKEN: u64 = u64::MAX - 1;

fn watch(wake: &OwnedFd, queue: &Mutex<Vec<Arc<Conn>>>) -> io::Result<()> {
    let poller = crate::guard::high(epoll::create(epoll::CreateFlags::CLOEXEC)?);
    epoll::add(&poller, wake, epoll::EventData::new_u64(WAKE_TOKEN), epoll::EventFlags::IN)?;
    let mut waiting: HashMap<u64, Waiting> = HashMap::new();
    let mut relay: Option<UdpSocket> = None;
    let mut hello_socket: Option<UdpSocket> = None;
    let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
    loop {
        // Up to 100 ms, and no later than the next hello due.
        let now = Instant::now();
        let next = waiting
            .values()
            .filter_map(|entry| match &entry.listening {
                Listening::Side { next_hello, .. } => Some(next_hello.saturating_duration_since(now)),
                Listening::Name { .. } => None,
            })
            .fold(HELLO_EVERY, Duration::min);
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: next.as_nanos() as i64 };
        events.clear();
        match epoll::wait(&poller, rustix::buffer::spare_capacity(&mut events), Some(&timeout)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(err) => return Err(err.into()),
        }
        for event in events.iter() {
            let token = event.data.u64();
            if token == WAKE_TOKEN {
                let mut counter = [0u8; 8];
                let _ = rustix::io::read(wake, &mut counter);
                let fresh = std::mem::take(&mut *queue.lock().unwrap_or_else(|p| p.into_inner()));
                for conn in fresh {
                    if let Some(entry) = offer(conn) {
                        let id = entry.conn.id;
                        let data = epoll::EventData::new_u64(id);
                        if epoll::add(&poller, entry.listening.fd(), data, epoll::EventFlags::IN).is_ok() {
                            waiting.insert(id, entry);
                        }
                    }
                }
            } else if token == RELAY_TOKEN {
                if let Some(socket) = relay.as_ref() {
                    relay_hellos(socket);
                }
            } else if let Some(entry) = waiting.get(&token) {
                let accepted = match &entry.listening {
                    Listening::Name { listener, .. } => match listener.accept() {
                        Ok((unix, _)) => Some(Paired::Named(unix)),
                        Err(_) => None,
                    },
                    Listening::Side { listener, sent, since, .. } => {
                        let side = accept_side(listener, &entry.conn);
                        if side.is_some() {
                            crate::report::debug(format_args!(
                                "the peer answered hello {sent} after {:?}",
                                since.elapsed()
                            ));
                        }
                        side.map(Paired::Side)
                    }
                };
                if let Some(paired) = accepted {
                    let entry = waiting.remove(&token).expect("present");
                    let _ = epoll::delete(&poller, entry.listening.fd());
                    drop(entry.listening);
                    spawn_pairing(entry.conn, paired);
                }
            }
        }
        crate::conn::release_stale_corks();
        let now = Instant::now();
        waiting.retain(|_, entry| {
            let mut state = entry.conn.lock();
            let keep = !state.closed && now < entry.deadline;
            if !keep {
                if state.phase == Phase::Waiting {
                    state.phase = Phase::Tcp(format!("no Lightpath peer turned up within {PEER_WAIT:?}"));
                }
                let _ = epoll::delete(&poller, entry.listening.fd());
            }
            keep
        });
        for entry in waiting.values_mut() {
            if let Listening::Side { hello, to, next_hello, gap, sent, .. } = &mut entry.listening {
                if now >= *next_hello {
                    *next_hello = now + *gap;
                    *gap = (*gap * 2).min(HELLO_EVERY);
                    *sent += 1;
                    if hello_socket.is_none() {
                        hello_socket = bind_udp_any(0).ok().map(crate::guard::high);
                    }
                    if let Some(socket) = hello_socket.as_ref() {
                        let _ = socket.send_to(&hello[..], *to);
                    }
                }
            }
        }
        // A higher end of a connection to another host needs this namespace's rendezvous port
        // held; the first process to need it keeps it (taken again if its holder has gone).
        let relay_needed =
            waiting.values().any(|e| matches!(e.listening, Listening::Name { remote: true, .. }));
        if relay.is_none() && relay_needed {
            if let Some(socket) = bind_relay() {
                let data = epoll::EventData::new_u64(RELAY_TOKEN);
                if epoll::add(&poller, socket.as_fd(), data, epoll::EventFlags::IN).is_ok() {
                    relay = Some(socket);
                }
            }
        }
    }
}

/// How a waiting end met its peer.
enum Paired {
    /// This end connected to the name a peer of this namespace listens on.
    Local(UnixStream),
    /// Someone connected to the connection's abstract name: a peer of this namespace, or the
    /// relay naming a peer on another host.
    Named(UnixStream),
    /// The peer on another host connected to this (lower) end's side listener.
    Side(TcpStream),
}

/// The peer's connection to a side listener, if one came from the connection's peer address
/// (anything else is closed; the end keeps waiting).
fn accept_side(listener: &TcpListener, conn: &Conn) -> Option<TcpStream> {
    let peer = conn.lock().peer?;
    loop {
        match listener.accept() {
            Ok((tcp, from)) if from.ip().to_canonical() == peer.ip().to_canonical() => return Some(tcp),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

/// A UDP socket on `port` of every address: IPv6 and IPv4, or IPv4 alone where IPv6 is off.
fn bind_udp_any(port: u16) -> io::Result<UdpSocket> {
    UdpSocket::bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port))
        .or_else(|_| UdpSocket::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)))
}

/// Binds this namespace's rendezvous port, if nobody holds it.
fn bind_relay() -> Option<UdpSocket> {
    let socket = bind_udp_any(remote::port()).ok()?;
    socket.set_nonblocking(true).ok()?;
    Some(crate::guard::high(socket))
}

/// Hellos the relay takes per wake-up: a flood of datagrams at the rendezvous port cannot
/// keep the watcher from its other work (what is left waits for the next round).
const RELAY_BATCH: usize = 64;

/// Hands each hello waiting at the relay to the end listening on its connection's name.
fn relay_hellos(socket: &UdpSocket) {
    let mut buf = [0u8; 64];
    for _ in 0..RELAY_BATCH {
        let Ok((len, from)) = socket.recv_from(&mut buf) else { return };
        let Some(hello) = remote::Hello::parse(&buf[..len]) else { continue };
        // The sender must be who it says it is (its address on the connection), and the
        // connection's other end must be of this namespace.
        if from.ip().to_canonical() != hello.sender.ip() || !remote::is_local(hello.receiver.ip()) {
            continue;
        }
        let target = SocketAddr::new(hello.sender.ip(), hello.side_port);
        let _ = tell_name(&name(hello.sender, hello.receiver), remote::RelayMessage::Remote(target));
    }
}

/// Connects to the abstract `name` without waiting and says `message`.
fn tell_name(name: &str, message: remote::RelayMessage) -> io::Result<()> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let address = SocketAddrUnix::new_abstract_name(name.as_bytes())?;
    let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)?;
    rustix::net::connect(&fd, &address)?;
    let bytes = message.emit();
    if rustix::io::write(&fd, &bytes)? != bytes.len() {
        return Err(io::Error::other("short write"));
    }
    Ok(())
}

/// Starts the pairing of `conn`: connects to or listens on the connection's name (a peer of
/// this namespace), or for a peer on another host named by the rule, waits as its end of the
/// pair must (see `remote`).
fn offer(conn: Arc<Conn>) -> Option<Waiting> {
    let (local, peer) = {
        let state = conn.lock();
        (state.local?, state.peer?)
    };
    let remote = !remote::is_local(peer.ip());
    if remote && !remote::rule().allows(peer.ip()) {
        let why = if remote::rule().is_empty() {
            format!("the peer {} is on another host (LIGHTPATH_PRELOAD_PEERS names no peer)", peer.ip())
        } else {
            format!("the peer {} is on another host, not named by LIGHTPATH_PRELOAD_PEERS", peer.ip())
        };
        conn.lock().phase = Phase::Tcp(why);
        return None;
    }
    if remote && remote::is_lower(local, peer) {
        return offer_side(conn, local, peer);
    }
    let address = match UnixAddr::from_abstract_name(name(local, peer).as_bytes()) {
        Ok(address) => address,
        Err(err) => {
            conn.lock().phase = Phase::Tcp(format!("rendezvous name: {err}"));
            return None;
        }
    };
    for _ in 0..2 {
        if !remote {
            if let Ok(unix) = UnixStream::connect_addr(&address) {
                spawn_pairing(conn, Paired::Local(unix));
                return None;
            }
        }
        match UnixListener::bind_addr(&address) {
            Ok(listener) => {
                let listener = crate::guard::high(listener);
                if listener.set_nonblocking(true).is_err() {
                    break;
                }
                let listening = Listening::Name { listener, remote };
                return Some(Waiting { conn, listening, deadline: Instant::now() + PEER_WAIT });
            }
            // The peer bound it between our connect and our bind: connect again.
            Err(err) if err.kind() == io::ErrorKind::AddrInUse && !remote => continue,
            Err(err) => {
                conn.lock().phase = Phase::Tcp(format!("rendezvous bind: {err}"));
                return None;
            }
        }
    }
    conn.lock().phase = Phase::Tcp("rendezvous name busy".into());
    None
}

/// The lower end of a connection to another host: a side listener on the connection's local
/// address, announced to the peer's rendezvous port (the watcher repeats the hello).
fn offer_side(conn: Arc<Conn>, local: SocketAddr, peer: SocketAddr) -> Option<Waiting> {
    let listener = match TcpListener::bind(SocketAddr::new(local.ip(), 0)).and_then(|listener| {
        listener.set_nonblocking(true)?;
        Ok(crate::guard::high(listener))
    }) {
        Ok(listener) => listener,
        Err(err) => {
            conn.lock().phase = Phase::Tcp(format!("side listener: {err}"));
            return None;
        }
    };
    let side_port = listener.local_addr().ok()?.port();
    let hello = remote::Hello { sender: local, receiver: peer, side_port }.emit();
    let to = SocketAddr::new(peer.ip(), remote::port());
    let listening = Listening::Side {
        listener,
        hello,
        to,
        next_hello: Instant::now(),
        gap: FIRST_HELLO_GAP,
        sent: 0,
        since: Instant::now(),
    };
    Some(Waiting { conn, listening, deadline: Instant::now() + PEER_WAIT })
}

fn spawn_pairing(conn: Arc<Conn>, paired: Paired) {
    {
        let mut state = conn.lock();
        if state.closed {
            return;
        }
        state.phase = Phase::Pairing;
    }
    let thread_conn = Arc::clone(&conn);
    let spawned = std::thread::Builder::new().name("lightpath-pair".into()).spawn(move || {
        crate::guard::mark_internal();
        let started = Instant::now();
        let result = pair(&thread_conn, paired);
        crate::report::debug(format_args!(
            "pairing took {:?}: {:?}",
            started.elapsed(),
            result.as_ref().map(|s| s.transport())
        ));
        let mut state = thread_conn.lock();
        match result {
            Ok(stream) if !state.closed => {
                state.install(&thread_conn, stream);
                drop(state);
                crate::epoll::conn_switched(&thread_conn);
            }
            Ok(stream) => stream.close_in_background(),
            Err(err) => {
                if state.phase == Phase::Pairing {
                    state.phase = Phase::Tcp(format!("pairing failed: {err}"));
                }
            }
        }
    });
    if let Err(err) = spawned {
        conn.lock().phase = Phase::Tcp(format!("could not start a pairing thread: {err}"));
    }
}

/// Bounds the steps on a rendezvous Unix socket, whose peer must run as this process's user
/// (the abstract namespace has no permissions).
fn prepare_unix(unix: &UnixStream) -> io::Result<()> {
    unix.set_read_timeout(Some(STEP_TIMEOUT))?;
    unix.set_write_timeout(Some(STEP_TIMEOUT))?;
    let credentials = rustix::net::sockopt::socket_peercred(unix)?;
    if credentials.uid != rustix::process::getuid() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the peer runs as another user"));
    }
    Ok(())
}

fn pair(conn: &Conn, paired: Paired) -> io::Result<lightpath::Stream> {
    let (local, peer) = {
        let state = conn.lock();
        (state.local, state.peer)
    };
    let (Some(local), Some(peer)) = (local, peer) else {
        return Err(io::Error::other("addresses unknown"));
    };
    {
        let mut device_pid = DEVICE_PID.lock().unwrap_or_else(|p| p.into_inner());
        if *device_pid == 0 {
            *device_pid = pid();
        }
    }
    let options = lightpath::Options { handshake_timeout: STEP_TIMEOUT, ..base_options().clone() };
    match paired {
        // This end listened on the name: a local peer gets a side listener's port; the relay
        // names a peer on another host to connect to.
        Paired::Named(mut unix) => {
            prepare_unix(&unix)?;
            let mut message = [0u8; remote::RelayMessage::LEN];
            unix.read_exact(&mut message)?;
            match remote::RelayMessage::parse(&message) {
                Some(remote::RelayMessage::Local) => {
                    let listener = TcpListener::bind(SocketAddr::new(local.ip(), 0))?;
                    unix.write_all(&listener.local_addr()?.port().to_be_bytes())?;
                    listener.set_nonblocking(true)?;
                    let mut fds = [rustix::event::PollFd::new(&listener, rustix::event::PollFlags::IN)];
                    let timeout =
                        rustix::event::Timespec { tv_sec: STEP_TIMEOUT.as_secs() as i64, tv_nsec: 0 };
                    rustix::event::poll(&mut fds, Some(&timeout))?;
                    let (tcp, _) = listener.accept()?;
                    tcp.set_nonblocking(false)?;
                    lightpath::Stream::negotiate_server(tcp, &options)
                }
                Some(remote::RelayMessage::Remote(target)) if target.ip() == peer.ip().to_canonical() => {
                    let tcp = TcpStream::connect_timeout(&target, STEP_TIMEOUT)?;
                    lightpath::Stream::negotiate_client(tcp, &options)
                }
                Some(remote::RelayMessage::Remote(target)) => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the relay named {target}, not the connection's peer {peer}"),
                )),
                None => Err(io::Error::new(io::ErrorKind::InvalidData, "unknown rendezvous message")),
            }
        }
        // This end connected to the name a local peer listens on.
        Paired::Local(mut unix) => {
            prepare_unix(&unix)?;
            unix.write_all(&remote::RelayMessage::Local.emit())?;
            let mut port = [0u8; 2];
            unix.read_exact(&mut port)?;
            let target = SocketAddr::new(peer.ip(), u16::from_be_bytes(port));
            let tcp = TcpStream::connect_timeout(&target, STEP_TIMEOUT)?;
            lightpath::Stream::negotiate_client(tcp, &options)
        }
        // The peer on another host connected to this end's side listener.
        Paired::Side(tcp) => {
            tcp.set_nonblocking(false)?;
            lightpath::Stream::negotiate_server(tcp, &options)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay on an ephemeral port, an end listening on the abstract name of `sender`'s and
    /// `receiver`'s connection, and what reaches that end after `datagram` came to the relay.
    fn relayed(sender: SocketAddr, receiver: SocketAddr, datagram: &[u8]) -> Option<remote::RelayMessage> {
        let relay = UdpSocket::bind("127.0.0.1:0").unwrap();
        relay.set_nonblocking(true).unwrap();
        let address = UnixAddr::from_abstract_name(name(sender, receiver).as_bytes()).unwrap();
        let end = UnixListener::bind_addr(&address).unwrap();
        end.set_nonblocking(true).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.send_to(datagram, relay.local_addr().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        relay_hellos(&relay);
        let (mut unix, _) = end.accept().ok()?;
        unix.set_nonblocking(false).unwrap();
        let mut message = [0u8; remote::RelayMessage::LEN];
        unix.read_exact(&mut message).ok()?;
        remote::RelayMessage::parse(&message)
    }

    #[test]
    fn the_relay_hands_a_true_hello_on_and_drops_forged_or_garbled_ones() {
        let receiver: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        let sender: SocketAddr = "127.0.0.1:40002".parse().unwrap();
        let hello = remote::Hello { sender, receiver, side_port: 41000 };
        assert_eq!(
            relayed(sender, receiver, &hello.emit()),
            Some(remote::RelayMessage::Remote("127.0.0.1:41000".parse().unwrap()))
        );
        // A hello claiming a sender address it does not come from.
        let forged_sender: SocketAddr = "192.0.2.7:40002".parse().unwrap();
        let forged = remote::Hello { sender: forged_sender, receiver, side_port: 41000 };
        assert_eq!(relayed(forged_sender, receiver, &forged.emit()), None);
        // A connection whose other end is not of this namespace.
        let elsewhere: SocketAddr = "192.0.2.8:40001".parse().unwrap();
        let stray = remote::Hello { sender, receiver: elsewhere, side_port: 41000 };
        assert_eq!(relayed(sender, elsewhere, &stray.emit()), None);
        // Garbage of every length up to a hello's and beyond.
        for len in [0, 1, 8, remote::Hello::LEN - 1, remote::Hello::LEN, 63] {
            let garbage = vec![0xA5u8; len];
            assert_eq!(relayed(sender, receiver, &garbage), None, "{len} bytes of garbage");
        }
    }
}
