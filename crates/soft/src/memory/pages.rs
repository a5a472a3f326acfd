//! Page-aligned, zero-filled buffers mapped from the kernel (RAM is used only by pages that
//! were touched), optionally locked into RAM.

use std::ptr::NonNull;

use crate::sys;

/// The allocation granularity and alignment of region memory.
pub(crate) const PAGE: usize = 4096;

/// A zero-filled buffer whose first byte is page aligned. Owns its allocation.
pub(crate) struct PageBuffer {
    ptr: NonNull<u8>,
    /// Bytes the user asked for (what the slice shows).
    len: usize,
    /// Bytes mapped: `len` rounded up to whole pages, at least one.
    size: usize,
    locked: bool,
}

// SAFETY: PageBuffer owns its allocation exclusively (like a Box<[u8]>); moving it to another
// thread moves that ownership, and shared references only allow reads through `&[u8]`.
unsafe impl Send for PageBuffer {}
// SAFETY: `&PageBuffer` only gives out `&[u8]` (immutable); mutation needs `&mut`.
unsafe impl Sync for PageBuffer {}

impl PageBuffer {
    /// Allocates `len` zero bytes (at least one page is reserved, so even an empty buffer has a
    /// real, aligned address) and, if `lock`, tries to `mlock` them.
    pub(crate) fn new(len: usize, lock: bool) -> Option<Self> {
        let size = len.max(1).checked_next_multiple_of(PAGE)?;
        // Not the heap: an aligned zeroed heap allocation is written with zeros at once, so a
        // region would use its whole size in RAM before carrying a byte (1,000 idle streams:
        // half a gigabyte).
        let ptr = sys::map_zeroed(size)?;
        let locked = lock && sys::mlock(ptr, size);
        Some(Self { ptr, len, size, locked })
    }

    /// Whether the pages are locked into RAM.
    pub(crate) fn is_locked(&self) -> bool {
        self.locked
    }

    /// The address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation holds at least `len` initialised (zero-filled, then only
        // written through `as_mut_slice`) bytes and lives as long as `self`; the borrow of
        // `self` prevents a simultaneous `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference to the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        if self.locked {
            sys::munlock(self.ptr, self.size);
        }
        // SAFETY: `ptr` and `size` are exactly the mapping `map_zeroed` returned in `new`,
        // unmapped once, here; no slice of it outlives `self`.
        unsafe { sys::unmap(self.ptr, self.size) };
    }
}

impl std::fmt::Debug for PageBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuffer").field("addr", &self.ptr).field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        for len in [0usize, 1, 4095, 4096, 10_000] {
            let mut buf = PageBuffer::new(len, true).expect("alloc");
            assert_eq!(buf.addr() % PAGE as u64, 0);
            assert_eq!(buf.as_slice().len(), len);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            if len > 0 {
                buf.as_mut_slice()[len - 1] = 7;
                assert_eq!(buf.as_slice()[len - 1], 7);
            }
        }
        assert!(PageBuffer::new(usize::MAX - 10, false).is_none());
    }

    /// Resident memory of this process, in bytes (`/proc/self/statm`).
    fn resident() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
        let pages: usize = statm.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("resident");
        pages * PAGE
    }

    /// A buffer costs RAM only for the pages that were touched: a 256 MiB region that has
    /// seen 1 MiB of writes adds far less than 256 MiB to the resident set (other tests
    /// running meanwhile may add a few MiB, hence the margin).
    #[test]
    fn untouched_pages_use_no_memory() {
        let before = resident();
        let mut buf = PageBuffer::new(256 << 20, false).expect("alloc");
        buf.as_mut_slice()[..1 << 20].fill(1);
        let grown = resident().saturating_sub(before);
        assert!(
            grown < 64 << 20,
            "a 256 MiB buffer with 1 MiB written grew the resident set by {grown} bytes"
        );
        assert_eq!(buf.as_slice()[(200 << 20) + 5], 0);
    }
}
