//! The verbs conformance suite, run against soft devices on two loopback addresses with the
//! progress thread.

mod common;

use lightpath_soft::{ProgressMode, SoftDevice};
use lightpath_verbs::conformance::ConformanceFixture;

struct ThreadedPair;

impl ConformanceFixture for ThreadedPair {
    type Device = SoftDevice;

    fn open_pair() -> (SoftDevice, SoftDevice) {
        common::open_pair(ProgressMode::Thread)
    }
}

lightpath_verbs::conformance_tests!(ThreadedPair);
