//! The KV operations as the ring loop serves them: every request payload is
//! validated (lengths, counts, block ids, instance ownership) before anything
//! is allocated; LOOKUP runs inline (a short index scan); STORE and RETRIEVE
//! become jobs whose chunk copies run on the copy workers.

use super::cache::Level;
use super::cache::{Cache, LeaseError, LeaseMeta, ObjectKey};
use super::disk::{tier::DiskTier, DiskStore};
use super::events::{EventQueue, Record};
use super::l2::value::Seal;
use super::pool::PoolMemory;
use super::registry::{Registration, Registry};
use super::tier::link::{Inbox, TierLink, Tiers};
use super::tier::{Fetch, TierStart, WriteMode};
use super::transfer::{BackendKind, Copier, Dir, EngineEvent, JobRun, JobWord, Task};
use super::Shared;
use kvring::jobs::{JobId, JobKind, JobResult, NewJob};
use kvring::kv::{ChunkHash, LayerGroups};
use kvring::liveness::monotonic_ns;
use kvring::proto::kv::{
    split_header, u32s, ClearReply, ConfigFlags, ConfigReply, DescribeRequest, EndSessionRequest,
    FreeLocksRequest, LookupRequest, RetrieveRequest, StatsReply, StoreRequest,
};
use kvring::proto::Status;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// The cache server's KV state.
pub struct KvState {
    /// Why this backend (e.g. why CUDA is not used), for the start-up line.
    pub backend_note: String,
    pub chunk_tokens: u32,
    pub lease_ttl: Duration,
    /// How long a job waits for its engine's event.
    pub engine_event_timeout: Duration,
    pub max_request_bytes: u32,
    pub copy_threads: u32,
    pub registry: Mutex<Registry>,
    /// Registered instances, kept by `change_registry` so publishing the
    /// counters never takes the registry's lock.
    instances: AtomicU64,
    cache: Mutex<Cache>,
    /// Declared (so dropped) before `pool`: a backend may hold registrations
    /// of the pool's memory (the CUDA backend pins it), which must end while
    /// it is still mapped.
    pub copier: Copier,
    pub pool: PoolMemory,
    /// The lookups-by-model rows (written under the cache's lock).
    pub model_rows: Mutex<super::model_rows::ModelRows>,
    /// The tiers below the pool, if any: their states and their owner's
    /// inbox.
    pub tiers: Option<Tiers>,
    /// The tiers and their owner's inbox, until the server starts them.
    pub(super) tier_start: Mutex<Option<(Vec<TierStart>, Inbox)>>,
    /// How long a lookup waits for a chunk being written.
    pub inflight_wait: Duration,
    /// Lookups waiting for a chunk being written (taken after the cache's
    /// lock, never before it).
    parked: Mutex<Vec<Parked>>,
    /// Where the counters are published for observers: set once the
    /// segment exists, before any thread of the server starts.
    board: OnceLock<super::board::Board>,
    /// The event stream's queue, if the server publishes events.
    pub events: Option<Arc<EventQueue>>,
}

/// A lookup that stopped at a chunk being written: answered once that
/// chunk is readable or dropped, or at `deadline`.
struct Parked {
    f: Box<Fetch>,
    /// The chunk it waits for.
    at: usize,
    deadline: Instant,
}

/// What serving a request produced: a status and a reply payload.
pub type Outcome = Result<Vec<u8>, Status>;

impl KvState {
    /// Bytes of the pool ready for copies (pinned, for the CUDA backend).
    pub fn pool_ready_bytes(&self) -> u64 {
        self.copier
            .backend
            .pool_ready_bytes()
            .unwrap_or(self.pool.len())
    }

