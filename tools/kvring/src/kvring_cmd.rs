//! `kvring`: the cache server and a few client commands.

use clap::{Args, Parser, Subcommand};
use kvring::shm::Geometry;
use kvring::units::parse_bytes;
use kvring::Client;
use kvring_server::ServerConfig;
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "kvring",
    version,
    about = "Node-local KV-cache server and shared-memory IPC runtime"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct Target {
    /// Server name: one server per name and user on a host.
    #[arg(long, default_value = kvring::rundir::DEFAULT_NAME, env = "KVRING_NAME")]
    name: String,
    /// Directory for the bootstrap socket and lock file (mode 0700). Default:
    /// $KVRING_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvring, else /tmp/kvring-UID.
    #[arg(long)]
    runtime_dir: Option<std::path::PathBuf>,
}

impl Target {
    fn dir(&self) -> std::path::PathBuf {
        self.runtime_dir
            .clone()
            .unwrap_or_else(kvring::rundir::runtime_dir)
    }
}

// Parsed once per process: the size of the server's options does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the cache server until SIGINT or SIGTERM.
    Serve {
        #[command(flatten)]
        target: Target,
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
        /// Tokens per chunk object. Every engine's block size must divide it.
        #[arg(long, env = "KVRING_CHUNK_TOKENS", default_value_t = kvring::kv::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: u32,
        /// Size of the host pool that holds chunk objects, allocated at
        /// start (bytes; K, M, G, KiB, MiB, GiB suffixes accepted).
        #[arg(long, env = "KVRING_POOL_BYTES", default_value = "2GiB", value_parser = parse_bytes)]
        pool_bytes: u64,
        /// Touch every pool page at start, so the first stores do not pay
        /// page faults (start-up takes longer).
        #[arg(long, env = "KVRING_PREFAULT")]
        prefault: bool,
        /// Start even when the segment exceeds the free space of /dev/shm
        /// or the pool and segment exceed available memory (refused
        /// otherwise, naming the limit).
        #[arg(long)]
        allow_oversize: bool,
        /// Threads that copy chunks between engines' caches and the pool,
        /// per copy lane: one lane for engines with no device, one per GPU
        /// (or simulated device). Default: half the CPUs, 1 to 8, on the
        /// host backend; 4 on CUDA.
        #[arg(long, env = "KVRING_COPY_THREADS")]
        copy_threads: Option<u32>,
        /// Largest request, all frames together (a LOOKUP of N chunks takes
        /// 24 + 16 N bytes).
        #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
        max_request_bytes: u64,
        /// Seconds a lookup's read leases last unless retrieved or freed.
        #[arg(long, env = "KVRING_LEASE_TTL_S", default_value_t = 300)]
        lease_ttl_s: u64,
        /// Seconds a lookup waits for a chunk being written (another
        /// request's store of the same prefix, under way) before it answers
        /// without it; 0: never waits. Fractions allowed.
        #[arg(long, default_value_t = 1.0, value_parser = parse_seconds_or_zero)]
        inflight_wait_s: f64,
        /// Seconds a STORE or RETRIEVE ordered after an engine's event waits
        /// for it (polled from the host: no stream of the server ever waits
        /// on the device for an engine) before it fails
        /// `engine_event_timeout` (chunks not copied by then never are). Fractions
        /// allowed.
        #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
        engine_event_timeout: f64,
        /// Copy backend: `cuda` (engines' KV caches in GPU memory; fails at
        /// start, saying why, without a usable GPU), `host` (host memory
        /// only), or `auto` (CUDA when the driver and a GPU are there).
        #[arg(long, env = "KVRING_BACKEND", default_value = "auto")]
        backend: kvring_server::BackendChoice,
        /// CUDA transfer path: 0 (default) gathers into a device staging
        /// buffer and moves it with the copy engine, leaving the engine's SMs
        /// alone; N > 0 uses zero-copy kernels between GPU memory and the
        /// pinned pool with at most N CTAs.
        #[arg(long, default_value_t = 0)]
        cuda_zero_copy_ctas: u32,
        /// CUDA: chunks each copy worker keeps in flight per device (one
        /// staging slot each), 1 to 8; default: the CUDA backend's.
        #[arg(long, env = "KVRING_CUDA_DEPTH", value_parser = clap::value_parser!(u32).range(1..=8))]
        cuda_depth: Option<u32>,
        /// Host backend: give this many simulated devices their own copy
        /// lanes (workers), as a CUDA server does for each GPU; engines name
        /// device i by `kvring_server::simulated_device_uuid(i)` when they
        /// register. For testing multi-device scheduling without GPUs.
        #[arg(long, default_value_t = 0)]
        simulated_devices: u32,
        /// Pool usage (percent) at which LRU eviction starts ...
        #[arg(long, default_value_t = 90)]
        evict_at_percent: u32,
        /// ... and down to which it evicts.
        #[arg(long, default_value_t = 80)]
        evict_to_percent: u32,
        /// At most this many pins held (POST /pin past it is refused, 409).
        #[arg(long, default_value_t = kvring_server::DEFAULT_MAX_PINS)]
        max_pins: u64,
        /// At most this many bytes of objects kept by pins (a pin call that
        /// would pin more is refused, 409; an object stored under a pin past
        /// it is cached unpinned). Default: half the pool.
        #[arg(long, value_parser = parse_bytes)]
        max_pinned_bytes: Option<u64>,
        /// The HTTP endpoint (GET /metrics, /healthz, /readyz, /status):
        /// ADDR:PORT, or `off`. Default 127.0.0.1:9090; when that is taken
        /// the server runs without it (saying so); an address given here
        /// that cannot be bound fails the start.
        #[arg(long, env = "KVRING_HTTP")]
        http: Option<String>,
        /// /healthz reports a job unfinished for longer than this (seconds)
        /// as a stall.
        #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
        stuck_job_s: f64,
        /// /healthz reports a copy worker with work (copies in flight,
        /// tasks queued or held) that made no step for longer than this
        /// (seconds) as a stall.
        #[arg(long, default_value_t = kvring::inspect::DEFAULT_LANE_STALL_S, value_parser = parse_seconds)]
        stalled_lane_s: f64,
        /// Take the HTTP admin calls (POST /clear, /evict, /pin, /unpin,
        /// GET /pins) from any peer, not only loopback; they still need
        /// the admin token (which then crosses the network in clear text).
        #[arg(long)]
        http_admin_remote: bool,
        /// At most this many HTTP connections open (never more than a
        /// quarter of the open-descriptor limit); past it, the oldest
        /// connection waiting on its client is closed to make room.
        #[arg(long, default_value_t = kvring_server::HTTP_DEFAULT_MAX_CONNECTIONS)]
        http_max_connections: usize,
        #[command(flatten)]
        l2: L2Args,
    },
    /// Asks a server's HTTP endpoint whether it is healthy (GET /healthz)
    /// or, with --ready, ready (GET /readyz); prints the answer and exits 0
    /// on 200, 1 otherwise (a container's health check, an exec probe).
    Health {
        /// The endpoint's ADDR:PORT.
        #[arg(long, default_value = kvring_server::DEFAULT_HTTP_ADDR)]
        http: String,
        /// Ask for readiness instead.
        #[arg(long)]
        ready: bool,
        /// Connect and answer within this (seconds).
        #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
        timeout_s: f64,
    },
    /// Round-trip PING requests to a running server and print latency.
    Ping {
        #[command(flatten)]
        target: Target,
        /// Number of pings.
        #[arg(long, default_value_t = 1000)]
        count: u32,
        /// Payload bytes per ping.
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Per-ping timeout in milliseconds.
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
    },
    /// The whole job end to end: start a server, two tensor-parallel engine
    /// workers and a scheduler; store KV for prompts with shared prefixes,
    /// look them up, retrieve them into fresh caches and verify every byte.
    Demo {
        /// Also print the results as one JSON object (the last line).
        #[arg(long)]
        json: bool,
    },
    /// The ring inspector: `kvring inspect ARGS` is `kvring-inspect ARGS`
    /// (list, show NAME [--json], jobs NAME, watch NAME; see its --help).
    #[command(disable_help_flag = true)]
    Inspect {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// (internal) One engine worker of `kvring demo`.
    #[command(hide = true)]
    DemoWorker {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        rank: u32,
    },
    /// Run a delay job through the job table and print every state it is
    /// seen in (a health check of the job path): pending for --pending-ms,
    /// running for --running-ms, then done, or failed with --fail.
    DelayJob {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 100)]
        pending_ms: u64,
        #[arg(long, default_value_t = 100)]
        running_ms: u64,
        /// End the job failed (reason "requested") instead of done.
        #[arg(long)]
        fail: bool,
        /// Leave the job unreleased (it stays readable as done or failed).
        #[arg(long)]
        keep: bool,
    },
}

