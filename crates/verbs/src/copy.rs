//! Copying bytes without falling into memcpy's slow case on AMD Zen 3 and Zen 4.
//!
//! # Why
//!
//! glibc's `memcpy`/`memmove` hand copies from about 4 KiB up to its non-temporal threshold
//! (a few hundred KiB to a few MiB, from the cache size) to `rep movsb` on CPUs with fast
//! string moves (ERMS/FSRM). On AMD Zen 3 and Zen 4, `rep movsb` runs more than ten times
//! slower when the destination lies a little past the source modulo the page size:
//! `(dst - src) mod 4096` in 1..=31 on this project's Zen 3 machines (glibc bug 30994, fixed in
//! glibc 2.39 by not using `rep movsb` on those CPUs; Debian 12's 2.36 and Ubuntu 22.04's 2.35
//! still do). Measured with `scripts/copy_distance.c` here (glibc 2.36, EPYC family 25): a
//! 32 KiB copy at distance 16 moves 2-3 GB/s against 40-50 GB/s at any distance from 32 on
//! (20-50 there on a busy run); every size from 4 KiB to 256 KiB is hit, 512 KiB and more
//! are not (glibc's non-temporal path). Where a copy
//! lands is up to the application's buffers and the rings' positions, so one copy in a hundred
//! or so is hit at random, and some layouts hit every time: a 2-rank `allgather` of 64 KiB,
//! whose own block is copied from the input to the output, took 25 µs instead of 3.
//!
//! # What
//!
//! [`copy_bytes`] copies like `copy_from_slice`, except that a copy at a slow distance is made
//! in pieces of [`PIECE`] bytes: below glibc's `rep movsb` threshold (2 KiB with SSE2, 4 KiB
//! with AVX2, 8 KiB with AVX-512), so each piece takes the vector loop. That costs nothing
//! measurable where it is not needed (it is not taken) and 5-15 % against an unhit `rep movsb`
//! where it is (a 32 KiB copy: 35-48 against 40-52 GB/s). Providers that copy through raw
//! pointers (shared mappings) cut their copies with [`piece_len`].

/// The largest piece a copy at a slow distance hands `memcpy` at once: below the smallest
/// `rep movsb` threshold glibc uses.
pub const PIECE: usize = 2048;

/// Copies from this many bytes on go to `rep movsb` in some glibc builds (the smallest
/// threshold, SSE2's), so only those are cut.
const CUT_FROM: usize = PIECE + 1;

/// From this size on glibc's copies take its non-temporal path on any machine this was tried
/// on, whatever the distance; a cut there would only lose the non-temporal stores.
const CUT_BELOW: usize = 16 << 20;

/// Whether a copy from `src` to `dst` (addresses) lies at a distance where `rep movsb` is slow
/// on Zen 3/4: the destination 1 to 63 bytes past the source, modulo 4096 (31 measured; the
/// margin covers parts not measured).
pub fn slow_distance(dst: usize, src: usize) -> bool {
    let distance = dst.wrapping_sub(src) % 4096;
    (1..64).contains(&distance)
}

/// How many bytes of a `len`-byte copy from `src` to `dst` (addresses) to hand `memcpy` in
/// one call: all of them, or [`PIECE`] at a slow distance (see [`slow_distance`]). Cutting a
/// copy keeps the distance, so each piece asks again with the same answer.
pub fn piece_len(dst: usize, src: usize, len: usize) -> usize {
    if (CUT_FROM..CUT_BELOW).contains(&len) && slow_distance(dst, src) {
        PIECE
    } else {
        len
    }
}

/// `dst.copy_from_slice(src)`, in pieces at a slow distance (see the module docs).
///
/// # Panics
///
/// If the lengths differ, as `copy_from_slice` does.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bytes: the two slices differ in length");
    let piece = piece_len(dst.as_ptr() as usize, src.as_ptr() as usize, src.len());
    if piece >= src.len() {
        dst.copy_from_slice(src);
        return;
    }
    for (to, from) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
        to.copy_from_slice(from);
    }
}

/// `buf.copy_within(from..from + len, to)`, in pieces at a slow distance when the two ranges
/// do not overlap (an overlapping move keeps `memmove`'s order).
///
/// # Panics
///
/// If either range is out of bounds, as `copy_within` does.
pub fn copy_within(buf: &mut [u8], from: usize, len: usize, to: usize) {
    let overlap = from < to + len && to < from + len;
    let piece = piece_len(to, from, len);
    if overlap || piece >= len {
        buf.copy_within(from..from + len, to);
        return;
    }
    let mut done = 0;
    while done < len {
        let n = piece.min(len - done);
        buf.copy_within(from + done..from + done + n, to + done);
        done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_destination_just_past_the_source_is_slow() {
        assert!(!slow_distance(4096, 4096));
        assert!(slow_distance(4096 + 1, 4096));
        assert!(slow_distance(4096 + 16, 4096));
        assert!(slow_distance(4096 + 63, 4096));
        assert!(!slow_distance(4096 + 64, 4096));
        assert!(!slow_distance(4096 - 16, 4096), "a destination before the source is not");
        assert!(slow_distance(16, 8192 + 4096 * 7), "modulo the page, wherever they are");
        assert!(slow_distance(0x10, 0), "and wrapping");
        assert!(!slow_distance(0, 0x10));
    }

    #[test]
    fn pieces_only_for_mid_sized_copies_at_a_slow_distance() {
        assert_eq!(piece_len(16, 0, 2048), 2048, "small copies never go to rep movsb");
        assert_eq!(piece_len(16, 0, 4096), PIECE);
        assert_eq!(piece_len(16, 0, 256 << 10), PIECE);
        assert_eq!(piece_len(64, 0, 256 << 10), 256 << 10);
        assert_eq!(piece_len(16, 0, 16 << 20), 16 << 20, "huge copies take the non-temporal path");
    }

    /// Copies at every distance of interest and odd lengths land exactly, in place and beside.
    #[test]
    fn copies_are_exact_at_every_distance() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let mut dst = vec![0u8; 50_000];
        for shift in [0usize, 1, 15, 16, 17, 31, 63, 64, 100, 4095] {
            for len in [0usize, 1, 2047, 2048, 2049, 4096, 5000, 33_333] {
                // `at` puts the destination `shift` bytes past the source, modulo the page.
                let at = (src.as_ptr() as usize + shift).wrapping_sub(dst.as_ptr() as usize) % 4096;
                let cut = slow_distance(dst[at..].as_ptr() as usize, src.as_ptr() as usize);
                assert_eq!(cut, (1..64).contains(&shift), "shift {shift}");
                dst.fill(0xEE);
                copy_bytes(&mut dst[at..at + len], &src[..len]);
                assert_eq!(&dst[at..at + len], &src[..len], "shift {shift} len {len}");
                assert!(dst[..at].iter().all(|&b| b == 0xEE));
                assert!(dst[at + len..].iter().all(|&b| b == 0xEE));
            }
        }
    }

    #[test]
    fn copy_within_matches_the_standard_library_also_when_ranges_overlap() {
        let original: Vec<u8> = (0..30_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for (from, len, to) in
            [(0, 10_000, 10_016), (10_016, 10_000, 0), (0, 10_000, 16), (16, 10_000, 0), (5, 0, 9)]
        {
            let mut ours = original.clone();
            let mut theirs = original.clone();
            copy_within(&mut ours, from, len, to);
            theirs.copy_within(from..from + len, to);
            assert_eq!(ours, theirs, "from {from} len {len} to {to}");
        }
    }
}
