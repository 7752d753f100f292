//! The cache: chunk objects in the host pool, their index, LRU order,
//! leases, eviction and counters. One mutex guards it; every operation is a
//! short, bounded piece of bookkeeping (no copy happens under it).
//!
//! Object life: `Writing` (allocated by a store, not yet readable: a lookup
//! that reaches it may wait for it, see [`Cache::in_flight`]) ->
//! `Ready` (committed, in LRU order) -> evicted or cleared. An object with
//! holds (a lease's, or a running retrieve's) or being written is never
//! evicted or cleared.
//!
//! A lease is what a LOOKUP took: for each hit chunk and each rank of the
//! world, one hold on the object that rank will retrieve (MLA ranks hold the
//! one shared object once each). A RETRIEVE moves its rank's holds from the
//! lease to its job, so a concurrent FREE_LOOKUP_LOCKS cannot drop an object
//! under a copy; the job drops them when the copy ends. A lease ends when it
//! holds nothing, at END_SESSION, when its owner goes, or at its TTL.
//!
//! A pin (an operator's, `POST /pin` of the HTTP endpoint) is a (model,
//! salt, chunk hash) triple: every object with that model, salt and hash
//! (any fingerprint, any rank) is pinned, now and when stored later, until
//! the triple is unpinned. A pinned object is never evicted or cleared: it
//! leaves the LRU order while pinned (so the eviction walk never meets it)
//! and rejoins it, as most recently used, when unpinned. With no pin held
//! the check is one `is_empty` per stored object. Pinned objects count
//! toward the pool usage the watermarks compare: a pool full of pinned
//! objects gives a store no space (`store_no_space_chunks`).
//!
//! Pins are bounded ([`PinLimits`]): a call that would hold more pins, or
//! pin more bytes, than the operator allows is refused whole; an object
//! stored later under a pin while the pinned bytes are at their bound is
//! cached unpinned (counted). A pin call finds the objects of each triple
//! through the (fingerprint, rank) variants stored for its model and salt,
//! one index probe each, never by walking every object: it holds the lock
//! about as long as a lookup of as many chunks.

use super::events::{EventQueue, Record};
use super::pool::PoolAlloc;
use kvring::jobs::JobId;
use kvring::kv::ChunkHash;
use kvring::proto::kv::StatsReply;
use std::collections::HashMap;
use std::sync::Arc;

mod eviction;
mod handoff;
mod leases;
mod lru;
mod pinning;
mod pins;
mod store;

pub use handoff::{Drained, Level, Levels};
use leases::Lease;
pub use leases::{LeaseError, LeaseMeta};
use pins::Pins;
pub use pins::{
    Pin, PinCount, PinLimits, PinRefusal, DEFAULT_MAX_PINS, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE,
};

/// Identity of a stored chunk object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    pub model_id: u64,
    pub salt: u64,
    pub fingerprint: u64,
    pub rank_tag: u32,
    pub hash: ChunkHash,
}

