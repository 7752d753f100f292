//! The host pool: one anonymous mapping sized at start, and a best-fit
//! allocator of page-aligned ranges in it with coalescing on free.

use memmap2::{MmapMut, MmapOptions};
use std::collections::{BTreeMap, BTreeSet};

/// Alignment and granularity of pool ranges.
pub const POOL_ALIGN: u64 = 4096;

/// The pool's memory.
pub struct PoolMemory {
    map: MmapMut,
    base: *mut u8,
}

// SAFETY: the mapping is plain memory owned by the pool; the cache hands
// each range to at most one writer at a time (an object being written has no
// readers, a readable one no writer).
unsafe impl Send for PoolMemory {}
// SAFETY: as above.
unsafe impl Sync for PoolMemory {}

impl PoolMemory {
    /// Maps `bytes` of anonymous memory; `prefault` touches every page now
    /// so the first stores run at memory speed.
    pub fn new(bytes: u64, prefault: bool) -> std::io::Result<PoolMemory> {
        let mut map = MmapOptions::new().len(bytes as usize).map_anon()?;
        // Huge pages where the kernel allows them (fewer TLB misses in
        // multi-megabyte copies); advisory, and set before the first touch
        // so faults allocate huge pages directly.
        let _ = map.advise(memmap2::Advice::HugePage);
        let base = map.as_mut_ptr();
        if prefault {
            for off in (0..bytes as usize).step_by(4096) {
                // SAFETY: in bounds of the fresh private mapping; writing
                // the zero it already reads as allocates the page.
                unsafe { base.add(off).write_volatile(0) };
            }
        }
        Ok(PoolMemory { map, base })
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The address of byte `off`. The caller keeps `off + len` in bounds.
    pub fn at(&self, off: u64) -> *mut u8 {
        assert!(off <= self.len());
        // SAFETY: in bounds of the mapping (checked above).
        unsafe { self.base.add(off as usize) }
    }
}

/// Best-fit allocator of `POOL_ALIGN`-aligned ranges of `[0, capacity)`.
pub struct PoolAlloc {
    capacity: u64,
    /// Ranges never cross a multiple of this (`u64::MAX`: none).
    segment: u64,
    /// Free ranges by start.
    by_start: BTreeMap<u64, u64>,
    /// Free ranges by (length, start), for best fit.
    by_len: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl PoolAlloc {
    /// An allocator whose ranges never cross a multiple of `segment` (a
    /// multiple of `POOL_ALIGN`, or `u64::MAX`).
    pub fn with_segments(capacity: u64, segment: u64) -> PoolAlloc {
        let capacity = capacity / POOL_ALIGN * POOL_ALIGN;
        let segment = if segment == u64::MAX {
            segment
        } else {
            (segment / POOL_ALIGN * POOL_ALIGN).max(POOL_ALIGN)
        };
        let mut a = PoolAlloc {
            capacity,
            segment,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_bytes: 0,
        };
        let mut start = 0;
        while start < capacity {
            let len = (capacity - start).min(segment);
            a.insert(start, len);
            start += len;
        }
        a
    }

    /// Whether `at` is a segment boundary (ranges are never merged there).
    fn boundary(&self, at: u64) -> bool {
        self.segment != u64::MAX && at % self.segment == 0
    }

    /// Bytes a request of `len` takes.
    pub fn rounded(len: u64) -> u64 {
        len.div_ceil(POOL_ALIGN) * POOL_ALIGN
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// The longest free range.
    pub fn largest_free(&self) -> u64 {
        self.by_len.last().map_or(0, |&(len, _)| len)
    }

    fn insert(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_bytes += len;
    }

    fn remove(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_bytes -= len;
    }

    /// A range of at least `len` bytes (rounded up), or `None`.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let need = Self::rounded(len.max(1));
        let &(flen, start) = self.by_len.range((need, 0)..).next()?;
        self.remove(start, flen);
        if flen > need {
            self.insert(start + need, flen - need);
        }
        Some(start)
    }

    /// Returns a range given by `alloc` (with the same `len`).
    pub fn free(&mut self, start: u64, len: u64) {
        let mut start = start;
        let mut len = Self::rounded(len.max(1));
        debug_assert!(start + len <= self.capacity);
        if let Some((&ps, &pl)) = self.by_start.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "double free");
            if ps + pl == start && !self.boundary(start) {
                self.remove(ps, pl);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.by_start.get(&(start + len)) {
            if !self.boundary(start + len) {
                self.remove(start + len, nl);
                len += nl;
            }
        }
        self.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Allocated ranges never overlap and stay in bounds; freeing all
        /// coalesces back to one range.
        #[test]
        fn ranges_never_overlap_and_coalesce(ops in proptest::collection::vec((1u64..50_000, any::<bool>()), 1..300), segmented in any::<bool>()) {
            let seg = if segmented { 1 << 18 } else { u64::MAX };
            let mut a = PoolAlloc::with_segments(1 << 20, seg);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (len, free) in ops {
                if free && !live.is_empty() {
                    let (s, l) = live.swap_remove(len as usize % live.len());
                    a.free(s, l);
                } else if let Some(s) = a.alloc(len) {
                    let r = PoolAlloc::rounded(len);
                    prop_assert!(s % POOL_ALIGN == 0 && s + r <= a.capacity());
                    if segmented {
                        prop_assert_eq!(s / seg, (s + r - 1) / seg, "crosses a segment");
                    }
                    for &(t, m) in &live {
                        let m = PoolAlloc::rounded(m);
                        prop_assert!(s + r <= t || t + m <= s, "overlap");
                    }
                    live.push((s, len));
                } else {
                    let used: u64 = live.iter().map(|&(_, l)| PoolAlloc::rounded(l)).sum();
                    prop_assert!(a.capacity() - used < PoolAlloc::rounded(len) || a.by_start.len() > 1);
                }
                let used: u64 = live.iter().map(|&(_, l)| PoolAlloc::rounded(l)).sum();
                prop_assert_eq!(a.used(), used);
            }
            for (s, l) in live {
                a.free(s, l);
            }
            prop_assert_eq!(a.by_start.len(), if segmented { 4 } else { 1 });
            prop_assert_eq!(a.used(), 0);
        }
    }
}
