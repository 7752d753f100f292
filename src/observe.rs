//! A read-only view of a segment: what `kvring-inspect` shows. Works while
//! the server runs, while it is wedged, and after it died, because it only
//! maps the segment PROT_READ, never writes, and never takes a lock the
//! server could wait on (liveness is a lock *test*).
//!
//! Every value comes from shared memory another process writes, so nothing
//! is trusted: each word is read once, impossible combinations are reported
//! as inconsistencies, and a job slot a writer holds too long is reported
//! busy rather than waited for.

use crate::jobs::{FailReason, JobKind, JobState};
use crate::layout::{OpStat, ServerState, SlotState, CACHE_STATS_WORDS, HIST_BUCKETS, OP_NAMES};
use crate::liveness::{monotonic_ns, process_start_ticks, unix_ns};
use crate::proto::kv::StatsReply;
use crate::segment::ReadOnlySegment;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// A heartbeat older than this (the server beats every 50 ms) is stale.
pub const HEARTBEAT_STALE_MS: f64 = 1000.0;

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

/// Every `/dev/shm/kvring-UID-*` object of this user.
pub fn list() -> Vec<SegmentEntry> {
    let prefix = format!("kvring-{}-", crate::rundir::euid());
    let mut names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
        .into_iter()
        .map(|file| {
            let name = file[prefix.len()..].to_string();
            let shm = format!("/{file}");
            let mut e = SegmentEntry {
                name,
                shm_path: format!("/dev/shm/{file}"),
                server_pid: None,
                alive: None,
                epoch: None,
                layout_version: None,
                clients_connected: None,
                age_s: None,
                error: None,
            };
            match ReadOnlySegment::open_shm(&shm) {
                Ok(seg) => {
                    let info = seg.mapping.info();
                    e.server_pid = Some(info.server_pid);
                    e.alive = seg.server_alive().ok();
                    e.epoch = Some(info.epoch);
                    e.layout_version = Some(info.layout_version);
                    e.clients_connected =
                        Some(seg.mapping.header().clients_connected.load(Relaxed));
                    e.age_s = Some(unix_ns().saturating_sub(info.created_unix_ns) as f64 / 1e9);
                }
                Err(err) => e.error = Some(err.to_string()),
            }
            e
        })
        .collect()
}

