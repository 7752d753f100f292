//! The cache server process: owns the segment, accepts clients on the
//! bootstrap socket, serves their rings, and reclaims what dead clients held.
//!
//! Two threads:
//! * the **acceptor** ([`acceptor`]) polls the listening socket, every client
//!   connection and every quarantined client's pidfd; it assigns and reclaims
//!   slots and keeps the heartbeat;
//! * the **ring loop** ([`ring_loop`]) serves every active client's request
//!   ring; it never blocks on anything but its own doorbell, with a timeout.
//!
//! They talk through [`Shared`]: slot attach/detach events one way, kicks (a
//! client broke its ring) and detach acknowledgements the other.

mod acceptor;
mod delay;
mod ring_loop;

use crate::error::{Error, Result};
use crate::jobs::{FailReason, JobTable};
use crate::layout::{DisconnectReason, Geometry, ServerState};
use crate::rundir::{ensure_runtime_dir, ServerPaths};
use crate::segment::ServerSegment;
use crate::wait::{Parking, WaitPolicy};
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
}

impl ServerConfig {
    /// Defaults for server `name` in the default runtime directory.
    pub fn new(name: &str) -> ServerConfig {
        ServerConfig {
            name: name.to_string(),
            runtime_dir: crate::rundir::runtime_dir(),
            geometry: Geometry::default(),
            ring_wait: WaitPolicy {
                spin: Duration::from_micros(50),
                yield_for: Duration::from_micros(500),
                park_slice: Duration::from_millis(100),
            },
            tick: Duration::from_millis(50),
        }
    }
}

enum RingEvent {
    Attach { slot: u32, session: u32 },
    Detach { slot: u32 },
}

/// State both server threads see.
pub(crate) struct Shared {
    /// The job table over the segment's job slots (declared before `seg`, so
    /// dropped before the mapping it points into).
    jobs: JobTable,
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
        crate::wait::wake(&self.seg.mapping.doorbell().server_doorbell);
    }

    /// Wakes client `slot` if it is parked (a job of its ended).
    fn wake_client(&self, slot: u32) {
        let m = &self.seg.mapping;
        crate::wait::notify(Parking {
            sleeping: &m.client_block(slot).client_sleeping,
            doorbell: &m.server_client(slot).client_doorbell,
        });
    }

    /// A job of client `owner` ended (`done`: Done, else Failed): count it
    /// and wake the owner if it waits.
    fn job_ended(&self, owner: u32, done: bool) {
        let h = self.seg.mapping.header();
        // Counters for observers only: Relaxed.
        if done {
            h.jobs_done.fetch_add(1, Ordering::Relaxed);
        } else {
            h.jobs_failed.fetch_add(1, Ordering::Relaxed);
        }
        self.wake_client(owner);
    }
}

/// A running server. Dropping it stops the server.
pub struct ServerHandle {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    paths: ServerPaths,
    _lock: File,
}

impl ServerHandle {
    /// The segment's epoch.
    pub fn epoch(&self) -> u64 {
        self.shared.seg.mapping.info().epoch
    }

    /// Paths of this server's files.
    pub fn paths(&self) -> &ServerPaths {
        &self.paths
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
        let sh = &self.shared;
        let h = sh.seg.mapping.header();
        h.server_state
            .store(ServerState::ShuttingDown as u32, Ordering::Relaxed);
        // The ring loop first: no job starts or is submitted after this.
        sh.stop.store(true, Ordering::Release);
        sh.wake_ring_loop();
        let mut threads = self.threads.drain(..);
        if let Some(ring) = threads.next() {
            let _ = ring.join();
        }
        // Unfinished jobs end Failed(ServerShutdown) while their owners are
        // still connected, so a waiting owner reads that, not a bare
        // "server gone".
        let (failed, owners) = sh
            .jobs
            .fail_all(FailReason::ServerShutdown, crate::liveness::monotonic_ns());
        h.jobs_failed.fetch_add(failed as u64, Ordering::Relaxed);
        for owner in owners {
            sh.wake_client(owner);
        }
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

/// Starts a server: takes the start-up lock, creates (or replaces a dead
/// server's) segment, binds the socket and starts the threads.
pub fn start(cfg: ServerConfig) -> Result<ServerHandle> {
    let paths = ServerPaths::in_dir(&cfg.name, &cfg.runtime_dir)?;
    ensure_runtime_dir(&paths.dir)?;
    let lock = crate::liveness::open_lock_file(&paths.lock)
        .map_err(crate::error::io(format!("open {}", paths.lock.display())))?;
    if !crate::liveness::try_lock(std::os::fd::AsFd::as_fd(&lock))
        .map_err(crate::error::io("lock the start-up lock"))?
    {
        let pid = crate::segment::ReadOnlySegment::open(&cfg.name)
            .map(|s| s.mapping.info().server_pid)
            .unwrap_or(0);
        return Err(Error::AlreadyRunning {
            name: cfg.name.clone(),
            pid,
        });
    }
    let seg = ServerSegment::create(&paths.shm_name, cfg.geometry)?;
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
    let listener = crate::bootstrap::Listener::bind(&paths.socket)
        .map_err(crate::error::io(format!("bind {}", paths.socket.display())))?;
    let shared = Arc::new(Shared {
        jobs,
        seg,
        stop: AtomicBool::new(false),
        stop_acceptor: AtomicBool::new(false),
        events: Mutex::new(Vec::new()),
        events_pending: AtomicBool::new(false),
        kicks: Mutex::new(Vec::new()),
        detached: Mutex::new(Vec::new()),
    });
    shared
        .seg
        .mapping
        .header()
        .server_state
        .store(ServerState::Running as u32, Ordering::Relaxed);
    let mut threads = Vec::new();
    {
        let shared = shared.clone();
        let wait = cfg.ring_wait;
        threads.push(
            std::thread::Builder::new()
                .name("kvring-rings".into())
                .spawn(move || ring_loop::run(&shared, wait))
                .map_err(crate::error::io("spawn ring loop"))?,
        );
    }
    {
        let shared = shared.clone();
        let tick = cfg.tick;
        threads.push(
            std::thread::Builder::new()
                .name("kvring-accept".into())
                .spawn(move || acceptor::run(&shared, listener, tick))
                .map_err(crate::error::io("spawn acceptor"))?,
        );
    }
    Ok(ServerHandle {
        shared,
        threads,
        paths,
        _lock: lock,
    })
}
