//! What a reading holds: the server, the rings, the job table, the
//! operations, the copy lanes, the lookups by model, each wire code as a
//! [`Field`] (known, or the code this build does not know).

use crate::jobs::{JobKind, JobState};
use crate::proto::kv::StatsReply;
use crate::shm::{
    DisconnectReason, ServerState, SlotState,
    HIST_BUCKETS,
};
use crate::wire::WireEnum;
use serde::Serialize;
use std::collections::BTreeMap;
use super::Anomaly;


/// A wire code as read from the segment: its variant (serialized as the
/// variant's stable name), or the text saying which code this build does not
/// know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Field<E: WireEnum> {
    Known(E),
    Unknown(String),
}

impl<E: WireEnum> Field<E> {
    /// `decoded`, or `unknown(raw)` as the text.
    pub(super) fn read<R: Copy>(
        raw: R,
        decode: impl FnOnce(R) -> Option<E>,
        unknown: impl FnOnce(R) -> String,
    ) -> Self {
        decode(raw).map_or_else(|| Field::Unknown(unknown(raw)), Field::Known)
    }

    /// The variant, when the code was known.
    pub fn known(&self) -> Option<E> {
        match self {
            Field::Known(e) => Some(*e),
            Field::Unknown(_) => None,
        }
    }
}

impl<E: WireEnum> std::fmt::Display for Field<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Field::Known(e) => f.pad(e.wire_name()),
            Field::Unknown(s) => f.pad(s),
        }
    }
}

impl<E: WireEnum> PartialEq<str> for Field<E> {
    fn eq(&self, other: &str) -> bool {
        match self {
            Field::Known(e) => e.wire_name() == other,
            Field::Unknown(s) => s == other,
        }
    }
}

impl<E: WireEnum> PartialEq<&str> for Field<E> {
    fn eq(&self, other: &&str) -> bool {
        self == *other
    }
}

/// One kvring segment of this user, as `list` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentEntry {
    pub name: String,
    pub shm_path: String,
    /// None when the segment could not be read (see `error`).
    pub server_pid: Option<u32>,
    pub alive: Option<bool>,
    pub epoch: Option<u64>,
    pub layout_version: Option<u32>,
    pub clients_connected: Option<u32>,
    pub age_s: Option<f64>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ServerView {
    pub pid: u32,
    pub uid: u32,
    /// Proven by the liveness lock (the kernel drops it at exit).
    pub alive: bool,
    pub state: Field<ServerState>,
    pub epoch: u64,
    pub layout_version: u32,
    pub age_s: f64,
    /// None when the heartbeat is more than a second in the future (torn
    /// or from another boot).
    pub heartbeat_age_ms: Option<f64>,
    pub ring_thread_sleeping: bool,
    pub clients_connected: u32,
    pub clients_accepted: u64,
    pub clients_reclaimed: u64,
    pub clients_refused: u64,
    /// Bytes of the pool ready for copies (pinned, for the CUDA backend).
    pub pool_ready_bytes: u64,
}

