//! The second tier: chunk objects in Valkey/Redis (standalone or cluster),
//! shared by servers on many hosts and kept across restarts.
//!
//! * Writes: with write-back, an object the pool evicts keeps its pool
//!   range until written (at most a quarter of the pool waits so; past
//!   that, or with the tier down or its queue full, the object is dropped
//!   and counted); one the tier had (written there or read from it) is
//!   written only if an EXISTS finds the store evicted it meanwhile. With
//!   write-through, every stored object is held (readable, not evicted)
//!   until written.
//! * Reads: a LOOKUP that misses the pool after a prefix asks the tier for
//!   the rest, brings the leading chunks it has (every rank's object, each
//!   value checked) into the pool, and only then takes its lease and ends:
//!   its job stays `Running` meanwhile, at most `lookup_wait`.
//! * Network I/O runs on the tier's own thread (`kvring-l2`, a Tokio
//!   runtime with a worker per connection of its pool, `kvring-l2-io`):
//!   the ring loop and the copy workers only
//!   queue operations (`try_send` on a bounded queue, never waiting). Every
//!   command has a deadline; a failed one marks the tier down, and while it
//!   is down nothing waits on it: writes are dropped, lookups answer from
//!   the pool, and the tier is probed again with a backoff (100 ms to 2 s).

mod conn;
mod key;
pub mod value;

use super::cache::{Cache, Drained, LeaseMeta, ObjectKey};
use super::registry::Group;
use super::Shared;
use crate::jobs::JobId;
use crate::kv::ChunkHash;
use crate::proto::kv::{StatsReply, TierState};
use conn::Conn;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::fmt;
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
    /// Links in the pool of connections (a cluster: each link connects to
    /// every node), and workers of the tier's runtime.
    pub connections: usize,
    /// How values are sealed, and the only seal taken
    /// (`--l2-secret-file`: a MAC).
    pub seal: value::Seal,
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
            connections: 4,
            seal: value::Seal::Checksum,
        })
    }
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
    state: AtomicU64,
    counters: Counters,
    /// When the tier was made (what `warned_ms` counts from).
    born: Instant,
    /// When a rate-limited warning was logged last (ms since `born`; 0:
    /// never).
    warned_ms: AtomicU64,
    /// Warnings left out since.
    unwarned: AtomicU64,
}

impl L2 {
    pub fn new(cfg: L2Config) -> L2 {
        let (tx, rx) = tokio::sync::mpsc::channel(cfg.queue.max(1));
        L2 {
            cfg,
            tx,
            rx: Mutex::new(Some(rx)),
            state: AtomicU64::new(TierState::Connecting.raw()),
            counters: Counters::default(),
            born: Instant::now(),
            warned_ms: AtomicU64::new(0),
            unwarned: AtomicU64::new(0),
        }
    }

    pub fn mode(&self) -> WriteMode {
        self.cfg.mode
    }

    fn state(&self) -> u64 {
        // Relaxed: a hint; every operation copes with the tier failing.
        self.state.load(Ordering::Relaxed)
    }

    fn set_state(&self, s: TierState) {
        // Relaxed: a hint (see `state`); no other access is ordered by it.
        let old = self.state.swap(s.raw(), Ordering::Relaxed);
        if old != s.raw() {
            match s {
                TierState::Up => tracing::info!("second tier up ({})", self.cfg.urls.join(", ")),
                TierState::Down => tracing::warn!(
                    "second tier down ({}): serving from the pool, retrying",
                    self.cfg.urls.join(", ")
                ),
                TierState::Connecting | TierState::None => {}
            }
        }
    }