    /// The cache service over a new pool (made before the segment, so that
    /// a pool that cannot be had fails the start before anything is
    /// published; [`Self::attach_board`] then names where to publish).
    pub fn new(server: &super::ServerConfig, max_clients: u32) -> crate::Result<KvState> {
        use super::BackendChoice;
        let (cfg, copy) = (&server.cache, &server.copy);
        let pool = PoolMemory::new(cfg.pool_bytes, cfg.prefault).map_err(kvring::error::io(
            format!("allocate a pool of {} bytes", cfg.pool_bytes),
        ))?;
        let (backend, backend_note, segment): (Box<dyn super::transfer::Backend>, String, u64) =
            match copy.backend {
                BackendChoice::Host => (
                    Box::new(super::HostBackend),
                    "host (chosen)".into(),
                    u64::MAX,
                ),
                choice => {
                    match super::transfer::open_cuda(
                        &pool,
                        copy.cuda_zero_copy_ctas,
                        copy.cuda_depth,
                    ) {
                        Ok(b) => b,
                        Err(e) if choice == BackendChoice::Auto => (
                            Box::new(super::HostBackend),
                            format!("host (CUDA not used: {e})"),
                            u64::MAX,
                        ),
                        Err(e) => return Err(crate::Error::Cuda(format!("--backend cuda: {e}"))),
                    }
                }
            };
        let devices = if backend.kind() == BackendKind::Cuda {
            if copy.simulated_devices > 0 {
                return Err(crate::Error::Config(
                    "--simulated-devices is for the host backend (this server copies with CUDA)"
                        .into(),
                ));
            }
            let uuids = backend.device_uuids();
            if uuids.len() > kvring::shm::MAX_DEVICES {
                return Err(crate::Error::Config(format!(
                    "{} CUDA devices: a server copies with at most {} (CUDA_VISIBLE_DEVICES picks them)",
                    uuids.len(),
                    kvring::shm::MAX_DEVICES
                )));
            }
            uuids
        } else {
            (0..copy.simulated_devices)
                .map(|i| super::simulated_device_uuid(i).to_bytes())
                .collect()
        };
        // The tiers below the pool, in lookup order: the disk, then the
        // remote tier.
        let mut links = Vec::new();
        let mut starts = Vec::new();
        if let Some(d) = &server.disk {
            let store = DiskStore::open(&d.dir, d.bytes, d.segment_bytes, Seal::Checksum).map_err(
                kvring::error::io(format!("the disk tier in {}", d.dir.display())),
            )?;
            let disk = Arc::new(DiskTier::new(store, &d.dir, d.bytes));
            links.push(TierLink::new(disk.clone(), d.mode, Level::Disk));
            starts.push(TierStart::Disk(disk));
        }
        if let Some(c) = server.tier.clone() {
            let mode = c.mode;
            let l2 = Arc::new(super::l2::L2::new(c));
            links.push(TierLink::new(l2.clone(), mode, Level::Remote));
            starts.push(TierStart::Remote(l2));
        }
        let (tiers, tier_start) = if links.is_empty() {
            (None, None)
        } else {
            let (tiers, inbox) = Tiers::new(links);
            (Some(tiers), Some((starts, inbox)))
        };
        let kv = KvState {
            board: OnceLock::new(),
            backend_note,
            chunk_tokens: cfg.chunk_tokens,
            lease_ttl: cfg.lease_ttl,
            engine_event_timeout: copy.engine_event_timeout,
            max_request_bytes: cfg.max_request_bytes,
            copy_threads: copy
                .copy_threads
                .unwrap_or(if backend.kind() == BackendKind::Cuda {
                    4
                } else {
                    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
                    (cores / 2).clamp(1, 8)
                }),
            registry: Mutex::new(Registry::default()),
            instances: AtomicU64::new(0),
            cache: Mutex::new(Cache::new(
                pool.len(),
                cfg.high_watermark,
                cfg.low_watermark,
                segment,
            )),
            pool,
            copier: Copier::new(max_clients, backend, &devices),
            model_rows: Mutex::new(super::model_rows::ModelRows::default()),
            tiers,
            tier_start: Mutex::new(tier_start),
            inflight_wait: cfg.inflight_wait,
            parked: Mutex::new(Vec::new()),
            events: server
                .events
                .as_ref()
                .map(|e| Arc::new(EventQueue::new(e.queue, cfg.chunk_tokens))),
        };
        if let Some(q) = &kv.events {
            kv.cache().set_events(q.clone());
        }
        {
            // The cache's bytes bound (half its pool) unless one is given.
            let mut cache = kv.cache();
            let mut limits = cache.pin_limits().0;
            limits.max_pins = cfg.max_pins;
            limits.max_bytes = cfg.max_pinned_bytes.unwrap_or(limits.max_bytes);
            cache.set_pin_limits(limits);
        }
        if let Some(t) = &kv.tiers {
            // At most a quarter of the pool waits to be written at once.
            let budget = kv.pool.len() / 4;
            kv.cache().set_tier_modes(
                t.in_mode(WriteMode::Back),
                t.in_mode(WriteMode::Through),
                budget,
            );
        }
        Ok(kv)
    }

