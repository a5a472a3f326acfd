//! Scripted faults: deterministic events layered on top of a link's random faults.

use crate::time::SimTime;

/// A fault that happens at a chosen point rather than at random.
#[derive(Clone, Debug, PartialEq)]
pub enum ScriptedFault {
    /// Drop the `nth` datagram (counting from 0) offered to the link `from → to`.
    DropNth { from: usize, to: usize, nth: u64 },
    /// Drop everything between nodes `a` and `b` (both directions) sent at or after `from`
    /// and before `until` (forever when `None`).
    Partition { a: usize, b: usize, from: SimTime, until: Option<SimTime> },
    /// From `at` on, `node` neither receives nor sends anything, and its engine is no longer
    /// driven (a crashed host).
    Kill { node: usize, at: SimTime },
}

impl ScriptedFault {
    /// Whether this fault drops a datagram sent from `from` to `to` at `now` as the link's
    /// `index`-th datagram.
    pub(crate) fn drops(&self, from: usize, to: usize, now: SimTime, index: u64) -> bool {
        match *self {
            ScriptedFault::DropNth { from: f, to: t, nth } => f == from && t == to && nth == index,
            ScriptedFault::Partition { a, b, from: start, until } => {
                let joins = (a == from && b == to) || (a == to && b == from);
                let before_end = match until {
                    None => true,
                    Some(end) => now < end,
                };
                joins && now >= start && before_end
            }
            ScriptedFault::Kill { .. } => false,
        }
    }

    /// Whether this fault has killed `node` by `now`.
    pub(crate) fn kills(&self, node: usize, now: SimTime) -> bool {
        matches!(*self, ScriptedFault::Kill { node: n, at } if n == node && now >= at)
    }

    /// Whether this fault can make a connection lose every retransmission, so that the
    /// transport may legitimately give up (retry exhaustion).
    pub fn can_exhaust_retries(&self) -> bool {
        matches!(self, ScriptedFault::Partition { until: None, .. } | ScriptedFault::Kill { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_symmetric_and_timed() {
        let fault = ScriptedFault::Partition {
            a: 0,
            b: 1,
            from: SimTime::from_micros(10),
            until: Some(SimTime::from_micros(20)),
        };
        assert!(!fault.drops(0, 1, SimTime::from_micros(9), 0));
        assert!(fault.drops(0, 1, SimTime::from_micros(10), 0));
        assert!(fault.drops(1, 0, SimTime::from_micros(15), 0));
        assert!(!fault.drops(1, 0, SimTime::from_micros(20), 0));
        assert!(!fault.drops(0, 2, SimTime::from_micros(15), 0));
        assert!(!fault.can_exhaust_retries());
    }

    #[test]
    fn drop_nth_matches_one_datagram_of_one_direction() {
        let fault = ScriptedFault::DropNth { from: 1, to: 0, nth: 3 };
        assert!(fault.drops(1, 0, SimTime::ZERO, 3));
        assert!(!fault.drops(1, 0, SimTime::ZERO, 2));
        assert!(!fault.drops(0, 1, SimTime::ZERO, 3));
    }

    #[test]
    fn kill_takes_effect_at_its_time() {
        let fault = ScriptedFault::Kill { node: 1, at: SimTime::from_micros(5) };
        assert!(!fault.kills(1, SimTime::from_micros(4)));
        assert!(fault.kills(1, SimTime::from_micros(5)));
        assert!(!fault.kills(0, SimTime::from_micros(50)));
        assert!(fault.can_exhaust_retries());
    }
}
