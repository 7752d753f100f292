//! Reading a segment: each word read once, judged on its own; impossible
//! combinations reported, never waited for.

use crate::jobs::{FailReason, JobKind, JobState};
use crate::liveness::{monotonic_ns, process_start_ticks, unix_ns};
use crate::proto::kv::StatsReply;
use crate::proto::Opcode;
use crate::segment::ReadOnlySegment;
use crate::shm::{
    DisconnectReason, ModelRowState, OpStat, ServerState, SlotState, CACHE_STATS_WORDS,
    HIST_BUCKETS, LANE_WORKERS, MAX_LANES, MODEL_ROWS,
};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use super::view::{
    ClientView, Field, JobRow, JobsSummary, LaneView, ModelView, OpView, RingView, SegmentEntry,
    SegmentGeometry, ServerView, Snapshot, WorkerView,
};
use super::{anomalies, Thresholds};


/// Every `/dev/shm/kvring-UID-NAME` segment of this user.
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

/// How old a monotonic time `then` is at `now` (when the reading started).
/// A time up to a second after `now` was written while the reading was
/// being taken (a heartbeat beat between the two): age 0. One further ahead
/// (torn, or from another boot) has no age.
fn age_ms(now: u64, then: u64) -> Option<f64> {
    if then <= now {
        Some((now - then) as f64 / 1e6)
    } else {
        (then - now < 1_000_000_000).then_some(0.0)
    }
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
    let st = JobState::decode(s.status.state).ok();
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
        kind: Field::read(s.kind, |v| JobKind::decode(v).ok(), |k| format!("kind {k}")),
        state: Field::read(s.status.state, |v| JobState::decode(v).ok(), |v| {
            format!("state {v} (unknown)")
        }),
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

/// Reads the whole segment once.
pub fn snapshot(seg: &ReadOnlySegment, th: Thresholds) -> Snapshot {
    let info = seg.mapping.info();
    let now = monotonic_ns();
    let server = read_server(seg, now);
    let g = info.geometry;
    let geometry = SegmentGeometry {
        max_clients: g.max_clients,
        job_slots: g.job_slots,
        req_ring_bytes: g.req_ring_bytes,
        cq_ring_bytes: g.cq_ring_bytes,
        max_frame_bytes: g.max_frame_bytes,
        segment_bytes: info.segment_bytes,
    };
    let clients = read_clients(seg, now);
    let (jobs, rows) = read_jobs(seg, now);
    let ops = read_ops(seg);
    let cache = read_cache(seg);
    let lanes = read_lanes(seg, now);
    let models = read_models(seg);
    let mut anomalies = Vec::new();
    anomalies::check_clients(&clients, server.alive, &mut anomalies);
    anomalies::check_jobs(&jobs, th, &mut anomalies);
    anomalies::check_cache(&cache, &mut anomalies);
    anomalies::check_server(&server, &mut anomalies);
    if server.alive {
        anomalies::check_lanes(&lanes, th, &mut anomalies);
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
        lanes,
        models,
        anomalies,
        taken_unix_ns: unix_ns(),
        taken_mono_ns: now,
        rows,
    }
}

/// The server's identity, state and counters.
fn read_server(seg: &ReadOnlySegment, now: u64) -> ServerView {
    let info = seg.mapping.info();
    let h = seg.mapping.header();
    ServerView {
        pid: info.server_pid,
        uid: info.server_uid,
        alive: seg.server_alive().unwrap_or(false),
        state: Field::read(
            h.server_state.load(Relaxed),
            |v| ServerState::decode(v).ok(),
            |v| format!("state {v} (unknown)"),
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
        pool_ready_bytes: h.pool_ready_bytes.load(Relaxed),
    }
}

/// Every copy lane the server has (those with workers).
fn read_lanes(seg: &ReadOnlySegment, now: u64) -> Vec<LaneView> {
    let view = seg.view();
    (0..MAX_LANES)
        .map(|i| (i, view.lane(i)))
        .filter(|(_, l)| l.workers > 0)
        .map(|(i, l)| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&l.device[0].to_le_bytes());
            bytes[8..].copy_from_slice(&l.device[1].to_le_bytes());
            let device = if bytes == [0; 16] {
                "host".to_string()
            } else {
                crate::DeviceUuid::from_bytes(bytes).to_string()
            };
            // A worker count past the entries is a torn or foreign word:
            // read the entries there are.
            let n = (l.workers as usize).min(LANE_WORKERS);
            let workers: Vec<WorkerView> = l.worker[..n]
                .iter()
                .enumerate()
                .map(|(w, v)| WorkerView {
                    index: w as u32,
                    in_flight: v.in_flight,
                    held: v.held,
                    copies: v.copies,
                    beat_age_ms: age_ms(now, v.beat_ns),
                })
                .collect();
            LaneView {
                lane: i as u32,
                device,
                queued: l.queued,
                in_flight: workers.iter().map(|w| u64::from(w.in_flight)).sum(),
                held: workers.iter().map(|w| u64::from(w.held)).sum(),
                copies: workers.iter().map(|w| w.copies).sum(),
                events_waited: l.events_waited,
                events_timed_out: l.events_timed_out,
                workers,
            }
        })
        .collect()
}