    fn parked(&self) -> MutexGuard<'_, Vec<Parked>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn cache(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the registry with `f` on behalf of client `slot`, then
    /// publishes the instance counts (the client's, and the total in the
    /// cache counters) before the caller answers the client, so a client
    /// that sees its registration done sees them too.
    pub fn change_registry<T>(&self, slot: u32, f: impl FnOnce(&mut Registry) -> T) -> T {
        let mut reg = self.registry();
        let r = f(&mut reg);
        // Observers only: Relaxed (here and for the total, which the cache
        // counters carry).
        if let Some(b) = self.board.get() {
            b.set_instances(slot, reg.count_of(slot) as u32);
        }
        self.instances.store(reg.len() as u64, Ordering::Relaxed);
        drop(reg);
        self.with_cache(|_| ());
        r
    }

    /// Runs `f` on the cache, then publishes its counters in the header.
    pub fn with_cache<T>(&self, f: impl FnOnce(&mut Cache) -> T) -> T {
        let mut c = self.cache();
        let r = f(&mut c);
        if let Some(t) = self.tiers.as_ref().filter(|_| c.tier_work()) {
            t.kick();
        }
        let mut stats = c.stats;
        let pending = c.tier_pending();
        drop(c);
        self.fill(&mut stats, pending);
        self.publish_read(&stats);
        r
    }

    /// The counters kept outside the cache (`pending`: objects the cache
    /// holds for each tier, not yet handed to it, counted in its queue).
    pub(super) fn fill(&self, stats: &mut StatsReply, pending: [u64; Level::ALL.len()]) {
        stats.instances = self.instances.load(Ordering::Relaxed);
        if let Some(q) = &self.events {
            // Relaxed (all): counters.
            stats.events_published = q.published.load(Ordering::Relaxed);
            stats.events_dropped = q.dropped.load(Ordering::Relaxed);
            stats.events_resyncs = q.resyncs.load(Ordering::Relaxed);
        }
        for t in self.tiers.iter().flat_map(Tiers::all) {
            t.tier.fill(stats);
            let (queue, dropped) = super::tier::queue_and_dropped(t.level, stats);
            // Relaxed (both): counters.
            *queue = t.in_flight.load(Ordering::Relaxed) + pending[t.level as usize];
            // Relaxed: a counter.
            *dropped += t.refused.load(Ordering::Relaxed);
        }
    }

    /// Publishes on `board` from now on.
    pub(super) fn attach_board(&self, board: super::board::Board) {
        if self.board.set(board).is_err() {
            unreachable!("the board is attached once, at the start");
        }
    }

    /// Publishes the cache's counters now (for those that change off the
    /// cache's lock: the tier's).
    pub fn publish(&self) {
        self.publish_read(&self.stats());
    }

    /// Publishes `stats`, the counters of a cache just read.
    pub(super) fn publish_read(&self, stats: &StatsReply) {
        if let Some(b) = self.board.get() {
            b.publish(stats);
        }
    }

    /// The cache's counters now.
    pub fn stats(&self) -> StatsReply {
        let c = self.cache();
        let (mut s, pending) = (c.stats, c.tier_pending());
        drop(c);
        self.fill(&mut s, pending);
        s
    }
}

