//! Setting up the out-of-band TCP connection of a perf run: the server listens and accepts one
//! client (as perftest does); the client connects, retrying briefly so that scripts may start
//! both sides at once.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use socket2::{Domain, Protocol, Socket, Type};

use super::args::Args;

/// How long a client keeps retrying a refused connection.
const CONNECT_PATIENCE: Duration = Duration::from_secs(5);

/// Listens on `--bind` (or every address) at `-p` and accepts one client.
pub fn accept_one(args: &Args) -> Result<TcpStream> {
    let addr = SocketAddr::new(args.bind.unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED)), args.port);
    let listener = listen(addr).with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!("lightpath perf: waiting for a client on {addr} ({} over {})", args.test, args.provider.name());
    let (stream, peer) = listener.accept()?;
    stream.set_nodelay(true)?;
    eprintln!("lightpath perf: client {peer} connected");
    Ok(stream)
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
