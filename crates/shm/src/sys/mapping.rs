//! [`Mapping`]: a memfd mapped `MAP_SHARED` into this process, and every access to it.
//!
//! This is the crate's one `unsafe` module. The memory behind a mapping is shared with another
//! process that may write it at any moment, so the rules are:
//!
//! - No Rust reference (`&[u8]`, `&mut [u8]`, `&T`) to mapped memory ever exists outside a
//!   single method call; bytes move in and out by raw-pointer copies into or out of private
//!   buffers (or between two mappings), and 8-byte words are read and written as atomics
//!   created for the one operation.
//! - Every offset and length is bounds-checked against the mapping, with checked arithmetic,
//!   before a pointer is formed; a failed check returns `false` / `None` and touches nothing.
//! - Writes go only through mappings made writable; a read-only mapping refuses them (the CPU
//!   would fault).
//! - The mapped file cannot shrink (see `memfd`), so every in-bounds access stays backed.
//!
//! Bytes read while the peer writes them are an unspecified mix of old and new, exactly as with
//! a NIC's DMA; callers copy what they need once, then validate the copy.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

use super::Memfd;

/// A whole memfd mapped shared, readable and possibly writable.
#[derive(Debug)]
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: a `Mapping` is an address range of shared memory that stays mapped until `drop`; all
// access goes through the methods below, which use raw-pointer copies and atomics and never
// hand out references, so using it from several threads is no different from the peer process
// using it concurrently, which every method already allows for.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: no method relies on exclusive access.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all of `memfd` (one we created), read-only or read-write. Pages are not
    /// pre-faulted: a page of a memfd costs memory only once this process or the peer touches
    /// it, so an idle connection's memory regions (its stream ring) cost the few pages used,
    /// not their full size (with `MAP_POPULATE` every region was resident from the start:
    /// about 0.6 MB per shm stream connection, and queue-pair segments another 0.12 MB). The
    /// first pass over a page costs one fault, once per page for the mapping's life.
    pub(crate) fn new(memfd: &Memfd, writable: bool) -> io::Result<Self> {
        Self::map(memfd, memfd.len(), writable)
    }

    /// Maps the first `len` bytes of a peer's `memfd` without pre-faulting: a peer decides the
    /// sizes, so only pages this process actually touches may cost it memory.
    pub(crate) fn peer(memfd: &Memfd, len: u64, writable: bool) -> io::Result<Self> {
        if len > memfd.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "mapping larger than the memfd"));
        }
        Self::map(memfd, len, writable)
    }

    fn map(memfd: &Memfd, len: u64, writable: bool) -> io::Result<Self> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "memfd size cannot be mapped"))?;
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a null hint lets the kernel choose a fresh address range, so no existing
        // memory is replaced; `len` is at most the file's size (checked by `peer`, equal in
        // `new`), which is sealed against shrinking, so every page of the range stays backed.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, memfd.as_fd(), 0)? };
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null address"))?;
        Ok(Self { base, len, writable })
    }

    /// The address of the first byte in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A pointer to `offset`, if `offset..offset + len` lies inside the mapping.
    fn pointer(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: `offset <= end <= self.len`, so the result stays inside (or one past the end
        // of) the mapped range that starts at `base`.
        Some(unsafe { self.base.as_ptr().add(offset) })
    }

    /// A pointer to the 8-byte word at `offset`, if it is inside and 8-byte aligned (the base
    /// is page aligned, so aligned offsets are aligned addresses).
    fn word(&self, offset: usize, need_write: bool) -> Option<*mut u64> {
        if !offset.is_multiple_of(8) || (need_write && !self.writable) {
            return None;
        }
        self.pointer(offset, 8).map(|p| p.cast::<u64>())
    }

    /// Asks the CPU to bring the cache line at `offset` into its cache for writing
    /// (`prefetchw`), so that a store there later need not wait for another core to give the
    /// line up. A hint only: nothing is read or written; outside the mapping it does nothing.
    pub(crate) fn prefetch_for_write(&self, offset: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(line) = self.pointer(offset, 1) {
            // SAFETY: `prefetchw` neither reads nor writes memory as far as the program can
            // tell (it cannot fault, even on an unmapped address; `line` is inside the live
            // mapping anyway); it touches no register but its operand and no flags. On CPUs
            // without it the instruction is a no-op.
            unsafe {
                std::arch::asm!("prefetchw [{0}]", in(reg) line, options(nostack, preserves_flags, readonly))
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = offset;
    }

    /// Copies `dst.len()` bytes at `offset` out of the mapping.
    #[must_use]
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        let Some(src) = self.pointer(offset, dst.len()) else { return false };
        // SAFETY: `src..src + dst.len()` is inside the live mapping (checked above) and `dst` is
        // a private buffer, so the ranges cannot overlap; the source may be written by the peer
        // concurrently, which yields unspecified bytes but no reference is formed to it.
        unsafe { copy_in_pieces(src, dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// [`Mapping::read`] into memory not yet initialised; returns `dst`, now initialised, or
    /// `None` if the range is outside the mapping (then nothing was written).
    pub(crate) fn read_uninit<'a>(
        &self,
        offset: usize,
        dst: &'a mut [MaybeUninit<u8>],
    ) -> Option<&'a mut [u8]> {
        let src = self.pointer(offset, dst.len())?;
        // SAFETY: as in `read`: the source range is inside the live mapping and `dst` is a
        // private buffer; `MaybeUninit<u8>` has the layout of `u8`, so its pointer is valid for
        // writes of `dst.len()` bytes.
        unsafe { copy_in_pieces(src, dst.as_mut_ptr().cast::<u8>(), dst.len()) };
        // SAFETY: the copy above wrote every one of the `dst.len()` bytes, so all of them are
        // initialised; the new slice borrows `dst` for as long as `dst` was borrowed.
        Some(unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<u8>]>(dst) as *mut [u8]) })
    }

    /// Copies `src` into the mapping at `offset`.
    #[must_use]
    pub(crate) fn write(&self, offset: usize, src: &[u8]) -> bool {
        if !self.writable {
            return false;
        }
        let Some(dst) = self.pointer(offset, src.len()) else { return false };
        // SAFETY: `dst..dst + src.len()` is inside the live, writable mapping (checked above),
        // and `src` is a private buffer that cannot overlap it.
        unsafe { copy_in_pieces(src.as_ptr(), dst, src.len()) };
        true
    }

    /// Copies `src`, a buffer of the application's, to `offset` (see
    /// `QueuePair::write_direct`). Unlike [`Mapping::write`] it makes no assumption about
    /// where `src` lives: it may be a view of another mapping of the same pages.
    #[must_use]
    pub(crate) fn write_from_caller(&self, offset: usize, src: &[u8]) -> bool {
        if !self.writable {
            return false;
        }
        let Some(dst) = self.pointer(offset, src.len()) else { return false };
        // SAFETY: `dst..dst + src.len()` is inside the live, writable mapping (checked above);
        // `src` is valid for reads of its length. It might alias the destination pages through
        // another mapping, which `copy_outbound` allows.
        unsafe { copy_outbound(src.as_ptr(), dst, src.len()) };
        true
    }

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`.
    #[must_use]
    pub(crate) fn copy(
        dst: &Mapping,
        dst_offset: usize,
        src: &Mapping,
        src_offset: usize,
        len: usize,
    ) -> bool {
        Self::copy_between(dst, dst_offset, src, src_offset, len, false)
    }

    /// [`Mapping::copy`] into memory the peer reads next (an RDMA WRITE into its region, a
    /// SEND's bytes into this queue pair's ring): large copies are made the way this process
    /// measured to be cheaper lately (see `crate::outbound_copy`).
    #[must_use]
    pub(crate) fn copy_to_peer(
        dst: &Mapping,
        dst_offset: usize,
        src: &Mapping,
        src_offset: usize,
        len: usize,
    ) -> bool {
        Self::copy_between(dst, dst_offset, src, src_offset, len, true)
    }

    /// [`Mapping::copy`], or with `to_peer` [`Mapping::copy_to_peer`].
    fn copy_between(
        dst: &Mapping,
        dst_offset: usize,
        src: &Mapping,
        src_offset: usize,
        len: usize,
        to_peer: bool,
    ) -> bool {
        if !dst.writable {
            return false;
        }
        let (Some(to), Some(from)) = (dst.pointer(dst_offset, len), src.pointer(src_offset, len)) else {
            return false;
        };
        // SAFETY: both ranges are inside live mappings (checked above) and the destination is
        // writable. Two mappings of one file alias the same pages at different addresses;
        // `copy_in_pieces` (memmove) and `copy_outbound` both allow any overlap.
        unsafe {
            if to_peer {
                copy_outbound(from, to, len)
            } else {
                copy_in_pieces(from, to, len)
            }
        };
        true
    }

    /// Atomically loads the aligned word at `offset`.
    pub(crate) fn load_u64(&self, offset: usize, order: Ordering) -> Option<u64> {
        let word = self.word(offset, false)?;
        // SAFETY: `word` is 8-byte aligned and inside the live mapping (checked by `word`); the
        // atomic exists only for this load, and every other access to shared words is atomic
        // as well (a peer that writes it non-atomically only gets itself garbage).
        Some(unsafe { AtomicU64::from_ptr(word) }.load(order))
    }

    /// Atomically stores `value` into the aligned word at `offset`.
    #[must_use]
    pub(crate) fn store_u64(&self, offset: usize, value: u64, order: Ordering) -> bool {
        let Some(word) = self.word(offset, true) else { return false };
        // SAFETY: as in `load_u64`; `word` also checked the mapping is writable.
        unsafe { AtomicU64::from_ptr(word) }.store(value, order);
        true
    }

    /// Atomic fetch-and-add on the aligned word at `offset`; returns the original value.
    pub(crate) fn fetch_add_u64(&self, offset: usize, add: u64) -> Option<u64> {
        let word = self.word(offset, true)?;
        // SAFETY: as in `store_u64`.
        Some(unsafe { AtomicU64::from_ptr(word) }.fetch_add(add, Ordering::AcqRel))
    }

    /// Atomic fetch-or on the aligned word at `offset`; returns the original value.
    pub(crate) fn fetch_or_u64(&self, offset: usize, bits: u64, order: Ordering) -> Option<u64> {
        let word = self.word(offset, true)?;
        // SAFETY: as in `store_u64`.
        Some(unsafe { AtomicU64::from_ptr(word) }.fetch_or(bits, order))
    }

    /// Atomic fetch-and on the aligned word at `offset`; returns the original value.
    pub(crate) fn fetch_and_u64(&self, offset: usize, bits: u64, order: Ordering) -> Option<u64> {
        let word = self.word(offset, true)?;
        // SAFETY: as in `store_u64`.
        Some(unsafe { AtomicU64::from_ptr(word) }.fetch_and(bits, order))
    }

    /// Atomic swap on the aligned word at `offset`; returns the original value.
    pub(crate) fn swap_u64(&self, offset: usize, value: u64, order: Ordering) -> Option<u64> {
        let word = self.word(offset, true)?;
        // SAFETY: as in `store_u64`.
        Some(unsafe { AtomicU64::from_ptr(word) }.swap(value, order))
    }

    /// Atomic compare-and-swap on the aligned word at `offset`; returns the original value
    /// (equal to `current` exactly when the swap happened).
    pub(crate) fn compare_swap_u64(&self, offset: usize, current: u64, new: u64) -> Option<u64> {
        let word = self.word(offset, true)?;
        // SAFETY: as in `store_u64`.
        let atomic = unsafe { AtomicU64::from_ptr(word) };
        Some(match atomic.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(original) | Err(original) => original,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base + len` is exactly the range `mmap` returned, and no reference into
        // it can outlive this call (none is ever handed out).
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// `memmove(to, from, len)`, in pieces where glibc's `memmove` would be slow on AMD Zen 3/4
/// (see `lightpath_verbs::copy`): every copy into or out of a ring or a region goes through
/// here.
///
/// # Safety
///
/// `from` must be valid for reads and `to` for writes of `len` bytes. The ranges may overlap
/// (in address or through two mappings of the same pages): each piece is a `memmove`, and a
/// copy is cut only when the destination lies past the source by less than a cache line
/// modulo the page, where a forward copy of one piece after another moves what `memmove`
/// would for ranges that do not overlap in address. Ranges that do overlap in address are
/// moved whole.
unsafe fn copy_in_pieces(from: *const u8, to: *mut u8, len: usize) {
    let (src, dst) = (from as usize, to as usize);
    let piece = lightpath_verbs::copy::piece_len(dst, src, len);
    if piece >= len || (src < dst + len && dst < src + len) {
        // SAFETY: the caller's promise, for the whole range; `copy` allows any overlap.
        unsafe { std::ptr::copy(from, to, len) };
        return;
    }
    let mut done = 0;
    while done < len {
        let n = piece.min(len - done);
        // SAFETY: `done + n <= len`, so both pieces are inside the ranges the caller vouched
        // for; `copy` allows them to alias through another mapping.
        unsafe { std::ptr::copy(from.add(done), to.add(done), n) };
        done += n;
    }
}