/// The segment's sizes, as the inspector reports them.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentGeometry {
    pub max_clients: u32,
    pub job_slots: u32,
    pub req_ring_bytes: u32,
    pub cq_ring_bytes: u32,
    pub max_frame_bytes: u32,
    pub segment_bytes: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RingView {
    pub head: u64,
    pub tail: u64,
    /// Bytes written and not consumed (`tail - head`).
    pub used: u64,
    pub capacity: u64,
    /// `head <= tail <= head + capacity` held in this reading.
    pub consistent: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ClientView {
    pub slot: u32,
    pub state: Field<SlotState>,
    pub session: u32,
    pub pid: u32,
    /// The process with this pid and start time still exists.
    pub alive: bool,
    pub kv_instances: u32,
    pub requests_served: u64,
    pub requests_rejected: u64,
    pub completions_posted: u64,
    pub disconnect_reason: Field<DisconnectReason>,
    pub request_ring: RingView,
    pub completion_ring: RingView,
    pub in_flight: u32,
    pub credits: u32,
    pub sleeping: bool,
    pub heartbeat_age_ms: Option<f64>,
    pub connected_age_s: f64,
    /// How long the slot has been in its state (closing or quarantined:
    /// how long its reclaim has taken so far).
    pub state_age_ms: Option<f64>,
    /// The session's own memory (its block and request ring) could be read:
    /// through the server's descriptor, so only while the server lives and
    /// the session lasts (a closing or quarantined slot, or a dead server's,
    /// has none); without it the client-written words above read as an
    /// empty ring, zeros and no heartbeat.
    pub client_memory: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct JobRow {
    pub index: u32,
    pub generation: u64,
    /// `epoch:key`, as the client library prints it.
    pub id: String,
    pub kind: Field<JobKind>,
    pub state: Field<JobState>,
    pub owner_slot: u32,
    pub owner_session: u32,
    pub fail_reason: Option<String>,
    pub result_value: u64,
    pub result_aux: u64,
    pub progress: u64,
    pub user_data: u64,
    /// Since submitted.
    pub age_s: f64,
    /// Submitted -> finished, for finished jobs.
    pub duration_ms: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct JobsSummary {
    /// Slots per state (free, pending, running, done, failed, tombstoned).
    pub by_state: BTreeMap<String, u64>,
    pub oldest_unfinished: Option<JobRow>,
    /// Slots a writer held past the read bound (reported, not waited for).
    pub busy_slots: u64,
    pub submitted: u64,
    pub done: u64,
    pub failed: u64,
    pub released: u64,
    pub refused: u64,
    /// Slots retired because another process wrote their lock word.
    pub retired: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpView {
    pub name: &'static str,
    pub count: u64,
    pub errors: u64,
    /// Upper bounds of the histogram buckets holding the percentile; None
    /// with no samples.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub samples: u64,
    /// The recorded latencies added up.
    pub sum_us: f64,
    /// The histogram's buckets (see `OpStat`).
    #[serde(skip)]
    pub buckets: [u64; HIST_BUCKETS],
}

/// One copy worker, as a reading shows it.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerView {
    pub index: u32,
    pub in_flight: u32,
    pub held: u32,
    pub copies: u64,
    /// Since its last step (None: unreadable).
    pub beat_age_ms: Option<f64>,
}

/// One copy lane (a device, or `host` for engines with no device).
#[derive(Clone, Debug, Serialize)]
pub struct LaneView {
    pub lane: u32,
    /// The device's UUID, or `host`.
    pub device: String,
    /// Tasks queued, not yet taken by a worker.
    pub queued: u64,
    /// Copies in flight, over the workers.
    pub in_flight: u64,
    /// Tasks held for their engine's event, over the workers.
    pub held: u64,
    /// Copies settled, over the workers.
    pub copies: u64,
    pub events_waited: u64,
    pub events_timed_out: u64,
    pub workers: Vec<WorkerView>,
}

impl LaneView {
    /// The longest a worker with work went without a step, in ms (0: none
    /// has work; None: a beat is unreadable).
    pub fn stalled_ms(&self) -> Option<f64> {
        let mut worst: f64 = 0.0;
        for w in &self.workers {
            if w.in_flight > 0 || w.held > 0 || self.queued > 0 {
                worst = worst.max(w.beat_age_ms?);
            }
        }
        Some(worst)
    }
}

/// Lookups of one (model, salt): `other` for those past the region's rows.
#[derive(Clone, Debug, Serialize)]
pub struct ModelView {
    /// The model id in hex, or `other`.
    pub model: String,
    /// The salt in hex, or `other`.
    pub salt: String,
    pub lookups: u64,
    pub chunks: u64,
    pub hit_chunks: u64,
    pub tokens: u64,
    pub hit_tokens: u64,
}

/// Everything `show` reports.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    pub name: String,
    pub server: ServerView,
    pub geometry: SegmentGeometry,
    pub clients: Vec<ClientView>,
    pub jobs: JobsSummary,
    pub ops: Vec<OpView>,
    pub cache: StatsReply,
    pub lanes: Vec<LaneView>,
    pub models: Vec<ModelView>,
    pub anomalies: Vec<Anomaly>,
    /// Unix ns when this was taken.
    pub taken_unix_ns: u64,
    #[serde(skip)]
    pub taken_mono_ns: u64,
    #[serde(skip)]
    pub rows: Vec<JobRow>,
}
