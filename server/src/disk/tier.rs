//! The disk store as the tier below the pool: a bounded queue that
//! [`Tier::submit`] fills without waiting, and one thread (`kvring-disk`)
//! that owns the store, writes what the owner hands it from the pool, and
//! reads lookups' chunks into the room the pool gives it. It reports every
//! operation's end to the tier's owner and never calls into the request
//! path.

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
}

impl DiskTier {
    /// The tier over `store`, whose budget is `capacity` bytes.
    pub fn new(store: DiskStore, capacity: u64) -> DiskTier {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let tier = DiskTier {
            tx,
            start: Mutex::new(None),
            counters: TierCounters::default(),
            objects: AtomicU64::new(0),
            used: AtomicU64::new(0),
            capacity,
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
        TierState::Up
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
        self.counters.fill(Level::Disk, TierState::Up, s);
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
}

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
        let thread = std::thread::Builder::new()
            .name("kvring-disk".into())
            .spawn(move || run(&tier, store, &*pool, &finished, rx, &s))
            .map_err(kvring::error::io("spawn the disk tier's thread"))?;
        Ok(DiskThread {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread after the operation under way; queued ones are
    /// dropped (the server is shutting down).
    pub fn stop(&mut self) {
        // Release pairs with the thread's Acquire load between operations.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
    // Acquire pairs with `DiskThread::stop`'s Release store.
    while !stop.load(Ordering::Acquire) {
        let op = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(op) => op,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // Relaxed: a gauge.
        tier.counters.queue.fetch_sub(1, Ordering::Relaxed);
        let done = serve(tier, &mut store, pool, op);
        tier.gauge(&store);
        finished.send(done);
    }
}

fn serve(tier: &DiskTier, store: &mut DiskStore, pool: &dyn PoolView, op: TierOp) -> TierDone {
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
            let ok = match store.put(&crate::l2::key::key(PREFIX, &key), bytes) {
                Ok(true) => {
                    c.written.fetch_add(1, r);
                    c.bytes_out.fetch_add(len, r);
                    true
                }
                Ok(false) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "disk tier: a write failed (dropped)");
                    c.errors.fetch_add(1, r);
                    c.dropped.fetch_add(1, r);
                    false
                }
            };
            TierDone::Written { then, ok }
        }
        TierOp::Fetch(fetch) => {
            let (hits, keep, drop) = fetch_chunks(tier, store, pool, &fetch);
            c.loaded.fetch_add(keep.len() as u64, r);
            TierDone::Fetched {
                fetch,
                hits,
                keep,
                drop,
            }
        }
    }
}

/// Reads the leading chunks of `f.hashes[f.start()..]` the store has (every
/// rank's object) into the pool: how many, the objects placed for them,
/// and the objects placed but not kept (a record that failed its check).
fn fetch_chunks(
    tier: &DiskTier,
    store: &mut DiskStore,
    pool: &dyn PoolView,
    f: &Fetch,
) -> (u32, Vec<u32>, Vec<u32>) {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let len = f.group.object_bytes;
    let (mut keep, mut drop) = (Vec::new(), Vec::new());
    let mut hits = 0;
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
                    drop.push(obj);
                    drop.extend(placed);
                    break 'chunks;
                }
            }
        }
        keep.extend(placed);
        hits += 1;
    }
    (hits, keep, drop)
}