/// A copy of `len` bytes into memory a peer reads next, made through the caches or with
/// streaming stores as [`crate::outbound_copy::OUTBOUND`] plans it (and timed when it asks).
///
/// # Safety
///
/// As for [`copy_in_pieces`]: `from` valid for reads and `to` for writes of `len` bytes; the
/// ranges may alias through two mappings of the same pages (each way then moves unspecified
/// bytes for the overlap, as a concurrent writer would, but never touches memory outside the
/// ranges).
unsafe fn copy_outbound(from: *const u8, to: *mut u8, len: usize) {
    use crate::outbound_copy::{Method, OUTBOUND};
    let overlapping = (from as usize) < (to as usize) + len && (to as usize) < (from as usize) + len;
    let plan = if overlapping { None } else { OUTBOUND.plan(len) };
    let Some(plan) = plan else {
        // SAFETY: the caller's promise.
        unsafe { copy_in_pieces(from, to, len) };
        return;
    };
    let started = plan.timed.then(std::time::Instant::now);
    match plan.method {
        // SAFETY: the caller's promise.
        Method::Cached => unsafe { copy_in_pieces(from, to, len) },
        // SAFETY: the caller's promise; the ranges do not overlap in address (checked above).
        Method::Streaming => unsafe { copy_streaming(from, to, len) },
    }
    if let Some(started) = started {
        OUTBOUND.record(plan.method, len, started.elapsed());
    }
}

