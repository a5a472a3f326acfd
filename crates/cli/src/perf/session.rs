//! Setting up the out-of-band TCP connection of a perf run: the server listens until one client
//! it can serve has said hello (as perftest, it then runs that one client's test and exits);
//! the client connects, retrying briefly so that scripts may start both sides at once.
//!
//! Anything else reaching the port — a port scanner, a plain TCP client sending garbage or
//! nothing, a perftest binary, a `lightpath perf` client asking for another test — is answered
//! or dropped and logged, and the server goes on waiting: each connection says hello on a
//! thread of its own, within [`HELLO_PATIENCE`], so a silent one holds up nobody.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use socket2::{Domain, Protocol, Socket, Type};

use super::args::Args;
use super::control::{self, Answer, Hello};

/// How long a client keeps retrying a refused connection.
const CONNECT_PATIENCE: Duration = Duration::from_secs(5);
/// How long the server waits for a new connection's hello before dropping it.
pub const HELLO_PATIENCE: Duration = Duration::from_secs(10);

/// Listens on `--bind` (or every address) at `-p` until a client whose hello this server can
/// serve ([`control::check_hello`] against `-p`'s test and provider, then `usable`: the
/// provider's look at the client's endpoint) arrives; returns its control connection and hello.
pub fn accept_client(
    args: &Args,
    usable: fn(&Hello) -> std::result::Result<(), String>,
) -> Result<(TcpStream, Hello)> {
    let addr = SocketAddr::new(args.bind.unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED)), args.port);
    let listener = listen(addr).with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!("lightpath perf: waiting for a client on {addr} ({} over {})", args.test, args.provider.name());
    let (test, provider) = (args.test, args.provider);
    let (found, clients) = mpsc::channel::<(TcpStream, Hello, SocketAddr)>();
    // The acceptor outlives this call (it is blocked in accept); later arrivals are told the
    // server is busy. The process exits when the run is over.
    std::thread::Builder::new().name("perf-accept".into()).spawn(move || loop {
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(err) => {
                eprintln!("lightpath perf: accept failed: {err}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let found = found.clone();
        let _ = std::thread::Builder::new().name("perf-hello".into()).spawn(move || {
            match hello_from(stream, test, provider, usable) {
                Ok((stream, hello)) => {
                    if let Err(mpsc::SendError((mut stream, _, _))) = found.send((stream, hello, peer)) {
                        let reason = "the server is busy with another client".to_string();
                        let _ = control::send(&mut stream, &Answer::Reject { reason });
                    }
                }
                Err(err) => eprintln!("lightpath perf: ignored a connection from {peer}: {err:#}"),
            }
        });
    })?;
    let (stream, hello, peer) = clients.recv().map_err(|_| anyhow!("the acceptor thread stopped"))?;
    drop(clients);
    eprintln!("lightpath perf: client {peer} connected");
    Ok((stream, hello))
}

/// Reads and checks one connection's hello; a client asking for something else is told why.
fn hello_from(
    mut stream: TcpStream,
    test: super::args::PerfTest,
    provider: super::args::ProviderKind,
    usable: fn(&Hello) -> std::result::Result<(), String>,
) -> Result<(TcpStream, Hello)> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HELLO_PATIENCE))?;
    let hello: Hello = control::recv(&mut stream).map_err(|err| {
        match err.downcast_ref::<std::io::Error>().map(std::io::Error::kind) {
            Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                anyhow!("no hello within {} s", HELLO_PATIENCE.as_secs())
            }
            _ => err,
        }
    })?;
    if let Err(reason) = control::check_hello(&hello, test, provider).and_then(|()| usable(&hello)) {
        let _ = control::send(&mut stream, &Answer::Reject { reason: reason.clone() });
        return Err(anyhow!("refused: {reason}"));
    }
    stream.set_read_timeout(None)?;
    Ok((stream, hello))
}

fn listen(addr: SocketAddr) -> Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        // Accept IPv4 clients too when listening on the IPv6 wildcard.
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(8)?;
    Ok(socket.into())
}

/// Connects to `server`:`-p`, from `--bind` when given.
pub fn connect(args: &Args, server: &str) -> Result<TcpStream> {
    let target = (server, args.port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {server}"))?
        .find(|a| args.bind.is_none_or(|b| b.is_ipv4() == a.is_ipv4()))
        .ok_or_else(|| anyhow!("{server} has no address of the --bind address's family"))?;
    let deadline = Instant::now() + CONNECT_PATIENCE;
    loop {
        match try_connect(target, args.bind) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(err) => return Err(err).with_context(|| format!("cannot connect to {target}")),
        }
    }
}

fn try_connect(target: SocketAddr, bind: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, Some(Protocol::TCP))?;
    if let Some(ip) = bind {
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    socket.connect(&target.into())?;
    Ok(socket.into())
}
