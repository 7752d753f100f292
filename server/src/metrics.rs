//! A [`Snapshot`] as Prometheus metrics, in the OpenMetrics text format or
//! Prometheus's text format 0.0.4 (`prometheus-client` writes both): names
//! `kvring_*` with their units, from the same words the inspector reads.
//! `kvring-inspect metrics NAME` prints it (a live server's, or a dead
//! one's for a post-mortem).
//!
//! Counters are the server's counters since it started; gauges are the
//! reading's values; each operation's latency is a histogram whose buckets
//! are the segment's log2 buckets (`OpStat`), in seconds. The reading is
//! one [`Collector`]: each scrape encodes the values read, as constant
//! metrics with typed label sets, in the order below.

use kvring::inspect::{AnomalyKind, LaneView, ModelView, OpView, Snapshot};
use kvring::proto::kv::TierState;
use kvring::shm::{OpStat, HIST_BUCKETS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::fmt::Error;

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
    let mut r = Registry::with_prefix("kvring");
    r.register_collector(Box::new(Reading(s.clone())));
    r
}

// ------------------------------------------------------------ label sets

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct BuildLabels {
    version: &'static str,
    layout_version: String,
}

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct DeviceLabels {
    device: String,
}

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct ModelLabels {
    model: String,
    salt: String,
}

#[derive(Clone, Debug, EncodeLabelSet, PartialEq, Eq, Hash)]
struct KindLabels {
    kind: &'static str,
}

// ------------------------------------------------------------ encoding

/// A metric's values, one per label set (or one without labels).
enum Values<L> {
    Counters(Vec<(L, u64)>),
    Gauges(Vec<(L, f64)>),
    Histograms(Vec<(L, Latency)>),
}

/// A latency histogram in seconds.
struct Latency {
    sum: f64,
    count: u64,
    /// (upper bound, count in this bucket), the last bound +Inf.
    buckets: Vec<(f64, u64)>,
}

/// The metrics of one reading, written as a scrape asks for them.
struct Out<'a>(DescriptorEncoder<'a>);

impl Out<'_> {
    fn metric(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        kind: MetricType,
        f: impl FnOnce(MetricEncoder) -> Result<(), Error>,
    ) -> Result<(), Error> {
        // (A sentence, as the registry writes the help of what it holds.)
        let help = format!("{help}.");
        f(self.0.encode_descriptor(name, &help, unit.as_ref(), kind)?)
    }

    fn counter(&mut self, name: &str, help: &str, unit: Option<Unit>, v: u64) -> Result<(), Error> {
        self.metric(name, help, unit, MetricType::Counter, |m| {
            ConstCounter::new(v).encode(m)
        })
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) -> Result<(), Error> {
        self.metric(name, help, unit, MetricType::Gauge, |m| {
            ConstGauge::new(v).encode(m)
        })
    }

    /// A metric family: one value per label set.
    fn family<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        values: Values<L>,
    ) -> Result<(), Error> {
        let kind = match values {
            Values::Counters(_) => MetricType::Counter,
            Values::Gauges(_) => MetricType::Gauge,
            Values::Histograms(_) => MetricType::Histogram,
        };
        self.metric(name, help, unit, kind, |mut m| match values {
            Values::Counters(rows) => rows
                .iter()
                .try_for_each(|(l, v)| ConstCounter::new(*v).encode(m.encode_family(l)?)),
            Values::Gauges(rows) => rows
                .iter()
                .try_for_each(|(l, v)| ConstGauge::new(*v).encode(m.encode_family(l)?)),
            Values::Histograms(rows) => rows.iter().try_for_each(|(l, h)| {
                m.encode_family(l)?
                    .encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)
            }),
        })
    }
}

/// One reading, encoded at each scrape.
#[derive(Debug)]
struct Reading(Snapshot);

impl Collector for Reading {
    fn encode(&self, e: DescriptorEncoder) -> Result<(), Error> {
        let (mut x, s) = (Out(e), &self.0);
        server(&mut x, s)?;
        requests(&mut x, s)?;
        jobs(&mut x, s)?;
        cache(&mut x, s)?;
        lanes(&mut x, &s.lanes)?;
        models(&mut x, &s.models)?;
        let anomalies = AnomalyKind::ALL
            .iter()
            .map(|&k| {
                let n = s.anomalies.iter().filter(|a| a.kind == k).count();
                (KindLabels { kind: k.name() }, n as f64)
            })
            .collect();
        x.family(
            "anomalies",
            "what the inspector flags in this reading, per kind",
            None,
            Values::Gauges(anomalies),
        )
    }
}

