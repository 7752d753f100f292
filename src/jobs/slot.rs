//! One job slot in shared memory and its seqlock.
//!
//! The server is the only writer of the job table (clients map it read-only),
//! but several server threads may write the same slot (the thread that runs a
//! job, the one that fails a dead client's jobs), so the sequence word is also
//! the writers' lock: a writer moves it from even to odd with a CAS, writes
//! the fields, and stores the next even value.
//!
//! ```text
//! writer                                  reader
//! CAS seq s -> s+1 (Acquire)              s1 = seq.load(Acquire)      -- R1
//! fence(Release)                  -- W1   if s1 odd: retry
//! store fields (Relaxed)                  load fields (Relaxed)
//! seq.store(s+2, Release)         -- W2   fence(Acquire)              -- R2
//!                                         s2 = seq.load(Relaxed)
//!                                         s1 == s2: the copy is whole
//! ```
//!
//! R1 pairs with W2: a reader that sees `s+2` sees every field of that write.
//! R2 pairs with W1: if a field load saw any store of a later write, the
//! later load of `seq` sees that write's odd value (or later), so the reader
//! retries. The CAS's Acquire pairs with the previous writer's W2, so writers
//! of one slot are ordered too. Every field is an atomic: a torn copy is
//! detected and discarded, never undefined behaviour.

use crate::shm_struct::shm_struct;
use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};

shm_struct! {
    /// One job slot (128 bytes, `shm_layout.md` "JobSlot"). Server-written only.
    #[repr(align(128))]
    pub struct JobSlot => JobSlotValues {
        /// Seqlock sequence: odd while a writer is inside, bumped by 2 per write.
        [0] pub seq: AtomicU64,
        /// Generation of the current (or last) job in this slot; 0 = never used.
        [8] pub generation: AtomicU64,
        /// `JobState` as u32.
        [16] pub state: AtomicU32,
        /// `JobKind` as u32.
        [20] pub kind: AtomicU32,
        /// Client slot of the owner.
        [24] pub owner_slot: AtomicU32,
        /// Session tag of the owner (its slot's occupant when it submitted).
        [28] pub owner_session: AtomicU32,
        /// `FailReason` code; 0 when the job did not fail.
        [32] pub fail_reason: AtomicU32,
        [36] pub _reserved0: AtomicU32,
        /// Result word 1 (meaning per job kind).
        [40] pub result_value: AtomicU64,
        /// Result word 2 (meaning per job kind).
        [48] pub result_aux: AtomicU64,
        /// Work done so far (meaning per job kind), updated while running.
        [56] pub progress: AtomicU64,
        /// The submitter's `user_data` of the request that created the job.
        [64] pub user_data: AtomicU64,
        /// CLOCK_MONOTONIC ns: submitted.
        [72] pub submitted_ns: AtomicU64,
        /// CLOCK_MONOTONIC ns: started (0 until then).
        [80] pub started_ns: AtomicU64,
        /// CLOCK_MONOTONIC ns: finished (0 until then).
        [88] pub finished_ns: AtomicU64,
        /// CLOCK_MONOTONIC ns: released (0 until then).
        [96] pub released_ns: AtomicU64,
        [104] pub _reserved1: [AtomicU64; 3],
    }
}

/// The fields a status poll needs, copied out consistently.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStatus {
    pub generation: u64,
    pub state: u32,
    pub fail_reason: u32,
    pub result_value: u64,
    pub result_aux: u64,
}

/// Every field of a slot, copied out consistently (observers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotSnapshot {
    pub status: SlotStatus,
    pub kind: u32,
    pub owner_slot: u32,
    pub owner_session: u32,
    pub progress: u64,
    pub user_data: u64,
    pub submitted_ns: u64,
    pub started_ns: u64,
    pub finished_ns: u64,
    pub released_ns: u64,
}

/// Fields a writer sets; `None` leaves a field as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct SlotUpdate {
    pub generation: Option<u64>,
    pub state: Option<u32>,
    pub kind: Option<u32>,
    pub owner_slot: Option<u32>,
    pub owner_session: Option<u32>,
    pub fail_reason: Option<u32>,
    pub result_value: Option<u64>,
    pub result_aux: Option<u64>,
    pub progress: Option<u64>,
    pub user_data: Option<u64>,
    pub submitted_ns: Option<u64>,
    pub started_ns: Option<u64>,
    pub finished_ns: Option<u64>,
    pub released_ns: Option<u64>,
}

