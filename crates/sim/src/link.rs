//! One direction of a simulated link: its fault rates, its timing, and the random choices it
//! makes for each datagram.
//!
//! Faults are applied in a fixed order (scripted drop, partition, MTU cap, loss, corruption,
//! delay and reordering, duplication) with the link's own random stream, so a link's behaviour
//! depends only on the seed and the sequence of datagrams it carries.

use std::time::Duration;

use serde::Serialize;

use crate::rng::SimRng;
use crate::time::SimTime;

/// Fault rates and timing of a link direction. Probabilities are per datagram, in 0..=1.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkConfig {
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Probability that a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back by up to `reorder_delay`, letting later ones pass.
    pub reorder: f64,
    /// Probability that some bits of a datagram are flipped (the ICRC must catch it).
    pub corrupt: f64,
    /// Propagation delay.
    pub latency: Duration,
    /// Extra random delay in `0..=jitter`; it never reorders datagrams by itself.
    pub jitter: Duration,
    /// Largest extra delay of a reordered datagram.
    pub reorder_delay: Duration,
    /// Serialization rate in bits per second; 0 means infinitely fast.
    pub bits_per_second: u64,
    /// IP MTU in bytes: datagrams whose IP packet (IP + UDP header + payload) is larger are
    /// dropped, as a real link drops oversized frames.
    pub mtu: usize,
}

impl Default for LinkConfig {
    /// A clean 10 Gbit/s link with 2 µs latency, 1 µs jitter and a 9000-byte MTU.
    fn default() -> Self {
        Self {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            latency: Duration::from_micros(2),
            jitter: Duration::from_micros(1),
            reorder_delay: Duration::from_micros(40),
            bits_per_second: 10_000_000_000,
            mtu: 9000,
        }
    }
}

impl LinkConfig {
    /// Whether no datagram can be lost on this link (corruption counts as loss: the receiver
    /// drops it).
    pub fn is_lossless(&self) -> bool {
        self.loss <= 0.0 && self.corrupt <= 0.0
    }
}

/// Why a link dropped a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum DropReason {
    /// Random loss.
    Loss,
    /// Larger than the link MTU.
    Mtu,
    /// A scripted "drop the k-th datagram" fault.
    Scripted,
    /// The two ends are partitioned.
    Partition,
    /// The destination (or source) endpoint was killed.
    Dead,
    /// No endpoint has the destination address.
    NoRoute,
}

/// What a link does with one datagram.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Verdict {
    /// Dropped.
    Drop(DropReason),
    /// Delivered at `arrival` (and again at `duplicate_arrival` if duplicated); `corrupted`
    /// tells whether the bytes were damaged (in place).
    Deliver { arrival: SimTime, duplicate_arrival: Option<SimTime>, corrupted: bool, reordered: bool },
}

/// The mutable state of a link direction.
#[derive(Clone, Debug)]
pub(crate) struct Link {
    pub(crate) config: LinkConfig,
    rng: SimRng,
    /// When the transmitter finishes serializing the previous datagram.
    busy_until: SimTime,
    /// Arrival time of the last in-order datagram; later in-order datagrams never overtake it.
    last_fifo_arrival: SimTime,
    /// Datagrams offered to this link so far (the index used by scripted drops).
    pub(crate) offered: u64,
}

impl Link {
    pub(crate) fn new(config: LinkConfig, rng: SimRng) -> Self {
        Self { config, rng, busy_until: SimTime::ZERO, last_fifo_arrival: SimTime::ZERO, offered: 0 }
    }

    /// Decides the fate of a datagram of `wire_len` IP bytes sent at `now`, corrupting `bytes`
    /// in place when the link corrupts it.
    pub(crate) fn carry(&mut self, now: SimTime, wire_len: usize, bytes: &mut [u8]) -> Verdict {
        if wire_len > self.config.mtu {
            return Verdict::Drop(DropReason::Mtu);
        }
        if self.rng.chance(self.config.loss) {
            return Verdict::Drop(DropReason::Loss);
        }
        let corrupted = self.rng.chance(self.config.corrupt) && corrupt(&mut self.rng, bytes);

        let departure = now.max(self.busy_until) + self.serialization(wire_len);
        self.busy_until = departure;
        let jitter = self.random_delay(self.config.jitter);
        let mut arrival = departure + self.config.latency + jitter;
        let reordered = self.rng.chance(self.config.reorder);
        if reordered {
            // A held-back datagram leaves the FIFO: later datagrams may overtake it.
            arrival += self.random_delay(self.config.reorder_delay);
        } else {
            arrival = arrival.max(self.last_fifo_arrival);
            self.last_fifo_arrival = arrival;
        }
        let duplicate_arrival = if self.rng.chance(self.config.duplicate) {
            let extra = self.random_delay(self.config.jitter + Duration::from_micros(1));
            Some(arrival + extra)
        } else {
            None
        };
        Verdict::Deliver { arrival, duplicate_arrival, corrupted, reordered }
    }

    fn serialization(&self, wire_len: usize) -> Duration {
        if self.config.bits_per_second == 0 {
            return Duration::ZERO;
        }
        let bits = wire_len as u128 * 8;
        let nanos = bits * 1_000_000_000 / u128::from(self.config.bits_per_second);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    fn random_delay(&mut self, max: Duration) -> Duration {
        let max_nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(self.rng.range_u64(0, max_nanos))
    }
}

/// Damages `bytes`: flips one to three random bits, or replaces one byte by a different value.
/// Returns false only for an empty datagram, which cannot be damaged.
fn corrupt(rng: &mut SimRng, bytes: &mut [u8]) -> bool {
    if bytes.is_empty() {
        return false;
    }
    if rng.chance(0.25) {
        let index = rng.range_usize(0, bytes.len() - 1);
        let delta = rng.range_u64(1, 255) as u8;
        bytes[index] ^= delta;
    } else {
        let flips = rng.range_usize(1, 3);
        let total_bits = bytes.len() * 8;
        let mut chosen: Vec<usize> = Vec::with_capacity(flips);
        while chosen.len() < flips.min(total_bits) {
            let bit = rng.range_usize(0, total_bits - 1);
            if !chosen.contains(&bit) {
                chosen.push(bit);
            }
        }
        for bit in chosen {
            bytes[bit / 8] ^= 1 << (bit % 8);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corruption_always_changes_the_bytes() {
        let mut rng = SimRng::new(3);
        for len in [1usize, 2, 60, 1500] {
            for _ in 0..200 {
                let original = rng.bytes(len);
                let mut damaged = original.clone();
                assert!(corrupt(&mut rng, &mut damaged));
                assert_ne!(original, damaged);
            }
        }
        assert!(!corrupt(&mut rng, &mut []));
    }

    #[test]
    fn serialization_paces_back_to_back_datagrams() {
        let config = LinkConfig {
            jitter: Duration::ZERO,
            latency: Duration::from_micros(1),
            bits_per_second: 8_000_000_000, // one byte per nanosecond
            ..LinkConfig::default()
        };
        let mut link = Link::new(config, SimRng::new(1));
        let mut buf = [0u8; 16];
        let first = link.carry(SimTime::ZERO, 1000, &mut buf);
        let second = link.carry(SimTime::ZERO, 1000, &mut buf);
        let arrival = |v: Verdict| match v {
            Verdict::Deliver { arrival, .. } => arrival,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(arrival(first), SimTime::from_nanos(2_000));
        assert_eq!(arrival(second), SimTime::from_nanos(3_000));
    }
}
