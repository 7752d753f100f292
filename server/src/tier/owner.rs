//! The tier's owner: one thread (`kvring-tier`) that feeds the tier what
//! the cache recorded for it, hands it lookups' fetches, and applies what
//! it finished: ranges given back, holds dropped, objects read made
//! readable (or dropped), lookups answered.

use super::link::{Inbox, Msg};
use super::{AfterWrite, Placement, PoolView, TierDone, TierOp};
use crate::cache::ObjectKey;
use crate::kv_ops::{end_lookup, wake_lookups};
use crate::Shared;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

/// The owner's thread: stopped and joined by [`TierOwner::stop`].
pub(crate) struct TierOwner {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TierOwner {
    /// Starts the owner of `shared`'s tier, reading `inbox`.
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
        if let Some(link) = self.shared.kv.tier.as_ref() {
            let _ = link.inbox.send(Msg::Stop);
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

fn run(shared: &Shared, rx: Receiver<Msg>) {
    let Some(link) = shared.kv.tier.as_ref() else {
        return;
    };
    loop {
        match rx.recv_timeout(IDLE) {
            Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => break,
            Ok(Msg::Done(d)) => apply(shared, d),
            Ok(Msg::Fetch(f)) => {
                if !link.up() {
                    end_lookup(shared, &f, 0);
                    continue;
                }
                if let Err(TierOp::Fetch(f)) = link.tier.submit(TierOp::Fetch(f)) {
                    // Not taken (its queue is full): the pool's answer.
                    end_lookup(shared, &f, 0);
                }
            }
            Ok(Msg::Kick) | Err(RecvTimeoutError::Timeout) => feed(shared),
        }
    }
}

/// Applies finished work to the cache.
fn apply(shared: &Shared, done: TierDone) {
    match done {
        TierDone::Written { then, ok } => shared.kv.with_cache(|c| match &then {
            AfterWrite::Release(id) => c.l2_written(*id, ok),
            AfterWrite::Free(d) => c.free_drained(d),
        }),
        TierDone::Fetched {
            fetch,
            hits,
            keep,
            drop,
        } => {
            shared.kv.with_cache(|c| {
                c.finish_objects(&keep, true, true);
                c.finish_objects(&drop, false, false);
            });
            end_lookup(shared, &fetch, hits);
            // Its reads settled objects other lookups may wait for.
            wake_lookups(shared);
        }
    }
}

/// Hands the tier what the cache recorded for it: objects evicted under
/// write-back, objects stored under write-through. What the tier does not
/// take is given back at once (a range freed, a hold dropped) and counted
/// as a dropped write.
fn feed(shared: &Shared) {
    let Some(link) = shared.kv.tier.as_ref() else {
        return;
    };
    link.take_kick();
    // Under the cache's lock throughout (submitting never waits), so an
    // object is always either waiting in the cache or in the tier's queue:
    // observers that see both empty see it written or dropped.
    let mut c = shared.kv.cache();
    let (drained, refused) = c.take_drained();
    let through = c.take_through();
    if drained.is_empty() && through.is_empty() && refused == 0 {
        return;
    }
    let up = link.up();
    let writes = drained
        .into_iter()
        .map(|d| TierOp::Write {
            key: d.key,
            off: d.off,
            len: d.len,
            check: d.in_l2,
            then: AfterWrite::Free(d),
        })
        .chain(
            through
                .into_iter()
                .map(|(id, key, off, len)| TierOp::Write {
                    key,
                    off,
                    len,
                    check: false,
                    then: AfterWrite::Release(id),
                }),
        );
    let mut dropped = refused;
    for op in writes {
        let back = if up {
            link.tier.submit(op).err()
        } else {
            Some(op)
        };
        if let Some(TierOp::Write { then, .. }) = back {
            dropped += 1;
            match &then {
                AfterWrite::Release(id) => c.l2_written(*id, false),
                AfterWrite::Free(d) => c.free_drained(d),
            }
        }
    }
    // Relaxed: a counter.
    shared.kv.tier_refused.fetch_add(dropped, Ordering::Relaxed);
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
