//! The second tier: chunk objects in Valkey/Redis (standalone or cluster),
//! shared by servers on many hosts and kept across restarts.
//!
//! * Writes: with write-back, an object the pool evicts that the tier does
//!   not have keeps its pool range until written (at most a quarter of the
//!   pool waits so; past that, or with the tier down or its queue full, the
//!   object is dropped and counted); with write-through, every stored object
//!   is held (readable, not evicted) until written.
//! * Reads: a LOOKUP that misses the pool after a prefix asks the tier for
//!   the rest, brings the leading chunks it has (every rank's object, each
//!   value checked) into the pool, and only then takes its lease and ends:
//!   its job stays `Running` meanwhile, at most `lookup_wait`.
//! * Network I/O runs on the tier's own thread (`kvring-l2`, a Tokio
//!   runtime with two workers): the ring loop and the copy workers only
//!   queue operations (`try_send` on a bounded queue, never waiting). Every
//!   command has a deadline; a failed one marks the tier down, and while it
//!   is down nothing waits on it: writes are dropped, lookups answer from
//!   the pool, and the tier is probed again with a backoff (100 ms to 2 s).

mod conn;
mod key;
mod object;

use super::cache::{Cache, Drained, LeaseMeta, ObjectKey};
use super::registry::Group;
use super::Shared;
use crate::jobs::JobId;
use crate::kv::ChunkHash;
use crate::proto::kv::StatsReply;
use conn::Conn;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When objects go to the second tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// When the pool evicts them.
    Back,
    /// As soon as they are stored.
    Through,
}

/// The second tier's settings (`kvring serve --l2 URL ...`).
#[derive(Clone, Debug)]
pub struct L2Config {
    /// `redis://` or `rediss://` URLs (auth and TLS in them): one for a
    /// standalone server, the seeds of a cluster otherwise.
    pub urls: Vec<String>,
    pub cluster: bool,
    /// Put before every key.
    pub prefix: String,
    pub mode: WriteMode,
    /// Expiry of written objects (`None`: the store's own eviction only).
    pub ttl: Option<Duration>,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    /// The longest a lookup waits for the tier.
    pub lookup_wait: Duration,
    /// Operations queued at most (writes and lookups).
    pub queue: usize,
    /// Operations running at once.
    pub concurrency: usize,
}

impl L2Config {
    /// Settings for `urls` (defaults for the rest): several URLs, or one
    /// whose scheme is `redis+cluster://` (`rediss+cluster://`), name a
    /// cluster. Each URL is checked here.
    pub fn from_urls(urls: &[String]) -> Result<L2Config, String> {
        if urls.is_empty() {
            return Err("--l2 needs a URL (redis://HOST:PORT)".into());
        }
        let mut cluster = urls.len() > 1;
        let mut plain = Vec::new();
        for u in urls {
            let u = match u.split_once("+cluster://") {
                Some((scheme, rest)) => {
                    cluster = true;
                    format!("{scheme}://{rest}")
                }
                None => u.clone(),
            };
            redis::Client::open(u.as_str()).map_err(|e| {
                format!("--l2 {u:?}: {e} (redis://[USER:PASSWORD@]HOST:PORT[/DB], rediss:// for TLS, redis+cluster:// for a cluster)")
            })?;
            plain.push(u);
        }
        Ok(L2Config {
            urls: plain,
            cluster,
            prefix: "kvring:".into(),
            mode: WriteMode::Back,
            ttl: None,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            lookup_wait: Duration::from_secs(2),
            queue: 1024,
            concurrency: 32,
        })
    }
}

/// `StatsReply::l2_state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum L2State {
    Connecting = 1,
    Up = 2,
    Down = 3,
}

/// The tier's counters (for STATS and the segment).
#[derive(Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    loaded: AtomicU64,
    missed: AtomicU64,
    corrupt: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    errors: AtomicU64,
    queue: AtomicU64,
}

/// What a write does when it ends (written or not).
pub(crate) enum AfterWrite {
    /// Drop the hold write-through took on object `.0`.
    Release(u32),
    /// Give back an evicted object's range (write-back).
    Free(Drained),
}

/// A lookup that missed the pool after `l1` chunks.
pub(crate) struct Fetch {
    pub id: JobId,
    pub owner: u32,
    pub meta: LeaseMeta,
    pub group: Group,
    pub hashes: Vec<ChunkHash>,
    pub l1: u32,
}

enum Op {
    Write {
        key: ObjectKey,
        off: u64,
        len: u64,
        then: AfterWrite,
    },
    Fetch(Box<Fetch>),
}

