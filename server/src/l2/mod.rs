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
//! * It is a `Tier` (`server/tier`): its owner submits writes and
//!   fetches (`try_send` on a bounded queue, never waiting) and applies
//!   what it finished; it sees the pool through a `PoolView` and never
//!   calls into the request path.
//! * Network I/O runs on the tier's own thread (`kvring-l2`, a Tokio
//!   runtime with a worker per connection of its pool, `kvring-l2-io`). Every
//!   command has a deadline; a failed one marks the tier down, and while it
//!   is down nothing waits on it: writes are dropped, lookups answer from
//!   the pool, and the tier is probed again with a backoff (100 ms to 2 s).

mod conn;
pub(crate) mod key;
pub mod value;

use super::cache::{Cache, ObjectKey};
use super::tier::link::Finished;
pub use super::tier::WriteMode;
use super::tier::{Fetch, Placement, PoolView, Tier, TierCounters, TierDone, TierOp};
use conn::Conn;
use kvring::proto::kv::{StatsReply, TierState};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// Checks the settings `from_urls` leaves to the caller.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if self.queue == 0 {
            return Err(crate::ConfigError::Tier(
                "--l2-queue must be at least 1".into(),
            ));
        }
        if self.connections == 0 || self.connections > 64 {
            return Err(crate::ConfigError::Tier(
                "--l2-connections must be 1 to 64".into(),
            ));
        }
        Ok(())
    }

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

