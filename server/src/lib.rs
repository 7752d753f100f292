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
//! They talk through `Sessions` (`sessions.rs`): slot attach/detach events
//! one way, kicks (a client broke its ring) and detach acknowledgements the
//! other. The cache service (`KvState`, `kv_ops.rs`) is shared with the
//! HTTP endpoint's admin calls, which see nothing else. Copies run
//! on the copy workers (`kvring-copy-LANE.N`: per copy lane, `copy_threads`
//! of them), and the CUDA backend pins the pool on a thread of its own
//! (`kvring-pin`).

mod acceptor;
mod board;
mod cache;
mod capacity;
pub mod config;
mod delay;
pub mod disk;
pub mod events;
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
mod sessions;
mod tier;
mod transfer;

#[cfg(feature = "jemalloc")]
mod alloc;

#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzz;

pub use cache::{DEFAULT_MAX_PINS, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE};
pub use config::{
    BackendChoice, CacheConfig, ConfigError, CopyConfig, DiskConfig, ServerConfig, UnknownBackend,
    MAX_PINS, MAX_SIMULATED_DEVICES,
};
pub use http::{
    HttpConfig, CLIENT_DEADLINE as HTTP_CLIENT_DEADLINE, DEFAULT_ADDR as DEFAULT_HTTP_ADDR,
    DEFAULT_MAX_CONNECTIONS as HTTP_DEFAULT_MAX_CONNECTIONS,
};
pub use l2::{L2Config, WriteMode as L2WriteMode};
pub use transfer::{Backend, BackendKind, HostBackend};

use kvring::doorbell::Doorbell;
use kvring::error::{Error, Result};
use kvring::jobs::{FailReason, JobId, JobTable};
use kvring::proto::Opcode;
use kvring::rundir::{ensure_runtime_dir, ServerPaths};
use kvring::segment::ServerSegment;
use kvring::shm::ServerState;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The UUID of simulated device `index` of a host-backend server started
/// with `--simulated-devices`.
pub fn simulated_device_uuid(index: u32) -> kvring::DeviceUuid {
    let mut u = [0u8; 16];
    u[..12].copy_from_slice(b"kvring-simdv");
    u[12..].copy_from_slice(&index.to_be_bytes());
    kvring::DeviceUuid::from_bytes(u)
}

/// What both server threads see: the job table, the cache service, the
/// segment, the stop flags and the sessions, each its own part.
pub(crate) struct Shared {
    /// The job table over the segment's job slots (declared before `seg`, so
    /// dropped before the mapping it points into).
    jobs: JobTable,
    /// The cache service: registry, pool, objects, leases, copy workers
    /// (shared with the HTTP endpoint's admin calls).
    kv: Arc<kv_ops::KvState>,
    seg: ServerSegment,
    /// Stops the ring loop.
    stop: AtomicBool,
    /// Stops the acceptor (after the ring loop, so jobs can be failed
    /// before connections close).
    stop_acceptor: AtomicBool,
    /// The client sessions: the acceptor's and the ring loop's link, and
    /// each slot's session memory.
    sessions: sessions::Sessions,
}

impl Shared {
    /// Wakes client `slot` if it is parked (a job of its ended).
    fn wake_client(&self, slot: u32) {
        self.sessions.wake_client(slot, &self.seg.mapping);
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
    /// The tiers' owner and threads: stopped after the copy workers (the
    /// owner first, so nothing is handed to a tier after).
    tier: Option<(tier::owner::TierOwner, Vec<tier::TierThread>)>,
    /// The KV event stream's publisher: stopped last (it reads the cache
    /// for a resync).
    events: Option<events::Publisher>,
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

    /// Where the KV event stream is bound (the live socket, the replay
    /// socket) and its topic, if the server publishes one.
    pub fn events_endpoints(&self) -> Option<(String, Option<String>, String)> {
        self.events.as_ref().map(|p| p.endpoints())
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
        sh.sessions.wake_ring_loop();
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
        // The tiers: their lookups not answered yet fail below.
        if let Some((mut owner, mut threads)) = self.tier.take() {
            owner.stop();
            for t in &mut threads {
                t.stop();
            }
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
        // What the stop evicted or dropped is sent before the stream ends.
        if let Some(mut p) = self.events.take() {
            p.stop();
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
    let kv = Arc::new(kv_ops::KvState::new(&cfg, cfg.geometry.max_clients)?);
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
        sessions: sessions::Sessions::new(cfg.geometry.max_clients, ring_bell, acceptor_bell),
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
    // Bound before any thread starts: an endpoint that cannot be bound
    // fails the start.
    let events = match (&cfg.events, &shared.kv.events) {
        (Some(e), Some(q)) => {
            Some(events::Publisher::start(e, q.clone(), shared.kv.clone()).map_err(Error::Config)?)
        }
        _ => None,
    };
    let (threads, workers) = spawn_threads(&shared, &cfg, doorbells, listener, acceptor_bell_rx)?;
    shared.kv.publish();
    let http = match (http_bound, &cfg.http) {
        (Some(b), Some(h)) => Some(http::HttpServer::start(
            b,
            &paths.shm_name,
            h,
            shared.kv.clone(),
        )?),
        _ => None,
    };
    let tier = start_tier(&shared)?;
    undo.done();
    Ok(ServerHandle {
        shared,
        threads,
        workers,
        http,
        tier,
        events,
        paths,
        _lock: lock,
    })
}

/// Checks what can be checked before the file system is touched: the
/// geometry, the cache's settings, and (unless allowed) that the segment
/// and the pool fit the machine.
fn check(cfg: &ServerConfig) -> Result<()> {
    cfg.validate().map_err(|e| Error::Config(e.to_string()))?;
    if !cfg.allow_oversize {
        let off = cfg.geometry.offsets();
        // Each client's memory is a memfd: memory, not /dev/shm space.
        let clients = u64::from(cfg.geometry.max_clients) * off.client_memory_bytes;
        capacity::check(
            off.segment_bytes,
            cfg.cache.pool_bytes.saturating_add(clients),
        )?;
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

/// Starts the tiers below the pool, if the server has any: their threads
/// and their owner.
#[allow(clippy::type_complexity)]
fn start_tier(
    shared: &Arc<Shared>,
) -> Result<Option<(tier::owner::TierOwner, Vec<tier::TierThread>)>> {
    let start = shared
        .kv
        .tier_start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let Some((starts, inbox)) = start else {
        return Ok(None);
    };
    let pool: Arc<dyn tier::PoolView> = Arc::new(tier::owner::Pool(shared.clone()));
    let threads = starts
        .into_iter()
        .map(|t| tier::TierThread::start(t, pool.clone(), inbox.finished.clone()))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some((
        tier::owner::TierOwner::start(shared.clone(), inbox)?,
        threads,
    )))
}
