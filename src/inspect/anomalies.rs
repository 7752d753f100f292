//! What the inspector flags: states a healthy server never shows, each with
//! its [`AnomalyKind`].

use super::{ClientView, JobsSummary, LaneView, RingView, ServerView, Snapshot, Thresholds};
use crate::proto::kv::StatsReply;
use crate::shm::SlotState;
use serde::Serialize;

/// A heartbeat older than this (the server beats every 50 ms) is stale.
pub const HEARTBEAT_STALE_MS: f64 = 1000.0;

/// A slot whose process has exited is reported as not reclaimed only once
/// it has been closing or quarantined this long: reclaiming takes the
/// server a ring-loop pass and an acceptor wake-up (well under this), and
/// until then the slot is on its way, not stuck.
pub const RECLAIM_GRACE_MS: f64 = 1000.0;

/// How long the inspector re-reads an active slot whose process has exited
/// before it takes the slot as it is: the server starts the reclaim when it
/// sees the connection end (at once, or within an acceptor tick of 50 ms),
/// which a reader can look in on first.
pub const ACTIVE_EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// The kinds of anomaly (their JSON names are the snake_case variant names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AnomalyKind {
    /// The server's liveness lock is free: a post-mortem view.
    ServerDead,
    /// The server is alive but its heartbeat stopped (wedged or stopped).
    HeartbeatStopped,
    /// Requests waited and the server consumed none between two readings.
    RingStalled,
    /// Completions waited and the client read none between two readings.
    CompletionsUnread,
    /// A job unfinished for longer than the threshold.
    JobStuck,
    /// A copy worker with work (copies in flight, tasks held or queued on
    /// its lane) that made no step for longer than the threshold.
    LaneStalled,
    /// A slot still held for a process that has exited.
    DeadClientNotReclaimed,
    /// Words that cannot all be true at once.
    Inconsistent,
    /// A tier below the pool is down (I/O errors, a disk that does not
    /// answer, an unreachable store): its writes are dropped and lookups
    /// skip it while the pool serves. Degraded, not dead.
    TierDown,
}

impl AnomalyKind {
    /// Every kind.
    pub const ALL: [AnomalyKind; 9] = [
        AnomalyKind::ServerDead,
        AnomalyKind::HeartbeatStopped,
        AnomalyKind::RingStalled,
        AnomalyKind::CompletionsUnread,
        AnomalyKind::JobStuck,
        AnomalyKind::LaneStalled,
        AnomalyKind::DeadClientNotReclaimed,
        AnomalyKind::Inconsistent,
        AnomalyKind::TierDown,
    ];

    /// The JSON name (what serde writes; a test holds the two together).
    pub fn name(self) -> &'static str {
        match self {
            AnomalyKind::ServerDead => "server_dead",
            AnomalyKind::HeartbeatStopped => "heartbeat_stopped",
            AnomalyKind::RingStalled => "ring_stalled",
            AnomalyKind::CompletionsUnread => "completions_unread",
            AnomalyKind::JobStuck => "job_stuck",
            AnomalyKind::LaneStalled => "lane_stalled",
            AnomalyKind::DeadClientNotReclaimed => "dead_client_not_reclaimed",
            AnomalyKind::Inconsistent => "inconsistent",
            AnomalyKind::TierDown => "tier_down",
        }
    }
}

impl std::fmt::Display for AnomalyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// One thing the inspector flags.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Anomaly {
    pub kind: AnomalyKind,
    pub message: String,
    pub client_slot: Option<u32>,
}

/// Rings whose words contradict each other, and slots of exited processes.
pub(super) fn check_clients(clients: &[ClientView], server_alive: bool, out: &mut Vec<Anomaly>) {
    for c in clients {
        let slot = c.slot;
        for (name, r) in [
            ("request", &c.request_ring),
            ("completion", &c.completion_ring),
        ] {
            if !r.consistent {
                out.push(Anomaly {
                    kind: AnomalyKind::Inconsistent,
                    message: format!(
                        "slot {slot}: {name} ring head {} tail {} capacity {} cannot all be true",
                        r.head, r.tail, r.capacity
                    ),
                    client_slot: Some(slot),
                });
            }
        }
        // (Free slots are not listed.) A slot being reclaimed is given
        // its grace; an active one was given its wait when read.
        let reclaiming = matches!(
            c.state.known(),
            Some(SlotState::Closing | SlotState::Quarantined)
        );
        let in_grace = reclaiming && c.state_age_ms.is_some_and(|a| a < RECLAIM_GRACE_MS);
        if !c.alive && server_alive && !in_grace {
            out.push(Anomaly {
                kind: AnomalyKind::DeadClientNotReclaimed,
                message: match c.state_age_ms {
                    Some(a) if reclaiming => format!(
                        "slot {slot} ({} for {:.1} s) still held for pid {}, which has exited",
                        c.state,
                        a / 1e3,
                        c.pid
                    ),
                    _ => format!(
                        "slot {slot} ({}) still held for pid {}, which has exited",
                        c.state, c.pid
                    ),
                },
                client_slot: Some(slot),
            });
        }
    }
}

