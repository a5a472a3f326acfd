//! How a large copy into memory a peer process reads next is made: through the caches (a plain
//! `memcpy`) or with streaming stores that bypass them, whichever this process measured to be
//! cheaper lately.
//!
//! # Why
//!
//! A stream's writer copies its bytes straight into the reader's ring (`write_direct`), and an
//! RDMA WRITE or SEND copies them into the peer's region: memory whose cache lines the peer
//! read last, so every line written must first be taken from the peer's cache, and the peer
//! then reads each one back out of the writer's. When the two processes' cores share a cache
//! that costs little; when they do not (cores of different CCDs on an AMD EPYC, or, on a
//! virtual machine, virtual CPUs the host places so), the same copy runs several times slower.
//! On this project's 2-vCPU VM the host switches between the two cases every few seconds to
//! minutes: a C program handing 1 MiB back and forth between two threads through a shared
//! buffer (write with `memcpy`, read with `memcpy`) took 60-75 µs per round in one case and
//! 200-290 µs in the other, the writer's copy alone 31-50 against 130-210 µs; with streaming
//! stores the writer took 43-51 µs and the round 92-105 µs in both. Lightpath's 1 MiB
//! broadcast between two ranks followed the same switches (runs with the C program slow before
//! and after them: median 199-231 µs; fast before and after: 37-62 µs), while Open MPI's
//! single-copy broadcast did not.
//!
//! Streaming stores lose where the caches are shared (the reader then fetches from memory
//! what it could have found in the cache) and win where they are not, and which case holds
//! is up to the machine and the scheduler, so it is measured: one large copy in
//! [`TIME_EVERY`] is timed, one in [`PROBE_EVERY`] is made the other way (and timed) to keep
//! that estimate current, and streaming stores are used while their cost per byte is at least
//! a fifth below the plain copy's (the margin leaves ties to the plain copy, which is kinder to
//! the reader). The estimates are per process, for all peers: the writer's side of the cost is
//! what it can see, and it moved with the reader's in every measurement above.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Copies shorter than this are always plain: they are latency, not bandwidth, and a clock
/// read would be a noticeable part of them.
const MIN_LEN: usize = 32 << 10;

/// One copy in this many (of those at least [`MIN_LEN`] long) is made the way not in use, to
/// see whether the other way became the cheaper one.
const PROBE_EVERY: u64 = 64;

/// One copy in this many is timed to keep the estimate of the way in use current.
const TIME_EVERY: u64 = 8;

/// How a copy is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    /// `memcpy`/`memmove`: through the caches.
    Cached,
    /// Streaming (non-temporal) stores, then a store fence.
    Streaming,
}

/// What [`Chooser::plan`] decided for one copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) method: Method,
    /// Time the copy and hand the time to [`Chooser::record`].
    pub(crate) timed: bool,
}

/// The estimates of one process (see the module docs): costs in picoseconds per byte, 0 while
/// unmeasured.
#[derive(Debug)]
pub(crate) struct Chooser {
    cached: AtomicU64,
    streaming: AtomicU64,
    copies: AtomicU64,
}

/// The process's chooser.
pub(crate) static OUTBOUND: Chooser = Chooser::new();

impl Chooser {
    pub(crate) const fn new() -> Self {
        Self { cached: AtomicU64::new(0), streaming: AtomicU64::new(0), copies: AtomicU64::new(0) }
    }

    /// How to make a copy of `len` bytes into a peer's memory; `None` for a plain copy that
    /// needs no timing (short ones).
    pub(crate) fn plan(&self, len: usize) -> Option<Plan> {
        if len < MIN_LEN {
            return None;
        }
        // Relaxed throughout: the estimates are hints, and a lost update loses one sample.
        let n = self.copies.fetch_add(1, Ordering::Relaxed);
        let (cached, streaming) =
            (self.cached.load(Ordering::Relaxed), self.streaming.load(Ordering::Relaxed));
        if cached == 0 {
            return Some(Plan { method: Method::Cached, timed: true });
        }
        if streaming == 0 {
            return Some(Plan { method: Method::Streaming, timed: true });
        }
        let preferred = if streaming.saturating_mul(5) < cached.saturating_mul(4) {
            Method::Streaming
        } else {
            Method::Cached
        };
        if n % PROBE_EVERY == PROBE_EVERY / 2 {
            let other = match preferred {
                Method::Cached => Method::Streaming,
                Method::Streaming => Method::Cached,
            };
            return Some(Plan { method: other, timed: true });
        }
        Some(Plan { method: preferred, timed: n.is_multiple_of(TIME_EVERY) })
    }

