//! The disk store as the tier below the pool: a bounded queue that
//! [`Tier::submit`] fills without waiting, and one thread (`kvring-disk`)
//! that owns the store, writes what the owner hands it from the pool, and
//! reads lookups' chunks into the room the pool gives it. It reports every
//! operation's end to the tier's owner and never calls into the request
//! path. An I/O error, or an operation that does not end, takes the tier
//! down ([`super::health`]); while down, what is still queued is dropped
//! (writes) or answered empty (lookups), counted.

use super::health::{Backoff, Health};
use super::store::{DiskStore, Get};
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

/// Operations taken off the queue at once: the writes among them go to the
/// store together, several in flight.
const BATCH: usize = 16;

/// Chunks of a lookup whose objects are read together, several in flight.
const WINDOW: usize = 8;

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
        // A refused write is counted by its owner (which gives it back).
        self.tx.try_send(op).map_err(|e| match e {
            mpsc::TrySendError::Full(op) | mpsc::TrySendError::Disconnected(op) => op,
        })
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

    /// Stops the thread after the batch under way; queued operations are
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
        let mut ops = vec![op];
        while ops.len() < BATCH {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        if tier.health.is_down() {
            for op in ops {
                finished.send(refuse(tier, op));
            }
            continue;
        }
        let io_failed = tier
            .health
            .during(|| serve(tier, &mut store, pool, ops, finished));
        if io_failed {
            backoff.failed(&tier.health);
        } else {
            backoff.succeeded();
        }
        tier.gauge(&store);
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

/// Serves `ops` in order, each one's end reported as it comes: a run of
/// writes is one batch of the store's. Whether an I/O error happened.
fn serve(
    tier: &DiskTier,
    store: &mut DiskStore,
    pool: &dyn PoolView,
    ops: Vec<TierOp>,
    finished: &Finished,
) -> bool {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let c = &tier.counters;
    let mut failed = false;
    let mut ops = ops.into_iter().peekable();
    while let Some(op) = ops.next() {
        let TierOp::Write {
            key,
            off,
            len,
            then,
            ..
        } = op
        else {
            let TierOp::Fetch(fetch) = op else {
                unreachable!("not a write")
            };
            let (hits, keep, drop, read_failed) = fetch_chunks(tier, store, pool, &fetch);
            failed |= read_failed;
            c.loaded.fetch_add(keep.len() as u64, r);
            finished.send(TierDone::Fetched {
                fetch,
                hits,
                keep,
                drop,
            });
            continue;
        };
        let mut writes = vec![(key, off, len, then)];
        while let Some(TierOp::Write { .. }) = ops.peek() {
            if let Some(TierOp::Write {
                key,
                off,
                len,
                then,
                ..
            }) = ops.next()
            {
                writes.push((key, off, len, then));
            }
        }
        let names: Vec<String> = writes
            .iter()
            .map(|w| crate::l2::key::key(PREFIX, &w.0))
            .collect();
        let items: Vec<(&str, &[u8])> = writes
            .iter()
            .zip(&names)
            // SAFETY: the range of an object the owner keeps for this
            // write until it applies the write's end (`PoolView::bytes`),
            // which is sent below, after the batch.
            .map(|(w, n)| (n.as_str(), unsafe { pool.bytes(w.1, w.2) }))
            .collect();
        let results = store.put_many(&items);
        for ((_, _, len, then), result) in writes.into_iter().zip(results) {
            let (ok, write_failed) = match result {
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
            failed |= write_failed;
            finished.send(TierDone::Written { then, ok });
        }
    }
    failed
}

/// A chunk of a window: its objects placed in the pool, and the range of
/// the window's reads that fill them.
struct Chunk {
    placed: Vec<u32>,
    reads: std::ops::Range<usize>,
}

/// Reads the leading chunks of `f.hashes[f.start()..]` the store has (every
/// rank's object) into the pool, a window of chunks at a time: how many,
/// the objects placed for them, and the objects placed but not kept (a
/// record that failed its check, or a chunk after it in its window), and
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
    let mut rest = f.hashes[f.start()..].iter();
    let mut last = false;
    while !last && Instant::now() < deadline {
        let mut chunks: Vec<Chunk> = Vec::new();
        // Each read: the object's name and its room in the pool.
        let mut reads: Vec<(String, u64)> = Vec::new();
        while chunks.len() < WINDOW {
            let Some(h) = rest.next() else {
                last = true;
                break;
            };
            let mut keys: Vec<ObjectKey> = Cache::rank_keys(&f.meta, f.group, *h);
            keys.dedup();
            let names: Vec<String> = keys
                .iter()
                .map(|k| crate::l2::key::key(PREFIX, k))
                .collect();
            // Only a chunk with every rank's object is a hit: none is
            // placed unless all are there.
            if !names.iter().all(|n| store.contains(n)) {
                tier.counters.missed.fetch_add(1, r);
                last = true;
                break;
            }
            let mut chunk = Chunk {
                placed: Vec::new(),
                reads: reads.len()..reads.len(),
            };
            for (k, name) in keys.iter().zip(names) {
                match pool.place(*k, len) {
                    Placement::Room { obj, off } => {
                        chunk.placed.push(obj);
                        reads.push((name, off));
                    }
                    Placement::Present => {}
                    Placement::NoRoom => {
                        last = true;
                        break;
                    }
                }
            }
            if last {
                // Not read: its rooms go back as they are.
                drop.extend(chunk.placed);
                reads.truncate(chunk.reads.start);
                break;
            }
            chunk.reads.end = reads.len();
            chunks.push(chunk);
        }
        let mut gets: Vec<Get<'_>> = reads
            .iter()
            .map(|(name, off)| Get {
                key: name,
                len,
                // SAFETY: the room `place` just gave this read alone, a
                // `Writing` object of `len` bytes, until the fetch
                // reports it; each read's room is another object's.
                dst: unsafe { pool.bytes_mut(*off, len) },
            })
            .collect();
        let results = store.get_many(&mut gets);
        // The leading whole chunks are hits: from the first that is not
        // whole on, what was placed is dropped.
        let mut broken = false;
        for chunk in chunks {
            for result in &results[chunk.reads] {
                match result {
                    Ok(true) => {
                        tier.counters.bytes_in.fetch_add(len, r);
                        continue;
                    }
                    Ok(false) => {
                        tier.counters.corrupt.fetch_add(1, r);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "disk tier: a read failed (a miss)");
                        tier.counters.errors.fetch_add(1, r);
                        failed = true;
                    }
                }
                broken = true;
            }
            if broken {
                drop.extend(chunk.placed);
            } else {
                keep.extend(chunk.placed);
                hits += 1;
            }
        }
        last |= broken;
    }
    (hits, keep, drop, failed)
}