/// The oldest unfinished job past the threshold, and slots held too long.
pub(super) fn check_jobs(jobs: &JobsSummary, th: Thresholds, out: &mut Vec<Anomaly>) {
    if let Some(o) = &jobs.oldest_unfinished {
        if o.age_s > th.job_age_s {
            out.push(Anomaly {
                kind: AnomalyKind::JobStuck,
                message: format!(
                    "{} job {} (slot {}) of client slot {} {} for {:.1} s",
                    o.kind, o.id, o.index, o.owner_slot, o.state, o.age_s
                ),
                client_slot: Some(o.owner_slot),
            });
        }
    }
    if jobs.retired > 0 {
        out.push(Anomaly {
            kind: AnomalyKind::Inconsistent,
            message: format!(
                "{} job slots retired: another process wrote their lock word",
                jobs.retired
            ),
            client_slot: None,
        });
    }
    if jobs.busy_slots > 0 {
        out.push(Anomaly {
            kind: AnomalyKind::Inconsistent,
            message: format!(
                "{} job slots stayed locked by a writer past the read bound",
                jobs.busy_slots
            ),
            client_slot: None,
        });
    }
}

/// Copy workers with work whose beat stopped (a wedged copy, a stopped
/// thread): one anomaly per lane, naming its stalled workers.
pub(super) fn check_lanes(lanes: &[LaneView], th: Thresholds, out: &mut Vec<Anomaly>) {
    let bound_ms = th.lane_stall_s * 1e3;
    for l in lanes {
        let stalled: Vec<String> = l
            .workers
            .iter()
            .filter(|w| w.in_flight > 0 || w.held > 0 || l.queued > 0)
            .filter(|w| w.beat_age_ms.is_none_or(|a| a > bound_ms))
            .map(|w| {
                format!(
                    "worker {} ({} in flight, {} held, no step for {})",
                    w.index,
                    w.in_flight,
                    w.held,
                    w.beat_age_ms
                        .map_or("an unreadable time".into(), |a| format!("{:.1} s", a / 1e3))
                )
            })
            .collect();
        if !stalled.is_empty() {
            out.push(Anomaly {
                kind: AnomalyKind::LaneStalled,
                message: format!(
                    "copy lane {} (device {}, {} tasks queued): {}",
                    l.lane,
                    l.device,
                    l.queued,
                    stalled.join("; ")
                ),
                client_slot: None,
            });
        }
    }
}

/// Cache counters that contradict each other, and tiers that are down.
pub(super) fn check_cache(cache: &StatsReply, out: &mut Vec<Anomaly>) {
    use crate::proto::kv::TierState;
    let tiers = [
        ("disk", cache.disk_tier_state(), cache.disk_errors),
        ("remote", cache.tier_state(), cache.l2_errors),
    ];
    for (name, state, errors) in tiers {
        if state == Ok(TierState::Down) {
            out.push(Anomaly {
                kind: AnomalyKind::TierDown,
                message: format!(
                    "the {name} tier is down ({errors} errors so far): its writes are dropped and lookups skip it until it answers again"
                ),
                client_slot: None,
            });
        }
    }
    if cache.pool_used_bytes > cache.pool_bytes {
        out.push(Anomaly {
            kind: AnomalyKind::Inconsistent,
            message: format!(
                "pool usage {} exceeds the pool's {} bytes",
                cache.pool_used_bytes, cache.pool_bytes
            ),
            client_slot: None,
        });
    }
}

