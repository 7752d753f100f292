//! The kvring cache server: owns the segment, accepts clients on the
//! bootstrap socket, serves their rings, copies KV between the engines'
//! caches and its pool, keeps the tier below the pool, answers HTTP, and
//! reclaims what dead clients held. Engines link only the `kvring` library
//! (the client, the wire ABI, the rings); this package is what the `kvring`
//! binary runs (`kvring serve`), so an engine's process never loads the
//! server's network stack.
//!
//! Two threads serve the protocol:
//! * the **acceptor** (`acceptor.rs`, thread `kvring-accept`) polls the
//!   listening socket, every client connection and every quarantined client's
//!   pidfd; it assigns and reclaims slots and keeps the heartbeat;
//! * the **ring loop** (`ring_loop.rs`, thread `kvring-rings`) serves every
//!   active client's request ring; it never blocks on anything but the
//!   doorbells (a pipe per client and its own, in one epoll set), with
//!   a timeout.
//!
//! They talk through `Shared`: slot attach/detach events one way, kicks (a
//! client broke its ring) and detach acknowledgements the other. Copies run
//! on the copy workers (`kvring-copy-LANE.N`: per copy lane, `copy_threads`
//! of them), and the CUDA backend pins the pool on a thread of its own
//! (`kvring-pin`).

mod acceptor;
mod board;
mod cache;
mod capacity;
mod delay;
pub(crate) mod http;
mod kv_ops;
pub mod l2;
pub mod metrics;
mod model_rows;
mod peer_memory;
mod pool;
mod refusal;
pub(crate) mod registry;
mod ring_loop;
mod tier;
mod transfer;

#[cfg(feature = "jemalloc")]
mod alloc;

#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzz;

pub use cache::{DEFAULT_MAX_PINS, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE};
pub use http::{
    HttpConfig, CLIENT_DEADLINE as HTTP_CLIENT_DEADLINE, DEFAULT_ADDR as DEFAULT_HTTP_ADDR,
    DEFAULT_MAX_CONNECTIONS as HTTP_DEFAULT_MAX_CONNECTIONS,
};
pub use l2::{L2Config, WriteMode as L2WriteMode};
pub use transfer::{Backend, BackendKind, HostBackend};

use kvring::client_memory::OwnedClientMemory;
use kvring::doorbell::Doorbell;
use kvring::error::{Error, Result};
use kvring::jobs::{FailReason, JobId, JobTable};
use kvring::proto::Opcode;
use kvring::rundir::{ensure_runtime_dir, ServerPaths};
use kvring::segment::ServerSegment;
use kvring::shm::{DisconnectReason, Geometry, ServerState};
use kvring::wait::{Parking, WaitPolicy};
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// Everything a server is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Server name (one server per name and user on a host).
    pub name: String,
    /// Runtime directory for the socket and the lock file.
    pub runtime_dir: PathBuf,
    /// Segment geometry.
    pub geometry: Geometry,
    /// How the ring loop waits when idle (spin, yield, then park).
    pub ring_wait: WaitPolicy,
    /// Heartbeat and housekeeping period.
    pub tick: Duration,
    /// The cache's settings.
    pub kv: KvConfig,
    /// Start even when the segment exceeds the free space of the
    /// shared-memory mount or the pool and segment exceed available memory
    /// (refused otherwise, naming the limit).
    pub allow_oversize: bool,
    /// The HTTP endpoint (metrics, health, status); `None`: none.
    pub http: Option<HttpConfig>,
}

/// Which copy backend a server uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when the driver and a device are there, else host (saying why).
    Auto,
    /// Host memory only (memcpy by the copy workers).
    Host,
    /// CUDA; start-up fails, saying why, when it is not usable.
    Cuda,
}

/// A backend name that is not `auto`, `host` or `cuda`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?} (auto, host or cuda)")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendChoice {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> std::result::Result<Self, UnknownBackend> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "host" => Ok(BackendChoice::Host),
            "cuda" => Ok(BackendChoice::Cuda),
            o => Err(UnknownBackend(o.to_string())),
        }
    }
}

