//! What the cache hands to the tiers below: evicted objects kept for a
//! write-back and stored objects held for a write-through, each for the
//! tiers whose mode asks for it. The cache only records them; the tiers'
//! owner takes them and reports back.

use super::{Cache, ObjState, ObjectKey};
use std::collections::HashMap;

/// Where a tier sits below the pool: lookups ask them in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Level {
    /// The local disk tier.
    Disk = 0,
    /// The remote (Valkey/Redis) tier.
    Remote = 1,
}

impl Level {
    /// Every level, in lookup order.
    pub const ALL: [Level; 2] = [Level::Disk, Level::Remote];

    /// The next level down, if any.
    pub fn below(self) -> Option<Level> {
        Level::ALL.get(self as usize + 1).copied()
    }
}

/// A set of levels: the tiers that have an object, or that it goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Levels(u8);

impl Levels {
    pub const NONE: Levels = Levels(0);

    pub fn of(l: Level) -> Levels {
        Levels(1 << l as u8)
    }

    pub fn has(self, l: Level) -> bool {
        self.0 & (1 << l as u8) != 0
    }

    pub fn with(self, l: Level) -> Levels {
        Levels(self.0 | 1 << l as u8)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The levels of both sets.
    pub fn union(self, o: Levels) -> Levels {
        Levels(self.0 | o.0)
    }

    /// The levels in the set, in lookup order.
    pub fn iter(self) -> impl Iterator<Item = Level> {
        Level::ALL.into_iter().filter(move |l| self.has(*l))
    }
}

/// An evicted object whose pool range is kept until each tier in `write`
/// has it, or gave up ([`Cache::free_drained`] once per tier).
#[derive(Clone, Copy, Debug)]
pub struct Drained {
    pub key: ObjectKey,
    pub off: u64,
    pub len: u64,
    /// The tiers to write it to.
    pub write: Levels,
    /// The tiers that had it when last heard of (written there, or read
    /// from there): those write it only if they no longer have it.
    pub had: Levels,
}

/// A stored object held for a write-through to the tier at `level`.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub obj: u32,
    pub key: ObjectKey,
    pub off: u64,
    pub len: u64,
    pub level: Level,
}

/// The cache's side of the tiers: which get what, and what waits.
#[derive(Default)]
pub(super) struct Handoff {
    /// Tiers written when the pool evicts (write-back), and at most how
    /// many bytes of evicted objects wait to be written at once.
    writeback: Levels,
    budget: u64,
    /// Tiers written when an object is stored (write-through).
    through_levels: Levels,
    /// Evicted objects waiting to be handed to the tiers.
    drained: Vec<Drained>,
    /// Writes each kept range still waits for, by pool offset.
    draining: HashMap<u64, u8>,
    /// Bytes of evicted objects whose ranges are kept until written.
    draining_bytes: u64,
    /// Evicted objects not kept for each tier since the last
    /// [`Cache::take_drained`] (too many bytes waiting already).
    refused: [u64; Level::ALL.len()],
    /// Stored objects held for a write-through, not yet handed over.
    through: Vec<Held>,
}

impl Cache {
    /// Sets which tiers are written on eviction (`writeback`, with at most
    /// `budget` bytes of evicted objects waiting at once) and which on a
    /// store (`through`).
    pub fn set_tier_modes(&mut self, writeback: Levels, through: Levels, budget: u64) {
        let h = &mut self.handoff;
        (h.writeback, h.through_levels, h.budget) = (writeback, through, budget);
    }