/// Every (model, salt) row of the lookups-by-model region in use.
fn read_models(seg: &ReadOnlySegment) -> Vec<ModelView> {
    let view = seg.view();
    (0..MODEL_ROWS)
        .map(|i| view.model_row(i))
        .filter_map(|r| {
            let others = match ModelRowState::decode(r.state).ok()? {
                ModelRowState::Free => return None,
                ModelRowState::One => false,
                ModelRowState::Others => true,
            };
            Some(ModelView {
                model: if others {
                    "other".into()
                } else {
                    format!("{:#018x}", r.model_id)
                },
                salt: if others {
                    "other".into()
                } else {
                    format!("{:#018x}", r.salt)
                },
                lookups: r.lookups,
                chunks: r.chunks,
                hit_chunks: r.hit_chunks,
                tokens: r.tokens,
                hit_tokens: r.hit_tokens,
            })
        })
        .collect()
}

/// Every occupied client slot.
fn read_clients(seg: &ReadOnlySegment, now: u64) -> Vec<ClientView> {
    let m = &seg.mapping;
    let g = m.info().geometry;
    let mut clients = Vec::new();
    'slots: for slot in 0..g.max_clients {
        let sb = m.server_client(slot);
        // Acquire pairs with the acceptor's Release stores of `state`: a slot
        // seen Active shows the occupant's identity written before it.
        let raw_state = sb.state.load(Acquire);
        if raw_state == SlotState::Free.raw() {
            continue;
        }
        let session = sb.session.load(Relaxed);
        // Through the server's descriptor, while it lives (and only if the
        // descriptor is still this session's: the occupant's identity is
        // read again after the mapping).
        let mem = crate::client_memory::ClientMemory::open_read_only(
            m.info().server_pid,
            sb.memory_fd.load(Relaxed),
            &crate::client_memory::name(&m.info().name, slot, session),
            m.info().offsets.client_memory_bytes,
        )
        .ok();
        // The server's ring indices on either side of the client's (see
        // `ring`).
        let (req_head0, cq_tail0) = (sb.req_head.load(Relaxed), sb.cq_tail.load(Relaxed));
        let cb = mem.map(|mem| mem.values()).filter(|_| {
            // Acquire pairs with the acceptor's Release store of `state`.
            sb.state.load(Acquire) == SlotState::Active.raw()
                && sb.session.load(Relaxed) == session
                && seg.server_alive().unwrap_or(false)
        });
        let req_head = sb.req_head.load(Relaxed);
        let cq_tail = sb.cq_tail.load(Relaxed);
        let pid = sb.pid.load(Relaxed);
        let start = sb.pid_start_ticks.load(Relaxed);
        let proc_alive = process_start_ticks(pid).is_some_and(|t| start == 0 || t == start);
        // An active slot whose process has exited: the server may not have
        // seen its connection end yet. Given a few acceptor ticks to
        // start the reclaim (the state it moves to has a grace of its own).
        let mut raw_state = raw_state;
        if raw_state == SlotState::Active.raw() && !proc_alive && seg.server_alive().unwrap_or(false)
        {
            let until = std::time::Instant::now() + anomalies::ACTIVE_EXIT_WAIT;
            while std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(2));
                // Acquire: as above.
                let (now_state, now_session) = (sb.state.load(Acquire), sb.session.load(Relaxed));
                if now_session != session || now_state == SlotState::Free.raw() {
                    // Reclaimed meanwhile (and perhaps taken again).
                    continue 'slots;
                }
                if now_state != raw_state {
                    raw_state = now_state;
                    break;
                }
            }
        }
        let state_ns = sb.state_ns.load(Relaxed);
        clients.push(ClientView {
            slot,
            state: Field::read(
                raw_state,
                |v| SlotState::decode(v).ok(),
                |v| format!("state {v} (unknown)"),
            ),
            session,
            pid,
            alive: proc_alive,
            kv_instances: sb.kv_instances.load(Relaxed),
            requests_served: sb.requests_served.load(Relaxed),
            requests_rejected: sb.requests_rejected.load(Relaxed),
            completions_posted: sb.completions_posted.load(Relaxed),
            disconnect_reason: Field::read(
                sb.disconnect_reason.load(Relaxed),
                |v| DisconnectReason::decode(v).ok(),
                |v| format!("reason {v} (unknown)"),
            ),
            request_ring: {
                let tail = cb.as_ref().map_or(req_head, |c| c.req_tail);
                ring((req_head0, req_head), (tail, tail), u64::from(g.req_ring_bytes))
            },
            completion_ring: {
                let head = cb.as_ref().map_or(cq_tail, |c| c.cq_head);
                ring((head, head), (cq_tail0, cq_tail), u64::from(g.cq_ring_bytes))
            },
            in_flight: cb.as_ref().map_or(0, |c| c.in_flight),
            credits: cb.as_ref().map_or(0, |c| c.credits),
            sleeping: cb.as_ref().is_some_and(|c| c.client_sleeping != 0),
            heartbeat_age_ms: cb.as_ref().and_then(|c| age_ms(now, c.heartbeat_ns)),
            client_memory: cb.is_some(),
            connected_age_s: unix_ns().saturating_sub(sb.connected_unix_ns.load(Relaxed)) as f64
                / 1e9,
            state_age_ms: age_ms(now, state_ns),
        });
    }
    clients
}

