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
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::conn::{pid, Conn, Phase};

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

/// Why connections of this process stay TCP, if they do.
pub(crate) fn why_not() -> Option<String> {
    static PROVIDERS: OnceLock<Result<(), String>> = OnceLock::new();
    let providers = PROVIDERS.get_or_init(|| {
        if std::env::var("LIGHTPATH_PRELOAD").is_ok_and(|v| v == "off" || v == "0") {
            return Err("LIGHTPATH_PRELOAD=off".into());
        }
        let options = lightpath::Options::default();
        if options.providers.contains(&lightpath::ProviderId::Shm) {
            Ok(())
        } else {
            Err("shm is not among LIGHTPATH_PROVIDERS (the preload pairs on one host only)".into())
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
    format!("lightpath-preload-1-{hash:016x}")
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

/// One listening end waiting for its peer.
struct Waiting {
    conn: Arc<Conn>,
    listener: UnixListener,
    deadline: Instant,
}

const WAKE_TOKEN: u64 = u64::MAX;

fn watch(wake: &OwnedFd, queue: &Mutex<Vec<Arc<Conn>>>) -> io::Result<()> {
    let poller = crate::guard::high(epoll::create(epoll::CreateFlags::CLOEXEC)?);
    epoll::add(&poller, wake, epoll::EventData::new_u64(WAKE_TOKEN), epoll::EventFlags::IN)?;
    let mut waiting: HashMap<u64, Waiting> = HashMap::new();
    let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
    loop {
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: 100_000_000 };
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
                        if epoll::add(
                            &poller,
                            entry.listener.as_fd(),
                            epoll::EventData::new_u64(id),
                            epoll::EventFlags::IN,
                        )
                        .is_ok()
                        {
                            waiting.insert(id, entry);
                        }
                    }
                }
            } else if let Some(entry) = waiting.get(&token) {
                match entry.listener.accept() {
                    Ok((unix, _)) => {
                        let entry = waiting.remove(&token).expect("present");
                        let _ = epoll::delete(&poller, entry.listener.as_fd());
                        drop(entry.listener);
                        spawn_pairing(entry.conn, unix, Role::Listened);
                    }
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => {}
                }
            }
        }
        let now = Instant::now();
        waiting.retain(|_, entry| {
            let mut state = entry.conn.lock();
            let keep = !state.closed && now < entry.deadline;
            if !keep {
                if state.phase == Phase::Waiting {
                    state.phase = Phase::Tcp(format!("no Lightpath peer turned up within {PEER_WAIT:?}"));
                }
                let _ = epoll::delete(&poller, entry.listener.as_fd());
            }
            keep
        });
    }
}

/// Connects to or listens on the connection's name.
fn offer(conn: Arc<Conn>) -> Option<Waiting> {
    let (local, peer) = {
        let state = conn.lock();
        (state.local?, state.peer?)
    };
    let address = match UnixAddr::from_abstract_name(name(local, peer).as_bytes()) {
        Ok(address) => address,
        Err(err) => {
            conn.lock().phase = Phase::Tcp(format!("rendezvous name: {err}"));
            return None;
        }
    };
    for _ in 0..2 {
        if let Ok(unix) = UnixStream::connect_addr(&address) {
            spawn_pairing(conn, unix, Role::Connected);
            return None;
        }
        match UnixListener::bind_addr(&address) {
            Ok(listener) => {
                let listener = crate::guard::high(listener);
                if listener.set_nonblocking(true).is_err() {
                    break;
                }
                return Some(Waiting { conn, listener, deadline: Instant::now() + PEER_WAIT });
            }
            // The peer bound it between our connect and our bind: connect again.
            Err(err) if err.kind() == io::ErrorKind::AddrInUse => continue,
            Err(err) => {
                conn.lock().phase = Phase::Tcp(format!("rendezvous bind: {err}"));
                return None;
            }
        }
    }
    conn.lock().phase = Phase::Tcp("rendezvous name busy".into());
    None
}

#[derive(Clone, Copy)]
enum Role {
    /// This end listened on the name: it serves the side connection.
    Listened,
    /// This end connected to the name: it makes the side connection.
    Connected,
}

fn spawn_pairing(conn: Arc<Conn>, unix: UnixStream, role: Role) {
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
        let result = pair(&thread_conn, unix, role);
        crate::report::debug(format_args!(
            "pairing took {:?}: {:?}",
            started.elapsed(),
            result.as_ref().map(|s| s.transport())
        ));
        let mut state = thread_conn.lock();
        match result {
            Ok(stream) if !state.closed => {
                state.install(stream);
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

fn pair(conn: &Conn, mut unix: UnixStream, role: Role) -> io::Result<lightpath::Stream> {
    let (local, peer) = {
        let state = conn.lock();
        (state.local, state.peer)
    };
    let (Some(local), Some(peer)) = (local, peer) else {
        return Err(io::Error::other("addresses unknown"));
    };
    unix.set_read_timeout(Some(STEP_TIMEOUT))?;
    unix.set_write_timeout(Some(STEP_TIMEOUT))?;
    let credentials = rustix::net::sockopt::socket_peercred(&unix)?;
    if credentials.uid != rustix::process::getuid() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the peer runs as another user"));
    }
    {
        let mut device_pid = DEVICE_PID.lock().unwrap_or_else(|p| p.into_inner());
        if *device_pid == 0 {
            *device_pid = pid();
        }
    }
    let options = lightpath::Options { handshake_timeout: STEP_TIMEOUT, ..Default::default() };
    match role {
        Role::Listened => {
            let listener = TcpListener::bind(SocketAddr::new(local.ip(), 0))?;
            unix.write_all(&listener.local_addr()?.port().to_be_bytes())?;
            listener.set_nonblocking(true)?;
            let mut fds = [rustix::event::PollFd::new(&listener, rustix::event::PollFlags::IN)];
            let timeout = rustix::event::Timespec { tv_sec: STEP_TIMEOUT.as_secs() as i64, tv_nsec: 0 };
            rustix::event::poll(&mut fds, Some(&timeout))?;
            let (tcp, _) = listener.accept()?;
            tcp.set_nonblocking(false)?;
            let _ = listener.as_raw_fd();
            lightpath::Stream::negotiate_server(tcp, &options)
        }
        Role::Connected => {
            let mut port = [0u8; 2];
            unix.read_exact(&mut port)?;
            let target = SocketAddr::new(peer.ip(), u16::from_be_bytes(port));
            let tcp = TcpStream::connect_timeout(&target, STEP_TIMEOUT)?;
            lightpath::Stream::negotiate_client(tcp, &options)
        }
    }
}