#[derive(Clone, Debug, Serialize)]
pub struct ServerView {
    pub pid: u32,
    pub uid: u32,
    /// Proven by the liveness lock (the kernel drops it at exit).
    pub alive: bool,
    pub state: String,
    pub epoch: u64,
    pub layout_version: u32,
    pub age_s: f64,
    /// None when the heartbeat is in the future (torn or from another boot).
    pub heartbeat_age_ms: Option<f64>,
    pub ring_thread_sleeping: bool,
    pub clients_connected: u32,
    pub clients_accepted: u64,
    pub clients_reclaimed: u64,
    pub clients_refused: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Geometry {
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

fn ring(head: u64, tail: u64, capacity: u64) -> RingView {
    let consistent = head <= tail && tail - head <= capacity;
    RingView {
        head,
        tail,
        used: tail.saturating_sub(head),
        capacity,
        consistent,
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ClientView {
    pub slot: u32,
    pub state: String,
    pub session: u32,
    pub pid: u32,
    /// The process with this pid and start time still exists.
    pub alive: bool,
    pub kv_instances: u32,
    pub requests_served: u64,
    pub requests_rejected: u64,
    pub completions_posted: u64,
    pub disconnect_reason: String,
    pub request_ring: RingView,
    pub completion_ring: RingView,
    pub in_flight: u32,
    pub credits: u32,
    pub sleeping: bool,
    pub heartbeat_age_ms: Option<f64>,
    pub connected_age_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct JobRow {
    pub index: u32,
    pub generation: u64,
    /// `epoch:key`, as the client library prints it.
    pub id: String,
    pub kind: String,
    pub state: String,
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
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Anomaly {
    /// `server_dead`, `heartbeat_stopped`, `ring_stalled`,
    /// `completions_unread`, `job_stuck`, `dead_client_not_reclaimed`,
    /// `inconsistent`.
    pub kind: &'static str,
    pub message: String,
    pub client_slot: Option<u32>,
}

/// Everything `show` reports.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    pub name: String,
    pub server: ServerView,
    pub geometry: Geometry,
    pub clients: Vec<ClientView>,
    pub jobs: JobsSummary,
    pub ops: Vec<OpView>,
    pub cache: StatsReply,
    pub anomalies: Vec<Anomaly>,
    /// Unix ns when this was taken.
    pub taken_unix_ns: u64,
    #[serde(skip)]
    pub taken_mono_ns: u64,
    #[serde(skip)]
    pub rows: Vec<JobRow>,
}

fn age_ms(now: u64, then: u64) -> Option<f64> {
    (then <= now).then(|| (now - then) as f64 / 1e6)
}

fn percentile(hist: &[u64; HIST_BUCKETS], q: f64) -> Option<f64> {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, &n) in hist.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some(OpStat::bucket_limit(i) as f64 / 1e3);
        }
    }
    None
}

fn job_row(epoch: u64, index: u32, s: &crate::jobs::slot::SlotSnapshot, now: u64) -> JobRow {
    let st = JobState::from_u32(s.status.state);
    let finished = matches!(
        st,
        Some(JobState::Done | JobState::Failed | JobState::Tombstoned)
    ) && s.finished_ns >= s.submitted_ns
        && s.finished_ns != 0;
    JobRow {
        index,
        generation: s.status.generation,
        id: format!(
            "{epoch}:{}",
            (s.status.generation << crate::jobs::INDEX_BITS) | u64::from(index)
        ),
        kind: JobKind::from_u32(s.kind)
            .map_or_else(|| format!("kind {}", s.kind), |k| k.name().to_string()),
        state: st.map_or_else(
            || format!("state {} (unknown)", s.status.state),
            |s| s.name().to_string(),
        ),
        owner_slot: s.owner_slot,
        owner_session: s.owner_session,
        fail_reason: (s.status.fail_reason != 0)
            .then(|| FailReason::from_code(s.status.fail_reason).to_string()),
        result_value: s.status.result_value,
        result_aux: s.status.result_aux,
        progress: s.progress,
        user_data: s.user_data,
        age_s: now.saturating_sub(s.submitted_ns) as f64 / 1e9,
        duration_ms: finished.then(|| (s.finished_ns - s.submitted_ns) as f64 / 1e6),
    }
}

/// Options of the checks.
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// A job unfinished for longer than this is flagged.
    pub job_age_s: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { job_age_s: 10.0 }
    }
}

