//! Test helpers: soft devices on distinct loopback addresses.
//!
//! Each device gets its own 127.x.y.z address (Linux routes all of 127.0.0.0/8 to loopback),
//! all on one port, so that test threads and concurrently running test binaries never collide;
//! the second octet comes from the process id, and an address that is taken is skipped.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};

use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::Error;

/// The port every test device uses (not 4791, to stay clear of a real RoCE endpoint).
pub const TEST_PORT: u16 = 24791;

static NEXT: AtomicU32 = AtomicU32::new(1);

/// A loopback address no other device of this process has used.
pub fn fresh_addr() -> SocketAddr {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let second = 16 + (std::process::id() % 200) as u8;
    let ip = Ipv4Addr::new(127, second, (n >> 8) as u8, (n & 0xFF) as u8 | if n & 0xFF == 0 { 1 } else { 0 });
    SocketAddr::new(IpAddr::V4(ip), TEST_PORT)
}

/// Opens a device with `configure` applied, on a fresh loopback address.
pub fn open_device(configure: impl Fn(&mut SoftConfig)) -> SoftDevice {
    for _ in 0..64 {
        let mut config = SoftConfig::with_addr(fresh_addr());
        configure(&mut config);
        match SoftDevice::open(config) {
            Ok(device) => return device,
            Err(Error::Io(err)) if err.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(err) => panic!("opening a soft device: {err}"),
        }
    }
    panic!("no free loopback address found");
}

/// Two devices in `mode` that can reach each other.
pub fn open_pair(mode: ProgressMode) -> (SoftDevice, SoftDevice) {
    let configure = |config: &mut SoftConfig| config.mode = mode;
    (open_device(configure), open_device(configure))
}
