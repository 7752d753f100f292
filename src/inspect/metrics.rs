//! A [`Snapshot`] as Prometheus metrics, in the OpenMetrics text format or
//! Prometheus's text format 0.0.4 (`prometheus-client` writes both): names `kvring_*` with their units, from
//! the same words the inspector reads. `kvring-inspect metrics NAME` prints
//! it (a live server's, or a dead one's for a post-mortem).
//!
//! Counters are the server's counters since it started; gauges are the
//! reading's values; each operation's latency is a histogram whose buckets
//! are the segment's log2 buckets (`OpStat`), in seconds.

use super::{AnomalyKind, Snapshot};
use crate::proto::kv::TierState;
use crate::shm::{OpStat, HIST_BUCKETS};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

type Labels = Vec<(&'static str, String)>;
/// A metric read off each row of a reading's table: name, help, value.
type Column<'a, R, V> = (&'a str, &'a str, &'a dyn Fn(&R) -> V);

/// One sample's value.
#[derive(Debug)]
enum Value {
    /// An info metric: its labels are the value.
    Info,
    Counter(u64),
    Gauge(f64),
    Histogram {
        sum: f64,
        count: u64,
        /// (upper bound, count in this bucket), the last bound +Inf.
        buckets: Vec<(f64, u64)>,
    },
}

/// A metric's samples, read once (what a scrape reports).
#[derive(Debug)]
struct Samples {
    kind: MetricType,
    rows: Vec<(Labels, Value)>,
}

impl Samples {
    fn one(kind: MetricType, v: Value) -> Samples {
        Samples {
            kind,
            rows: vec![(Vec::new(), v)],
        }
    }
}

fn encode_value(e: &mut MetricEncoder, v: &Value) -> Result<(), std::fmt::Error> {
    match v {
        Value::Counter(n) => e.encode_counter::<NoLabelSet, _, u64>(n, None),
        Value::Gauge(x) => e.encode_gauge(x),
        Value::Histogram {
            sum,
            count,
            buckets,
        } => e.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None),
        Value::Info => Ok(()),
    }
}

impl EncodeMetric for Samples {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, v) in &self.rows {
            match v {
                Value::Info => encoder.encode_info(labels)?,
                _ if labels.is_empty() => encode_value(&mut encoder, v)?,
                _ => encode_value(&mut encoder.encode_family(labels)?, v)?,
            }
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

/// The metric registry of one reading.
struct Exposition(Registry);

impl Exposition {
    fn add(&mut self, name: &str, help: &str, unit: Option<Unit>, m: Samples) {
        match unit {
            Some(u) => self.0.register_with_unit(name, help, u, m),
            None => self.0.register(name, help, m),
        }
    }

    fn counter(&mut self, name: &str, help: &str, unit: Option<Unit>, v: u64) {
        self.add(
            name,
            help,
            unit,
            Samples::one(MetricType::Counter, Value::Counter(v)),
        );
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) {
        self.add(
            name,
            help,
            unit,
            Samples::one(MetricType::Gauge, Value::Gauge(v)),
        );
    }
}

/// An operation's latency histogram, in seconds.
fn histogram(buckets: &[u64; HIST_BUCKETS], sum_us: f64) -> Value {
    let bounds = (0..HIST_BUCKETS).map(|i| {
        if i + 1 == HIST_BUCKETS {
            f64::INFINITY
        } else {
            OpStat::bucket_limit(i) as f64 / 1e9
        }
    });
    Value::Histogram {
        sum: sum_us / 1e6,
        count: buckets.iter().sum(),
        buckets: bounds.zip(buckets.iter().copied()).collect(),
    }
}

/// The OpenMetrics text of a reading (ends with `# EOF`).
pub fn openmetrics(s: &Snapshot) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry(s))
        .expect("writing to a String does not fail");
    out
}

/// The same metrics in Prometheus's text format 0.0.4 (for scrapers that
/// do not ask for OpenMetrics).
pub fn prometheus_text(s: &Snapshot) -> String {
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry(s))
        .expect("writing to a String does not fail");
    out
}

