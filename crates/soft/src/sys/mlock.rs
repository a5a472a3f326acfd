//! Memory-region pages: mapped from the kernel (zero-filled, each page committed only when
//! first touched), and best-effort pinning (`mlock`), so the kernel does not page them out
//! while a peer may write into them.

use std::ptr::NonNull;

/// Maps `size` bytes (a multiple of the page size) of private anonymous memory: zero-filled,
/// page aligned, and using no RAM until a page is first touched — an idle connection's ring
/// costs address space, not memory. `None` if the kernel refuses.
pub(crate) fn map_zeroed(size: usize) -> Option<NonNull<u8>> {
    use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
    // SAFETY: a fresh anonymous mapping at an address the kernel picks (null hint) aliases
    // nothing; the caller owns it until `unmap`.
    let ptr = unsafe {
        mmap_anonymous(std::ptr::null_mut(), size, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
    }
    .ok()?;
    NonNull::new(ptr.cast())
}

/// Unmaps what [`map_zeroed`] mapped.
///
/// # Safety
/// `ptr` and `size` must be exactly a mapping [`map_zeroed`] returned, not used afterwards.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, size: usize) {
    // SAFETY: per the contract, the whole mapping and nothing else; an error (impossible for
    // a valid mapping) would leave it mapped, which leaks but is harmless.
    let _ = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), size) };
}

/// Locks `len` bytes at `ptr` into RAM; returns whether it worked (it fails beyond
/// `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`, which is fine: pinning is an optimisation here,
/// since the engine copies with the CPU and never hands addresses to hardware).
pub(crate) fn mlock(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: mlock only changes paging attributes of the range; the caller's allocation
    // covers `len` bytes at `ptr`, and a bad range would only make the call fail.
    unsafe { libc::mlock(ptr.as_ptr().cast(), len) == 0 }
}

/// Undoes [`mlock`] for the same range.
pub(crate) fn munlock(ptr: NonNull<u8>, len: usize) {
    // SAFETY: as for mlock; unlocking a range that is still mapped is always permitted.
    unsafe {
        libc::munlock(ptr.as_ptr().cast(), len);
    }
}