/// The second tier's options of `kvring serve`.
#[derive(Args, Debug)]
struct L2Args {
    /// A second tier on Valkey/Redis: redis://[USER:PASSWORD@]HOST:PORT
    /// (rediss:// for TLS). Given more than once, or as redis+cluster://,
    /// the seeds of a Valkey/Redis Cluster.
    #[arg(long = "l2", env = "KVRING_L2", value_delimiter = ',')]
    urls: Vec<String>,
    /// Put before every key of the second tier.
    #[arg(long, default_value = "kvring:")]
    l2_prefix: String,
    /// When objects go to the second tier: `back` (when the pool evicts
    /// them) or `through` (as soon as they are stored).
    #[arg(long, default_value = "back", value_parser = ["back", "through"])]
    l2_write: String,
    /// Expire written objects after this (seconds; default: never, the
    /// store's maxmemory policy decides).
    #[arg(long, value_parser = parse_seconds)]
    l2_ttl_s: Option<f64>,
    /// Connect within this, and take an answer within this (seconds; a
    /// command past it marks the tier down). One connection carries many
    /// 32 MiB values at once: leave room for a burst.
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    l2_timeout_s: f64,
    /// The longest a lookup waits for the second tier (seconds).
    #[arg(long, default_value_t = 2.0, value_parser = parse_seconds)]
    l2_lookup_wait_s: f64,
    /// Operations queued for the second tier at most (writes past it are
    /// dropped and counted; lookups answer from the pool).
    #[arg(long, default_value_t = 1024)]
    l2_queue: usize,
    /// Connections to the second tier (a cluster: to each of its nodes),
    /// and threads of its runtime; commands take the connections in turn,
    /// and their replies are read and checked in parallel.
    #[arg(long, default_value_t = 4)]
    l2_connections: usize,
    /// Seal values with a MAC keyed by the secret in this file (at least
    /// 16 bytes; a trailing newline is left out), and take only values so
    /// sealed: a writer without the secret cannot make a value this server
    /// takes. Every server sharing the tier needs the same secret.
    #[arg(long, env = "KVRING_L2_SECRET_FILE")]
    l2_secret_file: Option<std::path::PathBuf>,
}