// ------------------------------------------------------------ the metrics

/// The build, the server process and its clients.
fn server(x: &mut Out, s: &Snapshot) -> Result<(), Error> {
    let sv = &s.server;
    x.metric(
        "build",
        "this build of kvring and the segment's layout version",
        None,
        MetricType::Info,
        |mut m| {
            m.encode_info(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                layout_version: sv.layout_version.to_string(),
            })
        },
    )?;
    let up = if sv.alive { 1.0 } else { 0.0 };
    x.gauge(
        "server_up",
        "1 while the server process lives (its liveness lock is held)",
        None,
        up,
    )?;
    x.gauge(
        "server_uptime",
        "time since the server made its segment",
        Some(Unit::Seconds),
        sv.age_s,
    )?;
    x.gauge(
        "server_heartbeat_age",
        "time since the server's last heartbeat (NaN: unreadable)",
        Some(Unit::Seconds),
        sv.heartbeat_age_ms.map_or(f64::NAN, |ms| ms / 1e3),
    )?;
    x.gauge(
        "clients_connected",
        "client sessions connected now",
        None,
        f64::from(sv.clients_connected),
    )?;
    for (name, help, v) in [
        (
            "clients_accepted",
            "client sessions accepted",
            sv.clients_accepted,
        ),
        (
            "clients_reclaimed",
            "client sessions reclaimed after their process died or broke the protocol",
            sv.clients_reclaimed,
        ),
        (
            "clients_refused",
            "connections refused (no slot, bad handshake, ...)",
            sv.clients_refused,
        ),
    ] {
        x.counter(name, help, None, v)?;
    }
    Ok(())
}

/// Per operation: requests, errors, latency.
fn requests(x: &mut Out, s: &Snapshot) -> Result<(), Error> {
    let label = |o: &OpView| OpLabels { op: o.name };
    let count = s.ops.iter().map(|o| (label(o), o.count)).collect();
    x.family(
        "requests",
        "requests served per operation (refused ones included)",
        None,
        Values::Counters(count),
    )?;
    let errors = s.ops.iter().map(|o| (label(o), o.errors)).collect();
    x.family(
        "request_errors",
        "error completions and failed jobs per operation",
        None,
        Values::Counters(errors),
    )?;
    let latency = s
        .ops
        .iter()
        // PING's latency is the client's round trip: not recorded.
        .filter(|o| o.name != "ping")
        .map(|o| (label(o), latency(&o.buckets, o.sum_us)))
        .collect();
    x.family(
        "request_latency",
        "per operation: a job's submitted-to-finished time, or the server's time from reading a request to its completion",
        Some(Unit::Seconds),
        Values::Histograms(latency),
    )
}

/// An operation's latency histogram, in seconds.
fn latency(buckets: &[u64; HIST_BUCKETS], sum_us: f64) -> Latency {
    let bounds = (0..HIST_BUCKETS).map(|i| {
        if i + 1 == HIST_BUCKETS {
            f64::INFINITY
        } else {
            OpStat::bucket_limit(i) as f64 / 1e9
        }
    });
    Latency {
        sum: sum_us / 1e6,
        count: buckets.iter().sum(),
        buckets: bounds.zip(buckets.iter().copied()).collect(),
    }
}

/// The job table: slots per state, jobs by outcome.
fn jobs(x: &mut Out, s: &Snapshot) -> Result<(), Error> {
    let j = &s.jobs;
    let slots = j
        .by_state
        .iter()
        .map(|(k, &n)| (StateLabels { state: k.clone() }, n as f64))
        .collect();
    x.family(
        "job_slots",
        "job slots per state in this reading",
        None,
        Values::Gauges(slots),
    )?;
    for (name, help, v) in [
        ("jobs_submitted", "jobs submitted", j.submitted),
        ("jobs_done", "jobs that ended done", j.done),
        ("jobs_failed", "jobs that ended failed", j.failed),
        ("jobs_refused", "jobs refused (no free slot)", j.refused),
    ] {
        x.counter(name, help, None, v)?;
    }
    Ok(())
}

