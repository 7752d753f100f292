//! The cache's side of pins: which objects a pin covers (found through
//! the stored variants of its model and salt), moving them out of and
//! back into the LRU order, and the pinned counters.

use super::pins::Pins;
use super::{Cache, ObjState, ObjectKey, Pin, PinCount, PinLimits, PinRefusal};

impl Cache {
    /// Pins or unpins object `id` (moving it out of or into the LRU order),
    /// keeping the pinned counters.
    pub(super) fn set_pinned(&mut self, id: u32, pinned: bool) {
        if self.obj(id).pinned == pinned {
            return;
        }
        let ready = self.obj(id).state == ObjState::Ready;
        if pinned && ready {
            self.lru_unlink(id);
        }
        let len = self.obj(id).len;
        self.obj_mut(id).pinned = pinned;
        if pinned {
            self.stats.pinned_objects += 1;
            self.stats.pinned_bytes += len;
        } else {
            self.stats.pinned_objects -= 1;
            self.stats.pinned_bytes -= len;
            if ready {
                self.lru_push_back(id);
            }
        }
    }

    /// The pin bounds (the default: [`DEFAULT_MAX_PINS`] pins, half the
    /// pool's bytes).
    pub fn set_pin_limits(&mut self, limits: PinLimits) {
        self.pins = Pins::new(limits);
    }

    /// Drops `key` from the variants of its model and salt.
    pub(super) fn forget_variant(&mut self, key: &ObjectKey) {
        let ms = (key.model_id, key.salt);
        let Some(vs) = self.variants.get_mut(&ms) else {
            return;
        };
        let v = (key.fingerprint, key.rank_tag);
        if let Some(n) = vs.get_mut(&v) {
            *n -= 1;
            if *n == 0 {
                vs.remove(&v);
                if vs.is_empty() {
                    self.variants.remove(&ms);
                }
            }
        }
    }

    /// The objects `pins` cover: one index probe per pin and stored
    /// (fingerprint, rank) variant of its model and salt.
    pub(super) fn covered(&self, pins: &[Pin]) -> Vec<u32> {
        let mut ids = Vec::new();
        for p in pins {
            let Some(vs) = self.variants.get(&(p.model_id, p.salt)) else {
                continue;
            };
            ids.extend(vs.keys().filter_map(|&(fingerprint, rank_tag)| {
                let key = ObjectKey {
                    model_id: p.model_id,
                    salt: p.salt,
                    fingerprint,
                    rank_tag,
                    hash: p.hash,
                };
                self.index.get(&key).copied()
            }));
        }
        // (A pin named twice covers its objects once.)
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Adds `pins` (those held already stay) and pins every object they
    /// cover, whether it is ready or being written; refused whole (nothing
    /// taken) past the pin bounds.
    pub fn pin(&mut self, pins: &[Pin]) -> Result<PinCount, PinRefusal> {
        let ids = self.covered(pins);
        let adding = ids
            .iter()
            .map(|&id| self.obj(id))
            .filter(|o| !o.pinned)
            .map(|o| o.len)
            .sum();
        self.pins.admit(pins, self.stats.pinned_bytes, adding)?;
        self.pins.insert(pins);
        for &id in &ids {
            self.set_pinned(id, true);
        }
        Ok(self.pin_count(ids.len()))
    }

    /// Removes `pins` (those not held are ignored): their objects become
    /// evictable again, most recently used first.
    pub fn unpin(&mut self, pins: &[Pin]) -> PinCount {
        self.pins.remove(pins);
        let ids = self.covered(pins);
        for &id in &ids {
            self.set_pinned(id, false);
        }
        self.pin_count(ids.len())
    }

    /// The pins held and the objects they keep (`matched`: as given).
    pub fn pin_count(&self, matched: usize) -> PinCount {
        PinCount {
            pins: self.pins.len(),
            objects: self.stats.pinned_objects,
            bytes: self.stats.pinned_bytes,
            matched: matched as u64,
        }
    }

    /// At most `limit` pins after `after` (from the first when `None`), in
    /// order, and whether more follow.
    pub fn pins_page(&self, after: Option<&Pin>, limit: usize) -> (Vec<Pin>, bool) {
        self.pins.page(after, limit)
    }

    /// The pin bounds and the objects stored under a pin over the bytes
    /// bound (cached unpinned) since the start.
    pub fn pin_limits(&self) -> (PinLimits, u64) {
        (self.pins.limits(), self.pins.over_bound())
    }
}
