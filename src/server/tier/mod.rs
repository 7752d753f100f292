//! The seam between the pool and a tier below it (the Valkey/Redis tier
//! today; any store that keeps chunk objects).
//!
//! A tier is driven by one owner ([`owner`]), the way an offloading tier
//! is driven by its manager: the owner submits work, which the tier takes
//! or refuses at once ([`Tier::submit`] never blocks), and takes back what
//! the tier finished ([`Finished`]), then applies it to the cache itself.
//! The tier never calls into the request path: it sees the pool through
//! [`PoolView`] (the bytes of the objects it was asked to write, and room
//! for the objects it reads), not the server's state, and it never ends a
//! job, a lookup or a write's hold.
//!
//! What the cache records for the tier (objects evicted under write-back,
//! objects stored under write-through) it keeps until the owner takes it;
//! the threads that touch the cache only wake the owner ([`TierLink::kick`]).

pub(crate) mod owner;

use super::cache::{Drained, LeaseMeta, ObjectKey};
use super::registry::Group;
use crate::jobs::JobId;
use crate::kv::ChunkHash;
use crate::proto::kv::{StatsReply, TierState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// When objects go to a tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// When the pool evicts them.
    Back,
    /// As soon as they are stored.
    Through,
}

/// A tier below the pool.
pub(crate) trait Tier: Send + Sync {
    /// Up, down or connecting: while not up, the owner submits nothing.
    fn state(&self) -> TierState;
    /// Takes `op` (its result comes back through [`Finished`]) or gives it
    /// back at once: never waits. (Given back whole, without a box: the
    /// caller undoes what it kept for it.)
    #[allow(clippy::result_large_err)]
    fn submit(&self, op: TierOp) -> Result<(), TierOp>;
    /// Copies the tier's counters into `stats`.
    fn fill(&self, stats: &mut StatsReply);
}

/// Work for a tier.
pub(crate) enum TierOp {
    /// Write object `key`, whose bytes are at pool offset `off` (`len`
    /// bytes, kept by the owner until the write is finished); `check`:
    /// only if the tier no longer has it.
    Write {
        key: ObjectKey,
        off: u64,
        len: u64,
        check: bool,
        then: AfterWrite,
    },
    /// Bring the leading chunks of `fetch.hashes[fetch.l1..]` the tier has
    /// (every rank's object) into the pool.
    Fetch(Box<Fetch>),
}

/// What the owner does once a write is finished (written or not).
pub(crate) enum AfterWrite {
    /// Drop the write-through hold on object `.0`.
    Release(u32),
    /// Give back an evicted object's range (write-back).
    Free(Drained),
}

/// A lookup that missed the pool after `l1` chunks.
pub(crate) struct Fetch {
    pub id: JobId,
    pub owner: u32,
    pub meta: LeaseMeta,
    pub group: Group,
    pub hashes: Vec<ChunkHash>,
    pub l1: u32,
}

/// Work a tier finished, for its owner to apply.
pub(crate) enum TierDone {
    /// A write ended; `ok`: the tier has the object.
    Written { then: AfterWrite, ok: bool },
    /// A fetch ended: `hits` chunks past `fetch.l1` are in the pool, their
    /// objects `keep` (placed, still `Writing`); the objects in `drop` were
    /// placed for chunks past that prefix, or failed their check on the
    /// copy: the owner drops them.
    Fetched {
        fetch: Box<Fetch>,
        hits: u32,
        keep: Vec<u32>,
        drop: Vec<u32>,
    },
}

/// Where a tier puts what it read: an object's room in the pool.
pub(crate) enum Placement {
    /// The pool has the object already (stored or read meanwhile).
    Present,
    /// A new `Writing` object `obj` at pool offset `off`: the tier fills it
    /// and reports it in `keep` or `drop`.
    Room { obj: u32, off: u64 },
    /// No room (every object in use).
    NoRoom,
}

/// The pool as a tier sees it.
pub(crate) trait PoolView: Send + Sync {
    /// The pool's `len` bytes at `off`.
    ///
    /// # Safety
    ///
    /// `[off, off + len)` must be the range of an object the owner keeps
    /// for the caller: one it submitted for writing (held, or evicted and
    /// out of the allocator) until the write is finished, or one
    /// [`PoolView::place`] gave the caller, until it is reported.
    unsafe fn bytes(&self, off: u64, len: u64) -> &[u8];
    /// The pool's `len` bytes at `off`, to fill.
    ///
    /// # Safety
    ///
    /// `[off, off + len)` must be a range [`PoolView::place`] gave the
    /// caller and that it has not reported yet (a `Writing` object: no
    /// reader sees it, nothing else writes it), and the caller must not
    /// hold two slices of it at once.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, off: u64, len: u64) -> &mut [u8];
    /// Room for object `key` of `len` bytes.
    fn place(&self, key: ObjectKey, len: u64) -> Placement;
}

/// The tier's finished work, on its way to the owner.
#[derive(Clone)]
pub(crate) struct Finished(mpsc::Sender<owner::Msg>);

impl Finished {
    /// Hands `done` to the owner (dropped if the owner has stopped: the
    /// server is shutting down and fails every job still running).
    pub fn send(&self, done: TierDone) {
        let _ = self.0.send(owner::Msg::Done(done));
    }
}

/// The request path's side of the tier: its state, and the owner's inbox.
pub(crate) struct TierLink {
    pub tier: Arc<dyn Tier>,
    pub mode: WriteMode,
    inbox: mpsc::Sender<owner::Msg>,
    /// A kick is in the owner's inbox, not yet taken.
    kicked: AtomicBool,
}

impl TierLink {
    /// A link to `tier` and its owner's inbox (its other end, for
    /// [`owner::TierOwner::start`]).
    pub fn new(tier: Arc<dyn Tier>, mode: WriteMode) -> (TierLink, owner::Inbox) {
        let (tx, rx) = mpsc::channel();
        let link = TierLink {
            tier,
            mode,
            inbox: tx.clone(),
            kicked: AtomicBool::new(false),
        };
        (link, owner::Inbox { rx, finished: Finished(tx) })
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
            let _ = self.inbox.send(owner::Msg::Kick);
        }
    }

    /// Hands lookup `f` to the owner for the tier; `Err(f)` if the owner
    /// has stopped.
    pub fn fetch(&self, f: Box<Fetch>) -> Result<(), Box<Fetch>> {
        self.inbox
            .send(owner::Msg::Fetch(f))
            .map_err(|e| match e.0 {
                owner::Msg::Fetch(f) => f,
                _ => unreachable!("a fetch was sent"),
            })
    }

    /// Marks the kick taken (the owner, before it takes the cache's work).
    fn take_kick(&self) {
        // AcqRel: pairs with `kick`'s compare_exchange (see there).
        self.kicked.swap(false, Ordering::AcqRel);
    }
}
