//! The disk store as the tier below the pool: a bounded queue that
//! [`Tier::submit`] fills without waiting, and one thread (`kvring-disk`)
//! that owns the store, writes what the owner hands it from the pool, and
//! reads lookups' chunks into the room the pool gives it. It reports every
//! operation's end to the tier's owner and never calls into the request
//! path. An I/O error, or an operation that does not end, takes the tier
//! down ([`super::health`]); while down, what is still queued is dropped
//! (writes) or answered empty (lookups), counted.

use super::health::{Backoff, Health};
use super::store::DiskStore;
use crate::cache::{Cache, Level, ObjectKey};
use crate::tier::link::Finished;
use crate::tier::{Fetch, Placement, PoolView, Tier, TierCounters, TierDone, TierOp};
use kvring::proto::kv::{StatsReply, TierState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Operations queued at most: writes past it are dropped (and counted by
/// the owner), lookups answer from the pool.
pub const QUEUE: usize = 1024;

/// The longest a lookup's reads go on: chunks not read by then are
/// misses (a read under way when it passes still ends first).
pub const LOOKUP_WAIT: Duration = Duration::from_secs(2);

/// The prefix of the keys records are bound to (the remote tier's key
/// format: model, world size, rank, layout fingerprint, salt, chunk hash).
const PREFIX: &str = "kvring-disk:";

/// The disk tier: its queue and counters; the store is its thread's.
pub(crate) struct DiskTier {
    tx: SyncSender<TierOp>,
    /// The queue's other end and the store, until the thread takes them.
    start: Mutex<Option<(Receiver<TierOp>, DiskStore)>>,
    counters: TierCounters,
    /// The store's objects and segment bytes, as its thread last saw them.
    objects: AtomicU64,
    used: AtomicU64,
    /// The byte budget.
    capacity: u64,
    health: Health,
    /// The store's directory (probed while down).
    dir: std::path::PathBuf,
}

impl DiskTier {
    /// The tier over `store` in `dir`, whose budget is `capacity` bytes.
    pub fn new(store: DiskStore, dir: &std::path::Path, capacity: u64) -> DiskTier {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let tier = DiskTier {
            tx,
            start: Mutex::new(None),
            counters: TierCounters::default(),
            objects: AtomicU64::new(0),
            used: AtomicU64::new(0),
            capacity,
            health: Health::default(),
            dir: dir.to_path_buf(),
        };
        tier.gauge(&store);
        *tier.start.lock().unwrap_or_else(|e| e.into_inner()) = Some((rx, store));
        tier
    }

    /// Publishes the store's size for observers.
    fn gauge(&self, store: &DiskStore) {
        let s = store.stats();
        // Relaxed: gauges for observers, each read on its own.
        self.objects.store(s.objects, Ordering::Relaxed);
        self.used.store(s.segment_bytes, Ordering::Relaxed);
    }
}

impl Tier for DiskTier {
    fn state(&self) -> TierState {
        self.health.state()
    }

    fn lookup_wait(&self) -> Duration {
        LOOKUP_WAIT
    }

    fn submit(&self, op: TierOp) -> Result<(), TierOp> {
        match self.tx.try_send(op) {
            Ok(()) => {
                // Relaxed: a gauge for observers.
                self.counters.queue.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // A refused write is counted by its owner (which gives it back).
            Err(e) => Err(match e {
                mpsc::TrySendError::Full(op) | mpsc::TrySendError::Disconnected(op) => op,
            }),
        }
    }

    fn fill(&self, s: &mut StatsReply) {
        self.counters.fill(Level::Disk, self.health.state(), s);
        // Relaxed: gauges (see `gauge`).
        s.disk_objects = self.objects.load(Ordering::Relaxed);
        s.disk_used_bytes = self.used.load(Ordering::Relaxed);
        s.disk_capacity_bytes = self.capacity;
    }
}

/// The tier's thread: stopped and joined by [`DiskThread::stop`].
pub(crate) struct DiskThread {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Closed when the thread ends.
    ended: Receiver<()>,
}

/// How long [`DiskThread::stop`] waits for an operation under way.
const STOP_WAIT: Duration = Duration::from_secs(2);

impl DiskThread {
    /// Starts `tier`'s thread over `pool`, reporting to `finished`.
    pub fn start(
        tier: Arc<DiskTier>,
        pool: Arc<dyn PoolView>,
        finished: Finished,
    ) -> crate::Result<DiskThread> {
        let (rx, store) = tier
            .start
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("started once");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (ended_tx, ended) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvring-disk".into())
            .spawn(move || {
                let _ended = ended_tx;
                run(&tier, store, &*pool, &finished, rx, &s)
            })
            .map_err(kvring::error::io("spawn the disk tier's thread"))?;
        Ok(DiskThread {
            stop,
            thread: Some(thread),
            ended,
        })
    }

    /// Stops the thread after the operation under way; queued ones are
    /// dropped (the server is shutting down). An operation the disk does
    /// not end within [`STOP_WAIT`] is left behind with its thread (which
    /// holds what it uses, the pool included, until it ends), said once.
    pub fn stop(&mut self) {
        // Release pairs with the thread's Acquire load between operations.
        self.stop.store(true, Ordering::Release);
        let Some(t) = self.thread.take() else {
            return;
        };
        match self.ended.recv_timeout(STOP_WAIT) {
            Err(RecvTimeoutError::Timeout) => tracing::warn!(
                "disk tier: an operation did not end within {} s (a disk that does not answer); its thread is left behind",
                STOP_WAIT.as_secs()
            ),
            _ => {
                let _ = t.join();
            }
        }
    }
}

impl Drop for DiskThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(
    tier: &DiskTier,
    mut store: DiskStore,
    pool: &dyn PoolView,
    finished: &Finished,
    rx: Receiver<TierOp>,
    stop: &AtomicBool,
) {
    let mut backoff = Backoff::new(&tier.dir);
    // Acquire pairs with `DiskThread::stop`'s Release store.
    while !stop.load(Ordering::Acquire) {
        backoff.tick(&tier.health);
        let op = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(op) => op,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // Relaxed: a gauge.
        tier.counters.queue.fetch_sub(1, Ordering::Relaxed);
        if tier.health.is_down() {
            finished.send(refuse(tier, op));
            continue;
        }
        let (done, io_failed) = tier.health.during(|| serve(tier, &mut store, pool, op));
        if io_failed {
            backoff.failed(&tier.health);
        } else {
            backoff.succeeded();
        }
        tier.gauge(&store);
        finished.send(done);
    }
}

/// What the tier answers while down: a write dropped, a lookup's chunks
/// missed.
fn refuse(tier: &DiskTier, op: TierOp) -> TierDone {
    // Relaxed: counters.
    let r = Ordering::Relaxed;
    match op {
        TierOp::Write { then, .. } => {
            tier.counters.dropped.fetch_add(1, r);
            TierDone::Written { then, ok: false }
        }
        TierOp::Fetch(fetch) => {
            tier.counters.missed.fetch_add(1, r);
            TierDone::Fetched {
                fetch,
                hits: 0,
                keep: Vec::new(),
                drop: Vec::new(),
            }
        }
    }
}

/// Serves `op`; whether an I/O error happened.
fn serve(
    tier: &DiskTier,
    store: &mut DiskStore,
    pool: &dyn PoolView,
    op: TierOp,
) -> (TierDone, bool) {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let c = &tier.counters;
    match op {
        TierOp::Write {
            key,
            off,
            len,
            then,
            ..
        } => {
            // SAFETY: the range of an object the owner keeps for this write
            // until it applies the write's end (`PoolView::bytes`).
            let bytes = unsafe { pool.bytes(off, len) };
            let (ok, failed) = match store.put(&crate::l2::key::key(PREFIX, &key), bytes) {
                Ok(true) => {
                    c.written.fetch_add(1, r);
                    c.bytes_out.fetch_add(len, r);
                    (true, false)
                }
                Ok(false) => (true, false),
                Err(e) => {
                    tracing::warn!(error = %e, "disk tier: a write failed (dropped)");
                    c.errors.fetch_add(1, r);
                    c.dropped.fetch_add(1, r);
                    (false, true)
                }
            };
            (TierDone::Written { then, ok }, failed)
        }
        TierOp::Fetch(fetch) => {
            let (hits, keep, drop, failed) = fetch_chunks(tier, store, pool, &fetch);
            c.loaded.fetch_add(keep.len() as u64, r);
            let done = TierDone::Fetched {
                fetch,
                hits,
                keep,
                drop,
            };
            (done, failed)
        }
    }
}

/// Reads the leading chunks of `f.hashes[f.start()..]` the store has (every
/// rank's object) into the pool: how many, the objects placed for them,
/// the objects placed but not kept (a record that failed its check), and
/// whether a read failed.
fn fetch_chunks(
    tier: &DiskTier,
    store: &mut DiskStore,
    pool: &dyn PoolView,
    f: &Fetch,
) -> (u32, Vec<u32>, Vec<u32>, bool) {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let len = f.group.object_bytes;
    let (mut keep, mut drop) = (Vec::new(), Vec::new());
    let mut hits = 0;
    let mut failed = false;
    let deadline = Instant::now() + LOOKUP_WAIT;
    'chunks: for h in &f.hashes[f.start()..] {
        if Instant::now() >= deadline {
            break;
        }
        let mut keys: Vec<ObjectKey> = Cache::rank_keys(&f.meta, f.group, *h);
        keys.dedup();
        let names: Vec<String> = keys
            .iter()
            .map(|k| crate::l2::key::key(PREFIX, k))
            .collect();
        // Only a chunk with every rank's object is a hit: none is placed
        // unless all are there.
        if !names.iter().all(|n| store.contains(n)) {
            tier.counters.missed.fetch_add(1, r);
            break;
        }
        let mut placed = Vec::new();
        for (k, name) in keys.iter().zip(&names) {
            let (obj, off) = match pool.place(*k, len) {
                Placement::Room { obj, off } => (obj, off),
                Placement::Present => continue,
                Placement::NoRoom => {
                    drop.extend(placed);
                    break 'chunks;
                }
            };
            // SAFETY: the room `place` just gave this read alone, a
            // `Writing` object of `len` bytes, until the fetch reports it.
            let dst = unsafe { pool.bytes_mut(off, len) };
            match store.get(name, len, dst) {
                Ok(true) => {
                    tier.counters.bytes_in.fetch_add(len, r);
                    placed.push(obj);
                }
                Ok(false) => {
                    tier.counters.corrupt.fetch_add(1, r);
                    drop.push(obj);
                    drop.extend(placed);
                    break 'chunks;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "disk tier: a read failed (a miss)");
                    tier.counters.errors.fetch_add(1, r);
                    failed = true;
                    drop.push(obj);
                    drop.extend(placed);
                    break 'chunks;
                }
            }
        }
        keep.extend(placed);
        hits += 1;
    }
    (hits, keep, drop, failed)
}
