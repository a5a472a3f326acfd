//! The seeded random source of a run.
//!
//! Every random choice of a run (workload, every link's faults) comes from a [`SimRng`] derived
//! from the run's seed, so `run_seed(config, seed)` replays exactly. Independent streams are
//! split off by label, so that e.g. changing a link's loss rate does not shift the workload
//! generated for the same seed.

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A deterministic random generator (ChaCha8: the same stream on every platform).
#[derive(Clone, Debug)]
pub struct SimRng {
    inner: ChaCha8Rng,
}

impl SimRng {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        Self { inner: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// An independent stream for `label` under `seed` (e.g. one per link).
    pub fn stream(seed: u64, label: u64) -> Self {
        // SplitMix64-style mixing so that nearby (seed, label) pairs give unrelated streams.
        let mut z = seed ^ label.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self::new(z ^ (z >> 31))
    }

    /// True with probability `p` (clamped to 0..=1). `p == 0` never draws, so a clean link
    /// consumes no randomness for that fault.
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            false
        } else if p >= 1.0 {
            true
        } else {
            self.inner.gen::<f64>() < p
        }
    }

    /// Uniform in `low..=high` (returns `low` when the range is empty).
    pub fn range_u64(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            low
        } else {
            self.inner.gen_range(low..=high)
        }
    }

    /// Uniform in `low..=high` for sizes and indices.
    pub fn range_usize(&mut self, low: usize, high: usize) -> usize {
        if high <= low {
            low
        } else {
            self.inner.gen_range(low..=high)
        }
    }

    /// A uniformly chosen element, or `None` for an empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get(self.inner.gen_range(0..items.len()))
        }
    }

    /// A random 32-bit value.
    pub fn u32(&mut self) -> u32 {
        self.inner.next_u32()
    }

    /// A random 64-bit value.
    pub fn u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Fills `dst` with random bytes.
    pub fn fill(&mut self, dst: &mut [u8]) {
        self.inner.fill_bytes(dst);
    }

    /// A vector of `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.fill(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let mut a = SimRng::new(7);
        let mut b = SimRng::new(7);
        let xs: Vec<u64> = (0..8).map(|_| a.u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.u64()).collect();
        assert_eq!(xs, ys);
        let mut c = SimRng::stream(7, 1);
        let mut d = SimRng::stream(7, 2);
        assert_ne!(c.u64(), d.u64());
    }

    #[test]
    fn chance_extremes_and_ranges() {
        let mut rng = SimRng::new(1);
        assert!((0..100).all(|_| !rng.chance(0.0)));
        assert!((0..100).all(|_| rng.chance(1.0)));
        for _ in 0..100 {
            let v = rng.range_usize(3, 5);
            assert!((3..=5).contains(&v));
        }
        assert_eq!(rng.range_u64(9, 2), 9);
        assert_eq!(rng.pick::<u8>(&[]), None);
    }
}
