//! The link between the request path and the tiers' owner: the owner's
//! inbox (finished work, fetches, kicks), the tiers' way into it, and the
//! request path's handle on the tiers. Neither side calls the other: each
//! sends into the inbox, which only the owner reads.

use super::{Fetch, Tier, TierDone, WriteMode};
use crate::cache::Level;
use kvring::proto::kv::TierState;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// What the owner's inbox carries.
pub(crate) enum Msg {
    /// Work a tier finished.
    Done(TierDone),
    /// A lookup for the tiers.
    Fetch(Box<Fetch>),
    /// The cache recorded objects for the tiers.
    Kick,
    /// Stop.
    Stop,
}

/// The owner's end of its inbox, and the tiers' way into it.
pub(crate) struct Inbox {
    pub(super) rx: mpsc::Receiver<Msg>,
    pub finished: Finished,
}

/// The tiers' finished work, on its way to the owner.
#[derive(Clone)]
pub(crate) struct Finished(mpsc::Sender<Msg>);

impl Finished {
    /// Hands `done` to the owner (dropped if the owner has stopped: the
    /// server is shutting down and fails every job still running).
    pub fn send(&self, done: TierDone) {
        let _ = self.0.send(Msg::Done(done));
    }
}

/// One tier as the request path and the owner see it.
pub(crate) struct TierLink {
    pub tier: Arc<dyn Tier>,
    pub mode: WriteMode,
    pub level: Level,
    /// Objects the tier was not handed (too many bytes waiting, its queue
    /// full, or down): counted with its dropped writes.
    pub refused: AtomicU64,
    /// Operations handed to the tier whose end the owner has not applied
    /// yet (its queue, as STATS shows it: once it reads 0, every write's
    /// pool range or hold is back with the cache).
    pub in_flight: AtomicU64,
}

impl TierLink {
    pub fn new(tier: Arc<dyn Tier>, mode: WriteMode, level: Level) -> TierLink {
        TierLink {
            tier,
            mode,
            level,
            refused: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }

    pub fn up(&self) -> bool {
        self.tier.state() == TierState::Up
    }

    /// Hands `op` to the tier (counted in flight), or gives it back.
    #[allow(clippy::result_large_err)]
    pub fn submit(&self, op: super::TierOp) -> Result<(), super::TierOp> {
        // Relaxed (both): a gauge for observers; the owner alone writes it.
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.tier.submit(op).inspect_err(|_| {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        })
    }

    /// The owner applied the end of an operation of this tier's.
    pub fn applied(&self) {
        // Relaxed: see `submit`.
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The request path's side of the tiers: each tier, in lookup order, and
/// the owner's inbox.
pub(crate) struct Tiers {
    links: Vec<TierLink>,
    inbox: mpsc::Sender<Msg>,
    /// A kick is in the owner's inbox, not yet taken.
    kicked: AtomicBool,
}

impl Tiers {
    /// The tiers of `links` (one per level at most) and their owner's inbox
    /// (its other end, for [`super::owner::TierOwner::start`]).
    pub fn new(mut links: Vec<TierLink>) -> (Tiers, Inbox) {
        links.sort_by_key(|l| l.level as u8);
        assert!(
            links.windows(2).all(|w| w[0].level != w[1].level),
            "one tier per level"
        );
        let (tx, rx) = mpsc::channel();
        let tiers = Tiers {
            links,
            inbox: tx.clone(),
            kicked: AtomicBool::new(false),
        };
        (
            tiers,
            Inbox {
                rx,
                finished: Finished(tx),
            },
        )
    }

    /// Every tier, in lookup order.
    pub fn all(&self) -> &[TierLink] {
        &self.links
    }

    /// The tier at `level`, if the server has one.
    pub fn at(&self, level: Level) -> Option<&TierLink> {
        self.links.iter().find(|l| l.level == level)
    }

    /// The first tier at `from` or below that is up.
    pub fn up_from(&self, from: Level) -> Option<&TierLink> {
        self.links
            .iter()
            .find(|l| l.level as u8 >= from as u8 && l.up())
    }

    /// Whether a tier is up (a lookup that misses the pool asks it).
    pub fn any_up(&self) -> bool {
        self.links.iter().any(TierLink::up)
    }

    /// The tiers written in `mode`.
    pub fn in_mode(&self, mode: WriteMode) -> crate::cache::Levels {
        self.links
            .iter()
            .filter(|l| l.mode == mode)
            .fold(crate::cache::Levels::NONE, |s, l| s.with(l.level))
    }

    /// Wakes the owner to take what the cache recorded for the tiers; one
    /// wake-up for any number of kicks before the owner takes them.
    pub fn kick(&self) {
        // AcqRel on success pairs with the owner's `swap(false, AcqRel)` in
        // `take_kick`: a kick after the owner took the last one sends a new
        // message; one before it is covered by the take that follows.
        if self
            .kicked
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let _ = self.inbox.send(Msg::Kick);
        }
    }

    /// Hands lookup `f` to the owner for the tiers; `Err(f)` if the owner
    /// has stopped.
    pub fn fetch(&self, f: Box<Fetch>) -> Result<(), Box<Fetch>> {
        self.inbox.send(Msg::Fetch(f)).map_err(|e| match e.0 {
            Msg::Fetch(f) => f,
            _ => unreachable!("a fetch was sent"),
        })
    }

    /// Asks the owner to stop.
    pub(super) fn stop_owner(&self) {
        let _ = self.inbox.send(Msg::Stop);
    }

    /// Marks the kick taken (the owner, before it takes the cache's work).
    pub(super) fn take_kick(&self) {
        // AcqRel: pairs with `kick`'s compare_exchange (see there).
        self.kicked.swap(false, Ordering::AcqRel);
    }
}