/// The cache's settings.
#[derive(Clone, Debug)]
pub struct KvConfig {
    /// Tokens per chunk object; every engine's block size must divide it.
    pub chunk_tokens: u32,
    /// Bytes of the host pool, allocated at start.
    pub pool_bytes: u64,
    /// Touch every pool page at start (no page faults in the first stores).
    pub prefault: bool,
    /// Copy worker threads per copy lane (one lane for engines with no
    /// device, one per device); `None`: half the CPUs (1 to 8) on the host
    /// backend, 4 on the CUDA backend (four workers, each with
    /// `cuda_depth` chunks in flight, keep the copy engines fed; more only
    /// contend for them).
    pub copy_threads: Option<u32>,
    /// Largest request (all frames of it together).
    pub max_request_bytes: u32,
    /// How long a lookup's leases last unless used or freed.
    pub lease_ttl: Duration,
    /// How long a lookup waits for a chunk being written (another
    /// request's store of the same prefix, under way) before it answers
    /// without it; zero: never waits.
    pub inflight_wait: Duration,
    /// Which copy backend: host memcpy, CUDA, or CUDA when usable.
    pub backend: BackendChoice,
    /// CUDA: 0 for the staged path (gather/scatter kernel + one copy-engine
    /// transfer per chunk, the default); N > 0 for zero-copy kernels that
    /// move the bytes between GPU memory and the pinned pool themselves,
    /// with at most N CTAs.
    pub cuda_zero_copy_ctas: u32,
    /// CUDA: chunks each copy worker keeps in flight per device (one
    /// staging slot each), 1..=8; `None`: the CUDA backend's default.
    pub cuda_depth: Option<u32>,
    /// Host backend: copy lanes for this many simulated devices (engines
    /// name one with [`simulated_device_uuid`]), scheduled as a CUDA server
    /// schedules its GPUs; 0: none.
    pub simulated_devices: u32,
    /// How long a STORE or RETRIEVE ordered after an engine's event waits
    /// for it (polled from the host; no stream of the server waits on it)
    /// before it fails `EngineEventTimeout` (chunks not copied by then never
    /// are).
    pub engine_event_timeout: Duration,
    /// Pool usage (fraction) past which eviction starts ...
    pub high_watermark: f64,
    /// ... and down to which it evicts.
    pub low_watermark: f64,
    /// Most pins held at once (`POST /pin` past it is refused).
    pub max_pins: u64,
    /// Most bytes of objects pins keep; `None`: half the pool.
    pub max_pinned_bytes: Option<u64>,
    /// A second tier on Valkey/Redis, if any.
    pub l2: Option<L2Config>,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            chunk_tokens: kvring::kv::DEFAULT_CHUNK_TOKENS,
            pool_bytes: 2 << 30,
            prefault: false,
            copy_threads: None,
            max_request_bytes: 4 << 20,
            lease_ttl: Duration::from_secs(300),
            inflight_wait: Duration::from_secs(1),
            backend: BackendChoice::Auto,
            cuda_zero_copy_ctas: 0,
            cuda_depth: None,
            simulated_devices: 0,
            engine_event_timeout: Duration::from_secs(60),
            high_watermark: 0.9,
            low_watermark: 0.8,
            max_pins: cache::DEFAULT_MAX_PINS,
            max_pinned_bytes: None,
            l2: None,
        }
    }
}

/// Most simulated devices a host server takes.
pub const MAX_SIMULATED_DEVICES: u32 = 64;

/// The UUID of simulated device `index` of a host-backend server started
/// with `--simulated-devices`.
pub fn simulated_device_uuid(index: u32) -> kvring::DeviceUuid {
    let mut u = [0u8; 16];
    u[..12].copy_from_slice(b"kvring-simdv");
    u[12..].copy_from_slice(&index.to_be_bytes());
    kvring::DeviceUuid::from_bytes(u)
}

