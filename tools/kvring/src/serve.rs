//! `kvring serve`: its flags, in the groups of the server's configuration
//! (the segment, the cache service, the copy lanes, the HTTP endpoint, the
//! tier below the pool), and the server run until SIGINT or SIGTERM. The
//! cache's and the copy lanes' flags are their settings themselves
//! (`kvring_server::CacheConfig` and `CopyConfig`, flattened); the other
//! groups are read into theirs here, and `ServerConfig::validate` checks
//! them all at start.

use clap::Args;
use kvring::shm::Geometry;
use kvring::wait::WaitPolicy;
use kvring_server::config::flags::seconds;
use kvring_server::{
    CacheConfig, CopyConfig, DiskConfig, HttpConfig, L2Config, L2WriteMode, ServerConfig,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The flags of `kvring serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    target: crate::target::Target,
    #[command(flatten)]
    segment: SegmentArgs,
    #[command(flatten)]
    cache: CacheConfig,
    #[command(flatten)]
    copy: CopyConfig,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    tier: TierArgs,
    #[command(flatten)]
    disk: DiskArgs,
    #[command(flatten)]
    events: EventsArgs,
}

/// The node's KV event stream.
#[derive(Args, Debug)]
struct EventsArgs {
    /// Publish KV events (what the pool stores and drops, for every engine
    /// of the node) on a ZeroMQ PUB socket bound here, in vLLM's format:
    /// tcp://*:5557, tcp://127.0.0.1:0 (a free port, printed),
    /// ipc:///path. docs/events.md has the schema.
    #[arg(long = "kv-events", value_name = "ENDPOINT", env = "KVRING_KV_EVENTS")]
    ev_endpoint: Option<String>,
    /// The replay socket (ROUTER; clients use DEALER): a subscriber asks
    /// for the batches from a sequence number on, or for a snapshot.
    #[arg(
        long = "kv-events-replay",
        value_name = "ENDPOINT",
        env = "KVRING_KV_EVENTS_REPLAY"
    )]
    ev_replay: Option<String>,
    /// The topic of every message.
    #[arg(
        long = "kv-events-topic",
        value_name = "TOPIC",
        default_value = "kvring"
    )]
    ev_topic: String,
    /// Event records queued for the publisher at most; past it records are
    /// dropped (counted) and a resync follows.
    #[arg(long = "kv-events-queue", value_name = "N", default_value_t = 1 << 16)]
    ev_queue: usize,
    /// Bytes of sent batches kept for replay (K, M, G, KiB, MiB, GiB).
    #[arg(long = "kv-events-replay-bytes", value_name = "BYTES", default_value = "64MiB",
        value_parser = kvring::units::parse_bytes)]
    ev_replay_bytes: u64,
    /// Messages queued for one subscriber at most (past it, that
    /// subscriber misses messages; the rings never wait for it).
    #[arg(long = "kv-events-hwm", value_name = "N", default_value_t = 100_000)]
    ev_hwm: i32,
}

impl EventsArgs {
    fn config(&self) -> Option<kvring_server::events::EventsConfig> {
        let mut c = kvring_server::events::EventsConfig::new(self.ev_endpoint.as_deref()?);
        c.replay = self.ev_replay.clone();
        c.topic = self.ev_topic.clone();
        c.queue = self.ev_queue;
        c.replay_bytes = self.ev_replay_bytes;
        c.hwm = self.ev_hwm;
        Some(c)
    }
}

/// The local disk tier.
#[derive(Args, Debug)]
struct DiskArgs {
    /// A tier below the pool on a local disk: objects the pool evicts are
    /// written to segment files in this directory (made if missing; one
    /// server per directory), and a server started on it serves what it
    /// holds. With --l2 too, lookups ask the disk first.
    #[arg(long = "disk", value_name = "DIR", env = "KVRING_DISK")]
    disk_dir: Option<std::path::PathBuf>,
    /// Bytes of the disk tier's files at most (K, M, G, KiB, MiB, GiB).
    #[arg(long = "disk-bytes", value_name = "BYTES", env = "KVRING_DISK_BYTES",
        default_value = "16GiB", value_parser = kvring::units::parse_bytes)]
    disk_bytes: u64,
    /// When objects go to disk: `back` (when the pool evicts them) or
    /// `through` (as soon as they are stored).
    #[arg(long = "disk-write", value_name = "WHEN", default_value = "back",
        value_parser = ["back", "through"])]
    disk_write: String,
}

impl DiskArgs {
    fn config(&self) -> Option<DiskConfig> {
        let mut c = DiskConfig::new(self.disk_dir.clone()?, self.disk_bytes);
        if self.disk_write == "through" {
            c.mode = L2WriteMode::Through;
        }
        Some(c)
    }
}

/// The segment and its ring loop.
#[derive(Args, Debug)]
struct SegmentArgs {
    /// Client slots in the segment (most engines processes at once).
    #[arg(long, default_value_t = Geometry::default().max_clients)]
    max_clients: u32,
    /// Request ring bytes per client (a power of two, at least 4096).
    #[arg(long, default_value_t = Geometry::default().req_ring_bytes)]
    req_ring_bytes: u32,
    /// Completion ring bytes per client (a power of two, at least 4096).
    #[arg(long, default_value_t = Geometry::default().cq_ring_bytes)]
    cq_ring_bytes: u32,
    /// Largest ring frame in bytes (header included; at most a quarter of
    /// each ring). Larger messages are refused; the client library splits.
    #[arg(long, default_value_t = Geometry::default().max_frame_bytes)]
    max_frame_bytes: u32,
    /// Job slots in the segment's job table.
    #[arg(long, default_value_t = Geometry::default().job_slots)]
    job_slots: u32,
    /// Microseconds the ring loop busy-polls after its last request before
    /// it yields and then parks (0 = park at once).
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Start even when the segment exceeds the free space of /dev/shm or
    /// the pool and segment exceed available memory (refused otherwise,
    /// naming the limit).
    #[arg(long)]
    allow_oversize: bool,
}

impl SegmentArgs {
    fn geometry(&self) -> Geometry {
        Geometry {
            max_clients: self.max_clients,
            req_ring_bytes: self.req_ring_bytes,
            cq_ring_bytes: self.cq_ring_bytes,
            max_frame_bytes: self.max_frame_bytes,
            job_slots: self.job_slots,
        }
    }

    fn ring_wait(&self, default: WaitPolicy) -> WaitPolicy {
        WaitPolicy {
            spin: Duration::from_micros(self.spin_us),
            ..default
        }
    }
}

/// The HTTP endpoint.
#[derive(Args, Debug)]
struct HttpArgs {
    /// The HTTP endpoint (GET /metrics, /healthz, /readyz, /status):
    /// ADDR:PORT, or `off`. Default 127.0.0.1:9090; when that is taken the
    /// server runs without it (saying so); an address given here that
    /// cannot be bound fails the start.
    #[arg(long, env = "KVRING_HTTP")]
    http: Option<String>,
    /// /healthz reports a job unfinished for longer than this (seconds) as
    /// a stall.
    #[arg(long = "stuck-job-s", value_name = "SECONDS", default_value = "60", value_parser = seconds)]
    stuck_job: Duration,
    /// /healthz reports a copy worker with work (copies in flight, tasks
    /// queued or held) that made no step for longer than this (seconds) as
    /// a stall.
    #[arg(long = "stalled-lane-s", value_name = "SECONDS", default_value_t = kvring::inspect::DEFAULT_LANE_STALL_S,
        value_parser = seconds_f64)]
    stalled_lane: f64,
    /// Take the HTTP admin calls (POST /clear, /evict, /pin, /unpin, GET
    /// /pins) from any peer, not only loopback; they still need the admin
    /// token (which then crosses the network in clear text).
    #[arg(long = "http-admin-remote")]
    admin_remote: bool,
    /// At most this many HTTP connections open (never more than a quarter
    /// of the open-descriptor limit); past it, the oldest connection
    /// waiting on its client is closed to make room.
    #[arg(long = "http-max-connections", value_name = "N", default_value_t = kvring_server::HTTP_DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
}

/// `stalled-lane-s`, whose default is a number of seconds.
fn seconds_f64(s: &str) -> Result<f64, String> {
    seconds(s).map(|d| d.as_secs_f64())
}

impl HttpArgs {
    /// The endpoint, or none (`--http off`).
    fn config(&self) -> kvring::Result<Option<HttpConfig>> {
        let mut h = HttpConfig::default_endpoint();
        match self.http.as_deref() {
            Some("off") => return Ok(None),
            Some(a) => {
                h.addr = a.parse::<SocketAddr>().map_err(|e| {
                    kvring::Error::Config(format!(
                        "--http {a:?}: {e} (ADDR:PORT, e.g. 127.0.0.1:9090, or off)"
                    ))
                })?;
                h.required = true;
            }
            None => {}
        }
        h.stuck_job = self.stuck_job;
        h.stalled_lane = Duration::from_secs_f64(self.stalled_lane);
        h.admin_remote = self.admin_remote;
        h.max_connections = self.max_connections;
        Ok(Some(h))
    }
}

/// The tier below the pool (Valkey/Redis).
#[derive(Args, Debug)]
struct TierArgs {
    /// A second tier on Valkey/Redis: redis://[USER:PASSWORD@]HOST:PORT
    /// (rediss:// for TLS). Given more than once, or as redis+cluster://,
    /// the seeds of a Valkey/Redis Cluster.
    #[arg(
        long = "l2",
        value_name = "URL",
        env = "KVRING_L2",
        value_delimiter = ','
    )]
    urls: Vec<String>,
    /// Put before every key of the second tier.
    #[arg(long = "l2-prefix", value_name = "PREFIX", default_value = "kvring:")]
    prefix: String,
    /// When objects go to the second tier: `back` (when the pool evicts
    /// them) or `through` (as soon as they are stored).
    #[arg(long = "l2-write", value_name = "WHEN", default_value = "back", value_parser = ["back", "through"])]
    write: String,
    /// Expire written objects after this (seconds; default: never, the
    /// store's maxmemory policy decides).
    #[arg(long = "l2-ttl-s", value_name = "SECONDS", value_parser = seconds)]
    ttl: Option<Duration>,
    /// Connect within this, and take an answer within this (seconds; a
    /// command past it marks the tier down). One connection carries many
    /// 32 MiB values at once: leave room for a burst.
    #[arg(long = "l2-timeout-s", value_name = "SECONDS", default_value = "5", value_parser = seconds)]
    timeout: Duration,
    /// The longest a lookup waits for the second tier (seconds).
    #[arg(long = "l2-lookup-wait-s", value_name = "SECONDS", default_value = "2", value_parser = seconds)]
    lookup_wait: Duration,
    /// Operations queued for the second tier at most (writes past it are
    /// dropped and counted; lookups answer from the pool).
    #[arg(long = "l2-queue", value_name = "N", default_value_t = 1024)]
    queue: usize,
    /// Connections to the second tier (a cluster: to each of its nodes),
    /// and threads of its runtime; commands take the connections in turn,
    /// and their replies are read and checked in parallel.
    #[arg(long = "l2-connections", value_name = "N", default_value_t = 4)]
    connections: usize,
    /// Seal values with a MAC keyed by the secret in this file (at least 16
    /// bytes; a trailing newline is left out), and take only values so
    /// sealed: a writer without the secret cannot make a value this server
    /// takes. Every server sharing the tier needs the same secret.
    #[arg(
        long = "l2-secret-file",
        value_name = "PATH",
        env = "KVRING_L2_SECRET_FILE"
    )]
    secret_file: Option<std::path::PathBuf>,
}

impl TierArgs {
    /// The tier, or none (no `--l2`).
    fn config(&self) -> kvring::Result<Option<L2Config>> {
        if self.urls.is_empty() {
            return Ok(None);
        }
        let mut c = L2Config::from_urls(&self.urls).map_err(kvring::Error::Config)?;
        c.prefix = self.prefix.clone();
        c.mode = if self.write == "through" {
            L2WriteMode::Through
        } else {
            L2WriteMode::Back
        };
        c.ttl = self.ttl;
        c.connect_timeout = self.timeout;
        c.response_timeout = self.timeout;
        c.lookup_wait = self.lookup_wait;
        c.queue = self.queue;
        c.connections = self.connections;
        if let Some(path) = &self.secret_file {
            let key = kvring_server::l2::value::MacKey::from_file(path)
                .map_err(|e| kvring::Error::Config(format!("--l2-secret-file {e}")))?;
            c.seal = kvring_server::l2::value::Seal::Mac(key);
        }
        Ok(Some(c))
    }
}

impl ServeArgs {
    /// The server's configuration (checked by the server when it starts).
    fn config(self) -> kvring::Result<ServerConfig> {
        let mut cfg = ServerConfig::new(&self.target.name);
        cfg.runtime_dir = self.target.dir();
        cfg.geometry = self.segment.geometry();
        cfg.ring_wait = self.segment.ring_wait(cfg.ring_wait);
        cfg.allow_oversize = self.segment.allow_oversize;
        cfg.http = self.http.config()?;
        cfg.tier = self.tier.config()?;
        cfg.disk = self.disk.config();
        cfg.events = self.events.config();
        cfg.cache = self.cache;
        cfg.copy = self.copy;
        Ok(cfg)
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// SIGINT and SIGTERM stop the server while it serves; the handlers they
/// had come back when it has stopped (`kvring_cmd::main` is a library
/// function: its caller's handlers survive it).
struct StopSignals([(libc::c_int, libc::sighandler_t); 2]);

impl StopSignals {
    fn install() -> StopSignals {
        // Relaxed: the flag is only read by this thread's serve loop.
        STOP.store(false, Ordering::Relaxed);
        StopSignals([libc::SIGINT, libc::SIGTERM].map(|sig| {
            // SAFETY: the handler only stores to an atomic, which is
            // async-signal-safe; the previous handler is kept to restore.
            (sig, unsafe {
                libc::signal(sig, on_signal as *const () as libc::sighandler_t)
            })
        }))
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for (sig, old) in self.0 {
            // SAFETY: puts back the handler `signal` returned, unchanged.
            unsafe { libc::signal(sig, old) };
        }
    }
}

/// Runs the server until SIGINT or SIGTERM (or its own stop).
pub fn run(args: ServeArgs) -> kvring::Result<()> {
    let cfg = args.config()?;
    let (pool_bytes, chunk_tokens) = (cfg.cache.pool_bytes, cfg.cache.chunk_tokens);
    let tier = cfg.tier.clone();
    let disk = cfg.disk.clone();
    let _signals = StopSignals::install();
    let server = kvring_server::start(cfg)?;
    let p = server.paths();
    println!(
        "kvring: serving {} (segment /dev/shm{}, socket {}, pid {}); pool {} MiB, chunk {} tokens",
        p.name,
        p.shm_name,
        p.socket.display(),
        std::process::id(),
        pool_bytes >> 20,
        chunk_tokens
    );
    println!("kvring: copy backend {}", server.backend().1);
    if let Some(c) = &tier {
        println!(
            "kvring: second tier {} ({}, write-{}, keys {}*)",
            c.urls.join(", "),
            if c.cluster { "cluster" } else { "standalone" },
            if c.mode == L2WriteMode::Back {
                "back"
            } else {
                "through"
            },
            c.prefix
        );
    }
    if let Some(d) = &disk {
        println!(
            "kvring: disk tier {} ({} MiB in {} MiB segments, write-{})",
            d.dir.display(),
            d.bytes >> 20,
            d.segment_bytes >> 20,
            if d.mode == L2WriteMode::Back {
                "back"
            } else {
                "through"
            }
        );
    }
    if let Some((live, replay, topic)) = server.events_endpoints() {
        println!(
            "kvring: KV events on {live}{}, topic {topic:?}",
            replay.map_or(String::new(), |r| format!(" (replay {r})"))
        );
    }
    if let Some(a) = server.http_addr() {
        println!("kvring: http://{a}/metrics, /healthz, /readyz, /status");
        println!(
            "kvring: admin calls (POST /clear, /evict, /pin, /unpin, GET /pins) need \"Authorization: Bearer $(cat {})\"",
            p.admin_token.display()
        );
    }
    while !STOP.load(Ordering::Relaxed) && !server.stopping() {
        std::thread::sleep(Duration::from_millis(20));
    }
    server.stop();
    println!("kvring: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    /// `kvring serve` with no flags starts the server `ServerConfig::new`
    /// describes: the flags' defaults are the settings' defaults.
    #[test]
    fn no_flags_is_the_default_configuration() {
        // The environment variables the flags read would change the answer.
        for k in [
            "KVRING_CHUNK_TOKENS",
            "KVRING_POOL_BYTES",
            "KVRING_PREFAULT",
            "KVRING_LEASE_TTL_S",
            "KVRING_BACKEND",
            "KVRING_COPY_THREADS",
            "KVRING_CUDA_DEPTH",
            "KVRING_HTTP",
            "KVRING_L2",
            "KVRING_L2_SECRET_FILE",
            "KVRING_DISK",
        ] {
            assert!(std::env::var_os(k).is_none(), "unset {k} to run this test");
        }
        let got = Serve::parse_from(["serve", "--name", "t"])
            .args
            .config()
            .unwrap();
        let want = ServerConfig::new("t");
        assert_eq!(got.cache, want.cache);
        assert_eq!(got.copy, want.copy);
        assert_eq!(got.geometry, want.geometry);
        assert_eq!(got.ring_wait, want.ring_wait);
        assert_eq!(got.allow_oversize, want.allow_oversize);
        assert_eq!(
            format!("{:?}", got.http),
            format!("{:?}", want.http),
            "the HTTP endpoint"
        );
        assert!(got.tier.is_none() && want.tier.is_none());
        assert!(got.disk.is_none() && want.disk.is_none());
    }

    /// A group's flags land in that group.
    #[test]
    fn flags_land_in_their_groups() {
        let cfg = Serve::parse_from([
            "serve",
            "--name",
            "t",
            "--lease-ttl-s",
            "7",
            "--evict-at-percent",
            "70",
            "--evict-to-percent",
            "60",
            "--backend",
            "host",
            "--engine-event-timeout",
            "2.5",
            "--http",
            "off",
            "--spin-us",
            "0",
            "--max-request-bytes",
            "64KiB",
        ])
        .args
        .config()
        .unwrap();
        assert_eq!(cfg.cache.lease_ttl, Duration::from_secs(7));
        assert_eq!(
            (cfg.cache.high_watermark, cfg.cache.low_watermark),
            (0.7, 0.6)
        );
        assert_eq!(cfg.cache.max_request_bytes, 64 << 10);
        assert_eq!(cfg.copy.backend, kvring_server::BackendChoice::Host);
        assert_eq!(cfg.copy.engine_event_timeout, Duration::from_millis(2500));
        assert!(cfg.http.is_none());
        assert_eq!(cfg.ring_wait.spin, Duration::ZERO);
        assert!(Serve::try_parse_from(["serve", "--evict-at-percent", "101"]).is_err());
        assert!(Serve::try_parse_from(["serve", "--max-request-bytes", "5GiB"]).is_err());
    }
}
