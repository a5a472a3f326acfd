//! The bytes behind a memory region: pages Lightpath maps itself (page aligned, zero-filled,
//! never inherited by a forked child), or a buffer moved in from the application.
//!
//! The device reads and writes these bytes by DMA at any time, so no Rust reference to them is
//! ever created: every CPU access is a raw copy (see [`RegionMemory::copy_out`]).

use std::ptr::NonNull;

/// Owned memory a region is registered over.
pub(crate) enum RegionMemory {
    /// An anonymous private mapping of `map_len` bytes (whole pages) of which `len` are the
    /// region.
    Mapped { ptr: NonNull<u8>, len: usize, map_len: usize },
    /// A boxed slice moved in from the application.
    Boxed { ptr: NonNull<u8>, len: usize },
}

// SAFETY: RegionMemory exclusively owns its allocation (like a Box<[u8]>), and it is only ever
// accessed through raw copies that the owning region serialises.
unsafe impl Send for RegionMemory {}
// SAFETY: as above: `&RegionMemory` gives out no references to the bytes.
unsafe impl Sync for RegionMemory {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

impl RegionMemory {
    /// Maps `len` zero bytes (at least one page, so even an empty region has a real address),
    /// marked `MADV_DONTFORK` so that a fork never copies them away from the device. `None` if
    /// the kernel refuses the mapping (the size is beyond what it will reserve).
    pub(crate) fn map(len: usize) -> Option<Self> {
        let map_len = len.max(1).checked_next_multiple_of(page_size())?;
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let ptr = NonNull::new(raw.cast::<u8>())?;
        // SAFETY: the range is exactly the mapping created above. Failure only means the
        // pages would be inherited by a child, which `ForkSafety` already accounts for.
        unsafe { libc::madvise(raw, map_len, libc::MADV_DONTFORK) };
        Some(Self::Mapped { ptr, len, map_len })
    }

    /// Takes ownership of an application buffer (its heap block stays where it is).
    pub(crate) fn from_vec(memory: Vec<u8>) -> Self {
        let boxed = memory.into_boxed_slice();
        let len = boxed.len();
        let raw = Box::into_raw(boxed).cast::<u8>();
        // A Box never holds a null pointer (an empty one holds a dangling, non-null one).
        let ptr = NonNull::new(raw).unwrap_or(NonNull::dangling());
        Self::Boxed { ptr, len }
    }