fn hashes(bytes: &[u8]) -> impl Iterator<Item = ChunkHash> + '_ {
    bytes
        .chunks_exact(16)
        .map(|c| c.try_into().expect("16 bytes"))
}

/// The requesting client.
#[derive(Clone, Copy)]
pub struct Caller {
    pub slot: u32,
    pub session: u32,
    /// The engine the client belongs to.
    pub engine: [u8; 32],
    pub user_data: u64,
}

fn new_job(shared: &Shared, kind: JobKind, who: Caller) -> Result<JobId, Status> {
    let h = shared.seg.mapping.header();
    let r = shared.jobs.submit(NewJob {
        kind,
        owner_slot: who.slot,
        owner_session: who.session,
        user_data: who.user_data,
        now_ns: monotonic_ns(),
    });
    // Counters for observers only: Relaxed.
    match r {
        Ok(id) => {
            h.jobs_submitted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(id)
        }
        Err(e) => {
            h.jobs_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(e.into())
        }
    }
}

fn id_reply(id: JobId) -> Outcome {
    Ok(bytemuck::bytes_of(&id).to_vec())
}

/// LOOKUP: inline (a scan of the index), unless a second tier may have
/// what the pool misses: then the job stays running until the tier has
/// answered ([`end_lookup`]).
pub fn lookup(shared: &Shared, who: Caller, req: &[u8]) -> Outcome {
    let (h, rest) = split_header::<LookupRequest>(req).ok_or(Status::BadLength)?;
    if rest.len() as u64 != u64::from(h.n_chunks) * 16 {
        return Err(Status::BadLength);
    }
    if h.world_size == 0 || h.world_size > super::registry::MAX_WORLD_SIZE {
        return Err(Status::InvalidArgument);
    }
    let id = new_job(shared, JobKind::Lookup, who)?;
    let group = shared.kv.registry().group(h.model_id, h.world_size);
    let Some(g) = group else {
        // No rank of this model is registered: nothing can be retrieved.
        finish_lookup(shared, id, who.slot, 0, h.n_chunks);
        return id_reply(id);
    };
    let f = Fetch {
        id,
        owner: who.slot,
        meta: LeaseMeta {
            engine: who.engine,
            model_id: h.model_id,
            world_size: h.world_size,
            salt: h.salt,
            fingerprint: g.fingerprint,
        },
        group: g,
        hashes: hashes(rest).collect(),
        l1: 0,
        at: Level::ALL[0],
        found: [0; Level::ALL.len()],
    };
    resolve(
        shared,
        Box::new(f),
        Instant::now() + shared.kv.inflight_wait,
    );
    id_reply(id)
}

/// Answers lookup `f` from the pool, or goes on to the second tier when it
/// may have what the pool misses; but if the first chunk the pool misses is
/// being written (another request's store of the same prefix, or a read
/// from the second tier, under way), the lookup waits for it, until
/// `deadline`: its job stays `Running` meanwhile, the engine goes on with
/// other requests, and the chunk is a hit rather than computed twice.
fn resolve(shared: &Shared, f: Box<Fetch>, deadline: Instant) {
    let id = f.id;
    let mut waiting = Some(f);
    let l1 = shared.kv.with_cache(|c| {
        let f = waiting.as_ref().expect("set above");
        let l1 = c.ready_prefix(&f.meta, f.group, &f.hashes).len();
        if l1 < f.hashes.len()
            && Instant::now() < deadline
            && c.in_flight(&f.meta, f.group, f.hashes[l1])
        {
            // Under the cache's lock, so the chunk cannot settle before the
            // lookup is parked: its writer wakes it (`wake_lookups`).
            let f = waiting.take().expect("set above");
            shared.kv.parked().push(Parked {
                f,
                at: l1,
                deadline,
            });
        }
        l1 as u32
    });
    let Some(f) = waiting else {
        let _ = shared.jobs.start(id, monotonic_ns());
        return;
    };
    if let Some(t) = shared.kv.tiers.as_ref().filter(|t| t.any_up()) {
        if (l1 as usize) < f.hashes.len() {
            let _ = shared.jobs.start(id, monotonic_ns());
            // The owner hands it down the tiers (or answers from the pool).
            if let Err(f) = t.fetch(Box::new(Fetch { l1, ..*f })) {
                end_lookup(shared, &f);
            }
            return;
        }
    }
    end_lookup(shared, &f);
}

