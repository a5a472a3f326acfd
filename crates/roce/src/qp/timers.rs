//! A queue pair's timers and the IBA timer encodings: the local ACK timeout
//! (4.096 µs × 2^timeout, 0 = infinite) and the 5-bit RNR timer table (digest §6.8).

use crate::time::Time;

/// Nanoseconds of the local ACK timeout for the 5-bit `timeout` exponent; `None` for 0, which
/// means "wait forever".
pub(crate) fn ack_timeout_nanos(timeout: u8) -> Option<u64> {
    (timeout != 0).then(|| 4096u64 << u32::from(timeout.min(31)))
}

/// The RNR timer table in microseconds, indexed by the 5-bit code (code 0 is the longest).
const RNR_MICROS: [u64; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120,
    7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680,
    491_520,
];

/// Nanoseconds an RNR NAK with timer `code` asks the requester to wait.
pub(crate) fn rnr_delay_nanos(code: u8) -> u64 {
    RNR_MICROS[usize::from(code & 0x1F)] * 1_000
}

/// The two timers of a queue pair's requester.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QpTimers {
    /// Retransmit timer: armed while requests are unacknowledged (and `timeout` ≠ 0).
    pub(crate) retransmit: Option<Time>,
    /// RNR wait: the requester sends nothing until then, then resumes from the NAKed PSN.
    pub(crate) rnr: Option<Time>,
}

impl QpTimers {
    /// The earliest armed deadline.
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        match (self.retransmit, self.rnr) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeout_examples_from_the_digest() {
        assert_eq!(ack_timeout_nanos(0), None);
        // 14 -> 67.1 ms, 8 -> 1.05 ms, 20 -> 4.29 s.
        assert_eq!(ack_timeout_nanos(14), Some(67_108_864));
        assert_eq!(ack_timeout_nanos(8), Some(1_048_576));
        assert_eq!(ack_timeout_nanos(20), Some(4_294_967_296));
    }

    #[test]
    fn rnr_table() {
        assert_eq!(rnr_delay_nanos(0), 655_360_000);
        assert_eq!(rnr_delay_nanos(1), 10_000);
        assert_eq!(rnr_delay_nanos(12), 640_000);
        assert_eq!(rnr_delay_nanos(25), 61_440_000);
        assert_eq!(rnr_delay_nanos(31), 491_520_000);
    }

    #[test]
    fn next_deadline_is_the_minimum() {
        let mut timers = QpTimers::default();
        assert_eq!(timers.next_deadline(), None);
        timers.rnr = Some(Time::from_nanos(9));
        assert_eq!(timers.next_deadline(), Some(Time::from_nanos(9)));
        timers.retransmit = Some(Time::from_nanos(5));
        assert_eq!(timers.next_deadline(), Some(Time::from_nanos(5)));
    }
}