/// The job counters, slots per state, and a row per job ever allocated.
fn read_jobs(seg: &ReadOnlySegment, now: u64) -> (JobsSummary, Vec<JobRow>) {
    let m = &seg.mapping;
    let h = m.header();
    let info = m.info();
    let reader = m.job_reader();
    let mut jobs = JobsSummary {
        submitted: h.jobs_submitted.load(Relaxed),
        done: h.jobs_done.load(Relaxed),
        failed: h.jobs_failed.load(Relaxed),
        released: h.jobs_released.load(Relaxed),
        refused: h.jobs_refused.load(Relaxed),
        retired: h.jobs_retired.load(Relaxed),
        ..Default::default()
    };
    let mut rows = Vec::new();
    for index in 0..info.geometry.job_slots {
        let snap = match reader.snapshot(index) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(_) => {
                jobs.busy_slots += 1;
                continue;
            }
        };
        let state = JobState::decode(snap.status.state).ok();
        let name = state.map_or("unknown", JobState::name);
        *jobs.by_state.entry(name.to_string()).or_default() += 1;
        if snap.status.generation == 0 {
            continue;
        }
        let row = job_row(info.epoch, index, &snap, now);
        let unfinished = matches!(state, Some(JobState::Pending | JobState::Running));
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
    (jobs, rows)
}

/// Per operation, its counters and latency percentiles.
fn read_ops(seg: &ReadOnlySegment) -> Vec<OpView> {
    let stats = seg.mapping.op_stats();
    Opcode::ALL
        .iter()
        .map(|&op| {
            let st = stats.of(op);
            let hist: [u64; HIST_BUCKETS] = std::array::from_fn(|i| st.hist[i].load(Relaxed));
            OpView {
                name: op.name(),
                count: st.count.load(Relaxed),
                errors: st.errors.load(Relaxed),
                p50_us: percentile(&hist, 0.5),
                p99_us: percentile(&hist, 0.99),
                samples: hist.iter().sum(),
                sum_us: st.sum_ns.load(Relaxed) as f64 / 1e3,
                buckets: hist,
            }
        })
        .collect()
}

/// The cache's counters, word by word.
fn read_cache(seg: &ReadOnlySegment) -> StatsReply {
    let h = seg.mapping.header();
    let words: [u64; CACHE_STATS_WORDS] = std::array::from_fn(|i| h.cache_stats[i].load(Relaxed));
    bytemuck::cast(words)
}

/// A ring whose head was read as `heads.0` and later `heads.1`, and whose
/// tail as `tails.0` and later `tails.1` (one index is read on either side
/// of the other: the two processes move them meanwhile). The indices are
/// consistent when some moment between the reads can have had
/// `head <= tail <= head + capacity`: the head read first is at most the
/// tail read last, and the tail read first at most the head read last plus
/// the capacity. A ring that is moving is never taken for a broken one.
fn ring(heads: (u64, u64), tails: (u64, u64), capacity: u64) -> RingView {
    let consistent =
        heads.0 <= tails.1 && heads.0 <= heads.1 && tails.0 <= tails.1 && tails.0.saturating_sub(heads.1) <= capacity;
    let (head, tail) = (heads.1, tails.1);
    RingView {
        head,
        tail,
        used: tail.saturating_sub(head),
        capacity,
        consistent,
    }
}

#[cfg(test)]
mod age_tests {
    use super::{age_ms, ring};

    #[test]
    fn a_ring_moving_between_the_reads_is_consistent_and_a_broken_one_is_not() {
        // The consumer passed the tail read before its second read: moving.
        assert!(ring((100, 300), (250, 250), 128).consistent);
        // The producer ran a capacity ahead of the first head read: moving.
        assert!(ring((100, 100), (180, 300), 128).consistent);
        // Head past the tail however the reads fell, and a tail more than a
        // capacity ahead of the latest head: broken.
        assert!(!ring((300, 300), (250, 250), 128).consistent);
        assert!(!ring((100, 100), (300, 300), 128).consistent);
        assert!(!ring((300, 200), (400, 400), 128).consistent);
    }

    #[test]
    fn a_beat_during_the_reading_is_fresh_and_a_far_future_one_has_no_age() {
        assert_eq!(age_ms(5_000_000_000, 3_000_000_000), Some(2000.0));
        assert_eq!(age_ms(5_000_000_000, 5_000_100_000), Some(0.0));
        assert_eq!(age_ms(5_000_000_000, 9_000_000_000), None);
    }
}