/// Resumes the lookups waiting for chunks that are now readable or were
/// dropped, and those whose wait is over. Called after every change that
/// ends a `Writing` object (a store's end, the second tier's reads) and
/// at each housekeeping tick (deadlines).
pub(super) fn wake_lookups(shared: &Shared) {
    // Nothing parked: no cache lock. A lookup parks under the cache's lock
    // before the chunk it waits for can settle, so a writer that settles
    // it afterwards sees it here.
    if shared.kv.parked().is_empty() {
        return;
    }
    let now = Instant::now();
    let due: Vec<Parked> = shared.kv.with_cache(|c| {
        let mut parked = shared.kv.parked();
        let (due, wait) = std::mem::take(&mut *parked).into_iter().partition(|p| {
            now >= p.deadline || !c.in_flight(&p.f.meta, p.f.group, p.f.hashes[p.at])
        });
        *parked = wait;
        due
    });
    for p in due {
        resolve(shared, p.f, p.deadline);
    }
}

/// Ends lookup `f` (inline, or once the tiers brought `f.found` chunks
/// past the pool's `f.l1` into the pool): takes its lease on the longest
/// prefix stored for every rank, counts it, and finishes its job.
pub(super) fn end_lookup(shared: &Shared, f: &Fetch) {
    let n = f.hashes.len() as u32;
    let hits = shared.kv.with_cache(|c| {
        let hits = c.lookup(
            f.id,
            f.owner,
            f.meta,
            f.group,
            &f.hashes,
            shared.kv.lease_ttl,
            Instant::now(),
        );
        // The hits past the pool's, by the tier that brought them (in
        // lookup order: the disk's chunks come first).
        let mut past = hits.saturating_sub(f.l1);
        for level in Level::ALL {
            let n = past.min(f.found[level as usize]);
            past -= n;
            *match level {
                Level::Disk => &mut c.stats.lookup_disk_hit_chunks,
                Level::Remote => &mut c.stats.lookup_l2_hit_chunks,
            } += u64::from(n);
        }
        // Under the cache's lock: one writer of the rows at a time.
        shared
            .kv
            .model_rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(
                shared.seg.mapping.models(),
                (f.meta.model_id, f.meta.salt),
                u64::from(n),
                u64::from(hits),
                u64::from(shared.kv.chunk_tokens),
            );
        hits
    });
    if !finish_lookup(shared, f.id, f.owner, hits, n) && hits > 0 {
        // The job was reclaimed while the lookup waited (its client went):
        // nobody will use or free the lease.
        let _ = shared
            .kv
            .with_cache(|c| c.end_session(f.id, &f.meta.engine));
    }
}

/// Finishes a lookup's job; false if it was no longer running.
fn finish_lookup(shared: &Shared, id: JobId, owner: u32, hits: u32, n: u32) -> bool {
    let result = JobResult {
        value: u64::from(hits),
        aux: u64::from(n),
    };
    let ended = shared.jobs.finish(id, result, monotonic_ns()).is_ok();
    if ended {
        shared.job_ended(owner, id, true);
    }
    ended
}

/// The request's engine event, if it names one the backend can wait for.
fn request_event(kv: &KvState, flags: u32, event: [u8; 64]) -> Result<Option<[u8; 64]>, Status> {
    use kvring::proto::kv::KvFlags;
    let Some(flags) = KvFlags::from_bits(flags) else {
        return Err(Status::InvalidArgument);
    };
    // Host memory has no device stream to order against.
    if !flags.is_empty() && kv.copier.backend.kind() != BackendKind::Cuda {
        return Err(Status::InvalidArgument);
    }
    Ok(flags.contains(KvFlags::EVENT).then_some(event))
}

