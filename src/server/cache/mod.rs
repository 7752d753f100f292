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

use super::pool::PoolAlloc;
use super::registry::{rank_tag, Group, SHARED_RANK};
use crate::jobs::JobId;
use crate::kv::ChunkHash;
use crate::proto::kv::StatsReply;
use std::collections::HashMap;
use std::time::Instant;

mod pins;
pub use pins::{
    Pin, PinCount, PinLimits, PinRefusal, DEFAULT_MAX_PINS, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE,
};
use pins::Pins;

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
    /// Known to be in the second tier (written there, or read from it).
    in_l2: bool,
    prev: u32,
    next: u32,
}

struct Lease {
    owner_slot: u32,
    expires: Instant,
    /// `holds[chunk][rank]`: the object that rank may retrieve, while held.
    holds: Vec<Vec<Option<u32>>>,
    held: usize,
}

/// A chunk a store will write: the object and where it lives in the pool.
#[derive(Clone, Copy, Debug)]
pub struct Planned {
    pub chunk: u32,
    pub obj: u32,
    pub off: u64,
}

/// What a store request turned into.
#[derive(Debug, Default)]
pub struct StorePlan {
    pub write: Vec<Planned>,
    /// Chunks already stored (or being stored by someone else).
    pub present: u32,
    /// Chunks that got no space (everything else was held or being written).
    pub no_space: u32,
}

/// Why a retrieve cannot use a lease.
#[derive(Debug, PartialEq, Eq)]
pub enum LeaseError {
    /// No such lease (never taken, ended, or expired).
    NoLease,
    /// The lease does not cover these chunks for this rank (not hit,
    /// already retrieved or freed).
    NotHeld,
    /// The lease was taken for another model, world size or salt.
    Mismatch,
    /// The lease belongs to another engine.
    Foreign,
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
    /// Write-back to the second tier: evicted objects not known to be
    /// there keep their range until written (at most this many bytes at
    /// once; `None`: no write-back).
    writeback: Option<u64>,
    /// Evicted objects waiting to be handed to the second tier.
    drained: Vec<Drained>,
    /// Bytes of evicted objects whose ranges are kept until written.
    draining_bytes: u64,
    /// Evicted objects not kept for the second tier since the last
    /// [`Cache::take_drained`] (too many bytes waiting already).
    drain_refused: u64,
    /// Stored objects held for a write-through to the second tier, not yet
    /// handed to it: (object, key, offset, length).
    through: Vec<(u32, ObjectKey, u64, u64)>,
}

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