impl JobSlot {
    /// A zeroed slot (what a fresh segment holds), for heap-backed tables.
    pub fn new() -> JobSlot {
        JobSlot {
            seq: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            state: AtomicU32::new(0),
            kind: AtomicU32::new(0),
            owner_slot: AtomicU32::new(0),
            owner_session: AtomicU32::new(0),
            fail_reason: AtomicU32::new(0),
            _reserved0: AtomicU32::new(0),
            result_value: AtomicU64::new(0),
            result_aux: AtomicU64::new(0),
            progress: AtomicU64::new(0),
            user_data: AtomicU64::new(0),
            submitted_ns: AtomicU64::new(0),
            started_ns: AtomicU64::new(0),
            finished_ns: AtomicU64::new(0),
            released_ns: AtomicU64::new(0),
            _reserved1: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// One attempt at a consistent copy of the status fields: `None` when a
    /// writer was inside or got in between (retry).
    #[inline]
    pub fn try_read_status(&self) -> Option<SlotStatus> {
        // R1: pairs with the writer's W2 (Release store of the even value).
        let s1 = self.seq.load(Ordering::Acquire);
        if s1 & 1 != 0 {
            return None;
        }
        let r = Ordering::Relaxed;
        let st = SlotStatus {
            generation: self.generation.load(r),
            state: self.state.load(r),
            fail_reason: self.fail_reason.load(r),
            result_value: self.result_value.load(r),
            result_aux: self.result_aux.load(r),
        };
        // R2: pairs with the writer's W1 (fence after taking the odd value).
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == s1).then_some(st)
    }

    /// One attempt at a consistent copy of every field.
    pub fn try_snapshot(&self) -> Option<SlotSnapshot> {
        // R1, as in `try_read_status`.
        let s1 = self.seq.load(Ordering::Acquire);
        if s1 & 1 != 0 {
            return None;
        }
        let snap = self.load_all();
        // R2, as in `try_read_status`.
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == s1).then_some(snap)
    }

    /// Every field, Relaxed: whole only between two equal even `seq` loads
    /// (readers) or under the writers' lock.
    fn load_all(&self) -> SlotSnapshot {
        let r = Ordering::Relaxed;
        SlotSnapshot {
            status: SlotStatus {
                generation: self.generation.load(r),
                state: self.state.load(r),
                fail_reason: self.fail_reason.load(r),
                result_value: self.result_value.load(r),
                result_aux: self.result_aux.load(r),
            },
            kind: self.kind.load(r),
            owner_slot: self.owner_slot.load(r),
            owner_session: self.owner_session.load(r),
            progress: self.progress.load(r),
            user_data: self.user_data.load(r),
            submitted_ns: self.submitted_ns.load(r),
            started_ns: self.started_ns.load(r),
            finished_ns: self.finished_ns.load(r),
            released_ns: self.released_ns.load(r),
        }
    }

    /// Takes the writers' lock (seq even -> odd), waiting at most `spins`
    /// times for another writer to leave; `None` when the word stayed odd.
    /// The server's writers exclude each other before they come here (the
    /// job table's stripes), so an odd word they meet was written by
    /// another process, and is never waited for without a bound.
    pub fn try_lock(&self, spins: u32) -> Option<SlotWriter<'_>> {
        let mut s = self.seq.load(Ordering::Relaxed);
        let mut waited = 0u32;
        loop {
            if s & 1 == 0 {
                // Acquire pairs with the previous writer's W2: its stores
                // happen before ours.
                match self.seq.compare_exchange_weak(
                    s,
                    s.wrapping_add(1),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => s = now,
                }
            } else {
                if waited >= spins {
                    return None;
                }
                waited += 1;
                crate::sync::spin_hint();
                s = self.seq.load(Ordering::Relaxed);
            }
        }
        // W1: pairs with the readers' R2 fence.
        fence(Ordering::Release);
        Some(SlotWriter { slot: self, seq: s })
    }

    /// Takes the writers' lock, waiting as long as another writer holds it
    /// (tests and models, whose writers all play by the rules).
    #[cfg(any(test, kvring_loom))]
    pub fn lock(&self) -> SlotWriter<'_> {
        loop {
            if let Some(w) = self.try_lock(u32::MAX) {
                return w;
            }
        }
    }
}

impl Default for JobSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// The writers' lock on one slot; dropping it publishes the write.
pub struct SlotWriter<'a> {
    slot: &'a JobSlot,
    seq: u64,
}

impl SlotWriter<'_> {
    /// The slot's current fields (only writers store them, and we hold the
    /// lock, so these are the latest values).
    pub fn current(&self) -> SlotSnapshot {
        self.slot.load_all()
    }

    /// Stores the fields `u` sets (Relaxed: published by the unlock's W2).
    pub fn apply(&self, u: &SlotUpdate) {
        let s = self.slot;
        let r = Ordering::Relaxed;
        macro_rules! set {
            ($($f:ident),*) => {$(
                if let Some(v) = u.$f { s.$f.store(v, r); }
            )*};
        }
        set!(
            generation,
            state,
            kind,
            owner_slot,
            owner_session,
            fail_reason,
            result_value,
            result_aux,
            progress,
            user_data,
            submitted_ns,
            started_ns,
            finished_ns,
            released_ns
        );
    }
}

impl Drop for SlotWriter<'_> {
    fn drop(&mut self) {
        // W2: pairs with the readers' R1 Acquire load and the next writer's
        // Acquire CAS.
        self.slot
            .seq
            .store(self.seq.wrapping_add(2), Ordering::Release);
    }
}