/// An instance, the engine event to wait for, and the job's word.
type CallerInstance = (Arc<Registration>, Option<[u8; 64]>, JobWord);

/// The caller's instance `id`, with the request's engine event and the
/// job's entry in the caller's job words.
fn caller_instance(
    shared: &Shared,
    who: Caller,
    id: u32,
    flags: u32,
    event: [u8; 64],
    (entry, generation): (u32, u32),
) -> Result<CallerInstance, Status> {
    let kv = &shared.kv;
    let event = request_event(kv, flags, event)?;
    if entry >= kvring::job_words::JOB_WORDS {
        return Err(Status::InvalidArgument);
    }
    let inst = kv
        .registry()
        .get(who.slot, who.session, id)
        .ok_or(Status::UnknownInstance)?;
    // The session's memory: present while its requests are served.
    let memory = shared
        .sessions
        .memory_of(who.slot)
        .ok_or(Status::InvalidArgument)?;
    Ok((
        inst,
        event,
        JobWord {
            memory,
            entry,
            generation,
        },
    ))
}

/// Checks block ids against the instance's cache; splits them per chunk.
fn blocks_per_chunk(
    bytes: &[u8],
    n_chunks: u32,
    bpc: u32,
    num_blocks: u32,
) -> Result<Vec<Vec<u32>>, Status> {
    // Each chunk `bpc` blocks, the last one 1 to `bpc` (a prompt's tail:
    // its object's other rows are zeros, `transfer::worker::settle`).
    let ids_len = bytes.len() as u64 / 4;
    let full = u64::from(n_chunks.saturating_sub(1)) * u64::from(bpc);
    let fits = if n_chunks == 0 {
        ids_len == 0
    } else {
        ids_len > full && ids_len <= full + u64::from(bpc)
    };
    if bytes.len() % 4 != 0 || !fits {
        return Err(Status::BadLength);
    }
    let ids: Vec<u32> = u32s(bytes).collect();
    if ids.iter().any(|&b| b >= num_blocks) {
        return Err(Status::InvalidArgument);
    }
    Ok(ids.chunks(bpc as usize).map(<[u32]>::to_vec).collect())
}

/// STORE: plans the objects, then queues one copy task per new chunk.
pub fn store(shared: &Shared, who: Caller, req: &[u8]) -> Outcome {
    let kv = &shared.kv;
    let (h, rest) = split_header::<StoreRequest>(req).ok_or(Status::BadLength)?;
    let word = (h.word, h.generation);
    let (inst, event, word) = caller_instance(shared, who, h.instance, h.flags, h.event, word)?;
    let n = h.n_chunks;
    let hash_bytes = (n as usize)
        .checked_mul(16)
        .filter(|&b| b <= rest.len())
        .ok_or(Status::BadLength)?;
    let (hash_part, block_part) = rest.split_at(hash_bytes);
    let bpc = inst.layout.blocks_per_chunk(kv.chunk_tokens);
    let blocks = blocks_per_chunk(block_part, n, bpc, inst.layout.geometry().blocks)?;
    let id = new_job(shared, JobKind::Store, who)?;
    let tag = inst.rank_tag();
    let keys: Vec<ObjectKey> = hashes(hash_part)
        .map(|hash| ObjectKey {
            model_id: inst.model_id,
            salt: h.salt,
            fingerprint: inst.fingerprint,
            rank_tag: tag,
            hash,
        })
        .collect();
    let len = inst.layout.object_bytes(kv.chunk_tokens);
    let plan = kv.with_cache(|c| c.plan_store(&keys, len));
    let value = u64::from(plan.present) + plan.write.len() as u64;
    let aux = u64::from(plan.no_space);
    if plan.write.is_empty() {
        // Nothing to copy: streams waiting for the job go on at once
        // (before the job ends: see `worker::finish`).
        word.release();
        let ended = shared
            .jobs
            .finish(id, JobResult { value, aux }, monotonic_ns())
            .is_ok();
        if ended {
            shared.job_ended(who.slot, id, true);
        }
        return id_reply(id);
    }
    let objs = plan.write.iter().map(|p| p.obj).collect();
    let layers = inst.layout.geometry().layers;
    let job = JobRun::new(
        id,
        who.slot,
        Dir::ToPool,
        inst,
        objs,
        value,
        aux,
        (plan.write.len() as u32, 1),
        event.map(|h| EngineEvent::new(h, kv.engine_event_timeout)),
        word,
    );
    let tasks = plan
        .write
        .iter()
        .map(|p| Task {
            job: job.clone(),
            pool_off: p.off,
            blocks: blocks[p.chunk as usize].clone(),
            skip_blocks: 0,
            layers: 0..layers,
            group: 0,
        })
        .collect();
    kv.copier
        .submit(shared.seg.mapping.lanes(), who.slot, tasks);
    id_reply(id)
}

