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
        // another mapping, so `copy_in_pieces` (memmove), defined for any overlap, is used.
        unsafe { copy_in_pieces(src.as_ptr(), dst, src.len()) };
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
        if !dst.writable {
            return false;
        }
        let (Some(to), Some(from)) = (dst.pointer(dst_offset, len), src.pointer(src_offset, len)) else {
            return false;
        };
        // SAFETY: both ranges are inside live mappings (checked above) and the destination is
        // writable. Two mappings of one file alias the same pages at different addresses, so
        // `copy_in_pieces` (memmove) is used, which is defined for any overlap.
        unsafe { copy_in_pieces(from, to, len) };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(len: u64, writable: bool) -> (Memfd, Mapping) {
        let memfd = Memfd::create("lightpath-shm-test", len).expect("memfd");
        let map = Mapping::new(&memfd, writable).expect("map");
        (memfd, map)
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
