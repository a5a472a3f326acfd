//! The soft devices of this process: a few per local address, shared by the connections.
//!
//! A soft device is one UDP socket and one engine behind one lock. A process with many
//! connections spreads them over up to [`max_devices`] devices per address (one per core by
//! default, as a NIC spreads flows over its queues), so threads serving different connections
//! do not all queue on one engine and the cores receive in parallel: a thread-per-connection
//! server with 16 connections went from 36-37k to 44-51k requests/s on 2 cores (100
//! connections: 36k to 48k). A device takes connections until each open device has
//! [`SPREAD_AFTER`] of them, then the next device opens and the least loaded one takes the
//! next connection; a few connections stay on one device (a device's only connection waits
//! in the device's spinning wait, which two devices' lone connections would each do).
//!
//! The first device of an address takes the RoCE v2 port (4791, or It takes the RoCE v2 port (4791, or
//! `Options::soft_udp_port`) when that is free, so hardware and rxe peers can reach it (they
//! send nowhere else: connections to them always use it); the others, and the first when
//! another process already holds the port, take ports the kernel picks and advertise them in
//! their endpoints: Lightpath peers send to each queue pair's advertised port, so any number of
//! processes and devices share an address. Connections between processes of the same host
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

/// The devices opened so far, by key, locked (a holder that panicked left the map usable).
fn registry() -> std::sync::MutexGuard<'static, HashMap<DeviceKey, Vec<Entry>>> {
    static DEVICES: OnceLock<Mutex<HashMap<DeviceKey, Vec<Entry>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Completion entries of a soft device's first shared queue: its queues are plain memory,
/// so one holds the completions of thousands of connections.
const SHARED_CQ_ENTRIES: u32 = 1 << 20;

/// Connections each open device of an address holds before the next device opens.
pub(crate) const SPREAD_AFTER: usize = 4;

/// Devices per address at most: `LIGHTPATH_SOFT_DEVICES`, else one per core (at most 8).
pub(crate) fn max_devices() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        let cores = lightpath_verbs::available_cores().min(8);
        std::env::var("LIGHTPATH_SOFT_DEVICES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(cores)
    })
}

/// Who the connection's queue pair will talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Facing {
    /// A Lightpath soft peer: any device of the address.
    Lightpath,
    /// RoCE hardware, which sends to the RoCE v2 port only: the address's first device.
    Hardware,
}

/// Which of an address's `loads` (connections per open device) takes the next connection:
/// `None` opens another device.
fn pick(loads: &[usize], max: usize, facing: Facing) -> Option<usize> {
    if loads.is_empty() {
        return None;
    }
    if facing == Facing::Hardware {
        return Some(0);
    }
    if loads.len() < max && loads.iter().all(|&n| n >= SPREAD_AFTER) {
        return None;
    }
    loads.iter().enumerate().min_by_key(|&(_, &n)| n).map(|(i, _)| i)
}

/// The device for a connection of `key` facing `facing`, opened if needed.
pub(crate) fn device_for(key: DeviceKey, options: &Options, facing: Facing) -> io::Result<Entry> {
    let mut devices = registry();
    let entries = devices.entry(key).or_default();
    let loads: Vec<usize> = entries.iter().map(|(_, hubs)| hubs.connections()).collect();
    if let Some(index) = pick(&loads, max_devices(), facing) {
        return Ok(entries[index].clone());
    }
    let ip = match key {
        DeviceKey::Loopback => IpAddr::V4(Ipv4Addr::LOCALHOST),
        DeviceKey::Local(ip) => ip,
    };
    // The largest MTU: the device lowers it to what the link of its address carries (4096 on
    // loopback and 9000-byte links, 1024 on 1500-byte ones). The first device tries the RoCE
    // v2 port; later ones take any.
    let port = if entries.is_empty() { options.soft_udp_port } else { 0 };
    let device = match open(SocketAddr::new(ip, port), Mtu::Mtu4096, options) {
        Err(err) if err.kind() == io::ErrorKind::AddrInUse => {
            open(SocketAddr::new(ip, 0), Mtu::Mtu4096, options)?
        }
        other => other?,
    };
    let entry = (device, Arc::new(HubPool::new(SHARED_CQ_ENTRIES)));
    entries.push(entry.clone());
    crate::counters::serve_once();
    Ok(entry)
}

/// Whether this process has opened a soft device (for any address).
pub(crate) fn any_open() -> bool {
    registry().values().any(|entries| !entries.is_empty())
}

/// Opens the first device of `key` if it has none (see `devices::warm_likely_pick`).
pub(crate) fn warm(key: DeviceKey, options: &Options) {
    let none = registry().get(&key).is_none_or(Vec::is_empty);
    if none {
        let _ = device_for(key, options, Facing::Lightpath);
    }
}

/// The soft devices opened so far (for their counters).
pub(crate) fn open_devices() -> Vec<SoftDevice> {
    let devices = registry();
    devices.values().flatten().map(|(device, _)| device.clone()).collect()
}

/// This side's verbs objects for the connection `tcp`.
pub(crate) fn setup(
    tcp: &std::net::TcpStream,
    options: &Options,
    facing: Facing,
) -> io::Result<Box<dyn PendingSetup>> {
    let key = DeviceKey::for_connection(tcp.local_addr()?, tcp.peer_addr()?);
    let (device, hubs) = device_for(key, options, facing)?;
    let port = device.local_addr().port();
    let mtu = device.config().mtu.min(Mtu::Mtu4096);
    let lightpath_pmtu = Some(device.preferred_lightpath_pmtu());
    let options = Options {
        ring_size: options.soft_ring_size.max(4096) & !63,
        // Resolved: a port of its own unless the options say no (see the option).
        soft_qp_port: Some(options.soft_qp_port != Some(false)),
        ..options.clone()
    };
    Ok(Box::new(RdmaSetup::new(device, &hubs, port, mtu, lightpath_pmtu, options.soft_wait_spin, &options)?))
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
    fn connections_spread_over_devices_once_each_has_a_few() {
        use Facing::{Hardware, Lightpath};
        assert_eq!(pick(&[], 2, Lightpath), None, "the first connection opens a device");
        assert_eq!(pick(&[], 2, Hardware), None);
        assert_eq!(pick(&[3], 2, Lightpath), Some(0), "a few connections share one device");
        assert_eq!(pick(&[SPREAD_AFTER], 2, Lightpath), None, "then the next device opens");
        assert_eq!(pick(&[SPREAD_AFTER], 1, Lightpath), Some(0), "unless one is the most");
        assert_eq!(pick(&[5, 1], 2, Lightpath), Some(1), "the least loaded takes it");
        assert_eq!(pick(&[7, 7], 2, Lightpath), Some(0));
        assert_eq!(pick(&[9, 1], 2, Hardware), Some(0), "hardware peers reach the first only");
        assert_eq!(pick(&[4, 4, 2], 4, Lightpath), Some(2));
        assert_eq!(pick(&[4, 4, 4], 4, Lightpath), None);
    }

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