impl L2Args {
    fn config(&self) -> kvring::Result<Option<kvring_server::L2Config>> {
        if self.urls.is_empty() {
            return Ok(None);
        }
        let mut c =
            kvring_server::L2Config::from_urls(&self.urls).map_err(kvring::Error::Config)?;
        c.prefix = self.l2_prefix.clone();
        c.mode = if self.l2_write == "through" {
            kvring_server::L2WriteMode::Through
        } else {
            kvring_server::L2WriteMode::Back
        };
        c.ttl = self.l2_ttl_s.map(Duration::from_secs_f64);
        c.connect_timeout = Duration::from_secs_f64(self.l2_timeout_s);
        c.response_timeout = Duration::from_secs_f64(self.l2_timeout_s);
        c.lookup_wait = Duration::from_secs_f64(self.l2_lookup_wait_s);
        if self.l2_queue == 0 {
            return Err(kvring::Error::Config(
                "--l2-queue must be at least 1".into(),
            ));
        }
        c.queue = self.l2_queue;
        if self.l2_connections == 0 || self.l2_connections > 64 {
            return Err(kvring::Error::Config(
                "--l2-connections must be 1 to 64".into(),
            ));
        }
        c.connections = self.l2_connections;
        if let Some(path) = &self.l2_secret_file {
            let key = kvring_server::l2::value::MacKey::from_file(path)
                .map_err(|e| kvring::Error::Config(format!("--l2-secret-file {e}")))?;
            c.seal = kvring_server::l2::value::Seal::Mac(key);
        }
        Ok(Some(c))
    }
}