/// The tier as the server's threads see it: a bounded queue to its thread,
/// its state and counters.
pub(crate) struct L2 {
    cfg: L2Config,
    tx: tokio::sync::mpsc::Sender<TierOp>,
    rx: Mutex<Option<tokio::sync::mpsc::Receiver<TierOp>>>,
    state: AtomicU64,
    counters: TierCounters,
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
            counters: TierCounters::default(),
            born: Instant::now(),
            warned_ms: AtomicU64::new(0),
            unwarned: AtomicU64::new(0),
        }
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

    /// Command `what` on `key` failed: counted. A connection error or a
    /// timeout marks the tier down until it answers again; an error reply
    /// (a wrong-typed key, the store out of memory, a key the ACL denies)
    /// is about that command only: a miss or a dropped write, the tier
    /// stays up.
    fn failed(&self, what: &str, key: &str, e: &redis::RedisError) {
        // Relaxed: a counter.
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if is_reply(e) {
            self.warn(format_args!(
                "second tier: {what} {key}: {e}: a miss (or a dropped write)"
            ));
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

impl Tier for L2 {
    fn state(&self) -> TierState {
        TierState::decode(self.state()).unwrap_or(TierState::Down)
    }

    fn lookup_wait(&self) -> Duration {
        self.cfg.lookup_wait
    }

    fn submit(&self, op: TierOp) -> Result<(), TierOp> {
        let refused = if !self.up() {
            Err(op)
        } else {
            self.tx.try_send(op).map_err(|e| e.into_inner())
        };
        // A refused write is counted by its owner (which gives it back).
        refused
    }

    fn fill(&self, s: &mut StatsReply) {
        self.counters
            .fill(crate::cache::Level::Remote, Tier::state(self), s);
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
    /// Starts the thread of tier `l2`: it reads and writes the pool
    /// through `pool` and hands what it finished to `finished`.
    pub fn start(
        l2: Arc<L2>,
        pool: Arc<dyn PoolView>,
        finished: Finished,
    ) -> crate::Result<L2Thread> {
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
            .map_err(kvring::error::io("start the second tier's runtime"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(tokio::sync::Notify::new());
        let (s, w) = (stop.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name("kvring-l2".into())
            .spawn(move || {
                rt.block_on(serve(pool, finished, l2, rx, s, w));
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(kvring::error::io("spawn the second tier's thread"))?;
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
    pool: Arc<dyn PoolView>,
    finished: Finished,
    l2: Arc<L2>,
    mut rx: tokio::sync::mpsc::Receiver<TierOp>,
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
        let (pool, l2, conn) = (pool.clone(), l2.clone(), conn.clone());
        let finished = finished.clone();
        tokio::spawn(async move {
            finished.send(run_op(&pool, &l2, &conn, op).await);
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

async fn run_op(pool: &Arc<dyn PoolView>, l2: &Arc<L2>, conn: &Shared2, op: TierOp) -> TierDone {
    let c = conn.read().await.clone();
    match op {
        TierOp::Write {
            key,
            off,
            len,
            check,
            then,
        } => {
            let ok = match c {
                Some(c) => write(&**pool, l2, c, &key, off, len, check).await,
                None => false,
            };
            if !ok {
                // Relaxed: a counter.
                l2.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
            TierDone::Written { then, ok }
        }
        TierOp::Fetch(f) => {
            let (hits, keep, drop) = match c {
                Some(c) if l2.up() => fetch(pool, l2, c, &f).await,
                _ => (0, Vec::new(), Vec::new()),
            };
            TierDone::Fetched {
                fetch: f,
                hits,
                keep,
                drop,
            }
        }
    }
}

/// Writes one object (`check`: unless the tier has it already); whether the
/// tier has it.
async fn write(
    pool: &dyn PoolView,
    l2: &L2,
    c: Conn,
    key: &ObjectKey,
    off: u64,
    len: u64,
    check: bool,
) -> bool {
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
    // SAFETY: `[off, off + len)` is the range of the object submitted for
    // this write, which the owner keeps until it applies the write's end (a
    // write-through hold on a ready object, which nothing writes; or an
    // evicted object's range, kept out of the allocator).
    let bytes = unsafe { pool.bytes(off, len) };
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
    /// Placed as object `.0`, then found corrupt on the copy: dropped.
    Failed(u32),
}

/// Brings the leading chunks of `f.hashes[f.start()..]` the tier has (for every
/// rank, every value checked) into the pool: how many, the objects placed
/// for them, and the other objects placed (past that prefix, or failed on
/// the copy), for the owner to drop.
///
/// Each object is read, checked and copied into the pool by a task of its
/// own, up to `WINDOW` chunks ahead, so copies overlap the reads that
/// follow. Chunks past the first one the tier lacks are not asked for; the
/// objects of chunks past the prefix that arrived anyway are dropped.
async fn fetch(
    pool: &Arc<dyn PoolView>,
    l2: &Arc<L2>,
    c: Conn,
    f: &Fetch,
) -> (u32, Vec<u32>, Vec<u32>) {
    let deadline = Instant::now() + l2.cfg.lookup_wait;
    // Per chunk past the pool's prefix, one key per rank (one for all when
    // the ranks share objects).
    let keys: Vec<Vec<ObjectKey>> = f.hashes[f.start()..]
        .iter()
        .map(|h| {
            let mut ks = Cache::rank_keys(&f.meta, f.group, *h);
            ks.dedup();
            ks
        })
        .collect();
    let mut got: Vec<Vec<Option<Got>>> = keys
        .iter()
        .map(|ks| ks.iter().map(|_| None).collect())
        .collect();
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
                let (pool, l2, c, k, i) = (pool.clone(), l2.clone(), c.clone(), *k, next);
                let len = f.group.object_bytes;
                reads
                    .spawn(async move { (i, r, read_object(&*pool, &l2, &c, k, len, wait).await) });
            }
            next += 1;
            in_flight += 1;
        }
        let Some(done) = reads.join_next().await else {
            break;
        };
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
        if matches!(g, Got::Missing | Got::Failed(_)) {
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
        .take_while(|row| {
            row.iter()
                .all(|g| matches!(g, Some(Got::Placed(_) | Got::Present)))
        })
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
    let (keep, mut drop) = (placed(&got[..hits]), placed(&got[hits..]));
    drop.extend(got.iter().flatten().filter_map(|g| match g {
        Some(Got::Failed(o)) => Some(*o),
        _ => None,
    }));
    // Relaxed: a counter.
    l2.counters
        .loaded
        .fetch_add(keep.len() as u64, Ordering::Relaxed);
    (hits as u32, keep, drop)
}

/// Reads object `k` (`len` bytes, as its fingerprint fixes) from the tier,
/// checks it, and copies it into a new `Writing` object of the pool.
///
/// A value whose length is not that of such a value is refused before it
/// is read ([`Conn::get_sized`]), so it costs this server no memory.
async fn read_object(
    pool: &dyn PoolView,
    l2: &L2,
    c: &Conn,
    k: ObjectKey,
    len: u64,
    wait: Duration,
) -> Got {
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
    let (obj, off) = match pool.place(k, len) {
        Placement::Room { obj, off } => (obj, off),
        Placement::Present => return Got::Present,
        Placement::NoRoom => return Got::Missing,
    };
    // SAFETY: the room `place` just gave this read alone, a `Writing`
    // object (no reader sees it, nothing else writes it) until the fetch
    // reports it; `len` bytes, the object's size (which `open` checked the
    // value's object has).
    let dst = unsafe { pool.bytes_mut(off, opened.len() as u64) };
    // Copied from the reply into the pool, its seal checked on the way (no
    // buffer of its own, one pass over the reply).
    match opened.copy_into(dst) {
        Ok(()) => Got::Placed(obj),
        Err(e) => {
            corrupt(e);
            Got::Failed(obj)
        }
    }
}
