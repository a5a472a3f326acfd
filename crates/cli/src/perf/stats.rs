//! Summaries of latency samples and bandwidth runs.

use std::time::Duration;

use serde::Serialize;

/// min / median / p99 / max in microseconds (plus the mean, which perftest also prints).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    pub min: f64,
    pub median: f64,
    pub p99: f64,
    pub max: f64,
    pub avg: f64,
}

impl LatencySummary {
    /// Summarises samples given in nanoseconds, each divided by `divisor` (2 for ping-pong tests
    /// reporting one-way latency). Returns `None` for no samples.
    pub fn from_nanos(samples: &mut [u64], divisor: u64) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let us = |ns: u64| ns as f64 / divisor as f64 / 1000.0;
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        let sum: u128 = samples.iter().map(|&s| u128::from(s)).sum();
        Some(Self {
            min: us(samples[0]),
            median: us(at(0.5)),
            p99: us(at(0.99)),
            max: us(samples[samples.len() - 1]),
            avg: sum as f64 / samples.len() as f64 / divisor as f64 / 1000.0,
        })
    }
}

/// Bandwidth of a run: MB/s with MB = 10^6 bytes, and millions of messages per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BandwidthSummary {
    pub bw_mb_s: f64,
    pub msg_rate_mpps: f64,
}

impl BandwidthSummary {
    /// From the bytes and messages moved in `elapsed`.
    pub fn new(bytes: u64, messages: u64, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64().max(1e-9);
        Self { bw_mb_s: bytes as f64 / secs / 1e6, msg_rate_mpps: messages as f64 / secs / 1e6 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles() {
        let mut samples: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        samples.reverse();
        let s = LatencySummary::from_nanos(&mut samples, 2).unwrap();
        assert_eq!(s.min, 0.5);
        assert_eq!(s.max, 50.0);
        assert_eq!(s.median, 25.5); // index round(49.5) = 50 -> 51 µs / 2
        assert_eq!(s.p99, 49.5);
        assert!((s.avg - 25.25).abs() < 1e-9);
        assert!(LatencySummary::from_nanos(&mut [], 1).is_none());
    }

    #[test]
    fn bandwidth_units() {
        let b = BandwidthSummary::new(2_000_000, 1000, Duration::from_millis(500));
        assert!((b.bw_mb_s - 4.0).abs() < 1e-9);
        assert!((b.msg_rate_mpps - 0.002).abs() < 1e-12);
    }
}
