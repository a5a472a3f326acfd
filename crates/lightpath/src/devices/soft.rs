//! The soft devices of this process: one per local address, shared by every connection.
//!
//! A soft device is one UDP socket. It takes the RoCE v2 port (4791, or
//! `Options::soft_udp_port`) when that is free, so hardware and rxe peers can reach it; when
//! another process already holds it, the device takes a port the kernel picks and advertises
//! it in its endpoint: Lightpath peers send to each queue pair's advertised port, so any
//! number of processes share an address. Connections between processes of the same host
//! (loopback, or a host talking to its own address) use a device on 127.0.0.1; connections
//! to other hosts use the local address of the TCP connection.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};

use lightpath_soft::{SoftConfig, SoftDevice};
use lightpath_verbs::Mtu;

use crate::completions::HubPool;
use crate::options::Options;
use crate::rdma::{PendingSetup, RdmaSetup};

/// Where a device is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DeviceKey {
    /// Peers on this host.
    Loopback,
    /// Peers elsewhere, reached from this local address.
    Local(IpAddr),
}

impl DeviceKey {
    /// The device a TCP connection between `local` and `peer` should use.
    pub(crate) fn for_connection(local: SocketAddr, peer: SocketAddr) -> Self {
        let (local, peer) = (local.ip().to_canonical(), peer.ip().to_canonical());
        if peer.is_loopback() || peer == local {
            DeviceKey::Loopback
        } else {
            DeviceKey::Local(local)
        }
    }
}

/// A device and the completion queues its connections share.
type Entry = (SoftDevice, Arc<HubPool<SoftDevice>>);

fn registry() -> &'static Mutex<HashMap<DeviceKey, Entry>> {
    static DEVICES: OnceLock<Mutex<HashMap<DeviceKey, Entry>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Completion entries of a soft device's first shared queue: its queues are plain memory,
/// so one holds the completions of thousands of connections.
const SHARED_CQ_ENTRIES: u32 = 1 << 20;

/// The process's device for `key`, opened on first use.
pub(crate) fn device_for(key: DeviceKey, options: &Options) -> io::Result<Entry> {
    let mut devices = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(entry) = devices.get(&key) {
        return Ok(entry.clone());
    }
    let ip = match key {
        DeviceKey::Loopback => IpAddr::V4(Ipv4Addr::LOCALHOST),
        DeviceKey::Local(ip) => ip,
    };
    // The largest MTU: the device lowers it to what the link of its address carries (4096 on
    // loopback and 9000-byte links, 1024 on 1500-byte ones).
    let device = match open(SocketAddr::new(ip, options.soft_udp_port), Mtu::Mtu4096, options) {
        Err(err) if err.kind() == io::ErrorKind::AddrInUse => {
            open(SocketAddr::new(ip, 0), Mtu::Mtu4096, options)?
        }
        other => other?,
    };
    let entry = (device, Arc::new(HubPool::new(SHARED_CQ_ENTRIES)));
    devices.insert(key, entry.clone());
    crate::counters::serve_once();
    Ok(entry)
}

/// The soft devices opened so far (for their counters).
pub(crate) fn open_devices() -> Vec<SoftDevice> {
    let devices = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    devices.values().map(|(device, _)| device.clone()).collect()
}

/// This side's verbs objects for the connection `tcp`.
pub(crate) fn setup(tcp: &std::net::TcpStream, options: &Options) -> io::Result<Box<dyn PendingSetup>> {
    let key = DeviceKey::for_connection(tcp.local_addr()?, tcp.peer_addr()?);
    let (device, hubs) = device_for(key, options)?;
    let port = device.local_addr().port();
    let mtu = device.config().mtu.min(Mtu::Mtu4096);
    let lightpath_pmtu = Some(device.max_lightpath_pmtu());
    let options = Options {
        ring_size: options.soft_ring_size.max(4096) & !63,
        // Resolved: a blocking stream does not take a port of its own (see the option).
        soft_qp_port: Some(options.soft_qp_port == Some(true)),
        ..options.clone()
    };
    Ok(Box::new(RdmaSetup::new(device, &hubs, port, mtu, lightpath_pmtu, &options)?))
}

fn open(addr: SocketAddr, mtu: Mtu, options: &Options) -> io::Result<SoftDevice> {
    let mut config = SoftConfig::with_addr(addr);
    config.mtu = mtu;
    config.mode = options.soft_progress;
    config.lock_memory = false;
    config.wait_spin = options.soft_wait_spin;
    config.max_cqe = config.max_cqe.max(SHARED_CQ_ENTRIES);
    SoftDevice::open(config).map_err(crate::error::from_verbs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        let a: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:6000".parse().unwrap();
        assert_eq!(DeviceKey::for_connection(a, b), DeviceKey::Loopback);
        let c: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let d: SocketAddr = "10.0.0.2:80".parse().unwrap();
        assert_eq!(DeviceKey::for_connection(c, d), DeviceKey::Local("10.0.0.1".parse().unwrap()));
        assert_eq!(DeviceKey::for_connection(c, "10.0.0.1:80".parse().unwrap()), DeviceKey::Loopback);
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:1".parse().unwrap();
        assert_eq!(DeviceKey::for_connection(mapped, d), DeviceKey::Local("10.0.0.1".parse().unwrap()));
    }
}
