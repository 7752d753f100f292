//! The copy lanes region: one [`LaneStat`] per copy lane (lane 0 for
//! engines with no device, then one per device), each with one
//! [`WorkerStat`] per copy worker of the lane. The workers and the ring
//! loop write them; observers (the inspector, `/healthz`, `/metrics`) read
//! each word on its own and see a worker with work that stopped moving.

use crate::shm_struct::shm_struct;
use crate::sync::{AtomicU32, AtomicU64};
use std::mem::size_of;

/// Most devices a server copies with (one lane each, plus lane 0).
pub const MAX_DEVICES: usize = 64;
/// Lanes the region has room for.
pub const MAX_LANES: usize = MAX_DEVICES + 1;
/// Worker entries per lane (the most copy workers a lane may have).
pub const LANE_WORKERS: usize = crate::job_words::WORD_WORKERS as usize;

shm_struct! {
    /// One copy worker's words, written by that worker only (Relaxed
    /// stores: observers read each word on its own).
    pub struct WorkerStat => WorkerStatValues {
        /// CLOCK_MONOTONIC ns of the worker's last step: it took a task,
        /// settled a copy, asked about its held tasks' events, or checked
        /// its lane for work (at least every 100 ms while it waits).
        [0] pub beat_ns: AtomicU64,
        /// Copies started and not yet settled.
        [8] pub in_flight: AtomicU32,
        /// Tasks taken and held back until their engine's event completes.
        [12] pub held: AtomicU32,
        /// Copies settled (any outcome).
        [16] pub copies: AtomicU64,
        [24] pub _reserved: [AtomicU64; 5],
    }
}

shm_struct! {
    /// One copy lane's words, at `lanes_off + lane * 2176`.
    pub struct LaneStat => LaneStatValues {
        /// The lane's device UUID as two little-endian words (0: lane 0,
        /// engines with no device). Written before the server runs.
        [0] pub device: [AtomicU64; 2],
        /// Copy workers of this lane (0: no such lane). Written before the
        /// server runs.
        [16] pub workers: AtomicU32,
        [20] pub _reserved0: AtomicU32,
        /// Tasks queued and not yet taken by a worker (stored under the
        /// lane's lock by whoever changed the queue).
        [24] pub queued: AtomicU64,
        /// Jobs whose engine event had not completed when a worker first
        /// asked (counter, Relaxed adds).
        [32] pub events_waited: AtomicU64,
        /// Jobs failed because their engine event did not complete before
        /// the job's deadline (counter, Relaxed adds).
        [40] pub events_timed_out: AtomicU64,
        [48] pub _reserved1: [AtomicU64; 10],
        /// Per worker, at its index in the lane.
        [128] pub worker: [WorkerStat; LANE_WORKERS],
    }
}

shm_struct! {
    /// The copy lanes region, at `lanes_off`. Written by the server only.
    pub struct LaneStats => LaneStatsValues {
        /// Per lane, at its index; lanes past the server's are zero.
        [0] pub lanes: [LaneStat; MAX_LANES],
    }
}

const _: () = {
    assert!(size_of::<WorkerStat>() == 64);
    assert!(size_of::<LaneStat>() == 128 + 64 * LANE_WORKERS);
    assert!(size_of::<LaneStats>() == MAX_LANES * size_of::<LaneStat>());
};