/// The pool, the cache's counters, the second tier and the pins.
fn cache(x: &mut Out, s: &Snapshot) -> Result<(), Error> {
    let c = &s.cache;
    let bytes = Some(Unit::Bytes);
    x.gauge(
        "pool",
        "the host pool's size",
        bytes.clone(),
        c.pool_bytes as f64,
    )?;
    x.gauge(
        "pool_used",
        "pool bytes held by objects",
        bytes.clone(),
        c.pool_used_bytes as f64,
    )?;
    x.gauge("objects", "stored chunk objects", None, c.objects as f64)?;
    x.gauge("leases", "lookup leases held", None, c.leases as f64)?;
    x.gauge(
        "registrations",
        "KV cache registrations",
        None,
        c.instances as f64,
    )?;
    let counters: [(&str, &str, Option<Unit>, u64); 22] = [
        ("lookups", "LOOKUP requests", None, c.lookups),
        ("lookup_chunks", "chunks looked up (requested)", None, c.lookup_chunks),
        ("lookup_hit_chunks", "chunks found by lookups", None, c.lookup_hit_chunks),
        ("stores", "STORE jobs", None, c.stores),
        ("stored_chunks", "chunk objects stored", None, c.stored_chunks),
        ("stored", "bytes stored into the pool", bytes.clone(), c.stored_bytes),
        (
            "store_no_space_chunks",
            "chunks not stored for want of pool space",
            None,
            c.store_no_space_chunks,
        ),
        ("retrieves", "RETRIEVE jobs", None, c.retrieves),
        ("retrieved_chunks", "chunks retrieved", None, c.retrieved_chunks),
        ("retrieved", "bytes retrieved from the pool", bytes.clone(), c.retrieved_bytes),
        ("evicted_objects", "objects evicted", None, c.evicted_objects),
        ("evicted", "bytes evicted", bytes.clone(), c.evicted_bytes),
        ("leases_expired", "leases ended by their TTL", None, c.leases_expired),
        (
            "lookup_l2_hit_chunks",
            "chunks lookups found in the second tier beyond the pool's (part of lookup_hit_chunks)",
            None,
            c.lookup_l2_hit_chunks,
        ),
        ("l2_written_objects", "objects written to the second tier", None, c.l2_written_objects),
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
        ("l2_out", "value bytes written to the second tier", bytes.clone(), c.l2_bytes_out),
        ("l2_in", "value bytes read from the second tier", bytes.clone(), c.l2_bytes_in),
        (
            "l2_errors",
            "second-tier commands that failed (timeouts and connection errors; error replies about one key)",
            None,
            c.l2_errors,
        ),
    ];
    for (name, help, unit, v) in counters {
        x.counter(name, help, unit, v)?;
    }
    let disk = c.disk_tier_state();
    if disk != Ok(TierState::None) {
        let counters: [(&str, &str, Option<Unit>, u64); 9] = [
            (
                "lookup_disk_hit_chunks",
                "chunks lookups found on the disk tier beyond the pool's (part of lookup_hit_chunks)",
                None,
                c.lookup_disk_hit_chunks,
            ),
            ("disk_written_objects", "objects written to the disk tier", None, c.disk_written_objects),
            (
                "disk_write_dropped_objects",
                "objects not written to the disk tier (its queue full, it down, a write failed, too many bytes waiting)",
                None,
                c.disk_write_dropped_objects,
            ),
            (
                "disk_loaded_objects",
                "objects read from the disk tier into the pool",
                None,
                c.disk_loaded_objects,
            ),
            (
                "disk_missed_objects",
                "objects asked of the disk tier and not there",
                None,
                c.disk_missed_objects,
            ),
            (
                "disk_corrupt_objects",
                "disk records that are not the object their key names (read as misses)",
                None,
                c.disk_corrupt_objects,
            ),
            ("disk_out", "record bytes written to the disk tier", bytes.clone(), c.disk_bytes_out),
            ("disk_in", "record bytes read from the disk tier", bytes.clone(), c.disk_bytes_in),
            (
                "disk_errors",
                "disk tier reads and writes that failed (I/O errors, a full disk, a deadline passed)",
                None,
                c.disk_errors,
            ),
        ];
        for (name, help, unit, v) in counters {
            x.counter(name, help, unit, v)?;
        }
        x.gauge(
            "disk_queue",
            "operations queued for or running on the disk tier",
            None,
            c.disk_queue as f64,
        )?;
        x.gauge(
            "disk_objects",
            "objects on the disk tier",
            None,
            c.disk_objects as f64,
        )?;
        x.gauge(
            "disk_used",
            "bytes of the disk tier's segment files",
            bytes.clone(),
            c.disk_used_bytes as f64,
        )?;
        x.gauge(
            "disk_capacity",
            "the disk tier's byte budget",
            bytes.clone(),
            c.disk_capacity_bytes as f64,
        )?;
        x.gauge(
            "disk_up",
            "1 while the disk tier takes work, 0 while it is down after I/O errors (absent without one)",
            None,
            if disk == Ok(TierState::Up) { 1.0 } else { 0.0 },
        )?;
    }
    // A server with an event stream starts it with a resync.
    if c.events_resyncs > 0 {
        let counters: [(&str, &str, u64); 3] = [
            (
                "events_published",
                "KV events published on the node's stream",
                c.events_published,
            ),
            (
                "events_dropped",
                "KV event records dropped because the stream's queue was full (a resync follows)",
                c.events_dropped,
            ),
            (
                "events_resyncs",
                "KV event resyncs published (all cleared, then every object the pool holds)",
                c.events_resyncs,
            ),
        ];
        for (name, help, v) in counters {
            x.counter(name, help, None, v)?;
        }
    }
    x.gauge(
        "l2_queue",
        "operations queued for or running on the second tier",
        None,
        c.l2_queue as f64,
    )?;
    let tier = c.tier_state();
    if tier != Ok(TierState::None) {
        x.gauge(
            "l2_up",
            "1 while the second tier answers, 0 while it is down or connecting (absent without one)",
            None,
            if tier == Ok(TierState::Up) { 1.0 } else { 0.0 },
        )?;
    }
    x.gauge(
        "pool_ready",
        "pool bytes ready for copies (pinned, with the CUDA backend)",
        bytes.clone(),
        s.server.pool_ready_bytes as f64,
    )?;
    x.gauge(
        "pinned_objects",
        "objects an operator pinned (kept through eviction and clear)",
        None,
        c.pinned_objects as f64,
    )?;
    x.gauge(
        "pinned",
        "bytes of the pinned objects",
        bytes,
        c.pinned_bytes as f64,
    )
}

