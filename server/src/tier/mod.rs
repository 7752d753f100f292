//! The seam between the pool and the tiers below it: the local disk tier
//! and the remote (Valkey/Redis) tier, asked in that order ([`Level`]).
//!
//! The tiers are driven by one owner ([`owner`]), the way an offloading
//! tier is driven by its manager: the owner submits work, which the tier takes
//! or refuses at once ([`Tier::submit`] never blocks), and takes back what
//! the tier finished ([`Finished`]), then applies it to the cache itself.
//! The tier never calls into the request path: it sees the pool through
//! [`PoolView`] (the bytes of the objects it was asked to write, and room
//! for the objects it reads), not the server's state, and it never ends a
//! job, a lookup or a write's hold.
//!
//! What the cache records for the tiers (objects evicted, for the tiers in
//! write-back; objects stored, for those in write-through) it keeps until
//! the owner takes it; the threads that touch the cache only wake the owner
//! ([`link::Tiers::kick`]). Each tier gets what its own mode asks for, from
//! the pool: an object the pool evicts goes to every write-back tier at
//! once, and its range comes back when the last of them is done.

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

use super::cache::{Drained, LeaseMeta, Level, ObjectKey};
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
}

impl TierCounters {
    /// Copies the counters and `state` into the words of `level` in `s`.
    pub fn fill(&self, level: Level, state: TierState, s: &mut StatsReply) {
        // Relaxed: counters, each read on its own; no access pairs.
        let r = Ordering::Relaxed;
        let words = match level {
            Level::Remote => [
                &mut s.l2_state,
                &mut s.l2_written_objects,
                &mut s.l2_write_dropped_objects,
                &mut s.l2_loaded_objects,
                &mut s.l2_missed_objects,
                &mut s.l2_corrupt_objects,
                &mut s.l2_bytes_out,
                &mut s.l2_bytes_in,
                &mut s.l2_errors,
                &mut s.l2_queue,
            ],
            Level::Disk => [
                &mut s.disk_state,
                &mut s.disk_written_objects,
                &mut s.disk_write_dropped_objects,
                &mut s.disk_loaded_objects,
                &mut s.disk_missed_objects,
                &mut s.disk_corrupt_objects,
                &mut s.disk_bytes_out,
                &mut s.disk_bytes_in,
                &mut s.disk_errors,
                &mut s.disk_queue,
            ],
        };
        let values = [
            state as u64,
            self.written.load(r),
            self.dropped.load(r),
            self.loaded.load(r),
            self.missed.load(r),
            self.corrupt.load(r),
            self.bytes_out.load(r),
            self.bytes_in.load(r),
            self.errors.load(r),
            // The queue: the owner's count (`TierLink::in_flight`).
            0,
        ];
        for (w, v) in words.into_iter().zip(values) {
            *w = v;
        }
    }
}

/// Where a tier's counters go: its queue and its dropped writes, as the
/// owner counts them.
pub(crate) fn queue_and_dropped(level: Level, s: &mut StatsReply) -> (&mut u64, &mut u64) {
    match level {
        Level::Remote => (&mut s.l2_queue, &mut s.l2_write_dropped_objects),
        Level::Disk => (&mut s.disk_queue, &mut s.disk_write_dropped_objects),
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
    /// The longest the tier takes to answer a fetch (its own bound): the
    /// owner answers a lookup itself a second after, if the tier has not
    /// (a tier stuck in an operation that does not end).
    fn lookup_wait(&self) -> std::time::Duration;
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
    /// Bring the leading chunks of `fetch.hashes[fetch.start()..]` the tier has
    /// (every rank's object) into the pool.
    Fetch(Box<Fetch>),
}

/// What the owner does once a write is finished (written or not).
pub(crate) enum AfterWrite {
    /// Drop the hold on object `obj` for its write-through to `level`.
    Release { obj: u32, level: Level },
    /// The tier at `level` is done with an evicted object (write-back).
    Free { d: Drained, level: Level },
}

impl AfterWrite {
    /// The tier the write went to.
    pub fn level(&self) -> Level {
        match self {
            AfterWrite::Release { level, .. } | AfterWrite::Free { level, .. } => *level,
        }
    }
}

/// A lookup that missed the pool after `l1` chunks, on its way down the
/// tiers.
#[derive(Clone)]
pub(crate) struct Fetch {
    pub id: JobId,
    pub owner: u32,
    pub meta: LeaseMeta,
    pub group: Group,
    pub hashes: Vec<ChunkHash>,
    pub l1: u32,
    /// The tier asked now.
    pub at: Level,
    /// Chunks each tier brought into the pool, past the pool's `l1`.
    pub found: [u32; Level::ALL.len()],
}

impl Fetch {
    /// The first chunk no tier asked so far brought: where the tier asked
    /// now starts.
    pub fn start(&self) -> usize {
        self.l1 as usize + self.found.iter().sum::<u32>() as usize
    }
}

/// Work a tier finished, for its owner to apply.
pub(crate) enum TierDone {
    /// A write ended; `ok`: the tier has the object.
    Written { then: AfterWrite, ok: bool },
    /// A fetch ended: `hits` chunks past `fetch.start()` are in the pool, their
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
