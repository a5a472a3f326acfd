//! Best-effort pinning of memory-region pages (`mlock`), so the kernel does not page them out
//! while a peer may write into them.

use std::ptr::NonNull;

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