/// What a lease was taken for; a retrieve must match it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseMeta {
    /// The engine whose client took it (`kv::engine_key`; zero: the
    /// anonymous engine): only its clients may use, free or end it.
    pub engine: [u8; 32],
    pub model_id: u64,
    pub world_size: u32,
    pub salt: u64,
    pub fingerprint: u64,
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
            writeback: None,
            drained: Vec::new(),
            through: Vec::new(),
            draining_bytes: 0,
            drain_refused: 0,
        }
    }

    fn obj(&self, id: u32) -> &Object {
        self.objects[id as usize].as_ref().expect("live object")
    }

    fn obj_mut(&mut self, id: u32) -> &mut Object {
        self.objects[id as usize].as_mut().expect("live object")
    }

    fn lru_unlink(&mut self, id: u32) {
        let (p, n) = {
            let o = self.obj(id);
            (o.prev, o.next)
        };
        if p == NIL {
            if self.lru_head == id {
                self.lru_head = n;
            }
        } else {
            self.obj_mut(p).next = n;
        }
        if n == NIL {
            if self.lru_tail == id {
                self.lru_tail = p;
            }
        } else {
            self.obj_mut(n).prev = p;
        }
        let o = self.obj_mut(id);
        o.prev = NIL;
        o.next = NIL;
    }

    fn lru_push_back(&mut self, id: u32) {
        let tail = self.lru_tail;
        {
            let o = self.obj_mut(id);
            o.prev = tail;
            o.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.obj_mut(tail).next = id;
        }
        self.lru_tail = id;
    }

    /// Whether the object is in the LRU order: ready and not pinned.
    fn in_lru(&self, id: u32) -> bool {
        let o = self.obj(id);
        o.state == ObjState::Ready && !o.pinned
    }

    /// Marks a ready object recently used.
    fn touch(&mut self, id: u32) {
        if self.in_lru(id) {
            self.lru_unlink(id);
            self.lru_push_back(id);
        }
    }

    fn remove_object(&mut self, id: u32) {
        let o = self.unlink_object(id);
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

    /// Evicts object `id`: with write-back, it keeps its range until the
    /// second tier has it (while the bytes waiting allow). One the tier had
    /// when last heard of is only checked for there, and written again if
    /// the store has evicted it meanwhile; past the bound it is let go
    /// uncounted, as the tier most likely has it.
    fn evict_object(&mut self, id: u32) {
        let o = self.unlink_object(id);
        match self.writeback {
            Some(budget) if self.draining_bytes + o.len <= budget => {
                self.draining_bytes += o.len;
                self.drained.push(Drained {
                    key: o.key,
                    off: o.off,
                    len: o.len,
                    in_l2: o.in_l2,
                });
            }
            Some(_) if !o.in_l2 => {
                self.drain_refused += 1;
                self.pool.free(o.off, o.len);
            }
            _ => self.pool.free(o.off, o.len),
        }
        self.stats.pool_used_bytes = self.pool.used();
        self.stats.evicted_objects += 1;
        self.stats.evicted_bytes += o.len;
    }

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
    fn used_staying(&self) -> u64 {
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

    /// Pins or unpins object `id` (moving it out of or into the LRU order),
    /// keeping the pinned counters.
    fn set_pinned(&mut self, id: u32, pinned: bool) {
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

    /// Evicts least recently used objects without holds until `pred` says
    /// stop or nothing evictable is left. Returns whether `pred` was met.
    /// Pinned objects are not in the LRU order: the walk never meets them,
    /// and it ends at the order's end whatever they are.
    fn evict_until(&mut self, mut enough: impl FnMut(&Cache) -> bool) -> bool {
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
    fn alloc(&mut self, len: u64) -> Option<u64> {
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
    fn watermark(&mut self) {
        if self.used_staying() > self.high_water {
            let low = self.low_water;
            self.evict_until(|c| c.used_staying() <= low);
        }
    }

    /// Plans a store of `keys` (one per chunk, `len` bytes each): chunks
    /// already present are skipped, the others get a `Writing` object.
    pub fn plan_store(&mut self, keys: &[ObjectKey], len: u64) -> StorePlan {
        let plan = self.plan_objects(keys, len);
        self.stats.stores += 1;
        self.stats.store_no_space_chunks += u64::from(plan.no_space);
        plan
    }

    /// Objects for `keys` as [`Cache::plan_store`] makes them, counted as
    /// no store (the second tier's loads).
    pub fn plan_objects(&mut self, keys: &[ObjectKey], len: u64) -> StorePlan {
        let mut plan = StorePlan::default();
        for (i, key) in keys.iter().enumerate() {
            if let Some(&id) = self.index.get(key) {
                self.touch(id);
                plan.present += 1;
                continue;
            }
            let Some(off) = self.alloc(len) else {
                plan.no_space += 1;
                continue;
            };
            // No pin held: no set lookup.
            let pinned = !self.pins.is_empty()
                && self
                    .pins
                    .pins_new_object(&Pin::of(key), self.stats.pinned_bytes, len);
            let o = Object {
                key: *key,
                off,
                len,
                state: ObjState::Writing,
                holds: 0,
                pinned,
                in_l2: false,
                prev: NIL,
                next: NIL,
            };
            let id = match self.free_ids.pop() {
                Some(id) => {
                    self.objects[id as usize] = Some(o);
                    id
                }
                None => {
                    self.objects.push(Some(o));
                    (self.objects.len() - 1) as u32
                }
            };
            self.index.insert(*key, id);
            *self
                .variants
                .entry((key.model_id, key.salt))
                .or_default()
                .entry((key.fingerprint, key.rank_tag))
                .or_default() += 1;
            self.stats.objects += 1;
            if pinned {
                self.stats.pinned_objects += 1;
                self.stats.pinned_bytes += len;
            }
            plan.write.push(Planned {
                chunk: i as u32,
                obj: id,
                off,
            });
        }
        self.stats.pool_used_bytes = self.pool.used();
        self.watermark();
        plan
    }

    /// Ends a store: its objects become readable (`ok`) or are dropped.
    pub fn finish_store(&mut self, objs: &[u32], ok: bool, bytes: u64) {
        self.finish_objects(objs, ok, false);
        if ok {
            self.stats.stored_chunks += objs.len() as u64;
            self.stats.stored_bytes += bytes;
        }
    }

    /// Ends objects planned with [`Cache::plan_objects`]: readable (`ok`;
    /// `in_l2`: read from the second tier) or dropped.
    pub fn finish_objects(&mut self, objs: &[u32], ok: bool, in_l2: bool) {
        for &id in objs {
            if ok {
                self.obj_mut(id).in_l2 = in_l2;
            }
            if ok {
                self.obj_mut(id).state = ObjState::Ready;
                if !self.obj(id).pinned {
                    self.lru_push_back(id);
                }
            } else {
                self.remove_object(id);
            }
        }
        self.watermark();
    }

    /// The keys of chunk `hash` for every rank of `group` (one when the
    /// ranks share their objects), in rank order.
    pub fn rank_keys(meta: &LeaseMeta, group: Group, hash: ChunkHash) -> Vec<ObjectKey> {
        let world = meta.world_size;
        (0..world)
            .map(|rank| ObjectKey {
                model_id: meta.model_id,
                salt: meta.salt,
                fingerprint: group.fingerprint,
                rank_tag: rank_tag(
                    world,
                    if group.shared_objects {
                        SHARED_RANK
                    } else {
                        rank
                    },
                ),
                hash,
            })
            .collect()
    }

    /// The ready objects of the longest prefix of `hashes` stored for every
    /// rank of `group`: per chunk, per rank (no hold taken).
    pub fn ready_prefix(
        &self,
        meta: &LeaseMeta,
        group: Group,
        hashes: &[ChunkHash],
    ) -> Vec<Vec<Option<u32>>> {
        let mut rows = Vec::new();
        for h in hashes {
            let row: Option<Vec<Option<u32>>> = Self::rank_keys(meta, group, *h)
                .iter()
                .map(|key| match self.index.get(key) {
                    Some(&o) if self.obj(o).state == ObjState::Ready => Some(Some(o)),
                    _ => None,
                })
                .collect();
            match row {
                Some(r) => rows.push(r),
                None => break,
            }
        }
        rows
    }

    /// Whether chunk `hash` is being written for `group`: an object of it
    /// exists for every rank and at least one is still `Writing` (a store,
    /// or a read from the second tier, under way). A lookup that stops at
    /// such a chunk may wait for it rather than miss it.
    pub fn in_flight(&self, meta: &LeaseMeta, group: Group, hash: ChunkHash) -> bool {
        let mut writing = false;
        for key in Self::rank_keys(meta, group, hash) {
            match self.index.get(&key) {
                Some(&o) => writing |= self.obj(o).state == ObjState::Writing,
                None => return false,
            }
        }
        writing
    }

    /// Longest prefix of `hashes` whose objects are ready for every rank of
    /// `group`; takes a lease `id` on the hits (owned by `owner`).
    #[allow(clippy::too_many_arguments)]
    pub fn lookup(
        &mut self,
        id: JobId,
        owner: u32,
        meta: LeaseMeta,
        group: Group,
        hashes: &[ChunkHash],
        ttl: std::time::Duration,
        now: Instant,
    ) -> u32 {
        let holds = self.ready_prefix(&meta, group, hashes);
        let world = meta.world_size;
        let hits = holds.len() as u32;
        for row in &holds {
            for o in row.iter().flatten() {
                self.obj_mut(*o).holds += 1;
                self.touch(*o);
            }
        }
        self.stats.lookups += 1;
        self.stats.lookup_chunks += hashes.len() as u64;
        self.stats.lookup_hit_chunks += u64::from(hits);
        if hits > 0 {
            let held = holds.len() * world as usize;
            self.leases.insert(
                id,
                (
                    meta,
                    Lease {
                        owner_slot: owner,
                        expires: now + ttl,
                        holds,
                        held,
                    },
                ),
            );
            self.stats.leases = self.leases.len() as u64;
        }
        hits
    }

    /// Moves `rank`'s holds on chunks `first .. first + n` of lease `id` to
    /// a retrieve: all of them or none. Returns the objects (and offsets).
    pub fn take_for_retrieve(
        &mut self,
        id: JobId,
        engine: &[u8; 32],
        meta_check: impl FnOnce(&LeaseMeta) -> bool,
        rank: u32,
        first: u32,
        n: u32,
    ) -> Result<Vec<(u32, u64)>, LeaseError> {
        let Some((meta, lease)) = self.leases.get_mut(&id) else {
            return Err(LeaseError::NoLease);
        };
        if meta.engine != *engine {
            return Err(LeaseError::Foreign);
        }
        if !meta_check(meta) {
            return Err(LeaseError::Mismatch);
        }
        let end = first.checked_add(n).ok_or(LeaseError::NotHeld)? as usize;
        if end > lease.holds.len() || rank as usize >= meta.world_size as usize {
            return Err(LeaseError::NotHeld);
        }
        let rows = &mut lease.holds[first as usize..end];
        if rows.iter().any(|r| r[rank as usize].is_none()) {
            return Err(LeaseError::NotHeld);
        }
        let ids: Vec<u32> = rows
            .iter_mut()
            .map(|r| r[rank as usize].take().expect("checked"))
            .collect();
        lease.held -= ids.len();
        let empty = lease.held == 0;
        if empty {
            self.leases.remove(&id);
            self.stats.leases = self.leases.len() as u64;
        }
        // The holds now belong to the retrieve (dropped by `finish_retrieve`).
        Ok(ids.into_iter().map(|o| (o, self.obj(o).off)).collect())
    }

    /// Ends a retrieve: drops its holds.
    pub fn finish_retrieve(&mut self, objs: &[u32], ok: bool, bytes: u64) {
        for &o in objs {
            self.obj_mut(o).holds -= 1;
        }
        self.stats.retrieves += 1;
        if ok {
            self.stats.retrieved_chunks += objs.len() as u64;
            self.stats.retrieved_bytes += bytes;
        }
    }

    fn drop_holds(&mut self, lease: &mut Lease, rows: std::ops::Range<usize>, touch: bool) {
        for r in rows {
            for h in lease.holds[r].iter_mut() {
                if let Some(o) = h.take() {
                    self.obj_mut(o).holds -= 1;
                    if touch {
                        self.touch(o);
                    }
                    lease.held -= 1;
                }
            }
        }
    }

    /// Lease `id`, if the client's `engine` may act on it.
    fn lease_of(&self, id: JobId, engine: &[u8; 32]) -> Result<(), LeaseError> {
        match self.leases.get(&id) {
            None => Err(LeaseError::NoLease),
            Some((m, _)) if m.engine != *engine => Err(LeaseError::Foreign),
            Some(_) => Ok(()),
        }
    }

    /// FREE_LOOKUP_LOCKS: drops lease `id`'s holds on chunks `first ..
    /// first + n` (clamped to the lease), for a client of `engine`.
    pub fn free_locks(
        &mut self,
        id: JobId,
        engine: &[u8; 32],
        first: u32,
        n: u32,
    ) -> Result<(), LeaseError> {
        self.lease_of(id, engine)?;
        let Some((meta, mut lease)) = self.leases.remove(&id) else {
            return Err(LeaseError::NoLease);
        };
        let len = lease.holds.len();
        let a = (first as usize).min(len);
        let b = (first as usize).saturating_add(n as usize).min(len);
        self.drop_holds(&mut lease, a..b, false);
        if lease.held > 0 {
            self.leases.insert(id, (meta, lease));
        }
        self.stats.leases = self.leases.len() as u64;
        Ok(())
    }

    /// END_SESSION: drops everything lease `id` holds, marking its objects
    /// recently used, for a client of `engine`.
    pub fn end_session(&mut self, id: JobId, engine: &[u8; 32]) -> Result<(), LeaseError> {
        self.lease_of(id, engine)?;
        let Some((_, mut lease)) = self.leases.remove(&id) else {
            return Err(LeaseError::NoLease);
        };
        let n = lease.holds.len();
        self.drop_holds(&mut lease, 0..n, true);
        self.stats.leases = self.leases.len() as u64;
        Ok(())
    }

    /// Drops the leases of a departed client, and leases past their TTL.
    /// Returns how many leases ended.
    pub fn drop_leases(&mut self, owner_slot: Option<u32>, now: Instant) -> usize {
        let ended: Vec<JobId> = self
            .leases
            .iter()
            .filter(|(_, (_, l))| Some(l.owner_slot) == owner_slot || l.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &ended {
            let (_, mut lease) = self.leases.remove(id).expect("listed");
            if lease.expires <= now && Some(lease.owner_slot) != owner_slot {
                self.stats.leases_expired += 1;
            }
            let n = lease.holds.len();
            self.drop_holds(&mut lease, 0..n, false);
        }
        self.stats.leases = self.leases.len() as u64;
        ended.len()
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

    /// The pin bounds (the default: [`DEFAULT_MAX_PINS`] pins, half the
    /// pool's bytes).
    pub fn set_pin_limits(&mut self, limits: PinLimits) {
        self.pins = Pins::new(limits);
    }

    /// Drops `key` from the variants of its model and salt.
    fn forget_variant(&mut self, key: &ObjectKey) {
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
    fn covered(&self, pins: &[Pin]) -> Vec<u32> {
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

    /// Holds on an object (tests).
    #[cfg(test)]
    pub fn holds_of(&self, key: &ObjectKey) -> Option<u32> {
        self.index.get(key).map(|&o| self.obj(o).holds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const LEN: u64 = 4096;

    fn key(i: u8, rank: u32) -> ObjectKey {
        ObjectKey {
            model_id: 1,
            salt: 0,
            fingerprint: 9,
            rank_tag: rank_tag(2, rank),
            hash: [i; 16],
        }
    }

    fn meta() -> LeaseMeta {
        LeaseMeta {
            engine: [0; 32],
            model_id: 1,
            world_size: 2,
            salt: 0,
            fingerprint: 9,
        }
    }

    fn group() -> Group {
        Group {
            fingerprint: 9,
            object_bytes: LEN,
            shared_objects: false,
            members: 2,
        }
    }

    /// Stores chunks `ids` for both ranks and commits them.
    fn stored(c: &mut Cache, ids: &[u8]) {
        for rank in 0..2 {
            let keys: Vec<ObjectKey> = ids.iter().map(|&i| key(i, rank)).collect();
            let plan = c.plan_store(&keys, LEN);
            let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
            c.finish_store(&objs, true, LEN * objs.len() as u64);
        }
    }

    fn lease(n: u64) -> JobId {
        JobId::new(1, n as u32, 1)
    }

    #[test]
    fn a_chunk_is_in_flight_while_every_rank_has_it_and_one_is_written() {
        let mut c = Cache::new(64 * LEN, 1.0, 1.0, u64::MAX);
        let h = [7u8; 16];
        let (m, g) = (meta(), group());
        assert!(!c.in_flight(&m, g, h), "absent");
        let r0 = c.plan_store(&[key(7, 0)], LEN).write[0].obj;
        assert!(!c.in_flight(&m, g, h), "rank 1 has no object: nothing to wait for");
        let r1 = c.plan_store(&[key(7, 1)], LEN).write[0].obj;
        assert!(c.in_flight(&m, g, h), "both written");
        c.finish_store(&[r0], true, LEN);
        assert!(c.in_flight(&m, g, h), "rank 1 still written");
        assert!(c.ready_prefix(&m, g, &[h]).is_empty());
        c.finish_store(&[r1], true, LEN);
        assert!(!c.in_flight(&m, g, h), "ready");
        assert_eq!(c.ready_prefix(&m, g, &[h]).len(), 1);
        // A store that fails drops its object: nothing in flight any more.
        let h2 = [8u8; 16];
        let objs: Vec<u32> = (0..2)
            .map(|r| c.plan_store(&[key(8, r)], LEN).write[0].obj)
            .collect();
        assert!(c.in_flight(&m, g, h2));
        c.finish_store(&objs, false, 0);
        assert!(!c.in_flight(&m, g, h2));
    }

    #[test]
    fn holds_move_from_lease_to_retrieve_and_end_once() {
        let mut c = Cache::new(64 * LEN, 1.0, 1.0, u64::MAX);
        stored(&mut c, &[1, 2, 3]);
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        let hashes = [[1u8; 16], [2; 16], [4; 16]];
        assert_eq!(c.lookup(lease(1), 5, meta(), group(), &hashes, ttl, now), 2);
        assert_eq!(c.holds_of(&key(1, 0)), Some(1));
        assert_eq!(c.holds_of(&key(3, 0)), Some(0), "not part of the prefix");
        let got = c
            .take_for_retrieve(lease(1), &[0; 32], |m| *m == meta(), 0, 0, 2)
            .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(c.holds_of(&key(1, 0)), Some(1), "now the retrieve's hold");
        assert_eq!(
            c.take_for_retrieve(lease(1), &[0; 32], |_| true, 0, 0, 1),
            Err(LeaseError::NotHeld),
            "used once"
        );
        // Freeing the lease does not drop the retrieve's holds.
        assert!(c.free_locks(lease(1), &[0; 32], 0, u32::MAX).is_ok());
        assert_eq!(c.holds_of(&key(1, 0)), Some(1));
        assert_eq!(c.holds_of(&key(1, 1)), Some(0));
        let objs: Vec<u32> = got.iter().map(|g| g.0).collect();
        c.finish_retrieve(&objs, true, 2 * LEN);
        assert_eq!(c.holds_of(&key(1, 0)), Some(0));
        assert_eq!(c.stats.leases, 0);
        assert_eq!(
            c.take_for_retrieve(lease(1), &[0; 32], |_| true, 1, 0, 1),
            Err(LeaseError::NoLease)
        );
    }

    #[test]
    fn held_and_unwritten_objects_survive_eviction_and_clear() {
        let mut c = Cache::new(8 * LEN, 1.0, 1.0, u64::MAX);
        stored(&mut c, &[1, 2, 3]); // 6 objects
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        assert_eq!(
            c.lookup(lease(1), 5, meta(), group(), &[[1u8; 16]], ttl, now),
            1
        );
        // Six more objects need space: only the four unheld ones give way.
        let keys: Vec<ObjectKey> = (10..16).map(|i| key(i, 0)).collect();
        let plan = c.plan_store(&keys, LEN);
        assert_eq!((plan.write.len(), plan.no_space), (6, 0));
        assert_eq!(c.holds_of(&key(1, 0)), Some(1));
        assert_eq!(c.holds_of(&key(2, 0)), None, "evicted");
        // Full of held and writing objects: a new store gets no space.
        let more = c.plan_store(&[key(20, 0)], LEN);
        assert_eq!((more.write.len(), more.no_space), (0, 1));
        assert_eq!(c.clear(), (0, 0), "nothing clearable");
        let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
        c.finish_store(&objs, true, 0);
        assert_eq!(c.clear().0, 6);
        // The owner goes: its leases end and the rest can go too.
        assert_eq!(c.drop_leases(Some(5), now), 1);
        assert_eq!(c.clear().0, 2);
        assert_eq!(c.stats.pool_used_bytes, 0);
    }

    #[test]
    fn leases_expire_at_their_ttl() {
        let mut c = Cache::new(8 * LEN, 1.0, 1.0, u64::MAX);
        stored(&mut c, &[1]);
        let now = Instant::now();
        c.lookup(
            lease(1),
            5,
            meta(),
            group(),
            &[[1u8; 16]],
            Duration::from_secs(1),
            now,
        );
        assert_eq!(c.drop_leases(None, now), 0);
        assert_eq!(c.drop_leases(None, now + Duration::from_secs(2)), 1);
        assert_eq!(c.stats.leases_expired, 1);
        assert_eq!(c.holds_of(&key(1, 0)), Some(0));
    }

    fn pin(i: u8) -> Pin {
        Pin {
            model_id: 1,
            salt: 0,
            hash: [i; 16],
        }
    }

    /// The pinned counters recounted from the objects, and the LRU order
    /// walked both ways: exactly the ready, unpinned objects.
    fn check(c: &Cache) {
        let live = c.objects.iter().flatten();
        let pinned: Vec<&Object> = live.clone().filter(|o| o.pinned).collect();
        assert_eq!(c.stats.pinned_objects, pinned.len() as u64);
        assert_eq!(
            c.stats.pinned_bytes,
            pinned.iter().map(|o| o.len).sum::<u64>()
        );
        for o in live.clone() {
            // Pinned only under a pin (which leaves one unpinned only when
            // it was stored past the bytes bound).
            assert!(!o.pinned || c.pins.contains(&Pin::of(&o.key)), "{:?}", o.key);
            if c.pins.over_bound() == 0 {
                assert_eq!(o.pinned, c.pins.contains(&Pin::of(&o.key)), "{:?}", o.key);
            }
        }
        let in_lru = live
            .filter(|o| o.state == ObjState::Ready && !o.pinned)
            .count();
        let (mut n, mut cur, mut prev) = (0, c.lru_head, NIL);
        while cur != NIL {
            let o = c.obj(cur);
            assert!(o.state == ObjState::Ready && !o.pinned);
            assert_eq!(o.prev, prev);
            (prev, cur) = (cur, o.next);
            n += 1;
        }
        assert_eq!(c.lru_tail, prev);
        assert_eq!(n, in_lru);
        assert_eq!(c.stats.objects, c.index.len() as u64);
        assert!(c.stats.pinned_bytes <= c.pins.limits().max_bytes);
        // The variants count exactly the stored objects.
        let mut variants: HashMap<(u64, u64), HashMap<(u64, u32), u64>> = HashMap::new();
        for k in c.index.keys() {
            *variants
                .entry((k.model_id, k.salt))
                .or_default()
                .entry((k.fingerprint, k.rank_tag))
                .or_default() += 1;
        }
        assert_eq!(variants, c.variants);
    }

    #[test]
    fn pins_past_their_bounds_are_refused_whole() {
        let mut c = Cache::new(8 * LEN, 1.0, 1.0, u64::MAX);
        c.set_pin_limits(PinLimits {
            max_pins: 3,
            max_bytes: 3 * LEN,
        });
        stored(&mut c, &[1, 2, 3]); // two ranks: two objects a chunk
        assert_eq!(c.pin(&[pin(1)]).unwrap().bytes, 2 * LEN);
        // Chunk 2's two objects would make 4 * LEN: refused, nothing taken.
        assert_eq!(
            c.pin(&[pin(2), pin(9)]),
            Err(PinRefusal::Bytes {
                pinned: 2 * LEN,
                adding: 2 * LEN,
                max: 3 * LEN
            })
        );
        assert_eq!(c.pins_page(None, 10).0, vec![pin(1)]);
        check(&c);
        // Pins of nothing stored take no bytes, up to the count.
        c.pin(&[pin(8), pin(9)]).unwrap();
        assert_eq!(
            c.pin(&[pin(7)]),
            Err(PinRefusal::Pins {
                held: 3,
                adding: 1,
                max: 3
            })
        );
        // Stored under a pin past the bytes bound: cached unpinned,
        // counted; the first fits.
        let plan = c.plan_store(&[key(9, 0), key(9, 1)], LEN);
        let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
        c.finish_store(&objs, true, 2 * LEN);
        assert_eq!(c.stats.pinned_bytes, 3 * LEN);
        assert_eq!(c.pin_limits().1, 1);
        check(&c);
        // Room made, the pin taken again pins the one left out.
        c.unpin(&[pin(1)]);
        assert_eq!(c.pin(&[pin(9)]).unwrap().bytes, 2 * LEN);
        check(&c);
    }

    #[test]
    fn pinned_objects_survive_eviction_and_clear_until_unpinned() {
        let mut c = Cache::new(8 * LEN, 1.0, 1.0, u64::MAX);
        // Pins may keep the whole pool.
        c.set_pin_limits(PinLimits {
            max_pins: 64,
            max_bytes: 8 * LEN,
        });
        stored(&mut c, &[1, 2, 3]); // 6 objects; chunk 1's are the oldest
        let got = c.pin(&[pin(1)]).unwrap();
        assert_eq!(
            got,
            PinCount {
                pins: 1,
                objects: 2,
                bytes: 2 * LEN,
                matched: 2
            }
        );
        check(&c);
        // Another salt or model is another pin: it covers nothing here.
        let other = [
            Pin { salt: 7, ..pin(2) },
            Pin {
                model_id: 2,
                ..pin(2)
            },
        ];
        assert_eq!(c.pin(&other).unwrap().matched, 0);
        assert_eq!(c.unpin(&other).pins, 1);
        // The pinned objects sit at the LRU end: one byte evicts the next
        // oldest object, whole, and nothing pinned.
        assert_eq!(c.evict_bytes(1), (1, LEN));
        assert_eq!(c.holds_of(&key(2, 0)), None);
        assert_eq!(c.holds_of(&key(1, 0)), Some(0));
        // As much as asked: only the three unpinned ones go.
        assert_eq!(c.evict_bytes(u64::MAX), (3, 3 * LEN));
        assert_eq!(c.clear(), (0, 0));
        assert_eq!((c.stats.objects, c.stats.pinned_objects), (2, 2));
        check(&c);
        // A lookup of a pinned chunk hits (and its hold ends as usual).
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        assert_eq!(
            c.lookup(lease(1), 5, meta(), group(), &[[1u8; 16]], ttl, now),
            1
        );
        assert!(c.end_session(lease(1), &[0; 32]).is_ok());
        check(&c);
        // Stores evict around the pinned objects: six more fit (8 slots),
        // and the next one evicts the oldest unpinned object.
        stored(&mut c, &[4, 5, 6]);
        let plan = c.plan_store(&[key(7, 0)], LEN);
        assert_eq!((plan.write.len(), plan.no_space), (1, 0));
        assert_eq!(c.holds_of(&key(4, 0)), None, "the oldest unpinned");
        c.finish_store(&[plan.write[0].obj], true, LEN);
        check(&c);
        // A pool full of pinned objects gives a store no space, counted.
        let all: Vec<Pin> = (1..=7).map(pin).collect();
        assert_eq!(c.pin(&all).unwrap().objects, 8);
        check(&c);
        let plan = c.plan_store(&[key(8, 0)], LEN);
        assert_eq!((plan.write.len(), plan.no_space), (0, 1));
        assert_eq!(c.stats.store_no_space_chunks, 1);
        assert_eq!(c.evict_bytes(u64::MAX), (0, 0));
        // Unpinned, they go (most recently used by then: evictable).
        let got = c.unpin(&all[1..]);
        assert_eq!((got.pins, got.objects, got.bytes), (1, 2, 2 * LEN));
        assert_eq!(got.matched, 6);
        check(&c);
        assert_eq!(c.clear(), (6, 6 * LEN));
        assert_eq!(c.unpin(&[pin(1)]).objects, 0);
        check(&c);
        assert_eq!(c.clear(), (2, 2 * LEN));
        assert_eq!(c.stats.pool_used_bytes, 0);
        assert_eq!(c.pins_page(None, usize::MAX).0, Vec::<Pin>::new());
    }

    #[test]
    fn a_pin_covers_objects_stored_after_it() {
        let mut c = Cache::new(8 * LEN, 1.0, 1.0, u64::MAX);
        let got = c.pin(&[pin(5)]).unwrap();
        assert_eq!((got.pins, got.objects, got.matched), (1, 0, 0));
        assert_eq!(c.pins_page(None, usize::MAX).0, vec![pin(5)]);
        // Pinned from the moment the store allocates it.
        let plan = c.plan_store(&[key(5, 0), key(6, 0)], LEN);
        assert_eq!(c.stats.pinned_objects, 1);
        assert_eq!(c.stats.pinned_bytes, LEN);
        check(&c);
        let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
        c.finish_store(&objs, true, 2 * LEN);
        check(&c);
        assert_eq!(c.clear(), (1, LEN));
        assert_eq!(c.evict_bytes(u64::MAX), (0, 0));
        assert_eq!(c.holds_of(&key(5, 0)), Some(0));
        // A failed store of a pinned object takes it off the counters.
        let plan = c.plan_store(&[key(5, 1)], 3 * LEN);
        assert_eq!(c.stats.pinned_bytes, 4 * LEN);
        c.finish_store(&[plan.write[0].obj], false, 0);
        assert_eq!(c.stats.pinned_bytes, LEN);
        check(&c);
        // Unpinned while being written: it joins the LRU order once ready.
        let plan = c.plan_store(&[key(5, 1)], LEN);
        assert_eq!(c.unpin(&[pin(5)]).matched, 2);
        check(&c);
        c.finish_store(&[plan.write[0].obj], true, LEN);
        check(&c);
        assert_eq!(c.clear(), (2, 2 * LEN));
        assert_eq!(c.stats.objects, 0);
    }

    #[test]
    fn pinned_counters_stay_exact_under_any_order_of_operations() {
        // Watermarks below 1: stores evict too.
        let mut c = Cache::new(24 * LEN, 0.75, 0.5, u64::MAX);
        let mut writing: Vec<u32> = Vec::new();
        let mut most_pinned = 0;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..4000 {
            match next(8) {
                0..=2 => {
                    let keys: Vec<ObjectKey> = (0..=next(4))
                        .map(|_| key(next(12) as u8, next(2) as u32))
                        .collect();
                    let plan = c.plan_store(&keys, LEN * (1 + next(3)));
                    writing.extend(plan.write.iter().map(|p| p.obj));
                }
                3 if !writing.is_empty() => {
                    let n = 1 + next(writing.len() as u64) as usize;
                    let objs: Vec<u32> = writing.drain(..n).collect();
                    c.finish_store(&objs, next(4) != 0, 0);
                }
                4 => {
                    // (Refused whole past the bytes bound.)
                    let _ = c.pin(&[pin(next(12) as u8), pin(next(12) as u8)]);
                }
                5 => {
                    c.unpin(&[pin(next(12) as u8)]);
                }
                6 => {
                    c.evict_bytes(LEN * next(6));
                }
                _ => {
                    if next(4) == 0 {
                        c.clear();
                    }
                }
            }
            check(&c);
            most_pinned = most_pinned.max(c.stats.pinned_objects);
        }
        assert!(c.stats.evicted_objects > 0 && c.stats.store_no_space_chunks > 0);
        assert!(most_pinned > 4, "{most_pinned}");
    }
}