/// A [`KvConfig`] setting out of its bounds.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KvConfigError {
    #[error("{0} simulated devices: at most {MAX_SIMULATED_DEVICES}")]
    SimulatedDevices(u32),
    #[error("chunk size {0} tokens: must be 1..=1048576")]
    ChunkTokens(u32),
    #[error("pool of {0} bytes: must be at least 1 MiB")]
    PoolBytes(u64),
    #[error("CUDA depth {0}: must be 1..=8")]
    CudaDepth(u32),
    #[error("{0} copy threads: must be 1..=32 (per copy lane)")]
    CopyThreads(u32),
    #[error("max request of {0} bytes: must be 4096..=1073741824")]
    MaxRequestBytes(u32),
    #[error("lease TTL must be positive")]
    LeaseTtl,
    #[error("watermarks {low} (low) and {high} (high): need 0 < low <= high <= 1")]
    Watermarks { low: f64, high: f64 },
    #[error("{0} pins: at most {MAX_PINS}")]
    MaxPins(u64),
}

/// Most pins a server may be told to hold (about 800 MiB of its memory).
pub const MAX_PINS: u64 = 1 << 24;

impl KvConfig {
    /// Checks the settings; the error names the one that is wrong.
    pub fn validate(&self) -> std::result::Result<(), KvConfigError> {
        if self.simulated_devices > MAX_SIMULATED_DEVICES {
            return Err(KvConfigError::SimulatedDevices(self.simulated_devices));
        }
        if self.chunk_tokens == 0 || self.chunk_tokens > 1 << 20 {
            return Err(KvConfigError::ChunkTokens(self.chunk_tokens));
        }
        if self.pool_bytes < 1 << 20 {
            return Err(KvConfigError::PoolBytes(self.pool_bytes));
        }
        if let Some(d) = self.cuda_depth.filter(|&d| d == 0 || d > 8) {
            return Err(KvConfigError::CudaDepth(d));
        }
        if let Some(n) = self
            .copy_threads
            .filter(|&n| n == 0 || n > kvring::job_words::WORD_WORKERS)
        {
            return Err(KvConfigError::CopyThreads(n));
        }
        if self.max_request_bytes < 4096 || self.max_request_bytes > 1 << 30 {
            return Err(KvConfigError::MaxRequestBytes(self.max_request_bytes));
        }
        if self.max_pins > MAX_PINS {
            return Err(KvConfigError::MaxPins(self.max_pins));
        }
        if self.lease_ttl.is_zero() {
            return Err(KvConfigError::LeaseTtl);
        }
        if !(0.0 < self.low_watermark
            && self.low_watermark <= self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return Err(KvConfigError::Watermarks {
                low: self.low_watermark,
                high: self.high_watermark,
            });
        }
        Ok(())
    }
}

impl ServerConfig {
    /// Defaults for server `name` in the default runtime directory.
    pub fn new(name: &str) -> ServerConfig {
        ServerConfig {
            name: name.to_string(),
            runtime_dir: kvring::rundir::runtime_dir(),
            geometry: Geometry::default(),
            ring_wait: WaitPolicy {
                spin: Duration::from_micros(50),
                yield_for: Duration::from_micros(500),
                park_slice: Duration::from_millis(100),
            },
            tick: Duration::from_millis(50),
            kv: KvConfig::default(),
            allow_oversize: false,
            http: Some(HttpConfig::default_endpoint()),
        }
    }
}

enum RingEvent {
    Attach {
        slot: u32,
        session: u32,
        /// The client's engine key (from its hello).
        engine: [u8; 32],
        /// The session's memory (its block and request ring).
        memory: Arc<OwnedClientMemory>,
        /// The server's end of the client's doorbell.
        doorbell: kvring::doorbell::DoorbellReceiver,
    },
    Detach {
        slot: u32,
    },
}

