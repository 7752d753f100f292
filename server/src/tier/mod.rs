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

pub(crate) mod link;
pub(crate) mod owner;

/// The tier a server was configured with, until its thread starts.
pub(crate) enum TierStart {
    /// The remote tier (Valkey/Redis).
    Remote(std::sync::Arc<crate::l2::L2>),
    /// The local disk tier.
    Disk(std::sync::Arc<crate::disk::tier::DiskTier>),
}

/// A tier's running thread(s).
pub(crate) enum TierThread {
    Remote(crate::l2::L2Thread),
    Disk(crate::disk::tier::DiskThread),
}

impl TierThread {
    /// Starts the thread of `start` over `pool`, reporting to `finished`.
    pub fn start(
        start: TierStart,
        pool: std::sync::Arc<dyn PoolView>,
        finished: link::Finished,
    ) -> crate::Result<TierThread> {
        Ok(match start {
            TierStart::Remote(l2) => {
                TierThread::Remote(crate::l2::L2Thread::start(l2, pool, finished)?)
            }
            TierStart::Disk(d) => {
                TierThread::Disk(crate::disk::tier::DiskThread::start(d, pool, finished)?)
            }
        })
    }

    /// Stops it: queued operations are dropped.
    pub fn stop(&mut self) {
        match self {
            TierThread::Remote(t) => t.stop(),
            TierThread::Disk(t) => t.stop(),
        }
    }
}

use super::cache::{Drained, LeaseMeta, ObjectKey};
use super::registry::Group;
use kvring::jobs::JobId;
use kvring::kv::ChunkHash;
use kvring::proto::kv::{StatsReply, TierState};
use std::sync::atomic::{AtomicU64, Ordering};

/// A tier's counters, as STATS, the inspector and the metrics show them.
#[derive(Default)]
pub(crate) struct TierCounters {
    pub written: AtomicU64,
    pub dropped: AtomicU64,
    pub loaded: AtomicU64,
    pub missed: AtomicU64,
    pub corrupt: AtomicU64,
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub errors: AtomicU64,
    /// Operations submitted and not yet taken by the tier's thread.
    pub queue: AtomicU64,
}

impl TierCounters {
    /// Copies the counters and `state` into `s`.
    pub fn fill(&self, state: TierState, s: &mut StatsReply) {
        // Relaxed: counters, each read on its own; no access pairs.
        let r = Ordering::Relaxed;
        s.l2_state = state as u64;
        s.l2_written_objects = self.written.load(r);
        s.l2_write_dropped_objects = self.dropped.load(r);
        s.l2_loaded_objects = self.loaded.load(r);
        s.l2_missed_objects = self.missed.load(r);
        s.l2_corrupt_objects = self.corrupt.load(r);
        s.l2_bytes_out = self.bytes_out.load(r);
        s.l2_bytes_in = self.bytes_in.load(r);
        s.l2_errors = self.errors.load(r);
        s.l2_queue = self.queue.load(r);
    }
}

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