/// Copies `len` bytes with streaming (non-temporal) stores, which write whole cache lines to
/// memory without first fetching them into this core's cache (and evict them from every
/// other), then fences them: a release store that publishes the bytes afterwards (a ring's
/// tail, a completion) is ordered after them, as after ordinary stores. The bytes before the
/// first 16-byte boundary of the destination and after the last one are copied plainly.
///
/// # Safety
///
/// `from` valid for reads and `to` for writes of `len` bytes, the two not overlapping in
/// address.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(from: *const u8, to: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = to.align_offset(16).min(len);
    // SAFETY: `head <= len`: inside both ranges.
    unsafe { std::ptr::copy(from, to, head) };
    let mut at = head;
    while at + 64 <= len {
        // SAFETY: `at + 64 <= len`, so the four 16-byte loads and stores are inside the
        // ranges; `to + at` is 16-byte aligned (`head` aligned it, and `at` moves by 64), as
        // `_mm_stream_si128` requires, and the loads need no alignment. SSE2 is part of the
        // x86_64 baseline.
        unsafe {
            let src = from.add(at).cast::<__m128i>();
            let dst = to.add(at).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(src), _mm_loadu_si128(src.add(1)));
            let (c, d) = (_mm_loadu_si128(src.add(2)), _mm_loadu_si128(src.add(3)));
            _mm_stream_si128(dst, a);
            _mm_stream_si128(dst.add(1), b);
            _mm_stream_si128(dst.add(2), c);
            _mm_stream_si128(dst.add(3), d);
        }
        at += 64;
    }
    // SAFETY: `at <= len`: the rest is inside both ranges. Then the fence: SSE2, as above.
    unsafe {
        std::ptr::copy(from.add(at), to.add(at), len - at);
        _mm_sfence();
    }
}

