//! Lookups and leases: the holds a LOOKUP takes on its hits, moved to a
//! RETRIEVE, freed, ended with the session, the owner or the TTL.

use super::{Cache, ObjState, ObjectKey};
use crate::registry::{rank_tag, Group, SHARED_RANK};
use kvring::jobs::JobId;
use kvring::kv::ChunkHash;
use std::time::Instant;

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

pub(super) struct Lease {
    owner_slot: u32,
    expires: Instant,
    /// `holds[chunk][rank]`: the object that rank may retrieve, while held.
    holds: Vec<Vec<Option<u32>>>,
    held: usize,
}

impl Cache {
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

    pub(super) fn drop_holds(
        &mut self,
        lease: &mut Lease,
        rows: std::ops::Range<usize>,
        touch: bool,
    ) {
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
    pub(super) fn lease_of(&self, id: JobId, engine: &[u8; 32]) -> Result<(), LeaseError> {
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
}
