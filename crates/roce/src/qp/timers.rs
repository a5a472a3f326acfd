//! A queue pair's timers and the IBA timer encodings: the local ACK timeout
//! (4.096 µs × 2^timeout, 0 = infinite) and the 5-bit RNR timer table (digest §6.8), plus
//! the round-trip estimate that paces go-back-N.

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

/// A smoothed round-trip time, measured from a new request packet to the first answer (ACK,
/// NAK or response) at or past its PSN — every answer is generated after the responder saw
/// that packet or a later one. Packets sent again are never measured (Karn's rule): their
/// answer could belong to either transmission.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RttEstimate {
    /// The packet being timed: its PSN and when it was sent.
    probe: Option<(lightpath_wire::Psn, Time)>,
    /// Smoothed round trip in nanoseconds (none until the first sample).
    smoothed: Option<u64>,
}

impl RttEstimate {
    /// A new (never sent before) packet went out: time it, unless one is timed.
    pub(crate) fn on_new_packet(&mut self, psn: lightpath_wire::Psn, now: Time) {
        if self.probe.is_none() {
            self.probe = Some((psn, now));
        }
    }

    /// Something was sent again: the answer to the timed packet may no longer be its own.
    pub(crate) fn on_retransmit(&mut self) {
        self.probe = None;
    }

    /// An answer for `psn` arrived: it covers the timed packet if `psn` is at or past it.
    pub(crate) fn on_answer(&mut self, psn: lightpath_wire::Psn, now: Time) {
        let Some((timed, sent)) = self.probe else { return };
        if psn.is_after_or_eq(timed) {
            self.probe = None;
            let sample = now.as_nanos().saturating_sub(sent.as_nanos());
            // The usual 7/8 smoothing.
            self.smoothed = Some(self.smoothed.map_or(sample, |old| (7 * old + sample) / 8));
        }
    }

    /// The smoothed round trip, once measured.
    pub(crate) fn smoothed_nanos(&self) -> Option<u64> {
        self.smoothed
    }
}

/// The timers of a queue pair's requester.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QpTimers {
    /// Retransmit timer: armed while requests are unacknowledged (and `timeout` ≠ 0).
    pub(crate) retransmit: Option<Time>,
    /// RNR wait: the requester sends nothing until then, then resumes from the NAKed PSN.
    pub(crate) rnr: Option<Time>,
    /// Go-back-N recovery probe: if nothing was acknowledged since, go back again.
    pub(crate) probe: Option<Time>,
}

impl QpTimers {
    /// The earliest armed deadline. Called for every packet a queue pair sends or handles,
    /// so written out rather than as an iterator chain (which did not inline and cost about 5%
    /// of a soft stream's CPU).
    #[inline]
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        fn earlier(a: Option<Time>, b: Option<Time>) -> Option<Time> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            }
        }
        earlier(earlier(self.retransmit, self.rnr), self.probe)
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
    fn rtt_is_sampled_from_new_packets_only_and_smoothed() {
        use lightpath_wire::Psn;
        let mut rtt = RttEstimate::default();
        assert_eq!(rtt.smoothed_nanos(), None);
        rtt.on_new_packet(Psn::new(10), Time::from_nanos(1_000));
        rtt.on_new_packet(Psn::new(11), Time::from_nanos(1_500)); // one probe at a time
        rtt.on_answer(Psn::new(9), Time::from_nanos(2_000)); // does not cover it
        assert_eq!(rtt.smoothed_nanos(), None);
        rtt.on_answer(Psn::new(11), Time::from_nanos(9_000));
        assert_eq!(rtt.smoothed_nanos(), Some(8_000));
        rtt.on_new_packet(Psn::new(12), Time::from_nanos(10_000));
        rtt.on_answer(Psn::new(12), Time::from_nanos(26_000));
        assert_eq!(rtt.smoothed_nanos(), Some((7 * 8_000 + 16_000) / 8));
        // Karn: a retransmission cancels the measurement.
        rtt.on_new_packet(Psn::new(13), Time::from_nanos(30_000));
        rtt.on_retransmit();
        rtt.on_answer(Psn::new(13), Time::from_nanos(1_000_000));
        assert_eq!(rtt.smoothed_nanos(), Some(9_000));
    }

    #[test]
    fn next_deadline_is_the_minimum() {
        let mut timers = QpTimers::default();
        assert_eq!(timers.next_deadline(), None);
        timers.rnr = Some(Time::from_nanos(9));
        assert_eq!(timers.next_deadline(), Some(Time::from_nanos(9)));
        timers.retransmit = Some(Time::from_nanos(5));
        assert_eq!(timers.next_deadline(), Some(Time::from_nanos(5)));
        timers.probe = Some(Time::from_nanos(3));
        assert_eq!(timers.next_deadline(), Some(Time::from_nanos(3)));
    }
}