/// RETRIEVE: takes the rank's holds from the lease (all or nothing), then
/// queues one copy task per chunk.
pub fn retrieve(shared: &Shared, who: Caller, req: &[u8]) -> Outcome {
    let kv = &shared.kv;
    let (h, rest) = split_header::<RetrieveRequest>(req).ok_or(Status::BadLength)?;
    let word = (h.word, h.generation);
    let (inst, event, word) = caller_instance(shared, who, h.instance, h.flags, h.event, word)?;
    let bpc = inst.layout.blocks_per_chunk(kv.chunk_tokens);
    let blocks = blocks_per_chunk(rest, h.n_chunks, bpc, inst.layout.geometry().blocks)?;
    let bt = inst.layout.geometry().block_tokens;
    let named = blocks.iter().map(Vec::len).sum::<usize>() as u64;
    if h.skip_tokens % bt != 0 || u64::from(h.skip_tokens / bt) > named {
        return Err(Status::InvalidArgument);
    }
    // Every destination block once: concurrent chunk copies never write the
    // same engine memory. The skipped blocks are written by no copy, so
    // they may repeat (an engine's null block, say).
    let mut sorted: Vec<u32> = blocks
        .iter()
        .flatten()
        .skip((h.skip_tokens / bt) as usize)
        .copied()
        .collect();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(Status::InvalidArgument);
    }
    if h.n_chunks == 0 {
        return Err(Status::InvalidArgument);
    }
    let groups = LayerGroups::new(inst.layout.geometry().layers, h.layer_groups.max(1))
        .ok_or(Status::InvalidArgument)?;
    let rank = inst.rank;
    let check = |m: &LeaseMeta| {
        m.model_id == inst.model_id
            && m.world_size == inst.world_size
            && m.fingerprint == inst.fingerprint
    };
    let held = kv.with_cache(|c| {
        c.take_for_retrieve(h.lease, &who.engine, check, rank, h.first_chunk, h.n_chunks)
    });
    let objs = match held {
        Ok(o) => o,
        Err(LeaseError::Mismatch) => return Err(Status::InvalidArgument),
        Err(LeaseError::Foreign) => return Err(Status::ForeignLease),
        Err(LeaseError::NoLease | LeaseError::NotHeld) => return Err(Status::NoLease),
    };
    let id = match new_job(shared, JobKind::Retrieve, who) {
        Ok(id) => id,
        Err(e) => {
            // Give the holds back to nobody: the lease no longer has them,
            // so they end here.
            let ids: Vec<u32> = objs.iter().map(|o| o.0).collect();
            kv.with_cache(|c| c.finish_retrieve(&ids, false, 0));
            return Err(e);
        }
    };
    let job = JobRun::new(
        id,
        who.slot,
        Dir::FromPool,
        inst,
        objs.iter().map(|o| o.0).collect(),
        u64::from(h.n_chunks),
        0,
        (objs.len() as u32, groups.len()),
        event.map(|h| EngineEvent::new(h, kv.engine_event_timeout)),
        word,
    );
    // Group after group, each over every chunk: the workers take tasks in
    // this order, so the first layers land first.
    let mut tasks = Vec::with_capacity(objs.len() * groups.len() as usize);
    for (k, layers) in groups.iter().enumerate() {
        let mut skip_blocks = h.skip_tokens / bt;
        for (i, &(_, off)) in objs.iter().enumerate() {
            let skip = skip_blocks.min(bpc);
            skip_blocks -= skip;
            tasks.push(Task {
                job: job.clone(),
                pool_off: off,
                blocks: blocks[i].clone(),
                skip_blocks: skip,
                layers: layers.clone(),
                group: k as u32,
            });
        }
    }
    kv.copier
        .submit(shared.seg.mapping.lanes(), who.slot, tasks);
    id_reply(id)
}