/// State both server threads see.
pub(crate) struct Shared {
    /// The job table over the segment's job slots (declared before `seg`, so
    /// dropped before the mapping it points into).
    jobs: JobTable,
    /// The cache: registry, pool, objects, leases, copy workers.
    kv: kv_ops::KvState,
    seg: ServerSegment,
    /// Stops the ring loop.
    stop: AtomicBool,
    /// Stops the acceptor (after the ring loop, so jobs can be failed
    /// before connections close).
    stop_acceptor: AtomicBool,
    /// Acceptor -> ring loop.
    events: Mutex<Vec<RingEvent>>,
    events_pending: AtomicBool,
    /// Ring loop -> acceptor: slots whose client broke its ring.
    kicks: Mutex<Vec<(u32, DisconnectReason)>>,
    /// Ring loop -> acceptor: detached slots.
    detached: Mutex<Vec<u32>>,
    /// Wakes the acceptor (rung with a kick or a detached slot, so that a
    /// slot is reclaimed at once, not at the acceptor's next tick).
    acceptor_bell: Doorbell,
    /// The ring loop's own doorbell: the other threads wake it with this.
    ring_bell: Doorbell,
    /// Each slot's session memory while it is attached (the acceptor sets
    /// and clears it; `wake_client` reads its `client_sleeping`). The last
    /// holder to let go closes and unmaps it.
    client_memory: Vec<RwLock<Option<Arc<OwnedClientMemory>>>>,
}

impl Shared {
    fn push_event(&self, ev: RingEvent) {
        self.events.lock().expect("events lock").push(ev);
        // Release pairs with the ring loop's Acquire swap in `take_events`.
        self.events_pending.store(true, Ordering::Release);
        self.wake_ring_loop();
    }

    fn take_events(&self) -> Vec<RingEvent> {
        // Acquire pairs with the Release store in `push_event`.
        if !self.events_pending.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.events.lock().expect("events lock"))
    }

    fn wake_ring_loop(&self) {
        self.ring_bell.ring();
    }

    /// Ring loop -> acceptor: disconnect `slot`'s client.
    fn kick(&self, slot: u32, reason: DisconnectReason) {
        self.kicks.lock().expect("kicks").push((slot, reason));
        self.acceptor_bell.ring();
    }

    /// Ring loop -> acceptor: `slot` is detached, reclaim it.
    fn detached(&self, slot: u32) {
        self.detached.lock().expect("detached").push(slot);
        self.acceptor_bell.ring();
    }

    /// The memory of the session attached at `slot`, if one is.
    pub(crate) fn client_memory_of(&self, slot: u32) -> Option<Arc<OwnedClientMemory>> {
        self.client_memory
            .get(slot as usize)?
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Wakes client `slot` if it is parked (a job of its ended).
    fn wake_client(&self, slot: u32) {
        let memory = self.client_memory[slot as usize]
            .read()
            .expect("client memory table");
        let Some(memory) = memory.as_ref() else {
            // Detached: nobody of this session waits any more.
            return;
        };
        kvring::wait::notify(Parking {
            sleeping: &memory.memory().block().client_sleeping,
            doorbell: &*self.seg.mapping.server_client(slot).client_doorbell,
        });
    }

    /// Job `id` of client `owner` ended (`done`: Done, else Failed): count
    /// it, record its latency, and wake the owner if it waits.
    fn job_ended(&self, owner: u32, id: JobId, done: bool) {
        let h = self.seg.mapping.header();
        // Counters for observers only: Relaxed.
        if done {
            h.jobs_done.fetch_add(1, Ordering::Relaxed);
        } else {
            h.jobs_failed.fetch_add(1, Ordering::Relaxed);
        }
        if let Some((kind, submitted, finished)) = self.jobs.timing(id) {
            let st = self.seg.mapping.op_stats().of(Opcode::of_job(kind));
            st.record(finished.saturating_sub(submitted));
            if !done {
                st.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.wake_client(owner);
    }
}

/// A running server. Dropping it stops the server.
pub struct ServerHandle {
    shared: Arc<Shared>,
    /// The ring loop, then the acceptor.
    threads: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
    /// Stopped first at shutdown.
    http: Option<http::HttpServer>,
    /// The second tier's owner and thread: stopped after the copy workers
    /// (the owner first, so nothing is handed to the tier after).
    l2: Option<(tier::owner::TierOwner, l2::L2Thread)>,
    paths: ServerPaths,
    _lock: File,
}

impl ServerHandle {
    /// The copy backend in use ("host" or "cuda") and what it found.
    pub fn backend(&self) -> (&'static str, String) {
        (
            self.shared.kv.copier.backend.name(),
            self.shared.kv.backend_note.clone(),
        )
    }

    /// The segment's epoch.
    pub fn epoch(&self) -> u64 {
        self.shared.seg.mapping.info().epoch
    }

    /// Paths of this server's files.
    pub fn paths(&self) -> &ServerPaths {
        &self.paths
    }

    /// Where the HTTP endpoint listens, if it runs.
    pub fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.http.as_ref().map(|h| h.addr)
    }

    /// Whether a stop was requested or the threads ended.
    pub fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Relaxed) || self.threads.iter().any(|t| t.is_finished())
    }

    /// Stops the server: refuses new work, disconnects clients, removes the
    /// socket and the segment's name.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.http = None;
        let sh = &self.shared;
        let h = sh.seg.mapping.header();
        h.server_state
            .store(ServerState::ShuttingDown as u32, Ordering::Relaxed);
        // The ring loop first: no job starts or is submitted after this.
        // Release pairs with the ring loop's Acquire loads of `stop`.
        sh.stop.store(true, Ordering::Release);
        sh.wake_ring_loop();
        let mut threads = self.threads.drain(..);
        if let Some(ring) = threads.next() {
            let _ = ring.join();
        }
        // Then the copy workers: each finishes the chunk it is copying; the
        // jobs of queued chunks fail below.
        sh.kv.copier.stop();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        // Queued tasks go now, so their jobs' streams are released before
        // the jobs are failed below.
        sh.kv.copier.drop_queued(sh.seg.mapping.lanes());
        // The second tier: its lookups not answered yet fail below.
        if let Some((mut owner, mut t)) = self.l2.take() {
            owner.stop();
            t.stop();
        }
        // Unfinished jobs end Failed(ServerShutdown) while their owners are
        // still connected, so a waiting owner reads that, not a bare
        // "server gone".
        let (failed, owners) = sh
            .jobs
            .fail_all(FailReason::ServerShutdown, kvring::liveness::monotonic_ns());
        h.jobs_failed.fetch_add(failed as u64, Ordering::Relaxed);
        for owner in owners {
            sh.wake_client(owner);
        }
        // Release pairs with the acceptor loop's Acquire load: it stops
        // after the jobs above have ended.
        sh.stop_acceptor.store(true, Ordering::Release);
        for t in threads {
            let _ = t.join();
        }
        h.server_state
            .store(ServerState::Stopped as u32, Ordering::Relaxed);
        self.shared.seg.unlink();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shutdown();
        }
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit:
/// a registration of VMM memory arrives as one descriptor per chunk (about
/// 7,000 for a 141 GB cache in PyTorch's 20 MiB chunks), all open until it
/// is imported, far above the usual soft limit of 1,024.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("raise the open-descriptor limit from {soft} to {hard}: {e}");
            }
        }
    }
}

