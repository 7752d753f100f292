//! Bulk copies that do not pull the destination into the cache.
//!
//! A chunk copy writes tens of megabytes that the copying thread never reads
//! again. Ordinary stores first read every destination line into the cache
//! (read for ownership) and later write it back: three memory transfers per
//! line instead of two. Non-temporal (streaming) stores write whole lines
//! straight to memory, as a large `memcpy` does; that memcpy is the ceiling
//! a store or retrieve is measured against.
//!
//! A chunk is many runs (pages or rows) at scattered addresses. One piece at a
//! time, a thread keeps too few cache misses in flight to reach memcpy's
//! rate (the hardware prefetcher restarts at every piece); [`copy_pieces`]
//! therefore copies four pieces at once, a line of each in turn: four
//! streams in flight, as memcpy's large-copy loop does over four pages. More
//! than four streams overflow the write-combining buffers and collapse.
//!
//! Streaming stores are weakly ordered: [`fence`] must run after the last
//! one and before the copy is published to another thread or process.

/// Pieces copied side by side.
const WAYS: usize = 4;

/// Copies `n` bytes from each `src` to its `dst` (no two ranges overlap).
///
/// # Safety
/// Every `src` must be valid for `n` reads and every `dst` for `n` writes,
/// and no destination range may overlap any other range.
pub unsafe fn copy_pieces(pieces: &[(*mut u8, *const u8)], n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let aligned = n % 64 == 0 && pieces.iter().all(|(d, _)| (*d as usize) % 16 == 0);
        if aligned {
            let mut groups = pieces.chunks_exact(WAYS);
            for g in &mut groups {
                // SAFETY: the caller's contract; destinations 16-byte
                // aligned and `n` a multiple of 64 (checked above).
                unsafe { copy4_sse2([g[0], g[1], g[2], g[3]], n) };
            }
            for &(d, s) in groups.remainder() {
                // SAFETY: the caller's contract for this one piece; its
                // destination 16-byte aligned and `n` a multiple of 64
                // (checked above).
                unsafe { copy_sse2(d, s, n) };
            }
            return;
        }
    }
    for &(d, s) in pieces {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(s, d, n) };
    }
}

/// Orders every streaming store before what follows (a release store that
/// publishes the copy).
#[inline]
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SFENCE has no memory operands; SSE2 is baseline on x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// One 64-byte line: unaligned loads, streaming stores.
///
/// # Safety
/// 64 bytes readable at `s` and writable at `d`; `d` 16-byte aligned.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn line(d: *mut u8, s: *const u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let (d, s) = (d as *mut __m128i, s as *const __m128i);
    // SAFETY: the function's contract; SSE2 is baseline on x86_64.
    unsafe {
        let a = _mm_loadu_si128(s);
        let b = _mm_loadu_si128(s.add(1));
        let c = _mm_loadu_si128(s.add(2));
        let e = _mm_loadu_si128(s.add(3));
        _mm_stream_si128(d, a);
        _mm_stream_si128(d.add(1), b);
        _mm_stream_si128(d.add(2), c);
        _mm_stream_si128(d.add(3), e);
    }
}

/// # Safety
/// As `copy_pieces`, with `n % 64 == 0` and 16-byte aligned destinations.
#[cfg(target_arch = "x86_64")]
unsafe fn copy4_sse2(p: [(*mut u8, *const u8); WAYS], n: usize) {
    for off in (0..n).step_by(64) {
        for &(d, s) in &p {
            // SAFETY: `off + 64 <= n`, inside every range.
            unsafe { line(d.add(off), s.add(off)) };
        }
    }
}

/// # Safety
/// As `copy4_sse2`, one piece.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_sse2(d: *mut u8, s: *const u8, n: usize) {
    for off in (0..n).step_by(64) {
        // SAFETY: `off + 64 <= n`.
        unsafe { line(d.add(off), s.add(off)) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_piece_exactly_at_any_count_alignment_and_length() {
        let src: Vec<u8> = (0..64_000u32).map(|i| (i * 31 + 7) as u8).collect();
        let mut dst = vec![0u8; 70_000];
        for (count, len, skew) in [
            (7, 1024, 0),
            (4, 640, 0),
            (3, 100, 0),
            (5, 1024, 3),
            (9, 64, 16),
        ] {
            dst.fill(0);
            let base = dst.as_mut_ptr();
            // Destination i at i * (len + 64) + skew; source i at 500 * i.
            let pieces: Vec<(*mut u8, *const u8)> = (0..count)
                .map(|i| {
                    // SAFETY: every offset below stays inside its vector.
                    unsafe { (base.add(i * (len + 64) + skew), src.as_ptr().add(500 * i)) }
                })
                .collect();
            // SAFETY: the ranges are in bounds and disjoint.
            unsafe { super::copy_pieces(&pieces, len) };
            super::fence();
            for i in 0..count {
                let at = i * (len + 64) + skew;
                assert_eq!(
                    &dst[at..at + len],
                    &src[500 * i..500 * i + len],
                    "piece {i}"
                );
                assert!(dst[at + len..at + len + 64 - skew.min(64)]
                    .iter()
                    .all(|&b| b == 0));
            }
        }
    }
}
