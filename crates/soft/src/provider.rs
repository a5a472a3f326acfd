//! [`SoftProvider`]: lists the addresses a soft device could bind and opens devices by name.
//!
//! Names: `soft-<ip>` (port 4791) or `soft-<ip>-<port>`, as [`SoftConfig::device_name`] makes
//! them, or simply `<ip>`, `<ip>:<port>` or `[<ipv6>]:<port>`.

use std::net::{IpAddr, SocketAddr};

use lightpath_verbs::{Error, Mtu, Provider, Result};

use crate::config::{ProgressMode, SoftConfig, ROCE_PORT};
use crate::device::SoftDevice;
use crate::sys;

/// The soft provider. Devices it opens use its `mode` and `mtu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftProvider {
    /// Progress mode of opened devices.
    pub mode: ProgressMode,
    /// Active MTU of opened devices.
    pub mtu: Mtu,
}

impl Default for SoftProvider {
    fn default() -> Self {
        Self { mode: ProgressMode::Thread, mtu: Mtu::Mtu1024 }
    }
}

/// Parses a device name into the socket address it binds.
pub fn parse_device_name(name: &str) -> Option<SocketAddr> {
    let body = name.strip_prefix("soft-");
    if let Some(body) = body {
        if let Ok(ip) = body.parse::<IpAddr>() {
            return Some(SocketAddr::new(ip, ROCE_PORT));
        }
        let (ip, port) = body.rsplit_once('-')?;
        return Some(SocketAddr::new(ip.parse().ok()?, port.parse().ok()?));
    }
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, ROCE_PORT));
    }
    name.parse().ok()
}

impl Provider for SoftProvider {
    type Device = SoftDevice;

    fn name(&self) -> &'static str {
        "soft"
    }

    /// One device name per address of every interface that is up.
    fn devices(&self) -> Result<Vec<String>> {
        let addrs = sys::interface_addrs().map_err(Error::Io)?;
        Ok(addrs.into_iter().map(|a| SoftConfig::new(a.ip).device_name()).collect())
    }

    fn open(&self, name: &str) -> Result<SoftDevice> {
        let local =
            parse_device_name(name).ok_or(Error::NotFound("soft device name (soft-<ip>[-<port>])"))?;
        let mut config = SoftConfig::with_addr(local);
        config.mode = self.mode;
        config.mtu = self.mtu;
        SoftDevice::open(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for text in ["10.0.0.1:4791", "127.0.0.2:5000", "[::1]:4791", "[fe80::1]:6000"] {
            let addr: SocketAddr = text.parse().expect("addr");
            let name = SoftConfig::with_addr(addr).device_name();
            assert_eq!(parse_device_name(&name), Some(addr), "{name}");
        }
        assert_eq!(parse_device_name("10.1.2.3"), Some("10.1.2.3:4791".parse().expect("addr")));
        assert_eq!(parse_device_name("127.0.0.1:9"), Some("127.0.0.1:9".parse().expect("addr")));
        assert_eq!(parse_device_name("rxe0"), None);
        assert_eq!(parse_device_name("soft-nonsense"), None);
    }

    #[test]
    fn loopback_is_offered() {
        let names = SoftProvider::default().devices().expect("devices");
        assert!(names.iter().any(|n| n == "soft-127.0.0.1"), "{names:?}");
    }
}