/// Elsewhere there are no streaming stores to use: a plain copy.
///
/// # Safety
///
/// As for [`copy_in_pieces`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(from: *const u8, to: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    unsafe { copy_in_pieces(from, to, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(len: u64, writable: bool) -> (Memfd, Mapping) {
        let memfd = Memfd::create("lightpath-shm-test", len).expect("memfd");
        let map = Mapping::new(&memfd, writable).expect("map");
        (memfd, map)
    }

    #[test]
    fn streaming_copies_move_exactly_their_bytes() {
        let source: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 4096, 33_000, 65_536] {
            for (from, to) in [(0, 0), (3, 0), (0, 5), (7, 9), (16, 1), (1, 16)] {
                let mut target = vec![0xEEu8; len + 64];
                // SAFETY: `source[from..from + len]` and `target[to..to + len]` are in bounds
                // (70,000 bytes and `len + 64`, offsets below 64) and do not overlap.
                unsafe { copy_streaming(source.as_ptr().add(from), target.as_mut_ptr().add(to), len) };
                assert_eq!(&target[to..to + len], &source[from..from + len], "len {len} from {from} to {to}");
                assert!(target[..to].iter().all(|&b| b == 0xEE), "nothing before, len {len}");
                assert!(target[to + len..].iter().all(|&b| b == 0xEE), "nothing after, len {len}");
            }
        }
    }

    #[test]
    fn copies_to_peers_arrive_whichever_way_they_are_made() {
        // Enough large copies for the chooser to make some each way (the first two are one of
        // each; probes follow), all through `Mapping::copy_to_peer` and `write_from_caller`.
        let (_fd_a, a) = mapping(1 << 20, true);
        let (_fd_b, b) = mapping(1 << 20, true);
        for round in 0..200u32 {
            let bytes: Vec<u8> = (0..100_000u32).map(|i| (i ^ round).wrapping_mul(31) as u8).collect();
            let at = (round as usize * 4_099) % 4_096;
            assert!(a.write_from_caller(at, &bytes));
            assert!(Mapping::copy_to_peer(&b, 300_000 + at, &a, at, bytes.len()));
            let mut back = vec![0u8; bytes.len()];
            assert!(b.read(300_000 + at, &mut back));
            assert_eq!(back, bytes, "round {round}");
        }
        let (_fd_r, read_only) = mapping(4096, false);
        assert!(!Mapping::copy_to_peer(&read_only, 0, &a, 0, 16), "a read-only mapping refuses");
        assert!(!Mapping::copy_to_peer(&b, (1 << 20) - 8, &a, 0, 16), "past the end");
    }

    #[test]
    fn accesses_are_bounds_checked() {
        let (_fd, map) = mapping(4096, true);
        assert!(map.write(4090, &[1; 6]));
        assert!(!map.write(4091, &[1; 6]));
        assert!(!map.write(usize::MAX, &[1]));
        let mut out = [0u8; 6];
        assert!(map.read(4090, &mut out));
        assert_eq!(out, [1; 6]);
        assert!(!map.read(4095, &mut out));
        assert!(map.load_u64(4088, Ordering::Relaxed).is_some());
        assert!(map.load_u64(4092, Ordering::Relaxed).is_none(), "misaligned word");
        assert!(map.load_u64(4096, Ordering::Relaxed).is_none(), "word past the end");
    }

    #[test]
    fn peer_mappings_cover_only_what_was_asked() {
        let memfd = Memfd::create("lightpath-shm-test", 8192).expect("memfd");
        let map = Mapping::peer(&memfd, 4096, false).expect("map");
        assert_eq!(map.len(), 4096);
        assert!(Mapping::peer(&memfd, 8193, false).is_err(), "past the end of the file");
        assert!(Mapping::peer(&memfd, 0, false).is_err(), "empty mapping");
    }

    #[test]
    fn read_only_mappings_refuse_writes() {
        let (memfd, writable) = mapping(4096, true);
        let read_only = Mapping::new(&memfd, false).expect("map");
        assert!(!read_only.write(0, &[1]));
        assert!(!read_only.store_u64(0, 1, Ordering::Relaxed));
        assert!(read_only.fetch_add_u64(0, 1).is_none());
        assert!(read_only.compare_swap_u64(0, 0, 1).is_none());
        assert!(read_only.fetch_or_u64(0, 1, Ordering::Relaxed).is_none());
        assert!(read_only.swap_u64(0, 1, Ordering::Relaxed).is_none());
        assert!(!Mapping::copy(&read_only, 0, &writable, 8, 8));
        assert!(writable.store_u64(0, 7, Ordering::Release));
        assert_eq!(read_only.load_u64(0, Ordering::Acquire), Some(7), "both mappings see one word");
    }

    #[test]
    fn atomics_and_copies_between_mappings() {
        let (memfd, a) = mapping(8192, true);
        let b = Mapping::new(&memfd, true).expect("second mapping of the same file");
        assert_eq!(a.fetch_add_u64(16, 5), Some(0));
        assert_eq!(b.fetch_add_u64(16, 5), Some(5));
        assert_eq!(a.compare_swap_u64(16, 10, 99), Some(10));
        assert_eq!(b.compare_swap_u64(16, 10, 1), Some(99), "mismatch leaves the value");
        assert_eq!(a.fetch_or_u64(24, 0b101, Ordering::Release), Some(0));
        assert_eq!(b.fetch_or_u64(24, 0b110, Ordering::Release), Some(0b101));
        assert_eq!(a.swap_u64(24, 0, Ordering::Acquire), Some(0b111));
        assert_eq!(b.load_u64(24, Ordering::Acquire), Some(0));
        assert!(a.swap_u64(8188, 0, Ordering::Relaxed).is_none(), "misaligned word");
        assert!(a.write(100, b"hello"));
        assert!(Mapping::copy(&b, 4096, &a, 100, 5));
        let mut out = [0u8; 5];
        assert!(a.read(4096, &mut out));
        assert_eq!(&out, b"hello");
        assert!(!Mapping::copy(&b, 8190, &a, 0, 5), "destination out of bounds");
        assert!(!Mapping::copy(&b, 0, &a, 8190, 5), "source out of bounds");
    }

    /// Copies at a distance where glibc's memcpy is slow on AMD Zen 3/4 are made in pieces
    /// (`lightpath_verbs::copy`); they must land exactly like whole ones, also between two
    /// mappings of the same pages and within one mapping.
    #[test]
    fn copies_cut_in_pieces_land_exactly() {
        let (memfd, a) = mapping(1 << 16, true);
        let b = Mapping::new(&memfd, true).expect("second mapping of the same file");
        let (_other, c) = mapping(1 << 16, true);
        let pattern: Vec<u8> = (0..20_000u32).map(|i| (i * 31 + i / 97) as u8).collect();
        // Mappings are page aligned: offsets 16 apart put the destination 16 bytes past the
        // source, modulo the page.
        assert!(lightpath_verbs::copy::piece_len(16, 0, pattern.len()) < pattern.len(), "cut");
        assert!(a.write(0, &pattern));
        assert!(Mapping::copy(&c, 16, &a, 0, pattern.len()), "between files");
        let mut out = vec![0u8; pattern.len()];
        assert!(c.read(16, &mut out));
        assert_eq!(out, pattern);
        assert!(Mapping::copy(&b, 32_784, &a, 0, pattern.len()), "between two mappings of one file");
        assert!(a.read(32_784, &mut out));
        assert_eq!(out, pattern);
        assert!(Mapping::copy(&a, 16, &a, 0, pattern.len()), "overlapping, within one mapping");
        assert!(a.read(16, &mut out));
        assert_eq!(out, pattern, "an overlapping move is a memmove");
        assert!(c.write_from_caller(40_000, &pattern));
        assert!(c.read(40_000, &mut out));
        assert_eq!(out, pattern);
    }
}
