//! The tiers' owner: one thread (`kvring-tier`) that feeds each tier what
//! the cache recorded for it, hands lookups' fetches down the tiers in
//! order (the disk, then the remote tier, from the first chunk the one
//! above did not bring), and applies what they finished: ranges given
//! back, holds dropped, objects read made readable (or dropped), lookups
//! answered.

use super::link::{Inbox, Msg, Tiers};
use super::{AfterWrite, Fetch, Placement, PoolView, TierDone, TierOp};
use crate::cache::{Level, Levels, ObjectKey};
use crate::kv_ops::{end_lookup, wake_lookups};
use crate::Shared;
use kvring::jobs::JobId;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The owner's thread: stopped and joined by [`TierOwner::stop`].
pub(crate) struct TierOwner {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TierOwner {
    /// Starts the owner of `shared`'s tiers, reading `inbox`.
    pub fn start(shared: Arc<Shared>, inbox: Inbox) -> crate::Result<TierOwner> {
        let (s, rx) = (shared.clone(), inbox.rx);
        let thread = std::thread::Builder::new()
            .name("kvring-tier".into())
            .spawn(move || run(&s, rx))
            .map_err(kvring::error::io("spawn the tier's owner"))?;
        Ok(TierOwner {
            shared,
            thread: Some(thread),
        })
    }

