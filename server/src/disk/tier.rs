//! The disk store as the tier below the pool: a bounded queue that
//! [`Tier::submit`] fills without waiting, and one thread (`kvring-disk`)
//! that owns the store, writes what the owner hands it from the pool, and
//! reads lookups' chunks into the room the pool gives it. It reports every
//! operation's end to the tier's owner and never calls into the request
//! path.

use super::store::{DiskStore, Get};
use crate::cache::{Cache, ObjectKey};
use crate::tier::link::Finished;
use crate::tier::{Fetch, Placement, PoolView, Tier, TierCounters, TierDone, TierOp};
use kvring::proto::kv::{StatsReply, TierState};
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl DiskTier {
    pub fn new(store: DiskStore) -> DiskTier {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        DiskTier {
            tx,
            start: Mutex::new(Some((rx, store))),
            counters: TierCounters::default(),
        }
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
        self.counters.fill(TierState::Up, s);
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
        let mut ops = vec![op];
        while ops.len() < BATCH {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        serve(tier, &mut store, pool, ops, finished);
    }
}

/// Serves `ops` in order, each one's end reported as it comes: a run of
/// writes is one batch of the store's. An operation leaves the queue's
/// gauge when its end is sent, so that a drained queue means every
/// write's pool range is back with the owner.
fn serve(
    tier: &DiskTier,
    store: &mut DiskStore,
    pool: &dyn PoolView,
    ops: Vec<TierOp>,
    finished: &Finished,
) {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let c = &tier.counters;
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
            let (hits, keep, drop) = fetch_chunks(tier, store, pool, &fetch);
            c.loaded.fetch_add(keep.len() as u64, r);
            finished.send(TierDone::Fetched {
                fetch,
                hits,
                keep,
                drop,
            });
            // Relaxed: a gauge.
            c.queue.fetch_sub(1, r);
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
            let ok = match result {
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
            finished.send(TierDone::Written { then, ok });
            // Relaxed: a gauge.
            c.queue.fetch_sub(1, r);
        }
    }
}

/// A chunk of a window: its objects placed in the pool, and the range of
/// the window's reads that fill them.
struct Chunk {
    placed: Vec<u32>,
    reads: std::ops::Range<usize>,
}

/// Reads the leading chunks of `f.hashes[f.l1..]` the store has (every
/// rank's object) into the pool, a window of chunks at a time: how many,
/// the objects placed for them, and the objects placed but not kept (a
/// record that failed its check, or a chunk after it in its window).
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
    let mut rest = f.hashes[f.l1 as usize..].iter();
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
    (hits, keep, drop)
}
