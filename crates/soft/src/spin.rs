//! A busy poll that stops paying for itself: a waiter spins before it sleeps while spins find
//! work, gives up after some spins in a row found none (an idle connection, or a peer that
//! cannot get a core), and then tries one wait in so many again. Shared by the soft device's
//! socket watchers and Lightpath's waiters on a queue pair's own port.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// How long waits spin, and how that paid lately.
#[derive(Debug)]
pub struct AdaptiveSpin {
    limit: Duration,
    give_up_after: u32,
    retry_every: u32,
    /// Spins in a row that found nothing.
    misses: AtomicU32,
    /// Waits that did not spin since spinning was given up.
    skipped: AtomicU32,
}

impl AdaptiveSpin {
    /// Spins of `limit` (zero: never), given up after `give_up_after` misses in a row, then
    /// tried again once every `retry_every` waits (at least 1).
    pub fn new(limit: Duration, give_up_after: u32, retry_every: u32) -> Self {
        Self {
            limit,
            give_up_after,
            retry_every: retry_every.max(1),
            misses: AtomicU32::new(0),
            skipped: AtomicU32::new(0),
        }
    }

    /// How long this wait spins: the limit while spinning pays, else zero except one wait in
    /// `retry_every`.
    pub fn budget(&self) -> Duration {
        if self.limit.is_zero() || self.misses.load(Ordering::Relaxed) < self.give_up_after {
            return self.limit;
        }
        let skipped = self.skipped.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if skipped.is_multiple_of(self.retry_every) {
            self.limit
        } else {
            Duration::ZERO
        }
    }

    /// Whether spinning was given up (the last spins found nothing): a spin now is a retry.
    pub fn given_up(&self) -> bool {
        !self.limit.is_zero() && self.misses.load(Ordering::Relaxed) >= self.give_up_after
    }

    /// Records whether a spin found anything.
    pub fn record(&self, hit: bool) {
        if hit {
            self.misses.store(0, Ordering::Relaxed);
        } else {
            let misses = self.misses.load(Ordering::Relaxed);
            self.misses.store(misses.saturating_add(1), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_up_after_misses_and_retries_every_so_often() {
        let limit = Duration::from_micros(50);
        let spin = AdaptiveSpin::new(limit, 2, 3);
        assert_eq!(spin.budget(), limit);
        spin.record(false);
        assert_eq!(spin.budget(), limit, "one miss is not enough to give up");
        spin.record(false);
        let budgets: Vec<Duration> = (0..6).map(|_| spin.budget()).collect();
        let z = Duration::ZERO;
        assert_eq!(budgets, [z, z, limit, z, z, limit], "one wait in 3 tries again");
        assert!(spin.given_up());
        spin.record(true);
        assert!(!spin.given_up());
        assert_eq!(spin.budget(), limit, "a hit resumes spinning");
        assert_eq!(AdaptiveSpin::new(Duration::ZERO, 2, 3).budget(), Duration::ZERO);
    }
}