    /// The address of the first byte.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        match self {
            RegionMemory::Mapped { ptr, .. } | RegionMemory::Boxed { ptr, .. } => *ptr,
        }
    }

    /// The region's length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            RegionMemory::Mapped { len, .. } | RegionMemory::Boxed { len, .. } => *len,
        }
    }

    /// The byte range `offset..offset + len` if it lies inside the region.
    pub(crate) fn range(&self, offset: usize, len: usize) -> Option<std::ops::Range<usize>> {
        let end = offset.checked_add(len)?;
        (end <= self.len()).then_some(offset..end)
    }

    /// Copies `dst.len()` bytes at `offset` out. The caller checked the range and serialises
    /// CPU accesses.
    pub(crate) fn copy_out(&self, range: std::ops::Range<usize>, dst: &mut [u8]) {
        debug_assert_eq!(range.len(), dst.len());
        // Order this copy after the completion (polled before) that announced the data.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: `range` lies inside the owned allocation; `dst` is a distinct Rust buffer.
        unsafe { copy_in_pieces(self.ptr().as_ptr().add(range.start), dst.as_mut_ptr(), dst.len()) };
    }

    /// [`RegionMemory::copy_out`] into memory not yet initialised; returns `dst`, initialised.
    pub(crate) fn copy_out_uninit<'a>(
        &self,
        range: std::ops::Range<usize>,
        dst: &'a mut [std::mem::MaybeUninit<u8>],
    ) -> &'a mut [u8] {
        debug_assert_eq!(range.len(), dst.len());
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: as in `copy_out`; `MaybeUninit<u8>` has the layout of `u8`, so `dst`'s pointer
        // is valid for writes of `dst.len()` bytes.
        unsafe {
            copy_in_pieces(self.ptr().as_ptr().add(range.start), dst.as_mut_ptr().cast::<u8>(), dst.len())
        };
        // SAFETY: the copy above wrote all `dst.len()` bytes, so every one is initialised; the
        // new slice borrows `dst` for as long as `dst` was borrowed.
        unsafe { &mut *(std::ptr::from_mut::<[std::mem::MaybeUninit<u8>]>(dst) as *mut [u8]) }
    }

    /// Copies `src` in at `offset`. The caller checked the range and serialises CPU accesses.
    pub(crate) fn copy_in(&self, range: std::ops::Range<usize>, src: &[u8]) {
        debug_assert_eq!(range.len(), src.len());
        // SAFETY: `range` lies inside the owned allocation; `src` is a distinct Rust buffer.
        unsafe { copy_in_pieces(src.as_ptr(), self.ptr().as_ptr().add(range.start), src.len()) };
        // Make the bytes visible before a later post tells the device to read them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        match *self {
            RegionMemory::Mapped { ptr, map_len, .. } => {
                // SAFETY: unmapping exactly the mapping `map` created, once.
                unsafe { libc::munmap(ptr.as_ptr().cast(), map_len) };
            }
            RegionMemory::Boxed { ptr, len } => {
                let slice = std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len);
                // SAFETY: `ptr`/`len` came from Box::into_raw of a Box<[u8]> and are freed once.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}

/// `memcpy(to, from, len)` in pieces where glibc's would be slow on AMD Zen 3/4 (see
/// `lightpath_verbs::copy`).
///
/// # Safety
///
/// `from` must be valid for reads and `to` for writes of `len` bytes, and the ranges must not
/// overlap.
unsafe fn copy_in_pieces(from: *const u8, to: *mut u8, len: usize) {
    let piece = lightpath_verbs::copy::piece_len(to as usize, from as usize, len).max(1);
    let mut done = 0;
    while done < len {
        let n = piece.min(len - done);
        // SAFETY: `done + n <= len`: both pieces lie inside the ranges the caller vouched for,
        // which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(from.add(done), to.add(done), n) };
        done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_memory_is_zeroed_aligned_and_bounded() {
        let memory = RegionMemory::map(10_000).expect("map");
        assert_eq!(memory.ptr().as_ptr() as usize % page_size(), 0);
        assert_eq!(memory.len(), 10_000);
        let mut out = vec![1u8; 10_000];
        memory.copy_out(0..10_000, &mut out);
        assert!(out.iter().all(|&b| b == 0));
        memory.copy_in(9_998..10_000, &[7, 8]);
        let mut two = [0u8; 2];
        memory.copy_out(9_998..10_000, &mut two);
        assert_eq!(two, [7, 8]);
        let mut spare = [std::mem::MaybeUninit::<u8>::uninit(); 3];
        assert_eq!(memory.copy_out_uninit(9_997..10_000, &mut spare), [0, 7, 8]);
        assert_eq!(memory.range(9_999, 2), None);
        assert_eq!(memory.range(usize::MAX, 2), None);
        assert_eq!(memory.range(10_000, 0), Some(10_000..10_000));
    }

    #[test]
    fn boxed_memory_keeps_the_applications_bytes() {
        let memory = RegionMemory::from_vec(vec![5u8; 100]);
        let mut out = [0u8; 3];
        memory.copy_out(97..100, &mut out);
        assert_eq!(out, [5, 5, 5]);
        let empty = RegionMemory::from_vec(Vec::new());
        assert_eq!(empty.len(), 0);
    }

    #[test]
    fn impossible_sizes_are_refused() {
        assert!(RegionMemory::map(usize::MAX).is_none());
    }
}