    /// Stops the owner: work finished after this is not applied (the server
    /// is shutting down and fails every job still running).
    pub fn stop(&mut self) {
        if let Some(tiers) = self.shared.kv.tiers.as_ref() {
            tiers.stop_owner();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TierOwner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How often the owner looks at the cache without a kick (a safety net:
/// every change the tier waits for kicks it).
const IDLE: Duration = Duration::from_millis(100);

/// Past its tier's own bound, the owner answers a lookup itself after this.
const GRACE: Duration = Duration::from_secs(1);

/// The lookups handed to a tier and not answered yet: a copy of each (as
/// it was handed over) and when the owner answers it itself.
#[derive(Default)]
struct Waiting(HashMap<JobId, (Box<Fetch>, Instant)>);

impl Waiting {
    /// Lookups whose tier did not answer in time, answered with what the
    /// pool and the tiers above brought.
    fn expire(&mut self, shared: &Shared, tiers: &Tiers) {
        let now = Instant::now();
        let late: Vec<JobId> = self
            .0
            .iter()
            .filter(|(_, (_, at))| now >= *at)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            let (f, _) = self.0.remove(&id).expect("listed above");
            if let Some(link) = tiers.at(f.at) {
                tracing::warn!(
                    tier = ?f.at,
                    state = link.tier.state().name(),
                    "a tier did not answer a lookup within its bound: answered without it"
                );
            }
            end_lookup(shared, &f);
        }
    }
}

fn run(shared: &Shared, rx: Receiver<Msg>) {
    let Some(tiers) = shared.kv.tiers.as_ref() else {
        return;
    };
    let mut waiting = Waiting::default();
    loop {
        match rx.recv_timeout(IDLE) {
            Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => break,
            Ok(Msg::Done(d)) => apply(shared, tiers, &mut waiting, d),
            Ok(Msg::Fetch(f)) => fetch_from(shared, tiers, &mut waiting, f, Level::ALL[0]),
            Ok(Msg::Kick) | Err(RecvTimeoutError::Timeout) => feed(shared, tiers),
        }
        waiting.expire(shared, tiers);
    }
}

/// Hands lookup `f` to the first tier at `from` or below that is up and
/// takes it; with none, answers it with what it has.
fn fetch_from(
    shared: &Shared,
    tiers: &Tiers,
    waiting: &mut Waiting,
    mut f: Box<Fetch>,
    from: Level,
) {
    let mut next = Some(from);
    while let Some(link) = next.and_then(|l| tiers.up_from(l)) {
        f.at = link.level;
        let copy = f.clone();
        match link.submit(TierOp::Fetch(f)) {
            Ok(()) => {
                let at = Instant::now() + link.tier.lookup_wait() + GRACE;
                waiting.0.insert(copy.id, (copy, at));
                return;
            }
            // Not taken (its queue is full): the next tier down.
            Err(TierOp::Fetch(back)) => f = back,
            Err(TierOp::Write { .. }) => unreachable!("a fetch was submitted"),
        }
        next = link.level.below();
    }
    end_lookup(shared, &f);
}

/// Applies finished work to the cache.
fn apply(shared: &Shared, tiers: &Tiers, waiting: &mut Waiting, done: TierDone) {
    match done {
        TierDone::Written { then, ok } => {
            shared.kv.with_cache(|c| match &then {
                AfterWrite::Release { obj, level } => c.tier_written(*obj, *level, ok),
                AfterWrite::Free { d, .. } => c.free_drained(d),
            });
            // After the cache has the range or hold back (see `in_flight`).
            if let Some(link) = tiers.at(then.level()) {
                link.applied();
            }
        }
        TierDone::Fetched {
            mut fetch,
            hits,
            keep,
            drop,
        } => {
            shared.kv.with_cache(|c| {
                c.finish_objects(&keep, true, Levels::of(fetch.at));
                c.finish_objects(&drop, false, Levels::NONE);
            });
            if let Some(link) = tiers.at(fetch.at) {
                link.applied();
            }
            // Its reads settled objects other lookups may wait for.
            wake_lookups(shared);
            if waiting.0.remove(&fetch.id).is_none() {
                // Answered already, without this tier (it was late): what
                // it read stays in the pool for the next lookup.
                return;
            }
            fetch.found[fetch.at as usize] += hits;
            match fetch.at.below() {
                // What this tier did not bring, the next one down may have.
                Some(below) if fetch.start() < fetch.hashes.len() => {
                    fetch_from(shared, tiers, waiting, fetch, below)
                }
                _ => end_lookup(shared, &fetch),
            }
        }
    }
}

/// Hands each tier what the cache recorded for it: objects evicted, for
/// the write-back tiers; objects stored, for the write-through ones. What
/// a tier does not take is given back at once (its share of a range
/// freed, a hold dropped) and counted as one of its dropped writes.
fn feed(shared: &Shared, tiers: &Tiers) {
    tiers.take_kick();
    // Under the cache's lock throughout (submitting never waits), so an
    // object is always either waiting in the cache or in a tier's queue:
    // observers that see both empty see it written or dropped.
    let mut c = shared.kv.cache();
    let (drained, refused) = c.take_drained();
    let through = c.take_through();
    if drained.is_empty() && through.is_empty() && refused.iter().all(|n| *n == 0) {
        return;
    }
    let writes = drained
        .into_iter()
        .flat_map(|d| {
            d.write.iter().map(move |level| {
                let op = TierOp::Write {
                    key: d.key,
                    off: d.off,
                    len: d.len,
                    check: d.had.has(level),
                    then: AfterWrite::Free { d, level },
                };
                (level, op)
            })
        })
        .chain(through.into_iter().map(|h| {
            let op = TierOp::Write {
                key: h.key,
                off: h.off,
                len: h.len,
                check: false,
                then: AfterWrite::Release {
                    obj: h.obj,
                    level: h.level,
                },
            };
            (h.level, op)
        }));
    let mut dropped = refused;
    for (level, op) in writes {
        let link = tiers.at(level).filter(|l| l.up());
        let back = match link {
            Some(l) => l.submit(op).err(),
            None => Some(op),
        };
        if let Some(TierOp::Write { then, .. }) = back {
            dropped[level as usize] += 1;
            match &then {
                AfterWrite::Release { obj, level } => c.tier_written(*obj, *level, false),
                AfterWrite::Free { d, .. } => c.free_drained(d),
            }
        }
    }
    for link in tiers.all() {
        // Relaxed: a counter.
        link.refused
            .fetch_add(dropped[link.level as usize], Ordering::Relaxed);
    }
    let mut stats = c.stats;
    let pending = c.tier_pending();
    drop(c);
    shared.kv.fill(&mut stats, pending);
    shared.kv.publish_read(&stats);
}

/// The pool, as the tier sees it.
pub(crate) struct Pool(pub Arc<Shared>);

impl PoolView for Pool {
    unsafe fn bytes(&self, off: u64, len: u64) -> &[u8] {
        // SAFETY: the caller's contract (`PoolView::bytes`): an object's
        // range the owner keeps for it, in the pool, which lives as long as
        // the server, whose shutdown stops the tier first.
        unsafe { std::slice::from_raw_parts(self.0.kv.pool.at(off), len as usize) }
    }

    unsafe fn bytes_mut(&self, off: u64, len: u64) -> &mut [u8] {
        // SAFETY: the caller's contract (`PoolView::bytes_mut`): a `Writing`
        // object's range given to it alone, in the pool (as above).
        unsafe { std::slice::from_raw_parts_mut(self.0.kv.pool.at(off), len as usize) }
    }

    fn place(&self, key: ObjectKey, len: u64) -> Placement {
        let plan = self.0.kv.with_cache(|c| c.plan_objects(&[key], len));
        match plan.write.first() {
            Some(p) => Placement::Room {
                obj: p.obj,
                off: p.off,
            },
            None if plan.present > 0 => Placement::Present,
            None => Placement::NoRoom,
        }
    }
}
