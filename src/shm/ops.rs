//! Per-operation telemetry: the op stats region, one [`OpStat`] per
//! operation, indexed by the operation's dense index (`Opcode::index`, its
//! position in `Opcode::ALL`).
//!
//! The region has room for [`OP_STAT_SLOTS`] operations, more than the
//! protocol has, so a new operation needs no layout change; slots past
//! `Opcode::ALL.len()` stay zero.

use crate::proto::Opcode;
use crate::shm_struct::shm_struct;
use crate::sync::AtomicU64;
use std::mem::size_of;
use std::sync::atomic::Ordering;

/// Buckets of an `OpStat` histogram.
pub const HIST_BUCKETS: usize = 32;
/// Operations the op stats region has room for.
pub const OP_STAT_SLOTS: usize = 64;

shm_struct! {
    /// One operation's counters, written by any server thread (Relaxed adds;
    /// observers read each word on its own).
    ///
    /// `hist[i]` counts latencies in `[64 << i, 64 << (i + 1))` ns (bucket 0 also
    /// takes anything shorter, the last anything longer). The latency of a job
    /// operation is its job's submitted -> finished time; of any other, the
    /// server's time from reading the request to writing its completion. PING
    /// latencies are not recorded (it is the client's round trip).
    pub struct OpStat => OpStatValues {
        /// Requests served (including refused ones).
        [0] pub count: AtomicU64,
        /// Requests answered with an error status, and jobs that failed.
        [8] pub errors: AtomicU64,
        [16] pub hist: [AtomicU64; HIST_BUCKETS],
        /// The recorded latencies added up, in ns (a histogram's sum).
        [272] pub sum_ns: AtomicU64,
    }
}

const _: () = {
    assert!(size_of::<OpStat>() == 280);
};

impl OpStat {
    /// The bucket of a latency.
    pub fn bucket(ns: u64) -> usize {
        let units = (ns >> 6).max(1);
        ((63 - units.leading_zeros()) as usize).min(HIST_BUCKETS - 1)
    }

    /// Counts one latency.
    pub fn record(&self, ns: u64) {
        // Observers only: Relaxed (a reader may see the bucket and the sum
        // of one latency apart; each word is right on its own).
        self.hist[Self::bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Upper bound (ns) of bucket `i`.
    pub fn bucket_limit(i: usize) -> u64 {
        64u64 << (i + 1)
    }
}

shm_struct! {
    /// The op stats region, at `op_stats_off`. Written by the server only.
    pub struct OpStats => OpStatsValues {
        /// Per operation, at its dense index.
        [0] pub ops: [OpStat; OP_STAT_SLOTS],
    }
}

const _: () = {
    assert!(size_of::<OpStats>() == OP_STAT_SLOTS * 280);
    // Every operation has a slot (the table grows with `Opcode`).
    assert!(crate::proto::OPS <= OP_STAT_SLOTS);
};

impl OpStats {
    /// The counters of `op`.
    pub fn of(&self, op: Opcode) -> &OpStat {
        &self.ops[op.index()]
    }
}
