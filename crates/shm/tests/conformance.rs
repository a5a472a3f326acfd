//! The verbs conformance suite against shm devices: two devices of this process (each with its
//! own GID, rendezvous socket and helper thread), connected exactly as devices of two processes
//! are.

use lightpath_shm::{ShmConfig, ShmDevice};
use lightpath_verbs::conformance::ConformanceFixture;

struct DefaultRings;

impl ConformanceFixture for DefaultRings {
    type Device = ShmDevice;

    fn open_pair() -> (ShmDevice, ShmDevice) {
        let open = || ShmDevice::open(ShmConfig::default()).expect("shm device");
        (open(), open())
    }
}

/// The smallest ring with small pieces and every SEND through the ring: every multi-piece,
/// wrap-around and ring-full path runs.
struct TinyRings;

impl ConformanceFixture for TinyRings {
    type Device = ShmDevice;

    fn open_pair() -> (ShmDevice, ShmDevice) {
        let config =
            ShmConfig { ring_bytes: 4096, max_fragment: 200, direct_min: u32::MAX, ..ShmConfig::default() };
        let open = || ShmDevice::open(config.clone()).expect("shm device");
        (open(), open())
    }
}

/// Every non-empty SEND as source descriptors (the receiver copies out of the sender's region).
struct DirectSends;

impl ConformanceFixture for DirectSends {
    type Device = ShmDevice;

    fn open_pair() -> (ShmDevice, ShmDevice) {
        let config = ShmConfig { direct_min: 1, ..ShmConfig::default() };
        let open = || ShmDevice::open(config.clone()).expect("shm device");
        (open(), open())
    }
}

mod default_rings {
    lightpath_verbs::conformance_tests!(super::DefaultRings);
}

mod tiny_rings {
    lightpath_verbs::conformance_tests!(super::TinyRings);
}

mod direct_sends {
    lightpath_verbs::conformance_tests!(super::DirectSends);
}