/// A lease operation's refusal as a status.
fn lease_status(e: LeaseError) -> Status {
    match e {
        LeaseError::Foreign => Status::ForeignLease,
        LeaseError::Mismatch => Status::InvalidArgument,
        LeaseError::NoLease | LeaseError::NotHeld => Status::NoLease,
    }
}

pub fn free_lookup_locks(shared: &Shared, who: Caller, req: &[u8]) -> Outcome {
    let (h, rest) = split_header::<FreeLocksRequest>(req).ok_or(Status::BadLength)?;
    if !rest.is_empty() {
        return Err(Status::BadLength);
    }
    shared
        .kv
        .with_cache(|c| c.free_locks(h.lease, &who.engine, h.first_chunk, h.n_chunks))
        .map(|()| Vec::new())
        .map_err(lease_status)
}

pub fn end_session(shared: &Shared, who: Caller, req: &[u8]) -> Outcome {
    let (h, rest) = split_header::<EndSessionRequest>(req).ok_or(Status::BadLength)?;
    if !rest.is_empty() {
        return Err(Status::BadLength);
    }
    shared
        .kv
        .with_cache(|c| c.end_session(h.lease, &who.engine))
        .map(|()| Vec::new())
        .map_err(lease_status)
}

pub fn clear(shared: &Shared, req: &[u8]) -> Outcome {
    if !req.is_empty() {
        return Err(Status::BadLength);
    }
    let (objects, bytes) = shared.kv.with_cache(|c| c.clear());
    Ok(bytemuck::bytes_of(&ClearReply { objects, bytes }).to_vec())
}

/// DESCRIBE: the token ids of chunks about to be stored, queued for the
/// event stream (which hashes them itself); ignored by a server without
/// one.
pub fn describe(shared: &Shared, req: &[u8]) -> Outcome {
    let (h, rest) = split_header::<DescribeRequest>(req).ok_or(Status::BadLength)?;
    let Some(q) = &shared.kv.events else {
        return Ok(Vec::new());
    };
    let want = (h.n_chunks as usize)
        .checked_mul(q.chunk_tokens as usize * 4)
        .ok_or(Status::BadLength)?;
    if rest.len() != want || h.n_chunks == 0 {
        return Err(Status::BadLength);
    }
    q.push(Record::Describe {
        model_id: h.model_id,
        salt: h.salt,
        prev: h.prev,
        tokens: u32s(rest).collect(),
    });
    Ok(Vec::new())
}

pub fn stats(shared: &Shared, req: &[u8]) -> Outcome {
    if !req.is_empty() {
        return Err(Status::BadLength);
    }
    Ok(bytemuck::bytes_of(&shared.kv.stats()).to_vec())
}

pub fn config(shared: &Shared, req: &[u8]) -> Outcome {
    if !req.is_empty() {
        return Err(Status::BadLength);
    }
    let kv = &shared.kv;
    Ok(bytemuck::bytes_of(&ConfigReply {
        chunk_tokens: kv.chunk_tokens,
        copy_threads: kv.copy_threads,
        pool_bytes: kv.pool.len(),
        max_request_bytes: kv.max_request_bytes,
        lease_ttl_ms: kv.lease_ttl.as_millis().min(u128::from(u32::MAX)) as u32,
        backend: kv.copier.backend.kind().raw(),
        flags: if kv.events.is_some() {
            ConfigFlags::EVENTS.bits()
        } else {
            0
        },
    })
    .to_vec())
}
