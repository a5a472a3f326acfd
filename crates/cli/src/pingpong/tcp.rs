//! The out-of-band TCP connection of the rdma-core-style tools (`pingpong`, `interop-peer`), with
//! every wait bounded: a listener that accepts one connection before a deadline, a connect that
//! retries while the server is still starting, and reads that give up at a deadline.
//!
//! rdma-core's examples wait forever; these tools are also run unattended by test suites, where
//! a peer that died must end the run with an error rather than hang it.

use std::io::{self, Read};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use socket2::{Domain, Socket, Type};

/// How often a listener or a refused connect is retried while waiting.
const RETRY_INTERVAL: Duration = Duration::from_millis(20);
/// How long a refused connect is retried at most (as verbs_peer does): long enough for a
/// server started at the same moment, short enough that a wrong address fails soon.
const CONNECT_RETRY_LIMIT: Duration = Duration::from_secs(10);

/// Time left until `deadline`, or `None` once it has passed.
pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero())
}

/// Listens on every local address (IPv6 and IPv4 where the host has IPv6, like the `AF_UNSPEC`,
/// `AI_PASSIVE` listener of rdma-core's examples) on `port`.
pub(crate) fn listen_any(port: u16) -> Result<TcpListener> {
    let dual_stack = || -> io::Result<TcpListener> {
        let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
        socket.set_only_v6(false)?;
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
        socket.listen(1)?;
        Ok(socket.into())
    };
    let ipv4_only = || -> io::Result<TcpListener> {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
        socket.listen(1)?;
        Ok(socket.into())
    };
    match dual_stack() {
        Ok(listener) => Ok(listener),
        // Hosts without IPv6 refuse the IPv6 socket; a port in use is reported as it is.
        Err(err) if err.kind() == io::ErrorKind::AddrInUse => {
            Err(err).with_context(|| format!("cannot listen on TCP port {port}"))
        }
        Err(_) => ipv4_only().with_context(|| format!("cannot listen on TCP port {port}")),
    }
}

/// Accepts one connection on `listener` before `deadline`.
pub(crate) fn accept_one(listener: &TcpListener, deadline: Instant) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(err)
                if err.kind() == io::ErrorKind::WouldBlock || err.kind() == io::ErrorKind::Interrupted =>
            {
                if remaining(deadline).is_none() {
                    bail!("no client connected to TCP port {port} before the timeout");
                }
                std::thread::sleep(RETRY_INTERVAL);
            }
            Err(err) => return Err(err).context("accepting the client's TCP connection"),
        }
    }
}

/// Connects to `host:port`, retrying refused connections until `deadline` but for at most
/// [`CONNECT_RETRY_LIMIT`] (the server may not be listening yet when both sides are started
/// together).
pub(crate) fn connect(host: &str, port: u16, deadline: Instant) -> Result<TcpStream> {
    let deadline = deadline.min(Instant::now() + CONNECT_RETRY_LIMIT);
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve the server name {host:?}"))?
        .collect();
    if addrs.is_empty() {
        bail!("the server name {host:?} has no addresses");
    }
    let mut last_error = None;
    while let Some(left) = remaining(deadline) {
        for addr in &addrs {
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    return Ok(stream);
                }
                Err(err) => last_error = Some(err),
            }
        }
        std::thread::sleep(RETRY_INTERVAL);
    }
    match last_error {
        Some(err) => Err(err).with_context(|| format!("cannot connect to {host} TCP port {port}")),
        None => bail!("cannot connect to {host} TCP port {port}: timed out"),
    }
}

/// One `read` that gives up at `deadline`: returns the bytes read (0 at end of stream), or an
/// error of kind `TimedOut`.
pub(crate) fn read_some(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<usize> {
    loop {
        let Some(left) = remaining(deadline) else {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        };
        stream.set_read_timeout(Some(left))?;
        match stream.read(buf) {
            Ok(count) => return Ok(count),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            // A read timeout shows as WouldBlock on Unix; loop to report it as TimedOut.
            Err(err) if err.kind() == io::ErrorKind::WouldBlock || err.kind() == io::ErrorKind::TimedOut => {
                continue
            }
            Err(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn accept_gives_up_at_the_deadline() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let err = accept_one(&listener, Instant::now() + Duration::from_millis(30)).unwrap_err();
        assert!(err.to_string().contains("no client connected"), "{err}");
    }

    #[test]
    fn connect_reports_refusal_after_retrying() {
        // A port that was free a moment ago: nothing listens there.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
        let err = connect("127.0.0.1", port, Instant::now() + Duration::from_millis(60)).unwrap_err();
        assert!(
            format!("{err:#}").contains(&format!("cannot connect to 127.0.0.1 TCP port {port}")),
            "{err:#}"
        );
    }

    #[test]
    fn read_some_times_out_and_sees_the_end() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut client = connect("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
        let mut server = accept_one(&listener, Instant::now() + Duration::from_secs(5)).unwrap();
        let mut buf = [0u8; 8];
        let err = read_some(&mut server, &mut buf, Instant::now() + Duration::from_millis(30)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        client.write_all(b"abc").unwrap();
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(read_some(&mut server, &mut buf, deadline).unwrap(), 3);
        assert_eq!(&buf[..3], b"abc");
        assert_eq!(read_some(&mut server, &mut buf, deadline).unwrap(), 0);
    }
}