/// Reads the whole segment once.
pub fn snapshot(seg: &ReadOnlySegment, th: Thresholds) -> Snapshot {
    let m = &seg.mapping;
    let info = m.info();
    let h = m.header();
    let now = monotonic_ns();
    let alive = seg.server_alive().unwrap_or(false);
    let state = h.server_state.load(Relaxed);
    let server = ServerView {
        pid: info.server_pid,
        uid: info.server_uid,
        alive,
        state: ServerState::from_u32(state).map_or_else(
            || format!("state {state} (unknown)"),
            |s| format!("{s:?}").to_lowercase(),
        ),
        epoch: info.epoch,
        layout_version: info.layout_version,
        age_s: unix_ns().saturating_sub(info.created_unix_ns) as f64 / 1e9,
        heartbeat_age_ms: age_ms(now, h.heartbeat_ns.load(Relaxed)),
        ring_thread_sleeping: h.server_sleeping.load(Relaxed) != 0,
        clients_connected: h.clients_connected.load(Relaxed),
        clients_accepted: h.clients_accepted.load(Relaxed),
        clients_reclaimed: h.clients_reclaimed.load(Relaxed),
        clients_refused: h.clients_refused.load(Relaxed),
    };
    let g = info.geometry;
    let geometry = Geometry {
        max_clients: g.max_clients,
        job_slots: g.job_slots,
        req_ring_bytes: g.req_ring_bytes,
        cq_ring_bytes: g.cq_ring_bytes,
        max_frame_bytes: g.max_frame_bytes,
        segment_bytes: info.segment_bytes,
    };
    let mut anomalies = Vec::new();
    let mut clients = Vec::new();
    for slot in 0..g.max_clients {
        let sb = m.server_client(slot);
        let raw_state = sb.state.load(Relaxed);
        if raw_state == SlotState::Free as u32 {
            continue;
        }
        let cb = m.client_block(slot);
        let pid = sb.pid.load(Relaxed);
        let start = sb.pid_start_ticks.load(Relaxed);
        let proc_alive = process_start_ticks(pid).is_some_and(|t| start == 0 || t == start);
        let reason = sb.disconnect_reason.load(Relaxed);
        let v = ClientView {
            slot,
            state: SlotState::from_u32(raw_state).map_or_else(
                || format!("state {raw_state} (unknown)"),
                |s| format!("{s:?}").to_lowercase(),
            ),
            session: sb.session.load(Relaxed),
            pid,
            alive: proc_alive,
            kv_instances: sb.kv_instances.load(Relaxed),
            requests_served: sb.requests_served.load(Relaxed),
            requests_rejected: sb.requests_rejected.load(Relaxed),
            completions_posted: sb.completions_posted.load(Relaxed),
            disconnect_reason: match reason {
                0 => "none".into(),
                1 => "goodbye".into(),
                2 => "socket closed".into(),
                3 => "ring corrupt".into(),
                4 => "server shutdown".into(),
                r => format!("reason {r} (unknown)"),
            },
            request_ring: ring(
                sb.req_head.load(Relaxed),
                cb.req_tail.load(Relaxed),
                u64::from(g.req_ring_bytes),
            ),
            completion_ring: ring(
                cb.cq_head.load(Relaxed),
                sb.cq_tail.load(Relaxed),
                u64::from(g.cq_ring_bytes),
            ),
            in_flight: cb.in_flight.load(Relaxed),
            credits: cb.credits.load(Relaxed),
            sleeping: cb.client_sleeping.load(Relaxed) != 0,
            heartbeat_age_ms: age_ms(now, cb.heartbeat_ns.load(Relaxed)),
            connected_age_s: unix_ns().saturating_sub(sb.connected_unix_ns.load(Relaxed)) as f64
                / 1e9,
        };
        for (name, r) in [
            ("request", &v.request_ring),
            ("completion", &v.completion_ring),
        ] {
            if !r.consistent {
                anomalies.push(Anomaly {
                    kind: "inconsistent",
                    message: format!(
                        "slot {slot}: {name} ring head {} tail {} capacity {} cannot all be true",
                        r.head, r.tail, r.capacity
                    ),
                    client_slot: Some(slot),
                });
            }
        }
        if !proc_alive && alive && raw_state != SlotState::Free as u32 {
            anomalies.push(Anomaly {
                kind: "dead_client_not_reclaimed",
                message: format!(
                    "slot {slot} ({}) still held for pid {pid}, which has exited",
                    v.state
                ),
                client_slot: Some(slot),
            });
        }
        clients.push(v);
    }

    // Jobs.
    let reader = m.job_reader();
    let mut jobs = JobsSummary {
        submitted: h.jobs_submitted.load(Relaxed),
        done: h.jobs_done.load(Relaxed),
        failed: h.jobs_failed.load(Relaxed),
        released: h.jobs_released.load(Relaxed),
        refused: h.jobs_refused.load(Relaxed),
        ..Default::default()
    };
    let mut rows = Vec::new();
    for index in 0..g.job_slots {
        let snap = match reader.snapshot(index) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(_) => {
                jobs.busy_slots += 1;
                continue;
            }
        };
        let name = JobState::from_u32(snap.status.state)
            .map_or_else(|| "unknown".to_string(), |s| s.name().to_string());
        *jobs.by_state.entry(name).or_default() += 1;
        if snap.status.generation == 0 {
            continue;
        }
        let row = job_row(info.epoch, index, &snap, now);
        let unfinished = matches!(
            JobState::from_u32(snap.status.state),
            Some(JobState::Pending | JobState::Running)
        );
        if unfinished
            && jobs
                .oldest_unfinished
                .as_ref()
                .is_none_or(|o| o.age_s < row.age_s)
        {
            jobs.oldest_unfinished = Some(row.clone());
        }
        rows.push(row);
    }
    if let Some(o) = &jobs.oldest_unfinished {
        if o.age_s > th.job_age_s {
            anomalies.push(Anomaly {
                kind: "job_stuck",
                message: format!(
                    "{} job {} (slot {}) of client slot {} {} for {:.1} s",
                    o.kind, o.id, o.index, o.owner_slot, o.state, o.age_s
                ),
                client_slot: Some(o.owner_slot),
            });
        }
    }
    if jobs.busy_slots > 0 {
        anomalies.push(Anomaly {
            kind: "inconsistent",
            message: format!(
                "{} job slots stayed locked by a writer past the read bound",
                jobs.busy_slots
            ),
            client_slot: None,
        });
    }

    let ops = OP_NAMES
        .iter()
        .zip(h.op_stats.iter())
        .map(|(name, st)| {
            let hist: [u64; HIST_BUCKETS] = std::array::from_fn(|i| st.hist[i].load(Relaxed));
            OpView {
                name,
                count: st.count.load(Relaxed),
                errors: st.errors.load(Relaxed),
                p50_us: percentile(&hist, 0.5),
                p99_us: percentile(&hist, 0.99),
                samples: hist.iter().sum(),
            }
        })
        .collect();
    let words: [u64; CACHE_STATS_WORDS] = std::array::from_fn(|i| h.cache_stats[i].load(Relaxed));
    let cache: StatsReply = bytemuck::cast(words);
    if cache.pool_used_bytes > cache.pool_bytes {
        anomalies.push(Anomaly {
            kind: "inconsistent",
            message: format!(
                "pool usage {} exceeds the pool's {} bytes",
                cache.pool_used_bytes, cache.pool_bytes
            ),
            client_slot: None,
        });
    }
    if !alive {
        anomalies.push(Anomaly {
            kind: "server_dead",
            message: format!(
                "server pid {} is gone (its liveness lock is free): this is a post-mortem view",
                info.server_pid
            ),
            client_slot: None,
        });
    } else if server
        .heartbeat_age_ms
        .is_none_or(|a| a > HEARTBEAT_STALE_MS)
    {
        anomalies.push(Anomaly {
            kind: "heartbeat_stopped",
            message: format!(
                "server pid {} is alive but its heartbeat is {} old: wedged or stopped",
                info.server_pid,
                server
                    .heartbeat_age_ms
                    .map_or("unreadable".to_string(), |a| format!("{:.0} ms", a))
            ),
            client_slot: None,
        });
    }
    Snapshot {
        name: {
            let shm = info.name.trim_start_matches('/');
            let prefix = format!("kvring-{}-", crate::rundir::euid());
            shm.strip_prefix(&prefix).unwrap_or(shm).to_string()
        },
        server,
        geometry,
        clients,
        jobs,
        ops,
        cache,
        anomalies,
        taken_unix_ns: unix_ns(),
        taken_mono_ns: now,
        rows,
    }
}