/// The tier as the server's threads see it: a bounded queue to its thread,
/// its state and counters.
pub(crate) struct L2 {
    cfg: L2Config,
    tx: tokio::sync::mpsc::Sender<Op>,
    rx: Mutex<Option<tokio::sync::mpsc::Receiver<Op>>>,
    state: AtomicU8,
    counters: Counters,
}

impl L2 {
    pub fn new(cfg: L2Config) -> L2 {
        let (tx, rx) = tokio::sync::mpsc::channel(cfg.queue.max(1));
        L2 {
            cfg,
            tx,
            rx: Mutex::new(Some(rx)),
            state: AtomicU8::new(L2State::Connecting as u8),
            counters: Counters::default(),
        }
    }

    pub fn mode(&self) -> WriteMode {
        self.cfg.mode
    }

    fn state(&self) -> u8 {
        // Relaxed: a hint; every operation copes with the tier failing.
        self.state.load(Ordering::Relaxed)
    }

    fn set_state(&self, s: L2State) {
        // Relaxed: a hint (see `state`); no other access is ordered by it.
        let old = self.state.swap(s as u8, Ordering::Relaxed);
        if old != s as u8 {
            match s {
                L2State::Up => tracing::info!("second tier up ({})", self.cfg.urls.join(", ")),
                L2State::Down => tracing::warn!(
                    "second tier down ({}): serving from the pool, retrying",
                    self.cfg.urls.join(", ")
                ),
                L2State::Connecting => {}
            }
        }
    }

    /// Whether operations are taken now (the tier answered last time).
    pub fn up(&self) -> bool {
        self.state() == L2State::Up as u8
    }

