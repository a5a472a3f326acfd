//! Page-aligned, zero-filled heap buffers, optionally locked into RAM.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::sys;

/// The allocation granularity and alignment of region memory.
pub(crate) const PAGE: usize = 4096;

/// A zero-filled buffer whose first byte is page aligned. Owns its allocation.
pub(crate) struct PageBuffer {
    ptr: NonNull<u8>,
    /// Bytes the user asked for (what the slice shows).
    len: usize,
    layout: Layout,
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
        let layout = Layout::from_size_align(size, PAGE).ok()?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)?;
        let locked = lock && sys::mlock(ptr, size);
        Some(Self { ptr, len, layout, locked })
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
            sys::munlock(self.ptr, self.layout.size());
        }
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
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
}
