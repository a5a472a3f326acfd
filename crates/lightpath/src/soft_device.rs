//! The soft devices of this process: one per local address, shared by every connection.
//!
//! A soft device is one UDP socket, and every soft peer sends to the same UDP port, so two
//! processes on one host cannot both hold `ip:4791`. Connections between processes of the
//! same host (loopback, or a host talking to its own address) therefore use a device on a
//! loopback address picked for this process in 127.100.0.0 – 127.199.255.255 (every 127/8
//! address is loopback on Linux); connections to other hosts use the local address of the
//! TCP connection.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Mutex, OnceLock};

use lightpath_soft::{SoftConfig, SoftDevice};
use lightpath_verbs::Mtu;

use crate::options::Options;

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

    fn mtu(self) -> Mtu {
        match self {
            DeviceKey::Loopback => Mtu::Mtu4096,
            DeviceKey::Local(_) => Mtu::Mtu1024,
        }
    }
}

fn registry() -> &'static Mutex<HashMap<DeviceKey, SoftDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<DeviceKey, SoftDevice>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The process's device for `key`, opened on first use.
pub(crate) fn device_for(key: DeviceKey, options: &Options) -> io::Result<SoftDevice> {
    let mut devices = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(device) = devices.get(&key) {
        return Ok(device.clone());
    }
    let device = match key {
        DeviceKey::Loopback => open_loopback(options)?,
        DeviceKey::Local(ip) => open(SocketAddr::new(ip, options.soft_udp_port), key.mtu(), options)?,
    };
    devices.insert(key, device.clone());
    Ok(device)
}

fn open(addr: SocketAddr, mtu: Mtu, options: &Options) -> io::Result<SoftDevice> {
    let mut config = SoftConfig::with_addr(addr);
    config.mtu = mtu;
    config.mode = options.soft_progress;
    config.lock_memory = false;
    SoftDevice::open(config).map_err(crate::error::from_verbs)
}

fn open_loopback(options: &Options) -> io::Result<SoftDevice> {
    let mut seed = std::process::id() as u64 ^ 0x9E37_79B9_7F4A_7C15;
    let mut last_error = None;
    for _ in 0..32 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let bits = (seed >> 32) as u32;
        let ip = Ipv4Addr::new(127, 100 + (bits % 100) as u8, (bits >> 8) as u8, ((bits >> 16) as u8).max(1));
        match open(SocketAddr::new(IpAddr::V4(ip), options.soft_udp_port), Mtu::Mtu4096, options) {
            Ok(device) => return Ok(device),
            Err(err) if err.kind() == io::ErrorKind::AddrInUse => last_error = Some(err),
            Err(err) => return Err(err),
        }
    }
    Err(last_error.unwrap_or_else(|| io::Error::other("no free loopback address for a soft device")))
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
