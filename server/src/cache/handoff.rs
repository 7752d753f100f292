//! What the cache hands to the tier below: evicted objects kept for a
//! write-back and stored objects held for a write-through. The cache only
//! records them; the tier's owner takes them and reports back.

use super::{Cache, ObjState, ObjectKey};

/// An evicted object whose pool range is kept until the second tier has
/// it ([`Cache::free_drained`] gives it back).
#[derive(Clone, Copy, Debug)]
pub struct Drained {
    pub key: ObjectKey,
    pub off: u64,
    pub len: u64,
    /// The tier had it when last heard of (written there, or read from
    /// it): written only if the tier no longer has it.
    pub in_l2: bool,
}

impl Cache {
    /// Turns write-back to the second tier on, with at most `budget` bytes
    /// of evicted objects waiting to be written at once.
    pub fn set_writeback(&mut self, budget: u64) {
        self.writeback = Some(budget);
    }

    /// The evicted objects to hand to the second tier (their ranges stay
    /// allocated until [`Cache::free_drained`]), and how many others were
    /// evicted without being kept for it since the last call.
    pub fn take_drained(&mut self) -> (Vec<Drained>, u64) {
        (
            std::mem::take(&mut self.drained),
            std::mem::take(&mut self.drain_refused),
        )
    }

    /// Gives back the range of a drained object (written, or not).
    pub fn free_drained(&mut self, d: &Drained) {
        self.pool.free(d.off, d.len);
        self.draining_bytes -= d.len;
        self.stats.pool_used_bytes = self.pool.used();
    }

    /// Pool bytes in use, less the ranges of evicted objects on their way
    /// to the second tier (what eviction must bring down).
    pub(super) fn used_staying(&self) -> u64 {
        self.pool.used() - self.draining_bytes
    }

    /// Holds each of `objs` that the second tier does not have, for a write
    /// there (write-through): they stay readable and are not evicted until
    /// [`Cache::l2_written`]; [`Cache::take_through`] hands them over.
    pub fn hold_for_l2(&mut self, objs: &[u32]) {
        for &id in objs {
            let Some(o) = self.objects.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            if o.state == ObjState::Ready && !o.in_l2 {
                o.holds += 1;
                self.through.push((id, o.key, o.off, o.len));
            }
        }
    }

    /// The objects [`Cache::hold_for_l2`] held, to write: (object, key,
    /// offset, length).
    pub fn take_through(&mut self) -> Vec<(u32, ObjectKey, u64, u64)> {
        std::mem::take(&mut self.through)
    }

    /// Objects waiting to be handed to the second tier.
    pub fn tier_pending(&self) -> u64 {
        (self.drained.len() + self.through.len()) as u64
    }

    /// Whether evicted or stored objects wait to be handed to the second
    /// tier.
    pub fn tier_work(&self) -> bool {
        !self.drained.is_empty() || !self.through.is_empty() || self.drain_refused > 0
    }

    /// A write held by [`Cache::hold_for_l2`] ended (`ok`: the tier has it).
    pub fn l2_written(&mut self, id: u32, ok: bool) {
        let o = self.obj_mut(id);
        o.holds -= 1;
        o.in_l2 |= ok;
    }
}
