//! Stores: objects planned for the chunks of a store (or of a read from
//! the second tier), written outside the lock, then made readable or
//! dropped.

use super::{Cache, Levels, ObjState, Object, ObjectKey, Pin, NIL};

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

impl Cache {
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
                in_tiers: Levels::NONE,
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
        self.finish_objects(objs, ok, Levels::NONE);
        if ok {
            self.stats.stored_chunks += objs.len() as u64;
            self.stats.stored_bytes += bytes;
        }
    }

    /// Ends objects planned with [`Cache::plan_objects`]: readable (`ok`;
    /// `from`: the tiers they were read from) or dropped.
    pub fn finish_objects(&mut self, objs: &[u32], ok: bool, from: Levels) {
        for &id in objs {
            if ok {
                self.obj_mut(id).in_tiers = from;
            }
            if ok {
                self.obj_mut(id).state = ObjState::Ready;
                let key = self.obj(id).key;
                self.event(|| super::Record::Stored(key));
                if !self.obj(id).pinned {
                    self.lru_push_back(id);
                }
            } else {
                self.remove_object(id);
            }
        }
        self.watermark();
    }
}
