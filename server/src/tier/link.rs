//! The link between the request path and the tier's owner: the owner's
//! inbox (finished work, fetches, kicks), the tier's way into it, and the
//! request path's handle on the tier. Neither side calls the other: each
//! sends into the inbox, which only the owner reads.

use super::{Fetch, Tier, TierDone, WriteMode};
use kvring::proto::kv::TierState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// What the owner's inbox carries.
pub(crate) enum Msg {
    /// Work the tier finished.
    Done(TierDone),
    /// A lookup for the tier.
    Fetch(Box<Fetch>),
    /// The cache recorded objects for the tier.
    Kick,
    /// Stop.
    Stop,
}

/// The owner's end of its inbox, and the tier's way into it.
pub(crate) struct Inbox {
    pub(super) rx: mpsc::Receiver<Msg>,
    pub finished: Finished,
}

/// The tier's finished work, on its way to the owner.
#[derive(Clone)]
pub(crate) struct Finished(mpsc::Sender<Msg>);

impl Finished {
    /// Hands `done` to the owner (dropped if the owner has stopped: the
    /// server is shutting down and fails every job still running).
    pub fn send(&self, done: TierDone) {
        let _ = self.0.send(Msg::Done(done));
    }
}

/// The request path's side of the tier: its state, and the owner's inbox.
pub(crate) struct TierLink {
    pub tier: Arc<dyn Tier>,
    pub mode: WriteMode,
    pub(super) inbox: mpsc::Sender<Msg>,
    /// A kick is in the owner's inbox, not yet taken.
    kicked: AtomicBool,
}

impl TierLink {
    /// A link to `tier` and its owner's inbox (its other end, for
    /// [`super::owner::TierOwner::start`]).
    pub fn new(tier: Arc<dyn Tier>, mode: WriteMode) -> (TierLink, Inbox) {
        let (tx, rx) = mpsc::channel();
        let link = TierLink {
            tier,
            mode,
            inbox: tx.clone(),
            kicked: AtomicBool::new(false),
        };
        (
            link,
            Inbox {
                rx,
                finished: Finished(tx),
            },
        )
    }

    pub fn up(&self) -> bool {
        self.tier.state() == TierState::Up
    }

    /// Wakes the owner to take what the cache recorded for the tier; one
    /// wake-up for any number of kicks before the owner takes them.
    pub fn kick(&self) {
        // AcqRel on success pairs with the owner's `swap(false, AcqRel)` in
        // `owner::run`: a kick after the owner took the last one sends a new
        // message; one before it is covered by the take that follows.
        if self
            .kicked
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let _ = self.inbox.send(Msg::Kick);
        }
    }

    /// Hands lookup `f` to the owner for the tier; `Err(f)` if the owner
    /// has stopped.
    pub fn fetch(&self, f: Box<Fetch>) -> Result<(), Box<Fetch>> {
        self.inbox.send(Msg::Fetch(f)).map_err(|e| match e.0 {
            Msg::Fetch(f) => f,
            _ => unreachable!("a fetch was sent"),
        })
    }

    /// Marks the kick taken (the owner, before it takes the cache's work).
    pub(super) fn take_kick(&self) {
        // AcqRel: pairs with `kick`'s compare_exchange (see there).
        self.kicked.swap(false, Ordering::AcqRel);
    }
}
