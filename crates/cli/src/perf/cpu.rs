//! CPU time of a run: user + system seconds of this process (every thread, Lightpath's own
//! background threads included), read from `CLOCK_PROCESS_CPUTIME_ID`. The client measures
//! itself over each size's measured iterations and asks the server for its readings at the
//! same two points, so one result line carries both processes' cost: microseconds of CPU per
//! request (latency and request/response tests) or CPU seconds per GB moved (bandwidth).

use std::time::Duration;

use serde::Serialize;

/// CPU time this process has used so far.
pub fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

/// Encodes a reading for the peer (nanoseconds, big-endian).
pub fn encode(reading: Duration) -> [u8; 8] {
    u64::try_from(reading.as_nanos()).unwrap_or(u64::MAX).to_be_bytes()
}

/// Decodes a reading sent by [`encode`].
pub fn decode(bytes: &[u8]) -> Option<Duration> {
    Some(Duration::from_nanos(u64::from_be_bytes(bytes.try_into().ok()?)))
}

/// What a result line reports about CPU use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CpuUse {
    /// This (the client) process's user + system seconds over the measured iterations.
    pub cpu_s: f64,
    /// The server process's, over the same iterations.
    pub server_cpu_s: f64,
    /// Both processes' CPU per request, in µs (latency and request/response tests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_us_per_op: Option<f64>,
    /// Both processes' CPU seconds per 10^9 bytes moved (bandwidth tests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_s_per_gb: Option<f64>,
}

impl CpuUse {
    /// CPU per request, over `ops` requests (round trips).
    pub fn per_op(client: Duration, server: Duration, ops: u64) -> Self {
        let total = (client + server).as_secs_f64();
        Self {
            cpu_s: client.as_secs_f64(),
            server_cpu_s: server.as_secs_f64(),
            cpu_us_per_op: Some(total * 1e6 / ops.max(1) as f64),
            cpu_s_per_gb: None,
        }
    }

    /// CPU per GB, over `bytes` bytes.
    pub fn per_gb(client: Duration, server: Duration, bytes: u64) -> Self {
        let total = (client + server).as_secs_f64();
        Self {
            cpu_s: client.as_secs_f64(),
            server_cpu_s: server.as_secs_f64(),
            cpu_us_per_op: None,
            cpu_s_per_gb: Some(total / (bytes.max(1) as f64 / 1e9)),
        }
    }

    /// The figure the tables print: "µs/op" or "s/GB".
    pub fn summary(&self) -> String {
        match (self.cpu_us_per_op, self.cpu_s_per_gb) {
            (Some(us), _) => format!("{us:.2} us/op"),
            (None, Some(s)) => format!("{s:.3} s/GB"),
            (None, None) => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_round_trip_and_grow_with_work() {
        let before = process_cpu();
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let after = process_cpu();
        assert!(after > before, "{before:?} then {after:?}");
        assert_eq!(decode(&encode(after)), Some(Duration::from_nanos(after.as_nanos() as u64)));
        assert_eq!(decode(&[1, 2, 3]), None);
    }

    #[test]
    fn units() {
        let c = CpuUse::per_op(Duration::from_millis(3), Duration::from_millis(1), 1000);
        assert!((c.cpu_us_per_op.unwrap() - 4.0).abs() < 1e-9);
        assert_eq!(c.cpu_s_per_gb, None);
        let c = CpuUse::per_gb(Duration::from_millis(300), Duration::from_millis(200), 2_000_000_000);
        assert!((c.cpu_s_per_gb.unwrap() - 0.25).abs() < 1e-9);
        assert_eq!(c.summary(), "0.250 s/GB");
    }
}