/// A metric read off each row of a reading's table: name, help, value.
type Column<'a, R, V> = (&'a str, &'a str, &'a dyn Fn(&R) -> V);

/// The copy lanes, one series per device.
fn lanes(x: &mut Out, lanes: &[LaneView]) -> Result<(), Error> {
    let label = |l: &LaneView| DeviceLabels {
        device: l.device.clone(),
    };
    let gauges: [Column<LaneView, f64>; 5] = [
        ("copy_workers", "copy workers of the lane", &|l| l.workers.len() as f64),
        (
            "copy_queued_tasks",
            "chunk copies queued, not yet taken by a worker (queue depth)",
            &|l| l.queued as f64,
        ),
        ("copy_in_flight", "chunk copies started, not yet finished", &|l| l.in_flight as f64),
        ("copy_held_tasks", "chunk copies waiting for their engine's event", &|l| l.held as f64),
        (
            "copy_stalled_seconds",
            "the longest time a worker with work went without a step (0: none stalled; NaN: unreadable)",
            &|l| l.stalled_ms().map_or(f64::NAN, |ms| ms / 1e3),
        ),
    ];
    for (name, help, f) in gauges {
        let rows = lanes.iter().map(|l| (label(l), f(l))).collect();
        x.family(name, help, None, Values::Gauges(rows))?;
    }
    let counters: [Column<LaneView, u64>; 3] = [
        ("copy_chunks", "chunk copies finished (any outcome)", &|l| {
            l.copies
        }),
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
    for (name, help, f) in counters {
        let rows = lanes.iter().map(|l| (label(l), f(l))).collect();
        x.family(name, help, None, Values::Counters(rows))?;
    }
    Ok(())
}

/// Lookups per model and salt.
fn models(x: &mut Out, models: &[ModelView]) -> Result<(), Error> {
    let counters: [Column<ModelView, u64>; 5] = [
        (
            "model_lookups",
            "LOOKUP requests per model and salt",
            &|m| m.lookups,
        ),
        (
            "model_lookup_chunks",
            "chunks looked up per model and salt",
            &|m| m.chunks,
        ),
        (
            "model_lookup_hit_chunks",
            "chunks found per model and salt",
            &|m| m.hit_chunks,
        ),
        (
            "lookup_tokens",
            "tokens looked up per model and salt (model=\"other\": past the 63 tracked)",
            &|m| m.tokens,
        ),
        (
            "lookup_hit_tokens",
            "tokens found per model and salt",
            &|m| m.hit_tokens,
        ),
    ];
    for (name, help, f) in counters {
        let rows = models
            .iter()
            .map(|m| {
                let labels = ModelLabels {
                    model: m.model.clone(),
                    salt: m.salt.clone(),
                };
                (labels, f(m))
            })
            .collect();
        x.family(name, help, None, Values::Counters(rows))?;
    }
    Ok(())
}