    /// Evicted object `o` (its range out of the LRU order, still
    /// allocated): kept for the write-back tiers while the bytes waiting
    /// allow. One a tier had when last heard of is only checked for there,
    /// and written again if that tier dropped it meanwhile; past the bound
    /// it is let go, counted as a dropped write only for the tiers that
    /// did not have it.
    /// Returns the tiers that have the object or are given it.
    pub(super) fn drain(&mut self, key: ObjectKey, off: u64, len: u64, had: Levels) -> Levels {
        let h = &mut self.handoff;
        let write = h.writeback;
        if write.is_empty() {
            self.pool.free(off, len);
            had
        } else if h.draining_bytes + len <= h.budget {
            h.draining_bytes += len;
            h.draining.insert(off, write.iter().count() as u8);
            h.drained.push(Drained {
                key,
                off,
                len,
                write,
                had,
            });
            had.union(write)
        } else {
            for l in write.iter().filter(|l| !had.has(*l)) {
                h.refused[l as usize] += 1;
            }
            self.pool.free(off, len);
            had
        }
    }

    /// The evicted objects to hand to the tiers (their ranges stay
    /// allocated until [`Cache::free_drained`]), and how many others were
    /// evicted without being kept for each tier since the last call.
    pub fn take_drained(&mut self) -> (Vec<Drained>, [u64; Level::ALL.len()]) {
        let h = &mut self.handoff;
        (
            std::mem::take(&mut h.drained),
            std::mem::take(&mut h.refused),
        )
    }

    /// One tier is done with a drained object (wrote it, or not): its
    /// range goes back once every tier it went to is.
    pub fn free_drained(&mut self, d: &Drained) {
        let h = &mut self.handoff;
        let left = h.draining.get_mut(&d.off).expect("a drained range");
        *left -= 1;
        if *left == 0 {
            h.draining.remove(&d.off);
            h.draining_bytes -= d.len;
            self.pool.free(d.off, d.len);
            self.stats.pool_used_bytes = self.pool.used();
        }
    }

    /// Pool bytes in use, less the ranges of evicted objects on their way
    /// to the tiers (what eviction must bring down).
    pub(super) fn used_staying(&self) -> u64 {
        self.pool.used() - self.handoff.draining_bytes
    }

    /// Holds each of `objs` for a write to every write-through tier that
    /// does not have it: they stay readable and are not evicted until
    /// [`Cache::tier_written`]; [`Cache::take_through`] hands them over.
    pub fn hold_for_tiers(&mut self, objs: &[u32]) {
        let levels = self.handoff.through_levels;
        if levels.is_empty() {
            return;
        }
        for &id in objs {
            let Some(o) = self.objects.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            if o.state != ObjState::Ready {
                continue;
            }
            for level in levels.iter().filter(|l| !o.in_tiers.has(*l)) {
                o.holds += 1;
                self.handoff.through.push(Held {
                    obj: id,
                    key: o.key,
                    off: o.off,
                    len: o.len,
                    level,
                });
            }
        }
    }

    /// The objects [`Cache::hold_for_tiers`] held, to write.
    pub fn take_through(&mut self) -> Vec<Held> {
        std::mem::take(&mut self.handoff.through)
    }

    /// Objects waiting to be handed to each tier, by level (one pass over
    /// what waits: this runs after every cache operation).
    pub fn tier_pending(&self) -> [u64; Level::ALL.len()] {
        let h = &self.handoff;
        let mut n = [0; Level::ALL.len()];
        for d in &h.drained {
            for l in d.write.iter() {
                n[l as usize] += 1;
            }
        }
        for t in &h.through {
            n[t.level as usize] += 1;
        }
        n
    }

    /// Whether evicted or stored objects wait to be handed to a tier.
    pub fn tier_work(&self) -> bool {
        let h = &self.handoff;
        !h.drained.is_empty() || !h.through.is_empty() || h.refused.iter().any(|n| *n > 0)
    }

    /// A write held by [`Cache::hold_for_tiers`] ended (`ok`: the tier at
    /// `level` has it).
    pub fn tier_written(&mut self, id: u32, level: Level, ok: bool) {
        let o = self.obj_mut(id);
        o.holds -= 1;
        if ok {
            o.in_tiers = o.in_tiers.with(level);
        }
    }
}