impl Pin {
    /// The pin that covers `key`.
    pub fn of(key: &ObjectKey) -> Pin {
        Pin {
            model_id: key.model_id,
            salt: key.salt,
            hash: key.hash,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ObjState {
    Writing,
    Ready,
}

const NIL: u32 = u32::MAX;

struct Object {
    key: ObjectKey,
    off: u64,
    len: u64,
    state: ObjState,
    /// Lease and retrieve holds.
    holds: u32,
    /// A pin covers it: out of the LRU order, never evicted or cleared.
    pinned: bool,
    /// The tiers known to have it (written there, or read from there).
    in_tiers: Levels,
    prev: u32,
    next: u32,
}

pub struct Cache {
    pool: PoolAlloc,
    objects: Vec<Option<Object>>,
    free_ids: Vec<u32>,
    index: HashMap<ObjectKey, u32>,
    lru_head: u32,
    lru_tail: u32,
    leases: HashMap<JobId, (LeaseMeta, Lease)>,
    /// The operator's pins (see the module doc).
    pins: Pins,
    /// For each (model, salt) stored: its objects' (fingerprint, rank tag)
    /// variants, with how many objects each has (a pin's objects are found
    /// through these).
    variants: HashMap<(u64, u64), HashMap<(u64, u32), u64>>,
    high_water: u64,
    low_water: u64,
    pub stats: StatsReply,
    /// What goes to the tiers below, and what waits for them.
    handoff: handoff::Handoff,
    /// The event stream's queue (`--kv-events`): an object that becomes
    /// readable or leaves the pool is pushed there, under this lock.
    events: Option<Arc<EventQueue>>,
}

impl Cache {
    /// A cache over a pool of `capacity` bytes that evicts down to
    /// `low_water` once usage passes `high_water` (fractions of capacity).
    /// No object spans a multiple of `segment` bytes (pool registrations
    /// of the CUDA backend); `u64::MAX`: no such boundary.
    pub fn new(capacity: u64, high: f64, low: f64, segment: u64) -> Cache {
        let pool = PoolAlloc::with_segments(capacity, segment);
        let cap = pool.capacity() as f64;
        Cache {
            stats: StatsReply {
                pool_bytes: pool.capacity(),
                ..Default::default()
            },
            pool,
            objects: Vec::new(),
            free_ids: Vec::new(),
            index: HashMap::new(),
            lru_head: NIL,
            lru_tail: NIL,
            leases: HashMap::new(),
            pins: Pins::new(PinLimits {
                max_pins: DEFAULT_MAX_PINS,
                max_bytes: cap as u64 / 2,
            }),
            variants: HashMap::new(),
            high_water: (cap * high) as u64,
            low_water: (cap * low) as u64,
            handoff: handoff::Handoff::default(),
            events: None,
        }
    }

    /// Pushes what happens to objects to `events` from now on.
    pub fn set_events(&mut self, events: Arc<EventQueue>) {
        self.events = Some(events);
    }

    /// Tells the event stream, if any, of `r`.
    fn event(&self, r: impl FnOnce() -> Record) {
        if let Some(q) = &self.events {
            q.push(r());
        }
    }

    /// The keys of every readable object (an event stream's resync).
    pub fn ready_keys(&self) -> Vec<ObjectKey> {
        self.objects
            .iter()
            .flatten()
            .filter(|o| o.state == ObjState::Ready)
            .map(|o| o.key)
            .collect()
    }

    fn obj(&self, id: u32) -> &Object {
        self.objects[id as usize].as_ref().expect("live object")
    }

    fn obj_mut(&mut self, id: u32) -> &mut Object {
        self.objects[id as usize].as_mut().expect("live object")
    }

    fn remove_object(&mut self, id: u32) {
        let o = self.unlink_object(id);
        if o.state == ObjState::Ready {
            self.event(|| Record::Removed {
                key: o.key,
                to: o.in_tiers,
            });
        }
        self.pool.free(o.off, o.len);
        self.stats.pool_used_bytes = self.pool.used();
    }

    /// Takes object `id` out of the cache (its range is the caller's).
    fn unlink_object(&mut self, id: u32) -> Object {
        if self.in_lru(id) {
            self.lru_unlink(id);
        }
        let o = self.objects[id as usize].take().expect("live object");
        if o.pinned {
            self.stats.pinned_objects -= 1;
            self.stats.pinned_bytes -= o.len;
        }
        self.index.remove(&o.key);
        self.forget_variant(&o.key);
        self.free_ids.push(id);
        self.stats.objects -= 1;
        o
    }

    /// Holds on an object (tests).
    #[cfg(test)]
    pub fn holds_of(&self, key: &ObjectKey) -> Option<u32> {
        self.index.get(key).map(|&o| self.obj(o).holds)
    }
}

#[cfg(test)]
mod tests;