/// A dead server, or a live one whose heartbeat stopped.
pub(super) fn check_server(server: &ServerView, out: &mut Vec<Anomaly>) {
    if !server.alive {
        out.push(Anomaly {
            kind: AnomalyKind::ServerDead,
            message: format!(
                "server pid {} is gone (its liveness lock is free): this is a post-mortem view",
                server.pid
            ),
            client_slot: None,
        });
    } else if server
        .heartbeat_age_ms
        .is_none_or(|a| a > HEARTBEAT_STALE_MS)
    {
        out.push(Anomaly {
            kind: AnomalyKind::HeartbeatStopped,
            message: format!(
                "server pid {} is alive but its heartbeat is {} old: wedged or stopped",
                server.pid,
                server
                    .heartbeat_age_ms
                    .map_or("unreadable".to_string(), |a| format!("{:.0} ms", a))
            ),
            client_slot: None,
        });
    }
}

/// A ring with bytes waiting in both readings whose consumer did not move.
fn stalled(prev: &RingView, cur: &RingView) -> bool {
    cur.used > 0 && prev.used > 0 && cur.head == prev.head
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
        let checks = [
            (
                &p.request_ring,
                &c.request_ring,
                AnomalyKind::RingStalled,
                "request bytes waiting and the server",
            ),
            (
                &p.completion_ring,
                &c.completion_ring,
                AnomalyKind::CompletionsUnread,
                "completion bytes waiting and the client",
            ),
        ];
        for (before, now, kind, what) in checks {
            if stalled(before, now) {
                cur.anomalies.push(Anomaly {
                    kind,
                    message: format!(
                        "slot {}: {} {what} {} none in {:.0} ms",
                        c.slot,
                        now.used,
                        if kind == AnomalyKind::RingStalled {
                            "consumed"
                        } else {
                            "read"
                        },
                        secs * 1e3
                    ),
                    client_slot: Some(c.slot),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::Field;
    use crate::shm::DisconnectReason;

    fn client(state: SlotState, alive: bool, state_age_ms: Option<f64>) -> ClientView {
        let ring = RingView {
            head: 0,
            tail: 0,
            used: 0,
            capacity: 4096,
            consistent: true,
        };
        ClientView {
            slot: 3,
            state: Field::Known(state),
            session: 1,
            pid: 77,
            alive,
            kv_instances: 0,
            requests_served: 0,
            requests_rejected: 0,
            completions_posted: 0,
            disconnect_reason: Field::Known(DisconnectReason::SocketClosed),
            request_ring: ring.clone(),
            completion_ring: ring,
            in_flight: 0,
            credits: 0,
            sleeping: false,
            heartbeat_age_ms: None,
            connected_age_s: 1.0,
            state_age_ms,
            client_memory: false,
        }
    }

    fn dead_slots(c: ClientView, server_alive: bool) -> usize {
        let mut out = Vec::new();
        check_clients(&[c], server_alive, &mut out);
        out.iter()
            .filter(|a| a.kind == AnomalyKind::DeadClientNotReclaimed)
            .count()
    }

    #[test]
    fn a_slot_being_reclaimed_is_reported_only_past_its_grace() {
        let g = RECLAIM_GRACE_MS;
        for state in [SlotState::Closing, SlotState::Quarantined] {
            assert_eq!(dead_slots(client(state, false, Some(0.0)), true), 0);
            assert_eq!(dead_slots(client(state, false, Some(g - 1.0)), true), 0);
            assert_eq!(dead_slots(client(state, false, Some(g)), true), 1);
            assert_eq!(dead_slots(client(state, false, Some(60e3)), true), 1);
            // A time that cannot be read gives no grace.
            assert_eq!(dead_slots(client(state, false, None), true), 1);
            // Alive, or a dead server's: nothing to say.
            assert_eq!(dead_slots(client(state, true, Some(60e3)), true), 0);
            assert_eq!(dead_slots(client(state, false, Some(60e3)), false), 0);
        }
        // An active slot was given its wait when it was read.
        assert_eq!(
            dead_slots(client(SlotState::Active, false, Some(0.0)), true),
            1
        );
        let mut out = Vec::new();
        check_clients(
            &[client(SlotState::Quarantined, false, Some(2500.0))],
            true,
            &mut out,
        );
        assert!(out[0].message.contains("quarantined for 2.5 s"), "{out:?}");
    }

    #[test]
    fn the_text_name_of_every_kind_is_its_json_name() {
        for k in AnomalyKind::ALL {
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.name())
            );
        }
    }
}
