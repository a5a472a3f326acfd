//! The device's UDP socket and the buffers that batch datagrams through it.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};

use lightpath_roce::{Engine, Time, Transmit, MAX_DATAGRAM};
use lightpath_wire::{icrc, Endpoints};

use super::stats::DriverStats;
use crate::sys::{self, Received, BATCH};

/// Receive buffers are a little larger than the largest RoCE datagram, so that an oversized
/// datagram shows up as truncated instead of looking like a valid one.
const RX_BUFFER: usize = MAX_DATAGRAM + 64;

/// One unconnected UDP socket bound to the device's address, set up as digest §5.1a requires.
#[derive(Debug)]
pub(crate) struct RoceSocket {
    socket: UdpSocket,
    local: SocketAddr,
}

impl RoceSocket {
    /// Binds `local` (a specific address) with path-MTU discovery forced on and large buffers.
    pub(crate) fn bind(local: SocketAddr, recv_buffer: usize, send_buffer: usize) -> io::Result<Self> {
        if local.ip().is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a soft device needs a specific local address (it is the device's GID)",
            ));
        }
        let socket = UdpSocket::bind(local)?;
        sys::set_pmtu_discovery_do(socket.as_fd(), local.is_ipv6())?;
        sys::set_buffer_sizes(socket.as_fd(), recv_buffer, send_buffer);
        let local = socket.local_addr()?;
        Ok(Self { socket, local })
    }

    /// The bound address (with the real port if 0 was asked for).
    pub(crate) fn local(&self) -> SocketAddr {
        self.local
    }
}

impl AsFd for RoceSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// Buffers for one `recvmmsg` batch.
pub(crate) struct RxBuffers {
    bufs: Vec<Box<[u8]>>,
    meta: [Received; BATCH],
}

impl RxBuffers {
    pub(crate) fn new() -> Self {
        Self {
            bufs: (0..BATCH).map(|_| vec![0u8; RX_BUFFER].into_boxed_slice()).collect(),
            meta: [Received { len: 0, from: None, truncated: false }; BATCH],
        }
    }

    /// Receives what is waiting (up to one batch) and feeds it to the engine. Returns how many
    /// datagrams arrived.
    pub(crate) fn receive(
        &mut self,
        socket: &RoceSocket,
        engine: &mut Engine,
        now: Time,
        stats: &mut DriverStats,
    ) -> usize {
        let count = match sys::recv_batch(socket.as_fd(), &mut self.bufs, &mut self.meta) {
            Ok(count) => count,
            Err(_) => {
                stats.rx_errors += 1;
                return 0;
            }
        };
        if count > 0 {
            stats.rx_batches += 1;
        }
        let to = socket.local().ip();
        for (buf, meta) in self.bufs.iter().zip(&self.meta).take(count) {
            if meta.truncated || meta.len > MAX_DATAGRAM {
                stats.drops_oversized += 1;
                continue;
            }
            match meta.from {
                Some(from) if from.is_ipv4() == to.is_ipv4() => {
                    engine.handle_datagram(now, from.ip(), to, from.port(), &buf[..meta.len]);
                }
                _ => stats.drops_bad_source += 1,
            }
        }
        count
    }
}

/// Buffers for one `sendmmsg` batch.
pub(crate) struct TxBuffers {
    bufs: Vec<Box<[u8]>>,
    dsts: Vec<SocketAddr>,
    lens: Vec<usize>,
}

impl TxBuffers {
    pub(crate) fn new() -> Self {
        Self {
            bufs: (0..BATCH).map(|_| vec![0u8; MAX_DATAGRAM].into_boxed_slice()).collect(),
            dsts: Vec::with_capacity(BATCH),
            lens: Vec::with_capacity(BATCH),
        }
    }

    /// Sends everything the engine has to send, one batch per system call.
    pub(crate) fn transmit_all(
        &mut self,
        socket: &RoceSocket,
        engine: &mut Engine,
        now: Time,
        stats: &mut DriverStats,
    ) {
        loop {
            self.dsts.clear();
            self.lens.clear();
            while self.dsts.len() < BATCH {
                let buf = &mut self.bufs[self.dsts.len()];
                let Some(transmit) = engine.poll_transmit(now, buf) else { break };
                let Some(dst) = destination(socket.local(), transmit.dst) else {
                    stats.tx_errors += 1;
                    continue;
                };
                if reseal_for_port(socket.local(), transmit, &mut buf[..transmit.len]).is_err() {
                    stats.tx_errors += 1;
                    continue;
                }
                self.dsts.push(dst);
                self.lens.push(transmit.len);
            }
            let filled = self.dsts.len();
            self.send(socket, stats);
            if filled < BATCH {
                return;
            }
        }
    }

    fn send(&mut self, socket: &RoceSocket, stats: &mut DriverStats) {
        let mut start = 0;
        while start < self.dsts.len() {
            stats.tx_batches += 1;
            match sys::send_batch(
                socket.as_fd(),
                &self.bufs[start..],
                &self.dsts[start..],
                &self.lens[start..],
            ) {
                Ok(0) => break,
                Ok(sent) => start += sent,
                // The datagram at `start` cannot go (no route, host unreachable…): it counts as
                // lost, and the engine's retransmission deals with it like any loss.
                Err(_) => {
                    stats.tx_errors += 1;
                    start += 1;
                }
            }
        }
    }
}

/// The ICRC covers the UDP source port. The engine seals each datagram for the source port it
/// picked (per queue pair, as rxe does), but one socket can only send from the port it is
/// bound to, so the ICRC is recomputed for that port when the two differ.
fn reseal_for_port(local: SocketAddr, transmit: Transmit, datagram: &mut [u8]) -> lightpath_wire::Result<()> {
    if transmit.src_port == local.port() {
        return Ok(());
    }
    let endpoints =
        Endpoints { src: local.ip(), dst: transmit.dst, src_port: local.port(), dst_port: local.port() };
    icrc::seal(&endpoints, datagram)
}

/// Where a datagram for peer `ip` goes: the peer's IP at our port (every RoCE endpoint listens
/// on the same port), with our scope for link-local IPv6. `None` if the families differ.
fn destination(local: SocketAddr, ip: IpAddr) -> Option<SocketAddr> {
    match (local, ip) {
        (SocketAddr::V4(local), IpAddr::V4(ip)) => Some(SocketAddr::new(IpAddr::V4(ip), local.port())),
        (SocketAddr::V6(local), IpAddr::V6(ip)) => {
            let scope = if ip.is_unicast_link_local() { local.scope_id() } else { 0 };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(ip, local.port(), 0, scope)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations() {
        let v4: SocketAddr = "127.0.0.1:4791".parse().expect("addr");
        assert_eq!(
            destination(v4, "10.0.0.2".parse().expect("ip")),
            Some("10.0.0.2:4791".parse().expect("addr"))
        );
        assert_eq!(destination(v4, "::1".parse().expect("ip")), None);
        let v6: SocketAddr = "[fe80::1%7]:5000".parse().expect("addr");
        let dst = destination(v6, "fe80::2".parse().expect("ip")).expect("same family");
        assert_eq!(dst, "[fe80::2%7]:5000".parse().expect("addr"));
        let global = destination(v6, "2001:db8::2".parse().expect("ip")).expect("same family");
        assert_eq!(global, "[2001:db8::2]:5000".parse().expect("addr"));
    }
}