/// What a start created, removed again if the start fails: the runtime
/// directory and lock file when they were not there before, the segment's
/// name and the socket.
#[derive(Default)]
struct StartUndo {
    dir: Option<PathBuf>,
    lock: Option<PathBuf>,
    shm: Option<String>,
    socket: Option<PathBuf>,
}

impl StartUndo {
    /// The start succeeded: keep everything.
    fn done(mut self) {
        self.dir = None;
        self.lock = None;
        self.shm = None;
        self.socket = None;
    }
}

impl Drop for StartUndo {
    fn drop(&mut self) {
        if let Some(s) = &self.socket {
            let _ = std::fs::remove_file(s);
        }
        if let Some(n) = &self.shm {
            let _ = nix::sys::mman::shm_unlink(n.as_str());
        }
        if let Some(l) = &self.lock {
            let _ = std::fs::remove_file(l);
        }
        if let Some(d) = &self.dir {
            // Only if empty: nothing of anyone else's goes.
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Starts a server: takes the start-up lock, creates (or replaces a dead
/// server's) segment, binds the socket and starts the threads.
pub fn start(cfg: ServerConfig) -> Result<ServerHandle> {
    // Everything that can be checked is checked before the file system is
    // touched; what a failed start created, it removes.
    let paths = ServerPaths::in_dir(&cfg.name, &cfg.runtime_dir)?;
    check(&cfg)?;
    let mut undo = StartUndo::default();
    let lock = take_startup_lock(&cfg.name, &paths, &mut undo)?;
    raise_open_file_limit();
    // Bound, and its admin token written, before the segment and the socket
    // exist: whoever finds the server can read the token.
    let http_bound = bind_http(cfg.http.as_ref(), &paths.admin_token)?;
    let kv = kv_ops::KvState::new(&cfg.kv, cfg.geometry.max_clients)?;
    let seg = ServerSegment::create(&paths.shm_name, cfg.geometry)?;
    undo.shm = Some(paths.shm_name.clone());
    kv.attach_board(board::Board::new(seg.mapping.clone()));
    let slots = seg.mapping.job_slots();
    // SAFETY: the slots lie in the segment's mapping, which `Shared` owns
    // next to the table and drops after it; this table is their only writer.
    let jobs = unsafe {
        JobTable::from_raw(
            slots.as_ptr(),
            slots.len() as u32,
            seg.mapping.info().epoch,
            cfg.geometry.max_clients,
        )
    };
    let listener = kvring::bootstrap::Listener::bind(&paths.socket).map_err(kvring::error::io(
        format!("bind {}", paths.socket.display()),
    ))?;
    undo.socket = Some(paths.socket.clone());
    let (ring_bell, ring_bell_rx) = Doorbell::pair()?;
    let (acceptor_bell, acceptor_bell_rx) = Doorbell::pair()?;
    let doorbells = kvring::doorbell::Doorbells::new(ring_bell_rx, cfg.geometry.max_clients)?;
    let shared = Arc::new(Shared {
        jobs,
        kv,
        seg,
        stop: AtomicBool::new(false),
        stop_acceptor: AtomicBool::new(false),
        events: Mutex::new(Vec::new()),
        events_pending: AtomicBool::new(false),
        kicks: Mutex::new(Vec::new()),
        detached: Mutex::new(Vec::new()),
        acceptor_bell,
        ring_bell,
        client_memory: (0..cfg.geometry.max_clients)
            .map(|_| RwLock::new(None))
            .collect(),
    });
    shared
        .kv
        .copier
        .publish_lanes(shared.seg.mapping.lanes(), shared.kv.copy_threads);
    let h = shared.seg.mapping.header();
    // A gauge observers read on its own: Relaxed, no access pairs.
    h.pool_ready_bytes
        .store(shared.kv.pool_ready_bytes(), Ordering::Relaxed);
    h.server_state
        .store(ServerState::Running as u32, Ordering::Relaxed);
    let (threads, workers) = spawn_threads(&shared, &cfg, doorbells, listener, acceptor_bell_rx)?;
    shared.kv.publish();
    let http = match (http_bound, &cfg.http) {
        (Some(b), Some(h)) => Some(http::HttpServer::start(
            b,
            &paths.shm_name,
            h,
            shared.clone(),
        )?),
        _ => None,
    };
    let l2 = start_tier(&shared)?;
    undo.done();
    Ok(ServerHandle {
        shared,
        threads,
        workers,
        http,
        l2,
        paths,
        _lock: lock,
    })
}

/// Checks what can be checked before the file system is touched: the
/// geometry, the cache's settings, and (unless allowed) that the segment
/// and the pool fit the machine.
fn check(cfg: &ServerConfig) -> Result<()> {
    cfg.geometry
        .validate()
        .map_err(|e| Error::Config(e.to_string()))?;
    cfg.kv
        .validate()
        .map_err(|e| Error::Config(e.to_string()))?;
    if !cfg.allow_oversize {
        let off = cfg.geometry.offsets();
        // Each client's memory is a memfd: memory, not /dev/shm space.
        let clients = u64::from(cfg.geometry.max_clients) * off.client_memory_bytes;
        capacity::check(off.segment_bytes, cfg.kv.pool_bytes.saturating_add(clients))?;
    }
    Ok(())
}

/// Takes the start-up lock of `name` (creating the runtime directory and
/// the lock file, which `undo` removes if the start fails): refused while
/// another server of this name runs.
fn take_startup_lock(name: &str, paths: &ServerPaths, undo: &mut StartUndo) -> Result<File> {
    if !paths.dir.exists() {
        undo.dir = Some(paths.dir.clone());
    }
    ensure_runtime_dir(&paths.dir)?;
    if !paths.lock.exists() {
        undo.lock = Some(paths.lock.clone());
    }
    let lock = kvring::liveness::open_lock_file(&paths.lock)
        .map_err(kvring::error::io(format!("open {}", paths.lock.display())))?;
    if !kvring::liveness::try_lock(std::os::fd::AsFd::as_fd(&lock))
        .map_err(kvring::error::io("lock the start-up lock"))?
    {
        let pid = kvring::segment::ReadOnlySegment::open(name)
            .map(|s| s.view().info().server_pid)
            .unwrap_or(0);
        return Err(Error::AlreadyRunning {
            name: name.to_string(),
            pid,
        });
    }
    Ok(lock)
}

/// Binds the HTTP endpoint's address and writes its admin token (to
/// `token_path`) before the segment and the socket exist and any thread
/// starts: a required
/// address that is taken fails the start (which then undoes what it made);
/// otherwise the server runs without the endpoint, saying why.
fn bind_http(
    http: Option<&http::HttpConfig>,
    token_path: &std::path::Path,
) -> Result<Option<http::Bound>> {
    Ok(match http {
        None => None,
        Some(h) => match http::HttpServer::bind(h) {
            Ok(l) => Some(http::HttpServer::prepare(l, token_path)?),
            Err(e) if h.required => {
                return Err(Error::Config(format!(
                    "the HTTP endpoint cannot listen on {}: {e} (--http off runs without it)",
                    h.addr
                )))
            }
            Err(e) => {
                tracing::warn!(
                    "no HTTP endpoint: {} cannot be bound ({e}); pass --http ADDR for another",
                    h.addr
                );
                None
            }
        },
    })
}

/// Threads of the server, joined at its stop.
type Threads = Vec<JoinHandle<()>>;

/// Starts the ring loop, the acceptor and `copy_threads` copy workers per
/// lane (device): the threads, and the workers.
fn spawn_threads(
    shared: &Arc<Shared>,
    cfg: &ServerConfig,
    doorbells: kvring::doorbell::Doorbells,
    listener: kvring::bootstrap::Listener,
    acceptor_bell_rx: kvring::doorbell::DoorbellReceiver,
) -> Result<(Threads, Threads)> {
    let mut threads = Vec::new();
    {
        let shared = shared.clone();
        let wait = cfg.ring_wait;
        threads.push(
            std::thread::Builder::new()
                .name("kvring-rings".into())
                .spawn(move || ring_loop::run(&shared, doorbells, wait))
                .map_err(kvring::error::io("spawn ring loop"))?,
        );
    }
    {
        let shared = shared.clone();
        let tick = cfg.tick;
        threads.push(
            std::thread::Builder::new()
                .name("kvring-accept".into())
                .spawn(move || acceptor::run(&shared, listener, acceptor_bell_rx, tick))
                .map_err(kvring::error::io("spawn acceptor"))?,
        );
    }
    // `copy_threads` workers per lane (device).
    let mut workers = Vec::new();
    for lane in 0..shared.kv.copier.lanes() {
        for i in 0..shared.kv.copy_threads {
            let shared = shared.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("kvring-copy-{lane}.{i}"))
                    .spawn(move || transfer::run(&shared, lane, i))
                    .map_err(kvring::error::io("spawn copy worker"))?,
            );
        }
    }
    Ok((threads, workers))
}

/// Starts the tier below the pool, if the server has one: its thread and
/// its owner.
fn start_tier(shared: &Arc<Shared>) -> Result<Option<(tier::owner::TierOwner, l2::L2Thread)>> {
    let start = shared
        .kv
        .tier_start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    Ok(match start {
        Some((l2, inbox)) => {
            let pool: Arc<dyn tier::PoolView> = Arc::new(tier::owner::Pool(shared.clone()));
            let thread = l2::L2Thread::start(l2, pool, inbox.finished.clone())?;
            Some((
                tier::owner::TierOwner::start(shared.clone(), inbox)?,
                thread,
            ))
        }
        None => None,
    })
}