    fn push(&self, op: Op) -> Result<(), Box<Op>> {
        if !self.up() {
            return Err(Box::new(op));
        }
        match self.tx.try_send(op) {
            Ok(()) => {
                // Relaxed: a gauge for observers.
                self.counters.queue.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(Box::new(e.into_inner())),
        }
    }

    /// Queues a write of object `key` (its bytes at pool offset `off`, kept
    /// by the caller until `then` runs); `Err(then)` when not queued (the
    /// tier down, its queue full): the caller undoes `then` itself.
    pub fn write(&self, key: ObjectKey, off: u64, len: u64, then: AfterWrite) -> Result<(), AfterWrite> {
        self.push(Op::Write { key, off, len, then }).map_err(|op| {
            // Relaxed: a counter.
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            match *op {
                Op::Write { then, .. } => then,
                Op::Fetch(_) => unreachable!("a write was pushed"),
            }
        })
    }

    /// Queues a lookup's fetch; `Err` when not queued.
    pub fn fetch(&self, f: Box<Fetch>) -> Result<(), Box<Fetch>> {
        self.push(Op::Fetch(f)).map_err(|op| match *op {
            Op::Fetch(f) => f,
            Op::Write { .. } => unreachable!("a fetch was pushed"),
        })
    }

    /// Copies the tier's counters into `s`.
    pub fn fill(&self, s: &mut StatsReply) {
        let c = &self.counters;
        // Relaxed: counters, each read on its own; no access pairs.
        let r = Ordering::Relaxed;
        s.l2_state = u64::from(self.state());
        s.l2_written_objects = c.written.load(r);
        s.l2_write_dropped_objects = c.dropped.load(r);
        s.l2_loaded_objects = c.loaded.load(r);
        s.l2_missed_objects = c.missed.load(r);
        s.l2_corrupt_objects = c.corrupt.load(r);
        s.l2_bytes_out = c.bytes_out.load(r);
        s.l2_bytes_in = c.bytes_in.load(r);
        s.l2_errors = c.errors.load(r);
        s.l2_queue = c.queue.load(r);
    }

    /// Hands the objects the cache evicted to the tier (write-back); one
    /// not taken gets its range back at once. Called with the cache locked.
    pub fn take_drained(&self, c: &mut Cache) {
        let (drained, refused) = c.take_drained();
        // Relaxed: a counter.
        self.counters.dropped.fetch_add(refused, Ordering::Relaxed);
        for d in drained {
            if let Err(AfterWrite::Free(d)) = self.write(d.key, d.off, d.len, AfterWrite::Free(d)) {
                c.free_drained(&d);
            }
        }
    }

    /// A command failed: counted, and the tier is down until it answers.
    fn failed(&self, what: &str, e: &redis::RedisError) {
        // Relaxed: a counter.
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("second tier: {what}: {e}");
        self.set_state(L2State::Down);
    }
}

/// The tier's thread: stopped and joined by [`L2Thread::stop`].
pub(crate) struct L2Thread {
    stop: Arc<AtomicBool>,
    wake: Arc<tokio::sync::Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl L2Thread {
    /// Starts the tier's thread for `shared.kv.l2`.
    pub fn start(shared: Arc<Shared>) -> crate::Result<L2Thread> {
        let l2 = shared.kv.l2.clone().expect("a second tier");
        let rx = l2
            .rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("started once");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvring-l2-io")
            .enable_all()
            .build()
            .map_err(crate::error::io("start the second tier's runtime"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(tokio::sync::Notify::new());
        let (s, w) = (stop.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name("kvring-l2".into())
            .spawn(move || {
                rt.block_on(serve(shared, l2, rx, s, w));
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(crate::error::io("spawn the second tier's thread"))?;
        Ok(L2Thread {
            stop,
            wake,
            thread: Some(thread),
        })
    }

    /// Stops the tier: queued operations are dropped, running ones end at
    /// their deadline at the latest.
    pub fn stop(&mut self) {
        // Relaxed: the join below orders the rest.
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for L2Thread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The connection, once made (shared by the operations, replaced by the
/// supervisor).
type Shared2 = Arc<tokio::sync::RwLock<Option<Conn>>>;

async fn serve(
    shared: Arc<Shared>,
    l2: Arc<L2>,
    mut rx: tokio::sync::mpsc::Receiver<Op>,
    stop: Arc<AtomicBool>,
    wake: Arc<tokio::sync::Notify>,
) {
    let conn: Shared2 = Arc::new(tokio::sync::RwLock::new(None));
    let sup = tokio::spawn(supervise(l2.clone(), conn.clone(), stop.clone()));
    let slots = Arc::new(tokio::sync::Semaphore::new(l2.cfg.concurrency.max(1)));
    loop {
        let op = tokio::select! {
            op = rx.recv() => op,
            _ = wake.notified() => None,
        };
        // Relaxed: set before the notification this loop woke for.
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let Some(op) = op else { break };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let (shared, l2, conn) = (shared.clone(), l2.clone(), conn.clone());
        tokio::spawn(async move {
            run_op(&shared, &l2, &conn, op).await;
            // Relaxed: a gauge.
            l2.counters.queue.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    sup.abort();
}

/// Connects, and reconnects after a failure, with a backoff; while down,
/// probes with PING.
async fn supervise(l2: Arc<L2>, conn: Shared2, stop: Arc<AtomicBool>) {
    let mut backoff = Duration::from_millis(100);
    // Relaxed: polled; the thread joins after.
    while !stop.load(Ordering::Relaxed) {
        let current = conn.read().await.clone();
        let ok = match current {
            None => match Conn::connect(&l2.cfg).await {
                Ok(c) => {
                    *conn.write().await = Some(c);
                    true
                }
                Err(e) => {
                    tracing::debug!("second tier: connect: {e}");
                    false
                }
            },
            Some(_) if l2.up() => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Some(mut c) => c.ping(l2.cfg.response_timeout).await.is_ok(),
        };
        if ok {
            l2.set_state(L2State::Up);
            backoff = Duration::from_millis(100);
        } else {
            l2.set_state(L2State::Down);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

async fn run_op(shared: &Arc<Shared>, l2: &Arc<L2>, conn: &Shared2, op: Op) {
    let c = conn.read().await.clone();
    match op {
        Op::Write { key, off, len, then } => {
            let ok = match c {
                Some(c) => write(shared, l2, c, &key, off, len).await,
                None => false,
            };
            if !ok {
                // Relaxed: a counter.
                l2.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
            shared.kv.with_cache(shared, |cache| match &then {
                AfterWrite::Release(id) => cache.l2_written(*id, ok),
                AfterWrite::Free(d) => cache.free_drained(d),
            });
        }
        Op::Fetch(f) => {
            let l2_hits = match c {
                Some(c) if l2.up() => fetch(shared, l2, c, &f).await,
                _ => 0,
            };
            super::kv_ops::end_lookup(shared, &f, l2_hits);
        }
    }
}

/// Writes one object; whether the tier has it.
async fn write(shared: &Shared, l2: &L2, mut c: Conn, key: &ObjectKey, off: u64, len: u64) -> bool {
    // SAFETY: `[off, off + len)` is an object's range in the pool, kept by
    // the caller of `L2::write` until this write's `then` runs (a
    // write-through hold on a ready object, which nothing writes; or an
    // evicted object's range, kept out of the allocator): nothing writes or
    // frees it meanwhile, and the pool lives as long as the server, whose
    // shutdown joins this thread first.
    let bytes = unsafe { std::slice::from_raw_parts(shared.kv.pool.at(off), len as usize) };
    let value = object::Value::of(bytes);
    let value_len = value.len();
    let k = key::key(&l2.cfg.prefix, key);
    match c.set(&k, value, l2.cfg.ttl, l2.cfg.response_timeout).await {
        Ok(()) => {
            // Relaxed: counters.
            let r = Ordering::Relaxed;
            l2.counters.written.fetch_add(1, r);
            l2.counters.bytes_out.fetch_add(value_len as u64, r);
            true
        }
        Err(e) => {
            l2.failed("SET", &e);
            false
        }
    }
}

/// Chunks fetched at once (every rank's object each).
const WINDOW: usize = 4;

/// Brings the leading chunks of `f.hashes[f.l1..]` the tier has (for every
/// rank, every value checked) into the pool; how many.
async fn fetch(shared: &Shared, l2: &L2, c: Conn, f: &Fetch) -> u32 {
    let deadline = Instant::now() + l2.cfg.lookup_wait;
    let rest = &f.hashes[f.l1 as usize..];
    let mut found: Vec<(Vec<ObjectKey>, Vec<Vec<u8>>)> = Vec::new();
    'windows: for window in rest.chunks(WINDOW) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let wait = left.min(l2.cfg.response_timeout);
        let mut gets = tokio::task::JoinSet::new();
        // One key per rank (one for all when the ranks share objects).
        let rank_keys = |h: ChunkHash| {
            let mut ks = Cache::rank_keys(&f.meta, f.group, h);
            ks.dedup();
            ks
        };
        let ranks = rank_keys(window[0]).len();
        for (i, h) in window.iter().enumerate() {
            for (r, k) in rank_keys(*h).into_iter().enumerate() {
                let mut c = c.clone();
                let name = key::key(&l2.cfg.prefix, &k);
                // Each value is checked in its own task, so the checks of
                // a window run on the runtime's workers beside the reads.
                gets.spawn(async move {
                    let res = c.get(&name, wait).await;
                    let check = match &res {
                        Ok(Some(v)) => Some(object::decode(v).map(|_| ())),
                        _ => None,
                    };
                    (i, r, k, res, check)
                });
            }
        }
        // Per chunk of the window, per rank: the key and its checked value.
        type Row = Vec<Option<(ObjectKey, Vec<u8>)>>;
        let mut rows: Vec<Row> = vec![vec![None; ranks]; window.len()];
        let mut failed = false;
        while let Some(j) = gets.join_next().await {
            let Ok((i, r, k, res, check)) = j else {
                failed = true;
                continue;
            };
            match res {
                Ok(Some(v)) => {
                    // Relaxed: a counter.
                    l2.counters.bytes_in.fetch_add(v.len() as u64, Ordering::Relaxed);
                    // Checked in place (above); the object is copied
                    // from the reply into the pool below (no buffer of its
                    // own).
                    match check.expect("a value was checked") {
                        Ok(()) => rows[i][r] = Some((k, v)),
                        Err(e) => {
                            l2.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!("second tier: {}: {e}: read as a miss", key::key(&l2.cfg.prefix, &k));
                        }
                    }
                }
                Ok(None) => {
                    l2.counters.missed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    l2.failed("GET", &e);
                    failed = true;
                }
            }
        }
        for row in rows {
            let Some(row) = row.into_iter().collect::<Option<Vec<_>>>() else {
                break 'windows;
            };
            let len = row[0].1.len();
            if row.iter().any(|(_, b)| b.len() != len) {
                break 'windows;
            }
            found.push(row.into_iter().unzip());
        }
        if failed {
            break;
        }
    }
    if found.is_empty() {
        return 0;
    }
    // Every value was checked: its object follows the header.
    let len = (found[0].1[0].len() - object::HEADER) as u64;
    let keys: Vec<ObjectKey> = found.iter().flat_map(|(ks, _)| ks.iter().copied()).collect();
    let values: Vec<&Vec<u8>> = found.iter().flat_map(|(_, bs)| bs.iter()).collect();
    let plan = shared.kv.with_cache(shared, |c| c.plan_objects(&keys, len));
    for p in &plan.write {
        let v = &values[p.chunk as usize][object::HEADER..];
        // SAFETY: the range of an object this plan made, `Writing`: no
        // reader sees it (lookups take ready objects only) and nothing
        // else writes it until `finish_objects` below; `len` bytes, the
        // object's size, in the pool.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), shared.kv.pool.at(p.off), v.len()) };
    }
    let objs: Vec<u32> = plan.write.iter().map(|p| p.obj).collect();
    shared.kv.with_cache(shared, |c| c.finish_objects(&objs, true, true));
    // Relaxed: a counter.
    l2.counters.loaded.fetch_add(objs.len() as u64, Ordering::Relaxed);
    found.len() as u32
}
