//! Eviction: least recently used objects without holds, walked in LRU
//! order, to make room for a store, to bring usage under the watermarks,
//! or at an operator's call; with write-back, an evicted object keeps its
//! range until the tiers below have it ([`super::handoff`]).

use super::{Cache, NIL};
use crate::pool::PoolAlloc;

impl Cache {
    /// Evicts object `id`: with write-back, it keeps its range until the
    /// tiers below have it ([`Cache::drain`]).
    pub(super) fn evict_object(&mut self, id: u32) {
        let o = self.unlink_object(id);
        let to = self.drain(o.key, o.off, o.len, o.in_tiers);
        if o.state == super::ObjState::Ready {
            self.event(|| super::Record::Removed { key: o.key, to });
        }
        self.stats.pool_used_bytes = self.pool.used();
        self.stats.evicted_objects += 1;
        self.stats.evicted_bytes += o.len;
    }

    /// Evicts least recently used objects without holds until `pred` says
    /// stop or nothing evictable is left. Returns whether `pred` was met.
    /// Pinned objects are not in the LRU order: the walk never meets them,
    /// and it ends at the order's end whatever they are.
    pub(super) fn evict_until(&mut self, mut enough: impl FnMut(&Cache) -> bool) -> bool {
        let mut cur = self.lru_head;
        while !enough(self) {
            if cur == NIL {
                return false;
            }
            let next = self.obj(cur).next;
            if self.obj(cur).holds == 0 {
                self.evict_object(cur);
            }
            cur = next;
        }
        true
    }

    /// A pool range of `len` bytes, evicting unheld objects (least recently
    /// used first) until one fits.
    pub(super) fn alloc(&mut self, len: u64) -> Option<u64> {
        if let Some(off) = self.pool.alloc(len) {
            return Some(off);
        }
        let need = PoolAlloc::rounded(len);
        if self.evict_until(|c| c.pool.largest_free() >= need) {
            self.pool.alloc(len)
        } else {
            None
        }
    }

    /// After a store allocated: evict down to the low watermark once usage
    /// passed the high one.
    pub(super) fn watermark(&mut self) {
        if self.used_staying() > self.high_water {
            let low = self.low_water;
            self.evict_until(|c| c.used_staying() <= low);
        }
    }

    /// Evicts at least `bytes` bytes of objects without holds or pins,
    /// least recently used first (fewer when no more are evictable). Returns
    /// (objects, bytes) evicted.
    pub fn evict_bytes(&mut self, bytes: u64) -> (u64, u64) {
        let (objects, start) = (self.stats.evicted_objects, self.stats.evicted_bytes);
        self.evict_until(|c| c.stats.evicted_bytes - start >= bytes);
        (
            self.stats.evicted_objects - objects,
            self.stats.evicted_bytes - start,
        )
    }

    /// CLEAR: drops every ready object without holds that no pin covers.
    /// Returns (objects, bytes).
    pub fn clear(&mut self) -> (u64, u64) {
        let (mut n, mut bytes) = (0, 0);
        let mut cur = self.lru_head;
        while cur != NIL {
            let next = self.obj(cur).next;
            if self.obj(cur).holds == 0 {
                bytes += self.obj(cur).len;
                self.remove_object(cur);
                n += 1;
            }
            cur = next;
        }
        (n, bytes)
    }
}
