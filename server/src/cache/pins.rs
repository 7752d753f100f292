//! An operator's pins and their bounds.
//!
//! A pin is a (model, salt, chunk hash) triple ([`Pin`]); the cache pins
//! every object it covers. This holds the set of pins (in order, so that a
//! listing is a page of a range and never a sort of the whole set) and the
//! two bounds an operator sets: how many pins, and how many bytes of
//! objects they may keep. The cache walks its objects; this only counts.

use kvring::kv::ChunkHash;
use std::collections::BTreeSet;
use std::ops::Bound;

/// An operator's pin: the objects of this model, salt and chunk hash (any
/// fingerprint, any rank) are neither evicted nor cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pin {
    pub model_id: u64,
    pub salt: u64,
    pub hash: ChunkHash,
}

/// Most pins a server holds unless told otherwise (`--max-pins`): about
/// 3 MiB of the server's memory when all are held.
pub const DEFAULT_MAX_PINS: u64 = 65_536;

/// Most chunk hashes one pin or unpin call names: the cache's lock is held
/// for one such call about as long as for a lookup of as many chunks.
pub const MAX_PINS_PER_CALL: usize = 256;

/// Most pins one page of a listing gives.
pub const MAX_PINS_PER_PAGE: usize = 1000;

/// How many pins may be held and how many bytes of objects they may keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinLimits {
    pub max_pins: u64,
    pub max_bytes: u64,
}

/// What a pin or unpin left: the pins held, the objects pinned in total and
/// their bytes, and how many objects the call's triples match.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PinCount {
    pub pins: u64,
    pub objects: u64,
    pub bytes: u64,
    pub matched: u64,
}

/// Why a pin call was refused (nothing of it was taken).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PinRefusal {
    #[error("{held} pins are held and the call adds {adding}: at most {max} (--max-pins)")]
    Pins { held: u64, adding: u64, max: u64 },
    #[error(
        "{pinned} bytes of objects are pinned and the call would pin {adding} more: at most {max} (--max-pinned-bytes)"
    )]
    Bytes { pinned: u64, adding: u64, max: u64 },
}

/// The pins held, in order, and their bounds.
#[derive(Debug)]
pub struct Pins {
    set: BTreeSet<Pin>,
    limits: PinLimits,
    /// Objects stored under a pin while the pinned bytes were at their
    /// bound: cached as any other object, not pinned.
    over_bound: u64,
}

impl Pins {
    pub fn new(limits: PinLimits) -> Pins {
        Pins {
            set: BTreeSet::new(),
            limits,
            over_bound: 0,
        }
    }

    pub fn limits(&self) -> PinLimits {
        self.limits
    }

    pub fn len(&self) -> u64 {
        self.set.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    #[cfg(test)]
    pub fn contains(&self, p: &Pin) -> bool {
        self.set.contains(p)
    }

    /// Of `pins`, how many are not held yet (each counted once).
    pub fn new_among(&self, pins: &[Pin]) -> u64 {
        let mut fresh: Vec<&Pin> = pins.iter().filter(|p| !self.set.contains(p)).collect();
        fresh.sort_unstable();
        fresh.dedup();
        fresh.len() as u64
    }

    /// Refuses a call that would hold more pins than the bound, or pin more
    /// bytes (`pinned` now, `adding` more).
    pub fn admit(&self, pins: &[Pin], pinned: u64, adding: u64) -> Result<(), PinRefusal> {
        let (held, new) = (self.len(), self.new_among(pins));
        if held + new > self.limits.max_pins {
            return Err(PinRefusal::Pins {
                held,
                adding: new,
                max: self.limits.max_pins,
            });
        }
        if adding > 0 && pinned + adding > self.limits.max_bytes {
            return Err(PinRefusal::Bytes {
                pinned,
                adding,
                max: self.limits.max_bytes,
            });
        }
        Ok(())
    }

    pub fn insert(&mut self, pins: &[Pin]) {
        self.set.extend(pins.iter().copied());
    }

    pub fn remove(&mut self, pins: &[Pin]) {
        for p in pins {
            self.set.remove(p);
        }
    }

    /// Whether an object of `len` bytes that `p` covers is pinned when
    /// stored, with `pinned` bytes pinned already: yes while the bytes
    /// bound allows, else it is counted as stored over the bound.
    pub fn pins_new_object(&mut self, p: &Pin, pinned: u64, len: u64) -> bool {
        if !self.set.contains(p) {
            return false;
        }
        if pinned + len > self.limits.max_bytes {
            self.over_bound += 1;
            return false;
        }
        true
    }

    /// Objects stored under a pin over the bytes bound, since the start.
    pub fn over_bound(&self) -> u64 {
        self.over_bound
    }

    /// At most `limit` pins after `after` (from the first when `None`), in
    /// order, and whether more follow.
    pub fn page(&self, after: Option<&Pin>, limit: usize) -> (Vec<Pin>, bool) {
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut it = self.set.range((from, Bound::Unbounded)).copied();
        let page: Vec<Pin> = it.by_ref().take(limit).collect();
        let more = it.next().is_some();
        (page, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(i: u8) -> Pin {
        Pin {
            model_id: 1,
            salt: 0,
            hash: [i; 16],
        }
    }

    #[test]
    fn bounds_refuse_a_whole_call_and_count_each_new_pin_once() {
        let mut p = Pins::new(PinLimits {
            max_pins: 3,
            max_bytes: 100,
        });
        p.insert(&[pin(1)]);
        // Two new (one named twice) and one held: 3 in all, admitted.
        assert_eq!(p.new_among(&[pin(2), pin(2), pin(1), pin(3)]), 2);
        assert!(p.admit(&[pin(2), pin(2), pin(1), pin(3)], 0, 0).is_ok());
        assert_eq!(
            p.admit(&[pin(2), pin(3), pin(4)], 0, 0),
            Err(PinRefusal::Pins {
                held: 1,
                adding: 3,
                max: 3
            })
        );
        assert_eq!(
            p.admit(&[pin(1)], 60, 41),
            Err(PinRefusal::Bytes {
                pinned: 60,
                adding: 41,
                max: 100
            })
        );
        // Nothing to add is never refused for bytes (an unpin's room).
        assert!(p.admit(&[pin(1)], 200, 0).is_ok());
        assert!(p.pins_new_object(&pin(1), 60, 40));
        assert!(!p.pins_new_object(&pin(1), 61, 40));
        assert!(!p.pins_new_object(&pin(9), 0, 1));
        assert_eq!(p.over_bound(), 1);
    }

    #[test]
    fn pages_walk_every_pin_once_in_order() {
        let mut p = Pins::new(PinLimits {
            max_pins: 1000,
            max_bytes: 0,
        });
        let all: Vec<Pin> = (0..=250u8).rev().map(pin).collect();
        p.insert(&all);
        let (mut seen, mut after): (Vec<Pin>, Option<Pin>) = (Vec::new(), None);
        loop {
            let (page, more) = p.page(after.as_ref(), 7);
            assert!(page.len() <= 7);
            seen.extend(&page);
            after = page.last().copied();
            if !more {
                break;
            }
        }
        let mut want = all.clone();
        want.sort_unstable();
        assert_eq!(seen, want);
        assert_eq!(p.page(Some(&pin(250)), 7), (vec![], false));
        assert_eq!(p.page(None, 0), (vec![], true));
    }
}