    /// Whether operations are taken now (the tier answered last time).
    pub fn up(&self) -> bool {
        self.state() == TierState::Up.raw()
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
        s.l2_state = self.state();
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

    /// Command `what` on `key` failed: counted. A connection error or a
    /// timeout marks the tier down until it answers again; an error reply
    /// (a wrong-typed key, the store out of memory, a key the ACL denies)
    /// is about that command only: a miss or a dropped write, the tier
    /// stays up.
    fn failed(&self, what: &str, key: &str, e: &redis::RedisError) {
        // Relaxed: a counter.
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if is_reply(e) {
            self.warn(format_args!("second tier: {what} {key}: {e}: a miss (or a dropped write)"));
        } else {
            tracing::debug!("second tier: {what} {key}: {e}");
            self.set_state(TierState::Down);
        }
    }

    /// Logs `msg` as a warning, at most one a second (what others write
    /// into the tier decides how many there are); says how many were left
    /// out.
    fn warn(&self, msg: fmt::Arguments<'_>) {
        let now = self.born.elapsed().as_millis() as u64;
        // Relaxed (both): a rate limit; a race logs one line more or less.
        let last = self.warned_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) < 1_000 && last != 0 {
            self.unwarned.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.warned_ms.store(now.max(1), Ordering::Relaxed);
        match self.unwarned.swap(0, Ordering::Relaxed) {
            0 => tracing::warn!("{msg}"),
            n => tracing::warn!("{msg} ({n} more such lines left out)"),
        }
    }
}

/// Whether `e` is the store's answer about one command (an error reply),
/// not a failure of the connection or of the store as a whole.
fn is_reply(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    match e.kind() {
        // Replies the client does not know (WRONGTYPE, OOM, ...), a reply
        // of an unexpected type, and replies about the command.
        K::Extension | K::UnexpectedReturnType => true,
        K::Server(s) => matches!(
            s,
            S::ResponseError | S::NoPerm | S::ReadOnly | S::ExecAbort | S::NoScript | S::CrossSlot
        ),
        _ => false,
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
        // A worker per connection: each connection's replies are read and
        // parsed on a worker of their own, and values checked and copied
        // on the others.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(l2.cfg.connections.max(1))
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
            Some(c) => c.ping(l2.cfg.response_timeout).await.is_ok(),
        };
        if ok {
            l2.set_state(TierState::Up);
            backoff = Duration::from_millis(100);
        } else {
            l2.set_state(TierState::Down);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

async fn run_op(shared: &Arc<Shared>, l2: &Arc<L2>, conn: &Shared2, op: Op) {
    let c = conn.read().await.clone();
    match op {
        Op::Write { key, off, len, then } => {
            let check = matches!(&then, AfterWrite::Free(d) if d.in_l2);
            let ok = match c {
                Some(c) => write(shared, l2, c, &key, off, len, check).await,
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
            // Its reads settled objects other lookups may wait for.
            super::kv_ops::wake_lookups(shared);
        }
    }
}

/// Writes one object (`check`: unless the tier has it already); whether the
/// tier has it.
async fn write(shared: &Shared, l2: &L2, c: Conn, key: &ObjectKey, off: u64, len: u64, check: bool) -> bool {
    let k = key::key(&l2.cfg.prefix, key);
    if check {
        match c.exists(&k, l2.cfg.response_timeout).await {
            Ok(true) => return true,
            Ok(false) => {}
            Err(e) => {
                l2.failed("EXISTS", &k, &e);
                return false;
            }
        }
    }
    // SAFETY: `[off, off + len)` is an object's range in the pool, kept by
    // the caller of `L2::write` until this write's `then` runs (a
    // write-through hold on a ready object, which nothing writes; or an
    // evicted object's range, kept out of the allocator): nothing writes or
    // frees it meanwhile, and the pool lives as long as the server, whose
    // shutdown joins this thread first.
    let bytes = unsafe { std::slice::from_raw_parts(shared.kv.pool.at(off), len as usize) };
    let value = value::Value::seal(&k, bytes, &l2.cfg.seal);
    let value_len = value.len();
    match c.set(&k, value, l2.cfg.ttl, l2.cfg.response_timeout).await {
        Ok(()) => {
            // Relaxed: counters.
            let r = Ordering::Relaxed;
            l2.counters.written.fetch_add(1, r);
            l2.counters.bytes_out.fetch_add(value_len as u64, r);
            true
        }
        Err(e) => {
            l2.failed("SET", &k, &e);
            false
        }
    }
}

/// Chunks whose objects are read at once (every rank's object each): a
/// chunk's reads start as soon as an earlier chunk's have all ended.
const WINDOW: usize = 4;

/// What became of one object a fetch asked the tier for.
enum Got {
    /// Checked and copied into the pool: object `.0`, `Writing` until the
    /// fetch finishes it.
    Placed(u32),
    /// Already in the pool (stored or brought in meanwhile).
    Present,
    /// Not in the tier, corrupt, no room in the pool, or the read failed.
    Missing,
}

/// Brings the leading chunks of `f.hashes[f.l1..]` the tier has (for every
/// rank, every value checked) into the pool; how many.
///
/// Each object is read, checked and copied into the pool by a task of its
/// own, up to `WINDOW` chunks ahead, so copies overlap the reads that
/// follow. Chunks past the first one the tier lacks are not asked for; the
/// objects of chunks past the prefix that arrived anyway are dropped.
async fn fetch(shared: &Arc<Shared>, l2: &Arc<L2>, c: Conn, f: &Fetch) -> u32 {
    let deadline = Instant::now() + l2.cfg.lookup_wait;
    // Per chunk past the pool's prefix, one key per rank (one for all when
    // the ranks share objects).
    let keys: Vec<Vec<ObjectKey>> = f.hashes[f.l1 as usize..]
        .iter()
        .map(|h| {
            let mut ks = Cache::rank_keys(&f.meta, f.group, *h);
            ks.dedup();
            ks
        })
        .collect();
    let mut got: Vec<Vec<Option<Got>>> = keys.iter().map(|ks| ks.iter().map(|_| None).collect()).collect();
    // Reads outstanding per chunk.
    let mut pending: Vec<usize> = keys.iter().map(Vec::len).collect();
    // Chunks past `end` are not needed (a chunk before lacks an object).
    let mut end = keys.len();
    let (mut next, mut in_flight) = (0usize, 0usize);
    let mut reads = tokio::task::JoinSet::new();
    loop {
        while next < end && in_flight < WINDOW {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                end = next;
                break;
            }
            let wait = left.min(l2.cfg.response_timeout);
            for (r, k) in keys[next].iter().enumerate() {
                let (shared, l2, c, k, i) = (shared.clone(), l2.clone(), c.clone(), *k, next);
                let len = f.group.object_bytes;
                reads.spawn(async move { (i, r, read_object(&shared, &l2, &c, k, len, wait).await) });
            }
            next += 1;
            in_flight += 1;
        }
        let Some(done) = reads.join_next().await else { break };
        let (i, r, g) = match done {
            Ok(d) => d,
            // A read task panicked (a bug): no more reads; its entry stays
            // empty, so the prefix ends before its chunk.
            Err(e) => {
                tracing::error!("second tier: a read task failed: {e}");
                end = 0;
                continue;
            }
        };
        if matches!(g, Got::Missing) {
            end = end.min(i);
        }
        got[i][r] = Some(g);
        pending[i] -= 1;
        if pending[i] == 0 {
            in_flight -= 1;
        }
    }
    // The prefix: leading chunks with every rank's object placed or present.
    let hits = got
        .iter()
        .take_while(|row| row.iter().all(|g| matches!(g, Some(Got::Placed(_) | Got::Present))))
        .count();
    let placed = |rows: &[Vec<Option<Got>>]| -> Vec<u32> {
        rows.iter()
            .flatten()
            .filter_map(|g| match g {
                Some(Got::Placed(o)) => Some(*o),
                _ => None,
            })
            .collect()
    };
    let (keep, drop) = (placed(&got[..hits]), placed(&got[hits..]));
    shared.kv.with_cache(shared, |c| {
        c.finish_objects(&keep, true, true);
        c.finish_objects(&drop, false, false);
    });
    // Relaxed: a counter.
    l2.counters.loaded.fetch_add(keep.len() as u64, Ordering::Relaxed);
    hits as u32
}

/// Reads object `k` (`len` bytes, as its fingerprint fixes) from the tier,
/// checks it, and copies it into a new `Writing` object of the pool.
///
/// A value whose length is not that of such a value is refused before it
/// is read ([`Conn::get_sized`]), so it costs this server no memory.
async fn read_object(shared: &Shared, l2: &L2, c: &Conn, k: ObjectKey, len: u64, wait: Duration) -> Got {
    // Relaxed (all counters here): no access pairs with them.
    let r = Ordering::Relaxed;
    let name = key::key(&l2.cfg.prefix, &k);
    let corrupt = |e: value::BadValue| {
        l2.counters.corrupt.fetch_add(1, r);
        l2.warn(format_args!("second tier: {name}: {e}: read as a miss"));
        Got::Missing
    };
    let v = match c.get_sized(&name, value::HEADER as u64 + len, wait).await {
        Ok(conn::Sized::Value(v)) => v,
        Ok(conn::Sized::Missing) => {
            l2.counters.missed.fetch_add(1, r);
            return Got::Missing;
        }
        Ok(conn::Sized::Other(n)) => {
            return corrupt(value::BadValue::ValueSize {
                expected: value::HEADER as u64 + len,
                found: n,
            })
        }
        Err(e) => {
            l2.failed("GET", &name, &e);
            return Got::Missing;
        }
    };
    l2.counters.bytes_in.fetch_add(v.len() as u64, r);
    // Bound to this key, of this size, with this server's seal; the seal
    // itself is checked on the copy below.
    let opened = match value::open(&v, &name, len, &l2.cfg.seal) {
        Ok(o) => o,
        Err(e) => return corrupt(e),
    };
    let plan = shared.kv.with_cache(shared, |c| c.plan_objects(&[k], len));
    let Some(p) = plan.write.first() else {
        return if plan.present > 0 { Got::Present } else { Got::Missing };
    };
    // SAFETY: the range of an object just planned, `Writing`: no reader
    // sees it (lookups take ready objects only) and nothing else writes or
    // frees it until this fetch finishes it (below, or at the fetch's end);
    // `len` bytes, the object's size (which `open` checked the value's
    // object has), in the pool.
    let dst = unsafe { std::slice::from_raw_parts_mut(shared.kv.pool.at(p.off), opened.len()) };
    // Copied from the reply into the pool, its seal checked on the way (no
    // buffer of its own, one pass over the reply).
    match opened.copy_into(dst) {
        Ok(()) => Got::Placed(p.obj),
        Err(e) => {
            shared.kv.with_cache(shared, |c| c.finish_objects(&[p.obj], false, false));
            corrupt(e)
        }
    }
}
