//! Virtual time: the simulator's clock, independent of the wall clock.
//!
//! The network model keeps its own nanosecond type so that it can be tested without an engine;
//! the driver converts to `lightpath_roce::Time` at the engine boundary.

use std::fmt;
use std::ops::{Add, AddAssign};
use std::time::Duration;

use serde::Serialize;

/// A point in virtual time, in nanoseconds since the start of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
pub struct SimTime(u64);

impl SimTime {
    /// The start of every run.
    pub const ZERO: SimTime = SimTime(0);
    /// Later than any event a run can schedule.
    pub const NEVER: SimTime = SimTime(u64::MAX);

    /// From a nanosecond count.
    pub const fn from_nanos(nanos: u64) -> SimTime {
        SimTime(nanos)
    }

    /// From a microsecond count (saturating).
    pub const fn from_micros(micros: u64) -> SimTime {
        SimTime(micros.saturating_mul(1_000))
    }

    /// Nanoseconds since the start of the run.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Seconds since the start of the run, for statistics.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// The later of two times.
    pub fn max(self, other: SimTime) -> SimTime {
        SimTime(self.0.max(other.0))
    }

    /// `self - earlier`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: SimTime) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for SimTime {
    type Output = SimTime;
    /// Saturates at [`SimTime::NEVER`] instead of overflowing.
    fn add(self, rhs: Duration) -> SimTime {
        let nanos = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        SimTime(self.0.saturating_add(nanos))
    }
}

impl AddAssign<Duration> for SimTime {
    fn add_assign(&mut self, rhs: Duration) {
        *self = *self + rhs;
    }
}

impl fmt::Display for SimTime {
    /// Microseconds with three decimals, which keeps traces readable.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}us", self.0 / 1_000, self.0 % 1_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_and_displays_micros() {
        let t = SimTime::from_micros(5) + Duration::from_nanos(250);
        assert_eq!(t.as_nanos(), 5_250);
        assert_eq!(t.to_string(), "5.250us");
        assert_eq!(SimTime::NEVER + Duration::from_secs(1), SimTime::NEVER);
        assert_eq!(SimTime::ZERO.saturating_since(t), Duration::ZERO);
        assert_eq!(t.saturating_since(SimTime::from_micros(5)), Duration::from_nanos(250));
    }
}
