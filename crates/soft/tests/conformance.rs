//! The verbs conformance suite, run against soft devices three ways: two devices on distinct
//! loopback addresses with the progress thread; the same in caller-driven polling mode; and
//! IPv6, where both ends are queue pairs of one device on `::1` (IPv6 loopback has a single
//! address, and all devices of a RoCE network share one port).

mod common;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::conformance::ConformanceFixture;

struct ThreadedPair;

impl ConformanceFixture for ThreadedPair {
    type Device = SoftDevice;

    fn open_pair() -> (SoftDevice, SoftDevice) {
        common::open_pair(ProgressMode::Thread)
    }
}

struct PollingPair;

impl ConformanceFixture for PollingPair {
    type Device = SoftDevice;

    fn open_pair() -> (SoftDevice, SoftDevice) {
        common::open_pair(ProgressMode::polling())
    }
}

struct Ipv6Loopback;

impl ConformanceFixture for Ipv6Loopback {
    type Device = SoftDevice;

    fn open_pair() -> (SoftDevice, SoftDevice) {
        // Port 0: the kernel picks a free port, which the device then also sends to.
        let local = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0);
        let device = SoftDevice::open(SoftConfig::with_addr(local)).expect("soft device on [::1]");
        (device.clone(), device)
    }
}

mod threaded {
    lightpath_verbs::conformance_tests!(super::ThreadedPair);
}

mod polling {
    lightpath_verbs::conformance_tests!(super::PollingPair);
}

mod ipv6 {
    lightpath_verbs::conformance_tests!(super::Ipv6Loopback);
}