fn registry(s: &Snapshot) -> Registry {
    let mut x = Exposition(Registry::with_prefix("kvring"));
    let c = &s.cache;
    let sv = &s.server;
    x.add(
        "build",
        "this build of kvring and the segment's layout version",
        None,
        Samples {
            kind: MetricType::Info,
            rows: vec![(
                vec![
                    ("version", env!("CARGO_PKG_VERSION").to_string()),
                    ("layout_version", sv.layout_version.to_string()),
                ],
                Value::Info,
            )],
        },
    );
    x.gauge(
        "server_up",
        "1 while the server process lives (its liveness lock is held)",
        None,
        if sv.alive { 1.0 } else { 0.0 },
    );
    x.gauge(
        "server_uptime",
        "time since the server made its segment",
        Some(Unit::Seconds),
        sv.age_s,
    );
    x.gauge(
        "server_heartbeat_age",
        "time since the server's last heartbeat (NaN: unreadable)",
        Some(Unit::Seconds),
        sv.heartbeat_age_ms.map_or(f64::NAN, |ms| ms / 1e3),
    );
    x.gauge(
        "clients_connected",
        "client sessions connected now",
        None,
        f64::from(sv.clients_connected),
    );
    x.counter(
        "clients_accepted",
        "client sessions accepted",
        None,
        sv.clients_accepted,
    );
    x.counter(
        "clients_reclaimed",
        "client sessions reclaimed after their process died or broke the protocol",
        None,
        sv.clients_reclaimed,
    );
    x.counter(
        "clients_refused",
        "connections refused (no slot, bad handshake, ...)",
        None,
        sv.clients_refused,
    );
    let per_op = |f: &dyn Fn(&super::OpView) -> Value, timed: bool| {
        s.ops
            .iter()
            // PING's latency is the client's round trip: not recorded.
            .filter(|o| !timed || o.name != "ping")
            .map(|o| (vec![("op", o.name.to_string())], f(o)))
            .collect::<Vec<_>>()
    };
    x.add(
        "requests",
        "requests served per operation (refused ones included)",
        None,
        Samples {
            kind: MetricType::Counter,
            rows: per_op(&|o| Value::Counter(o.count), false),
        },
    );
    x.add(
        "request_errors",
        "error completions and failed jobs per operation",
        None,
        Samples {
            kind: MetricType::Counter,
            rows: per_op(&|o| Value::Counter(o.errors), false),
        },
    );
    x.add(
        "request_latency",
        "per operation: a job's submitted-to-finished time, or the server's time from reading a request to its completion",
        Some(Unit::Seconds),
        Samples {
            kind: MetricType::Histogram,
            rows: per_op(&|o| histogram(&o.buckets, o.sum_us), true),
        },
    );
    x.add(
        "job_slots",
        "job slots per state in this reading",
        None,
        Samples {
            kind: MetricType::Gauge,
            rows: s
                .jobs
                .by_state
                .iter()
                .map(|(k, &n)| (vec![("state", k.clone())], Value::Gauge(n as f64)))
                .collect(),
        },
    );
    let j = &s.jobs;
    for (name, help, v) in [
        ("jobs_submitted", "jobs submitted", j.submitted),
        ("jobs_done", "jobs that ended done", j.done),
        ("jobs_failed", "jobs that ended failed", j.failed),
        ("jobs_refused", "jobs refused (no free slot)", j.refused),
    ] {
        x.counter(name, help, None, v);
    }
    x.gauge(
        "pool",
        "the host pool's size",
        Some(Unit::Bytes),
        c.pool_bytes as f64,
    );
    x.gauge(
        "pool_used",
        "pool bytes held by objects",
        Some(Unit::Bytes),
        c.pool_used_bytes as f64,
    );
    x.gauge("objects", "stored chunk objects", None, c.objects as f64);
    x.gauge("leases", "lookup leases held", None, c.leases as f64);
    x.gauge(
        "registrations",
        "KV cache registrations",
        None,
        c.instances as f64,
    );
    for (name, help, unit, v) in [
        ("lookups", "LOOKUP requests", None, c.lookups),
        (
            "lookup_chunks",
            "chunks looked up (requested)",
            None,
            c.lookup_chunks,
        ),
        (
            "lookup_hit_chunks",
            "chunks found by lookups",
            None,
            c.lookup_hit_chunks,
        ),
        ("stores", "STORE jobs", None, c.stores),
        ("stored_chunks", "chunk objects stored", None, c.stored_chunks),
        (
            "stored",
            "bytes stored into the pool",
            Some(Unit::Bytes),
            c.stored_bytes,
        ),
        (
            "store_no_space_chunks",
            "chunks not stored for want of pool space",
            None,
            c.store_no_space_chunks,
        ),
        ("retrieves", "RETRIEVE jobs", None, c.retrieves),
        (
            "retrieved_chunks",
            "chunks retrieved",
            None,
            c.retrieved_chunks,
        ),
        (
            "retrieved",
            "bytes retrieved from the pool",
            Some(Unit::Bytes),
            c.retrieved_bytes,
        ),
        (
            "evicted_objects",
            "objects evicted",
            None,
            c.evicted_objects,
        ),
        (
            "evicted",
            "bytes evicted",
            Some(Unit::Bytes),
            c.evicted_bytes,
        ),
        (
            "leases_expired",
            "leases ended by their TTL",
            None,
            c.leases_expired,
        ),
        (
            "lookup_l2_hit_chunks",
            "chunks lookups found in the second tier beyond the pool's (part of lookup_hit_chunks)",
            None,
            c.lookup_l2_hit_chunks,
        ),
        (
            "l2_written_objects",
            "objects written to the second tier",
            None,
            c.l2_written_objects,
        ),
        (
            "l2_write_dropped_objects",
            "objects not written to the second tier (its queue full, it down, too many bytes waiting)",
            None,
            c.l2_write_dropped_objects,
        ),
        (
            "l2_loaded_objects",
            "objects read from the second tier into the pool",
            None,
            c.l2_loaded_objects,
        ),
        (
            "l2_missed_objects",
            "objects asked of the second tier and not there",
            None,
            c.l2_missed_objects,
        ),
        (
            "l2_corrupt_objects",
            "second-tier values that are not the object their key names (read as misses)",
            None,
            c.l2_corrupt_objects,
        ),
        (
            "l2_out",
            "value bytes written to the second tier",
            Some(Unit::Bytes),
            c.l2_bytes_out,
        ),
        (
            "l2_in",
            "value bytes read from the second tier",
            Some(Unit::Bytes),
            c.l2_bytes_in,
        ),
        (
            "l2_errors",
            "second-tier commands that failed (timeouts and connection errors; error replies about one key)",
            None,
            c.l2_errors,
        ),
    ] {
        x.counter(name, help, unit, v);
    }
    x.gauge(
        "l2_queue",
        "operations queued for or running on the second tier",
        None,
        c.l2_queue as f64,
    );
    let tier = c.tier_state();
    if tier != Ok(TierState::None) {
        x.gauge(
            "l2_up",
            "1 while the second tier answers, 0 while it is down or connecting (absent without one)",
            None,
            if tier == Ok(TierState::Up) { 1.0 } else { 0.0 },
        );
    }
    x.gauge(
        "pool_ready",
        "pool bytes ready for copies (pinned, with the CUDA backend)",
        Some(Unit::Bytes),
        sv.pool_ready_bytes as f64,
    );
    x.gauge(
        "pinned_objects",
        "objects an operator pinned (kept through eviction and clear)",
        None,
        c.pinned_objects as f64,
    );
    x.gauge(
        "pinned",
        "bytes of the pinned objects",
        Some(Unit::Bytes),
        c.pinned_bytes as f64,
    );
    let per_lane = |kind: MetricType, f: &dyn Fn(&super::LaneView) -> Value| Samples {
        kind,
        rows: s
            .lanes
            .iter()
            .map(|l| (vec![("device", l.device.clone())], f(l)))
            .collect(),
    };
    let lane_gauges: [Column<super::LaneView, f64>; 5] = [
        ("copy_workers", "copy workers of the lane", &|l| l.workers.len() as f64),
        ("copy_queued_tasks", "chunk copies queued, not yet taken by a worker (queue depth)", &|l| l.queued as f64),
        ("copy_in_flight", "chunk copies started, not yet finished", &|l| l.in_flight as f64),
        ("copy_held_tasks", "chunk copies waiting for their engine's event", &|l| l.held as f64),
        (
            "copy_stalled_seconds",
            "the longest time a worker with work went without a step (0: none stalled; NaN: unreadable)",
            &|l| l.stalled_ms().map_or(f64::NAN, |ms| ms / 1e3),
        ),
    ];
    for (name, help, f) in lane_gauges {
        x.add(name, help, None, per_lane(MetricType::Gauge, &|l| Value::Gauge(f(l))));
    }
    let lane_counters: [Column<super::LaneView, u64>; 3] = [
        ("copy_chunks", "chunk copies finished (any outcome)", &|l| l.copies),
        (
            "engine_events_waited",
            "jobs whose engine event had not completed when a worker first asked",
            &|l| l.events_waited,
        ),
        (
            "engine_events_timed_out",
            "jobs failed because their engine event missed the job's deadline",
            &|l| l.events_timed_out,
        ),
    ];
    for (name, help, f) in lane_counters {
        x.add(name, help, None, per_lane(MetricType::Counter, &|l| Value::Counter(f(l))));
    }
    let per_model = |f: &dyn Fn(&super::ModelView) -> u64| Samples {
        kind: MetricType::Counter,
        rows: s
            .models
            .iter()
            .map(|m| {
                (
                    vec![("model", m.model.clone()), ("salt", m.salt.clone())],
                    Value::Counter(f(m)),
                )
            })
            .collect(),
    };
    let model_counters: [Column<super::ModelView, u64>; 5] = [
        ("model_lookups", "LOOKUP requests per model and salt", &|m| m.lookups),
        ("model_lookup_chunks", "chunks looked up per model and salt", &|m| m.chunks),
        ("model_lookup_hit_chunks", "chunks found per model and salt", &|m| m.hit_chunks),
        ("lookup_tokens", "tokens looked up per model and salt (model=\"other\": past the 63 tracked)", &|m| m.tokens),
        ("lookup_hit_tokens", "tokens found per model and salt", &|m| m.hit_tokens),
    ];
    for (name, help, f) in model_counters {
        x.add(name, help, None, per_model(f));
    }
    x.add(
        "anomalies",
        "what the inspector flags in this reading, per kind",
        None,
        Samples {
            kind: MetricType::Gauge,
            rows: AnomalyKind::ALL
                .iter()
                .map(|&k| {
                    let n = s.anomalies.iter().filter(|a| a.kind == k).count();
                    (vec![("kind", k.name().to_string())], Value::Gauge(n as f64))
                })
                .collect(),
        },
    );
    x.0
}
