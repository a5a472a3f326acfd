//! Engine time: a plain nanosecond count supplied by the driver.
//!
//! The engine never reads a clock. Every call that may arm or fire a timer takes a [`Time`],
//! and the driver decides what the epoch is (a virtual clock in the simulator, a monotonic
//! clock in the soft provider).

use std::time::Duration;

/// Virtual or real time: nanoseconds since an arbitrary epoch chosen by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    /// The epoch.
    pub const ZERO: Time = Time(0);

    /// A time `n` nanoseconds after the epoch.
    pub fn from_nanos(n: u64) -> Time {
        Time(n)
    }

    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, clamped at the largest representable time (so "never" stays "never").
    pub fn saturating_add(self, d: Duration) -> Time {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(nanos))
    }

    /// How long after `earlier` this is; zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// `self + nanos`, saturating.
    pub(crate) fn plus_nanos(self, nanos: u64) -> Time {
        Time(self.0.saturating_add(nanos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Time::from_nanos(10);
        assert_eq!(t.saturating_add(Duration::from_nanos(5)).as_nanos(), 15);
        assert_eq!(
            Time::from_nanos(u64::MAX - 1).saturating_add(Duration::from_secs(1)).as_nanos(),
            u64::MAX
        );
        assert_eq!(Time::from_nanos(100).saturating_duration_since(t), Duration::from_nanos(90));
        assert_eq!(t.saturating_duration_since(Time::from_nanos(100)), Duration::ZERO);
        assert!(Time::ZERO < t);
    }
}
