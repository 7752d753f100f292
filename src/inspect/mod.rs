//! A read-only view of a segment: what `kvring-inspect` shows. Works while
//! the server runs, while it is wedged, and after it died, because it only
//! maps the segment PROT_READ, never writes, and never takes a lock the
//! server could wait on (liveness is a lock *test*).
//!
//! Every value comes from shared memory another process writes, so nothing
//! is trusted: each word is read once, impossible combinations are reported
//! as inconsistencies, and a job slot a writer holds too long is reported
//! busy rather than waited for.
//!
//! Loads are Relaxed unless they say otherwise: each word is read once and
//! judged on its own, nothing is concluded from the order in which two words
//! were written, so there is no store for them to pair with.

mod anomalies;
mod read;
mod view;

pub use anomalies::{compare, Anomaly, AnomalyKind, HEARTBEAT_STALE_MS};
pub use read::{list, snapshot};
pub use view::{
    ClientView, Field, JobRow, JobsSummary, LaneView, ModelView, OpView, RingView, SegmentEntry,
    SegmentGeometry, ServerView, Snapshot, WorkerView,
};

use serde::Serialize;

/// Options of the checks.
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// A job unfinished for longer than this is flagged.
    pub job_age_s: f64,
    /// A copy worker with work that made no step for longer than this is
    /// flagged.
    pub lane_stall_s: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            job_age_s: 10.0,
            lane_stall_s: DEFAULT_LANE_STALL_S,
        }
    }
}

/// The default stall bound of a copy worker with work: a chunk's copy takes
/// about a millisecond, a pool's 1 GiB pin under a second.
pub const DEFAULT_LANE_STALL_S: f64 = 5.0;

/// Rates between two readings (per second).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Rates {
    pub requests_per_s: f64,
    pub bytes_per_s: f64,
    pub jobs_per_s: f64,
}

pub fn rates(prev: &Snapshot, cur: &Snapshot) -> Rates {
    let secs = cur.taken_mono_ns.saturating_sub(prev.taken_mono_ns) as f64 / 1e9;
    if secs <= 0.0 {
        return Rates::default();
    }
    let reqs = |s: &Snapshot| -> u64 {
        s.clients
            .iter()
            .map(|c| c.requests_served + c.requests_rejected)
            .sum()
    };
    let bytes = |s: &Snapshot| s.cache.stored_bytes + s.cache.retrieved_bytes;
    Rates {
        requests_per_s: reqs(cur).saturating_sub(reqs(prev)) as f64 / secs,
        bytes_per_s: bytes(cur).saturating_sub(bytes(prev)) as f64 / secs,
        jobs_per_s: cur.jobs.submitted.saturating_sub(prev.jobs.submitted) as f64 / secs,
    }
}
