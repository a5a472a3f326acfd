//! [`RegionBytes`]: the memory of one region, shared between the application and the engine,
//! every access under the region's lock (see the module doc of `memory` for the model).

use lightpath_verbs::copy::copy_bytes;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use lightpath_roce::RegionMemory;

use super::PageBuffer;

/// Where a region's bytes live.
#[derive(Debug)]
enum Backing {
    /// Allocated by the provider: page aligned, zero-filled, maybe locked.
    Pages(PageBuffer),
    /// An application buffer moved into the region (`reg_vec`).
    Vec(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Pages(pages) => pages.as_slice(),
            Backing::Vec(vec) => vec,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Backing::Pages(pages) => pages.as_mut_slice(),
            Backing::Vec(vec) => vec,
        }
    }
}

/// The bytes of one memory region behind a reader-writer lock.
#[derive(Debug)]
pub struct RegionBytes {
    backing: RwLock<Backing>,
    len: usize,
    addr: u64,
    locked: bool,
}

impl RegionBytes {
    /// `len` zero bytes on fresh pages (`None` if the allocation fails).
    pub(crate) fn alloc(len: usize, lock: bool) -> Option<Self> {
        let pages = PageBuffer::new(len, lock)?;
        let (addr, locked) = (pages.addr(), pages.is_locked());
        Some(Self { backing: RwLock::new(Backing::Pages(pages)), len, addr, locked })
    }

    /// Takes over an application buffer. Its heap allocation never moves while the region owns
    /// it (the vector is never grown), so its address stays valid as the region's address.
    pub(crate) fn from_vec(vec: Vec<u8>) -> Self {
        let (len, addr) = (vec.len(), vec.as_ptr() as u64);
        Self { backing: RwLock::new(Backing::Vec(vec)), len, addr, locked: false }
    }

    /// The address of the first byte (the region's virtual address).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Whether the pages are locked into RAM (`mlock`).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// `offset..offset + len` if it lies inside the region.
    pub(crate) fn range(&self, offset: usize, len: usize) -> Option<std::ops::Range<usize>> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(offset..end)
    }

    fn read_guard(&self) -> RwLockReadGuard<'_, Backing> {
        // Plain bytes have no invariant a panic could break, so a poisoned lock is usable.
        self.backing.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_guard(&self) -> RwLockWriteGuard<'_, Backing> {
        self.backing.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` on the bytes with the region locked for reading.
    pub(crate) fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        f(self.read_guard().bytes())
    }

    /// Runs `f` on the bytes with the region locked for writing.
    pub(crate) fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        f(self.write_guard().bytes_mut())
    }

    fn word(bytes: &[u8], offset: usize) -> u64 {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[offset..offset + 8]);
        u64::from_ne_bytes(raw)
    }
}

// The engine checks bounds before every call (its contract); the slice indexing below would
// still stop an out-of-bounds access with a panic rather than touch foreign memory.
impl RegionMemory for RegionBytes {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) {
        copy_bytes(dst, &self.read_guard().bytes()[offset..offset + dst.len()]);
    }

    fn write(&self, offset: usize, src: &[u8]) {
        copy_bytes(&mut self.write_guard().bytes_mut()[offset..offset + src.len()], src);
    }

    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        let mut guard = self.write_guard();
        let bytes = guard.bytes_mut();
        let old = Self::word(bytes, offset);
        if old == compare {
            bytes[offset..offset + 8].copy_from_slice(&swap.to_ne_bytes());
        }
        old
    }

    /// Both backings stay where they are for the region's whole life (pages are never
    /// remapped, the vector never grows), so the kernel may read ranges of them in place.
    fn stable_addr(&self) -> Option<usize> {
        usize::try_from(self.addr).ok()
    }

    fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        let mut guard = self.write_guard();
        let bytes = guard.bytes_mut();
        let old = Self::word(bytes, offset);
        bytes[offset..offset + 8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomics_and_copies() {
        let region = RegionBytes::alloc(64, false).expect("alloc");
        region.write(8, &5u64.to_ne_bytes());
        assert_eq!(region.compare_swap(8, 5, 9), 5);
        assert_eq!(region.compare_swap(8, 5, 11), 9);
        assert_eq!(region.fetch_add(8, u64::MAX), 9);
        let mut word = [0u8; 8];
        region.read(8, &mut word);
        assert_eq!(u64::from_ne_bytes(word), 8);
        assert_eq!(region.range(60, 4), Some(60..64));
        assert_eq!(region.range(60, 5), None);
        assert_eq!(region.range(usize::MAX, 2), None);
    }

    #[test]
    fn vec_backing_keeps_its_address() {
        let vec = vec![1u8, 2, 3];
        let addr = vec.as_ptr() as u64;
        let region = RegionBytes::from_vec(vec);
        assert_eq!(region.addr(), addr);
        assert_eq!(region.with_bytes(|b| b.to_vec()), vec![1, 2, 3]);
        region.with_bytes_mut(|b| b[0] = 9);
        let mut out = [0u8; 3];
        region.read(0, &mut out);
        assert_eq!(out, [9, 2, 3]);
    }
}
