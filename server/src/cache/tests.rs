//! The cache's unit tests.

use super::*;
use crate::registry::{rank_tag, Group};
use std::time::{Duration, Instant};

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
    assert!(
        !c.in_flight(&m, g, h),
        "rank 1 has no object: nothing to wait for"
    );
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
        assert!(
            !o.pinned || c.pins.contains(&Pin::of(&o.key)),
            "{:?}",
            o.key
        );
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

#[test]
fn an_evicted_range_comes_back_when_the_last_write_back_tier_is_done() {
    let mut c = Cache::new(64 * LEN, 1.0, 1.0, u64::MAX);
    let both = Levels::of(Level::Disk).with(Level::Remote);
    c.set_tier_modes(both, Levels::NONE, 64 * LEN);
    stored(&mut c, &[1]);
    let used = c.stats.pool_used_bytes;
    assert_eq!(c.evict_bytes(2 * LEN).0, 2);
    let (drained, refused) = c.take_drained();
    assert_eq!((drained.len(), refused), (2, [0, 0]));
    assert!(drained.iter().all(|d| d.write == both && d.had.is_empty()));
    assert_eq!(c.tier_pending()[Level::Disk as usize], 0, "taken");
    // One tier done with each: the ranges stay.
    for d in &drained {
        c.free_drained(d);
    }
    assert_eq!(c.stats.pool_used_bytes, used);
    assert_eq!(c.used_staying(), 0, "not what eviction must bring down");
    // The other: they come back.
    for d in &drained {
        c.free_drained(d);
    }
    assert_eq!(c.stats.pool_used_bytes, 0);
}

#[test]
fn a_stored_object_is_held_once_for_each_write_through_tier_that_lacks_it() {
    let mut c = Cache::new(64 * LEN, 1.0, 1.0, u64::MAX);
    c.set_tier_modes(
        Levels::NONE,
        Levels::of(Level::Disk).with(Level::Remote),
        64 * LEN,
    );
    let plan = c.plan_store(&[key(3, 0)], LEN);
    let obj = plan.write[0].obj;
    c.finish_store(&[obj], true, LEN);
    c.hold_for_tiers(&[obj]);
    let held = c.take_through();
    assert_eq!(
        held.iter().map(|h| h.level).collect::<Vec<_>>(),
        [Level::Disk, Level::Remote]
    );
    // Held: not evicted until both writes end.
    assert_eq!(c.evict_bytes(LEN).0, 0);
    c.tier_written(obj, Level::Disk, true);
    assert_eq!(c.evict_bytes(LEN).0, 0);
    c.tier_written(obj, Level::Remote, false);
    // The disk has it, the remote tier not: a second hold is for the
    // remote tier only.
    c.hold_for_tiers(&[obj]);
    let again = c.take_through();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].level, Level::Remote);
    c.tier_written(obj, Level::Remote, true);
    assert_eq!(c.evict_bytes(LEN).0, 1);
}

#[test]
fn past_the_bound_an_evicted_object_is_dropped_for_the_tiers_that_lack_it() {
    let mut c = Cache::new(64 * LEN, 1.0, 1.0, u64::MAX);
    // Room for one range waiting.
    c.set_tier_modes(Levels::of(Level::Disk), Levels::NONE, LEN);
    stored(&mut c, &[1, 2]);
    assert_eq!(c.evict_bytes(4 * LEN).0, 4);
    let (drained, refused) = c.take_drained();
    assert_eq!(drained.len(), 1);
    assert_eq!(refused, [3, 0]);
    assert_eq!(c.stats.pool_used_bytes, LEN, "only the kept range");
}

/// What the cache told its event queue, in order (`S`: stored, `R`:
/// removed, with the tiers the object went to).
fn told(q: &crate::events::EventQueue) -> Vec<(char, u8, Levels)> {
    use crate::events::Record;
    q.take()
        .0
        .into_iter()
        .map(|r| match r {
            Record::Stored(k) => ('S', k.hash[0], Levels::NONE),
            Record::Removed { key, to } => ('R', key.hash[0], to),
            Record::Describe { .. } => unreachable!("the cache describes nothing"),
        })
        .collect()
}

#[test]
fn the_event_queue_hears_of_every_object_that_becomes_readable_or_leaves() {
    let q = Arc::new(crate::events::EventQueue::new(1024, 64));
    // Room for four objects.
    let mut c = Cache::new(4 * LEN, 1.0, 1.0, u64::MAX);
    c.set_events(q.clone());
    // A store that fails: its objects were never readable, so no event.
    let plan = c.plan_store(&[key(1, 0)], LEN);
    let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
    c.finish_store(&objs, false, 0);
    assert_eq!(told(&q), []);
    // Stored, then evicted by later stores (no tier below: to nowhere).
    stored(&mut c, &[1, 2]);
    assert_eq!(
        told(&q).iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(),
        [('S', 1), ('S', 2), ('S', 1), ('S', 2)]
    );
    stored(&mut c, &[3]);
    let ev = told(&q);
    assert_eq!(ev.iter().filter(|e| e.0 == 'R').count(), 2, "{ev:?}");
    // The least recently used go (rank 0's objects of chunks 1 and 2).
    assert_eq!(
        ev,
        [
            ('R', 1, Levels::NONE),
            ('S', 3, Levels::NONE),
            ('R', 2, Levels::NONE),
            ('S', 3, Levels::NONE)
        ]
    );
    // With a write-back tier, an evicted object goes to it.
    c.set_tier_modes(Levels::of(Level::Disk), Levels::NONE, 64 * LEN);
    stored(&mut c, &[4]);
    let ev = told(&q);
    assert!(
        ev.iter()
            .any(|e| e.0 == 'R' && e.2 == Levels::of(Level::Disk)),
        "{ev:?}"
    );
    // A clear removes every readable object without holds.
    let (n, _) = c.clear();
    let ev = told(&q);
    assert_eq!(ev.len() as u64, n);
    assert!(ev.iter().all(|e| e.0 == 'R'));
    assert_eq!(c.ready_keys(), []);
    assert_eq!(q.dropped.load(std::sync::atomic::Ordering::Relaxed), 0);
}