    /// A timed copy of `len` bytes made with `method` took `took`. A cheaper sample moves the
    /// estimate half of the way down, a dearer one a quarter of the way up and counting at most
    /// twice the estimate: what slows a copy down besides the machine's caches (page faults on
    /// a ring's first pass, losing the CPU for a while) only ever makes it dearer, so cheap
    /// samples are the more trustworthy ones.
    pub(crate) fn record(&self, method: Method, len: usize, took: Duration) {
        if len == 0 {
            return;
        }
        let sample = (took.as_nanos().saturating_mul(1000) / len as u128).min(u64::MAX as u128) as u64;
        let sample = sample.max(1);
        let estimate = match method {
            Method::Cached => &self.cached,
            Method::Streaming => &self.streaming,
        };
        let old = estimate.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else if sample < old {
            old - (old - sample) / 2
        } else {
            let sample = sample.min(old.saturating_mul(2));
            old + (sample - old) / 4
        };
        estimate.store(new, Ordering::Relaxed);
    }

    /// The current estimates (cached, streaming), in picoseconds per byte; 0 while unmeasured.
    #[cfg(test)]
    fn estimates(&self) -> (u64, u64) {
        (self.cached.load(Ordering::Relaxed), self.streaming.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEN: usize = 1 << 20;

    /// Runs `copies` plans against a machine where a plain copy of [`LEN`] bytes takes
    /// `cached` and a streaming one `streaming`; returns how many were made each way.
    fn run(chooser: &Chooser, copies: usize, cached: Duration, streaming: Duration) -> (usize, usize) {
        let mut made = (0, 0);
        for _ in 0..copies {
            let plan = chooser.plan(LEN).expect("a large copy is planned");
            let took = match plan.method {
                Method::Cached => {
                    made.0 += 1;
                    cached
                }
                Method::Streaming => {
                    made.1 += 1;
                    streaming
                }
            };
            if plan.timed {
                chooser.record(plan.method, LEN, took);
            }
        }
        made
    }

    #[test]
    fn short_copies_are_plain_and_untimed() {
        let chooser = Chooser::new();
        assert_eq!(chooser.plan(MIN_LEN - 1), None);
        assert_eq!(chooser.plan(0), None);
        assert_eq!(chooser.estimates(), (0, 0), "nothing measured");
    }

    #[test]
    fn both_ways_are_measured_first() {
        let chooser = Chooser::new();
        assert_eq!(chooser.plan(LEN), Some(Plan { method: Method::Cached, timed: true }));
        chooser.record(Method::Cached, LEN, Duration::from_micros(40));
        assert_eq!(chooser.plan(LEN), Some(Plan { method: Method::Streaming, timed: true }));
        chooser.record(Method::Streaming, LEN, Duration::from_micros(50));
        let (cached, streaming) = chooser.estimates();
        assert_eq!(cached, 40_000_000 / LEN as u64);
        assert_eq!(streaming, 50_000_000 / LEN as u64);
    }

    #[test]
    fn follows_the_machine_both_ways() {
        let chooser = Chooser::new();
        // Shared caches: plain copies win and are nearly all that is made.
        let (cached, streaming) = run(&chooser, 2_000, Duration::from_micros(35), Duration::from_micros(45));
        assert!(
            streaming <= 2_000 / PROBE_EVERY as usize + 2,
            "probes only: {cached} plain, {streaming} streaming"
        );
        // The host moves the processes apart: plain copies become 4x dearer; within a few
        // hundred copies streaming stores take over.
        let _ = run(&chooser, 400, Duration::from_micros(150), Duration::from_micros(45));
        let (cached, streaming) = run(&chooser, 2_000, Duration::from_micros(150), Duration::from_micros(45));
        assert!(
            cached <= 2_000 / PROBE_EVERY as usize + 2,
            "probes only: {cached} plain, {streaming} streaming"
        );
        // And back: the probes of plain copies see them cheap again.
        let _ = run(&chooser, 3_000, Duration::from_micros(35), Duration::from_micros(45));
        let (cached, streaming) = run(&chooser, 2_000, Duration::from_micros(35), Duration::from_micros(45));
        assert!(
            streaming <= 2_000 / PROBE_EVERY as usize + 2,
            "probes only: {cached} plain, {streaming} streaming"
        );
    }

    #[test]
    fn a_close_race_stays_plain() {
        // Streaming 10% cheaper is inside the margin: the reader's side favours plain copies.
        let chooser = Chooser::new();
        let (_, streaming) = run(&chooser, 1_000, Duration::from_micros(50), Duration::from_micros(45));
        assert!(streaming <= 1_000 / PROBE_EVERY as usize + 2, "{streaming} streaming copies");
    }

    #[test]
    fn one_preempted_copy_does_not_flip_the_choice() {
        let chooser = Chooser::new();
        let _ = run(&chooser, 500, Duration::from_micros(35), Duration::from_micros(45));
        // A timed plain copy that lost its CPU for 5 ms.
        chooser.record(Method::Cached, LEN, Duration::from_millis(5));
        let plan =
            (0..PROBE_EVERY).filter_map(|_| chooser.plan(LEN)).filter(|p| p.method == Method::Cached).count();
        assert!(plan as u64 >= PROBE_EVERY - 1, "plain copies stay the choice ({plan} of {PROBE_EVERY})");
    }
}
