//! Region memory with guard bytes: the backing store the simulator registers with engines.
//!
//! Each region sits between two guard areas filled with a known pattern. After a run the
//! checker compares the guards with the pattern and the region with the reference model, which
//! proves that the engine touched nothing outside a region, and nothing inside it that the
//! workload did not ask for. Accesses that break the `RegionMemory` contract (past the end) are
//! counted and land in the guard instead of panicking, so they show up as a failure report.

use std::sync::{Mutex, MutexGuard};

use lightpath_roce::RegionMemory;

/// Guard bytes on each side of a region.
pub const GUARD_LEN: usize = 64;

/// The guard pattern byte at guard position `i` (varied so a shifted copy is noticed).
fn guard_byte(i: usize) -> u8 {
    0xA5 ^ (i as u8).wrapping_mul(37)
}

#[derive(Debug)]
struct Inner {
    /// `GUARD_LEN` guard bytes, the region, `GUARD_LEN` guard bytes.
    bytes: Vec<u8>,
    /// Calls whose range did not fit the region.
    violations: u64,
}

/// Memory of one region plus guards.
#[derive(Debug)]
pub struct GuardedMemory {
    len: usize,
    inner: Mutex<Inner>,
}

impl GuardedMemory {
    /// A region holding `contents`.
    pub fn new(contents: &[u8]) -> Self {
        let len = contents.len();
        let mut bytes = Vec::with_capacity(len + 2 * GUARD_LEN);
        bytes.extend((0..GUARD_LEN).map(guard_byte));
        bytes.extend_from_slice(contents);
        bytes.extend((0..GUARD_LEN).map(guard_byte));
        Self { len, inner: Mutex::new(Inner { bytes, violations: 0 }) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the bytes inconsistent (plain copies).
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The region's current contents (without guards).
    pub fn snapshot(&self) -> Vec<u8> {
        self.lock().bytes[GUARD_LEN..GUARD_LEN + self.len].to_vec()
    }

    /// Whether both guards still hold their pattern.
    pub fn guards_intact(&self) -> bool {
        let inner = self.lock();
        let before = &inner.bytes[..GUARD_LEN];
        let after = &inner.bytes[GUARD_LEN + self.len..];
        (0..GUARD_LEN).all(|i| before[i] == guard_byte(i) && after[i] == guard_byte(i))
    }

    /// Calls that broke the bounds contract.
    pub fn violations(&self) -> u64 {
        self.lock().violations
    }

    /// The backing range for `offset..offset+len`, counting a violation (and clamping into the
    /// guard area) when it does not fit the region.
    fn backing_range(&self, inner: &mut Inner, offset: usize, len: usize) -> std::ops::Range<usize> {
        let fits = offset.checked_add(len).is_some_and(|end| end <= self.len);
        if !fits {
            inner.violations += 1;
        }
        let start = GUARD_LEN.saturating_add(offset).min(inner.bytes.len());
        let end = start.saturating_add(len).min(inner.bytes.len());
        start..end
    }

    fn atomic(&self, offset: usize, update: impl FnOnce(u64) -> u64) -> u64 {
        let mut inner = self.lock();
        let range = self.backing_range(&mut inner, offset, 8);
        if range.len() != 8 {
            return 0;
        }
        let mut word = [0u8; 8];
        word.copy_from_slice(&inner.bytes[range.clone()]);
        let old = u64::from_ne_bytes(word);
        inner.bytes[range].copy_from_slice(&update(old).to_ne_bytes());
        old
    }
}

impl RegionMemory for GuardedMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) {
        let mut inner = self.lock();
        let range = self.backing_range(&mut inner, offset, dst.len());
        let n = range.len();
        dst[..n].copy_from_slice(&inner.bytes[range]);
        dst[n..].fill(0);
    }

    fn write(&self, offset: usize, src: &[u8]) {
        let mut inner = self.lock();
        let range = self.backing_range(&mut inner, offset, src.len());
        let n = range.len();
        inner.bytes[range].copy_from_slice(&src[..n]);
    }

    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        self.atomic(offset, |old| if old == compare { swap } else { old })
    }

    fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        self.atomic(offset, |old| old.wrapping_add(add))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_bounds_access_keeps_guards() {
        let memory = GuardedMemory::new(&[0u8; 32]);
        memory.write(8, &[1, 2, 3]);
        let mut out = [0u8; 4];
        memory.read(7, &mut out);
        assert_eq!(out, [0, 1, 2, 3]);
        assert_eq!(memory.fetch_add(16, 5), 0);
        assert_eq!(memory.compare_swap(16, 5, 9), 5);
        assert_eq!(memory.compare_swap(16, 5, 1), 9);
        assert_eq!(u64::from_ne_bytes(memory.snapshot()[16..24].try_into().unwrap()), 9);
        assert!(memory.guards_intact());
        assert_eq!(memory.violations(), 0);
    }

    #[test]
    fn out_of_bounds_write_is_counted_and_hits_the_guard() {
        let memory = GuardedMemory::new(&[0u8; 16]);
        memory.write(14, &[7, 7, 7, 7]);
        assert_eq!(memory.violations(), 1);
        assert!(!memory.guards_intact());
        assert_eq!(&memory.snapshot()[14..], &[7, 7]);
        // Far past the end: nothing panics, the access is counted.
        memory.write(usize::MAX - 1, &[1; 8]);
        let mut out = [9u8; 8];
        memory.read(1 << 40, &mut out);
        assert_eq!(out, [0; 8]);
        assert_eq!(memory.violations(), 3);
    }
}