/// A positive, finite number of seconds.
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds (positive, at most 1e9)"
        )),
    }
}

fn parse_seconds_or_zero(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(0.0) => Ok(0.0),
        _ => parse_seconds(s).map_err(|e| format!("{e}, or 0")),
    }
}

/// Prints a status the way the CLI shows it.
fn show(st: &kvring::jobs::JobStatus) -> String {
    use kvring::jobs::JobStatus::*;
    match st {
        Done(r) => format!("done (value {}, aux {})", r.value, r.aux),
        Failed(f) => format!("failed ({f})"),
        Tombstoned(Ok(r)) => format!("tombstoned (done: value {}, aux {})", r.value, r.aux),
        Tombstoned(Err(f)) => format!("tombstoned (failed: {f})"),
        other => other.name().to_string(),
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// SIGINT and SIGTERM stop the server while it serves; the handlers they
/// had come back when it has stopped (`main` is a library function: its
/// caller's handlers survive it).
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

/// Runs `kvring` with `args` (the first is the program's name).
pub fn main(args: Vec<OsString>) -> ExitCode {
    let cli = match crate::parse::<Cli>(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // Logs go to stderr through `tracing`: warnings and errors by default,
    // more with RUST_LOG (e.g. RUST_LOG=kvring=debug). Already set when the
    // command runs a second time in one process.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    if let Cmd::Health {
        http,
        ready,
        timeout_s,
    } = &cli.cmd
    {
        return crate::health::run(http, *ready, Duration::from_secs_f64(*timeout_s));
    }
    if let Cmd::Inspect { args } = cli.cmd {
        let argv = std::iter::once(OsString::from("kvring inspect")).chain(args);
        return crate::inspect_cmd::main(argv.collect());
    }
    // How a child process (the demo's server and workers) runs this
    // binary again.
    let this = std::env::current_exe()
        .map(|p| vec![p.into_os_string()])
        .unwrap_or_else(|_| vec![OsString::from("kvring")]);
    match run(cli, this) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvring: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, this: Vec<OsString>) -> kvring::Result<()> {
    match cli.cmd {
        Cmd::Serve {
            target,
            max_clients,
            req_ring_bytes,
            cq_ring_bytes,
            max_frame_bytes,
            job_slots,
            spin_us,
            chunk_tokens,
            pool_bytes,
            prefault,
            allow_oversize,
            copy_threads,
            max_request_bytes,
            lease_ttl_s,
            inflight_wait_s,
            engine_event_timeout,
            evict_at_percent,
            max_pins,
            max_pinned_bytes,
            evict_to_percent,
            backend,
            cuda_zero_copy_ctas,
            cuda_depth,
            simulated_devices,
            http,
            stuck_job_s,
            stalled_lane_s,
            http_admin_remote,
            http_max_connections,
            l2,
        } => {
            let mut cfg = ServerConfig::new(&target.name);
            cfg.runtime_dir = target.dir();
            cfg.geometry = Geometry {
                max_clients,
                req_ring_bytes,
                cq_ring_bytes,
                max_frame_bytes,
                job_slots,
            };
            cfg.ring_wait.spin = Duration::from_micros(spin_us);
            cfg.kv.chunk_tokens = chunk_tokens;
            cfg.kv.pool_bytes = pool_bytes;
            cfg.kv.prefault = prefault;
            cfg.allow_oversize = allow_oversize;
            cfg.kv.copy_threads = copy_threads;
            cfg.kv.max_request_bytes = u32::try_from(max_request_bytes).map_err(|_| {
                kvring::Error::Config(format!(
                    "max request of {max_request_bytes} bytes is too large"
                ))
            })?;
            cfg.kv.lease_ttl = Duration::from_secs(lease_ttl_s);
            cfg.kv.inflight_wait = Duration::from_secs_f64(inflight_wait_s);
            cfg.kv.engine_event_timeout = Duration::from_secs_f64(engine_event_timeout);
            cfg.http = match http.as_deref() {
                Some("off") => None,
                given => {
                    let mut h = kvring_server::HttpConfig::default_endpoint();
                    if let Some(a) = given {
                        h.addr = a.parse().map_err(|e| {
                            kvring::Error::Config(format!(
                                "--http {a:?}: {e} (ADDR:PORT, e.g. 127.0.0.1:9090, or off)"
                            ))
                        })?;
                        h.required = true;
                    }
                    h.stuck_job = Duration::from_secs_f64(stuck_job_s);
                    h.stalled_lane = Duration::from_secs_f64(stalled_lane_s);
                    h.admin_remote = http_admin_remote;
                    h.max_connections = http_max_connections;
                    Some(h)
                }
            };
            cfg.kv.high_watermark = f64::from(evict_at_percent) / 100.0;
            cfg.kv.low_watermark = f64::from(evict_to_percent) / 100.0;
            cfg.kv.max_pins = max_pins;
            cfg.kv.max_pinned_bytes = max_pinned_bytes;
            cfg.kv.backend = backend;
            cfg.kv.cuda_zero_copy_ctas = cuda_zero_copy_ctas;
            cfg.kv.cuda_depth = cuda_depth;
            cfg.kv.simulated_devices = simulated_devices;
            cfg.kv.l2 = l2.config()?;
            let cfg_l2 = cfg.kv.l2.clone();
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
            if let Some(c) = &cfg_l2 {
                println!(
                    "kvring: second tier {} ({}, write-{}, keys {}*)",
                    c.urls.join(", "),
                    if c.cluster { "cluster" } else { "standalone" },
                    if c.mode == kvring_server::L2WriteMode::Back {
                        "back"
                    } else {
                        "through"
                    },
                    c.prefix
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
        Cmd::Ping {
            target,
            count,
            size,
            timeout_ms,
        } => {
            let mut c = Client::builder(&target.name)
                .runtime_dir(target.dir())
                .connect()?;
            let payload: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
            let mut rtts = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let t = Instant::now();
                let back = c.ping(&payload, t + Duration::from_millis(timeout_ms))?;
                rtts.push(t.elapsed().as_nanos() as u64);
                if back != payload {
                    return Err(kvring::Error::Protocol(
                        "ping payload came back changed".into(),
                    ));
                }
            }
            rtts.sort_unstable();
            let pct = |p: f64| rtts[((rtts.len() as f64 - 1.0) * p) as usize];
            println!(
                "{} pings of {} bytes to {} (slot {}): p50 {} ns, p99 {} ns, max {} ns",
                count,
                size,
                target.name,
                c.slot(),
                pct(0.5),
                pct(0.99),
                rtts.last().copied().unwrap_or(0)
            );
            Ok(())
        }
        Cmd::Demo { json } => crate::demo::run(json, &this),
        Cmd::Inspect { .. } | Cmd::Health { .. } => unreachable!("run by `main`"),
        Cmd::DemoWorker { target, rank } => crate::demo::worker(&target.name, &target.dir(), rank),
        Cmd::DelayJob {
            target,
            pending_ms,
            running_ms,
            fail,
            keep,
        } => {
            let mut c = Client::builder(&target.name)
                .runtime_dir(target.dir())
                .connect()?;
            let mut req = kvring::DelayJob::new(
                Duration::from_millis(pending_ms),
                Duration::from_millis(running_ms),
            )
            .progress_every(Duration::from_millis(1))
            .result(1, 0);
            if fail {
                req = req.fail(kvring::jobs::FailReason::Requested);
            }
            let start = Instant::now();
            // Released below by id (or kept, with --keep).
            let id = c.delay_job(req)?.into_id();
            println!("submitted {id}");
            let deadline = start + Duration::from_millis(pending_ms + running_ms + 10_000);
            let mut last = None;
            let st = loop {
                let st = c.job_status(id)?;
                if last != Some(st) {
                    println!(
                        "{:>9.3} ms  {}",
                        start.elapsed().as_secs_f64() * 1e3,
                        show(&st)
                    );
                    last = Some(st);
                }
                if st.is_terminal() {
                    break st;
                }
                if Instant::now() > deadline {
                    return Err(kvring::Error::Timeout(deadline - start));
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            if !keep {
                c.release_job(id)?;
                println!("released: {}", show(&c.job_status(id)?));
            }
            if fail != matches!(st, kvring::jobs::JobStatus::Failed(_)) {
                return Err(kvring::Error::Protocol(format!("job ended {}", show(&st))));
            }
            Ok(())
        }
    }
}