/// Adds what only two readings show: a ring whose consumer did not move
/// while it had bytes to consume.
pub fn compare(prev: &Snapshot, cur: &mut Snapshot) {
    let secs = cur.taken_mono_ns.saturating_sub(prev.taken_mono_ns) as f64 / 1e9;
    for c in cur.clients.iter() {
        let Some(p) = prev
            .clients
            .iter()
            .find(|p| p.slot == c.slot && p.session == c.session)
        else {
            continue;
        };
        if c.request_ring.used > 0
            && p.request_ring.used > 0
            && c.request_ring.head == p.request_ring.head
        {
            cur.anomalies.push(Anomaly {
                kind: "ring_stalled",
                message: format!(
                    "slot {}: {} request bytes waiting and the server consumed none in {:.0} ms",
                    c.slot,
                    c.request_ring.used,
                    secs * 1e3
                ),
                client_slot: Some(c.slot),
            });
        }
        if c.completion_ring.used > 0
            && p.completion_ring.used > 0
            && c.completion_ring.head == p.completion_ring.head
        {
            cur.anomalies.push(Anomaly {
                kind: "completions_unread",
                message: format!(
                    "slot {}: {} completion bytes waiting and the client read none in {:.0} ms",
                    c.slot,
                    c.completion_ring.used,
                    secs * 1e3
                ),
                client_slot: Some(c.slot),
            });
        }
    }
}

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
