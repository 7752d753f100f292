//! Copy workers: the threads that move chunk objects between engines' KV
//! caches and the pool, so the ring loop never waits on a copy.
//!
//! A STORE or RETRIEVE job is split into one task per chunk. Tasks wait in
//! per-client queues served round robin, so one client's large job cannot
//! stall another's: every client with work gets the next free worker in
//! turn. A job ends when its last task does; the worker that finishes it
//! commits (store) or drops holds (retrieve) in the cache, then publishes the
//! job's outcome in the job table and wakes the owner.
//!
//! Tasks are queued in one **lane per device**, each with its own workers
//! (and, on the CUDA backend, each worker's streams and staging buffers on
//! that device only), plus a lane for engines with no device: a backlog on
//! one GPU never holds up another GPU's copies, even for one client that
//! drives several devices. A registration names its device by UUID (device
//! memory: the GPU it lives on; host memory: optionally the GPU its worker
//! runs on). The host backend can split its workers into simulated device
//! lanes (`--simulated-devices`), so the same scheduling is tested without
//! GPUs.
//!
//! The copy itself is the backend's ([`Backend`]): memcpy on the host.

use super::registry::Instance;
use super::stream_copy;
use super::Shared;
use crate::jobs::{FailReason, JobId, JobResult};
use crate::kv::KvLayout;
use crate::liveness::monotonic_ns;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Engine cache -> pool object (STORE).
    ToPool,
    /// Pool object -> engine cache (RETRIEVE).
    FromPool,
}

/// One chunk to copy: `blocks` of the engine's cache <-> the object at
/// `object`. Blocks before `skip_blocks` are left alone.
pub struct ChunkCopy<'a> {
    pub layout: &'a KvLayout,
    pub inst: &'a Instance,
    pub chunk_tokens: u32,
    pub blocks: &'a [u32],
    pub skip_blocks: u32,
    pub object: *mut u8,
    pub dir: Dir,
    /// A CUDA IPC event of the engine the copy must wait for.
    pub event: Option<[u8; 64]>,
    /// Publish a job event once every chunk of the job is queued.
    pub publish: Option<Publish<'a>>,
}

/// A job that publishes a job event: which client's events, how many chunks
/// are still to be queued, and how to publish the event's index + 1.
pub struct Publish<'a> {
    pub owner_slot: u32,
    pub left: &'a AtomicU32,
    pub done: &'a dyn Fn(u64),
}

/// What moves the bytes: it gives each copy worker its own engine, and
/// opens engines' device memory at registration.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// `ConfigReply::backend`: 1 host, 2 CUDA.
    fn code(&self) -> u32 {
        1
    }
    /// A copy engine for one worker thread (its streams, staging buffers).
    fn engine(&self) -> Result<Box<dyn Engine>, String>;
    /// The handles of client `slot`'s job events on device `uuid`.
    fn job_events(
        &self,
        _slot: u32,
        _uuid: &[u8; 16],
    ) -> Result<Vec<[u8; 64]>, crate::proto::Status> {
        Err(crate::proto::Status::InvalidArgument)
    }
    /// Client `slot` left: drop what the backend keeps for it.
    fn client_gone(&self, _slot: u32) {}
    /// The UUIDs of the devices this backend copies with (one copy lane
    /// each).
    fn device_uuids(&self) -> Vec<[u8; 16]> {
        Vec::new()
    }
    /// Opens the device memory of a registration (memory kinds other than
    /// host).
    fn open_device(
        &self,
        _slot: u32,
        _req: &crate::proto::kv::RegisterKv,
        _regions: &[crate::proto::kv::CudaRegion],
        _fds: &[std::os::fd::OwnedFd],
    ) -> Result<
        (
            Vec<super::registry::Tensor>,
            super::cuda_backend::InstanceDevice,
        ),
        super::registry::Refusal,
    > {
        Err((
            crate::proto::Status::InvalidArgument,
            format!(
                "device memory needs the CUDA backend; this server copies with the {} backend (kvring serve --backend cuda)",
                self.name()
            ),
        ))
    }
}

/// One worker's copy engine. A copy may finish after `submit` returns (on
/// a GPU stream); finished copies are collected with `poll`, which never
/// runs a callback: the worker polls, so no lock is ever taken on a
/// driver's thread.
pub trait Engine {
    /// Most copies this engine keeps in flight.
    fn depth(&self) -> usize;
    /// Starts copying one chunk; `token` comes back from `poll`. The
    /// instance and the pool object stay valid until then (the worker holds
    /// the task).
    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), String>;
    /// Appends finished copies (token, bytes moved or why not) to `out`;
    /// with `wait`, returns only once at least one finished (or none is in
    /// flight).
    fn poll(&mut self, wait: bool, out: &mut Vec<(usize, Result<u64, String>)>);
}

/// The host backend: slab-by-slab copies between mapped engine memory and
/// the pool, done in `submit`.
pub struct HostBackend;

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn engine(&self) -> Result<Box<dyn Engine>, String> {
        Ok(Box::new(HostEngine { done: Vec::new() }))
    }
}

struct HostEngine {
    done: Vec<(usize, Result<u64, String>)>,
}

impl Engine for HostEngine {
    fn depth(&self) -> usize {
        1
    }

    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), String> {
        let r = host_copy(c);
        self.done.push((token, r));
        Ok(())
    }

    fn poll(&mut self, _wait: bool, out: &mut Vec<(usize, Result<u64, String>)>) {
        out.append(&mut self.done);
    }
}

/// The host copy of one chunk (slab pieces, four at a time, streaming).
pub(super) fn host_copy(c: &ChunkCopy<'_>) -> Result<u64, String> {
    let l = c.layout;
    let slab = l.slab_bytes() as usize;
    let mut pieces = Vec::with_capacity((l.parts() * l.num_layers) as usize * c.blocks.len());
    for part in 0..l.parts() {
        for layer in 0..l.num_layers {
            for (j, &block) in c.blocks.iter().enumerate().skip(c.skip_blocks as usize) {
                let (t, off) = l.slab_at(layer, part, block);
                let tensor = c.inst.tensors[t as usize]
                    .host()
                    .ok_or("host copy of device memory")?;
                let obj_off = l.object_offset(c.chunk_tokens, layer, part, j as u32);
                debug_assert!(off + slab as u64 <= tensor.bytes());
                // SAFETY: `block < num_blocks` was checked when the job
                // was accepted, so the slab lies inside the tensor's
                // mapping (`slab_at` tiles the tensor exactly); the
                // object range lies inside the pool range the cache
                // allocated for `object_bytes`. Only addresses here.
                let (eng, obj) = unsafe {
                    (
                        tensor.ptr().add(off as usize),
                        c.object.add(obj_off as usize),
                    )
                };
                pieces.push(match c.dir {
                    Dir::ToPool => (obj, eng as *const u8),
                    Dir::FromPool => (eng, obj as *const u8),
                });
            }
        }
    }
    // SAFETY: every piece is a slab inside a live mapping (above); the
    // destinations are distinct slabs of one object (store) or distinct
    // blocks of the engine's cache (retrieve: block ids are distinct,
    // checked at acceptance), so no two overlap, and a
    // pool object never overlaps engine memory. The engine's memory may
    // change under the copy (its bytes are the engine's business) but
    // cannot shrink (sealed), so no access faults. Raw pointers only: no
    // reference to shared memory is formed.
    unsafe { stream_copy::copy_pieces(&pieces, slab) };
    // The streaming stores land before the job's completion is published
    // (a Release store after this returns).
    stream_copy::fence();
    Ok((pieces.len() * slab) as u64)
}

/// A STORE or RETRIEVE job in flight.
pub struct JobRun {
    pub id: JobId,
    pub owner: u32,
    pub dir: Dir,
    pub inst: Arc<Instance>,
    /// Objects written (store) or held (retrieve).
    pub objs: Vec<u32>,
    /// The job's result words (store: present chunks and no-space chunks;
    /// retrieve: chunk count; bytes are added as the copies finish).
    pub value: u64,
    pub aux: u64,
    /// The engine's CUDA IPC event every chunk copy waits for.
    pub event: Option<[u8; 64]>,
    /// Chunks still to be queued before the job event is published (None:
    /// no job event asked for).
    pub publish_left: Option<AtomicU32>,
    remaining: AtomicU32,
    started: AtomicBool,
    failed: AtomicBool,
    bytes: AtomicU64,
}

impl JobRun {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        owner: u32,
        dir: Dir,
        inst: Arc<Instance>,
        objs: Vec<u32>,
        value: u64,
        aux: u64,
        tasks: u32,
        event: Option<[u8; 64]>,
        publish: bool,
    ) -> Arc<JobRun> {
        Arc::new(JobRun {
            publish_left: publish.then(|| AtomicU32::new(tasks)),
            id,
            owner,
            dir,
            inst,
            objs,
            value,
            aux,
            event,
            remaining: AtomicU32::new(tasks),
            started: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
        })
    }
}

/// One chunk of a job.
pub struct Task {
    pub job: Arc<JobRun>,
    /// Pool offset of the object.
    pub pool_off: u64,
    pub blocks: Vec<u32>,
    pub skip_blocks: u32,
}

#[derive(Default)]
struct Queues {
    per_client: Vec<VecDeque<Task>>,
    /// Clients with queued tasks, in service order.
    turn: VecDeque<u32>,
    stop: bool,
}

/// The queue of one device's workers.
struct Lane {
    /// The device ([0; 16]: engines with no device).
    uuid: [u8; 16],
    q: Mutex<Queues>,
    cv: Condvar,
}

/// The workers' queues, one lane per device.
pub struct Copier {
    lanes: Vec<Lane>,
    pub backend: Box<dyn Backend>,
}

impl Copier {
    /// A copier with a lane for engines with no device and one per entry
    /// of `devices`.
    pub fn new(max_clients: u32, backend: Box<dyn Backend>, devices: &[[u8; 16]]) -> Copier {
        let lane = |uuid| Lane {
            uuid,
            q: Mutex::new(Queues {
                per_client: (0..max_clients).map(|_| VecDeque::new()).collect(),
                ..Default::default()
            }),
            cv: Condvar::new(),
        };
        Copier {
            lanes: std::iter::once([0; 16])
                .chain(devices.iter().copied())
                .map(lane)
                .collect(),
            backend,
        }
    }

    /// How many lanes (each gets its own workers).
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// The lane of device `uuid` (lane 0 for no device or one this server
    /// does not copy with).
    pub fn lane_of(&self, uuid: &[u8; 16]) -> usize {
        if *uuid == [0; 16] {
            return 0;
        }
        self.lanes.iter().position(|l| l.uuid == *uuid).unwrap_or(0)
    }

    /// Queues a job's tasks (all of one client and one instance).
    pub fn submit(&self, client: u32, tasks: Vec<Task>) {
        let Some(first) = tasks.first() else {
            return;
        };
        let lane = &self.lanes[self.lane_of(&first.job.inst.device_uuid)];
        let mut q = lane.lock();
        let queue = &mut q.per_client[client as usize];
        let was_empty = queue.is_empty();
        let n = tasks.len();
        queue.extend(tasks);
        if was_empty {
            q.turn.push_back(client);
        }
        drop(q);
        if n == 1 {
            lane.cv.notify_one();
        } else {
            lane.cv.notify_all();
        }
    }

    /// Stops the workers of every lane; queued tasks are dropped (their
    /// jobs are failed by the shutdown that follows).
    pub fn stop(&self) {
        for lane in &self.lanes {
            lane.lock().stop = true;
            lane.cv.notify_all();
        }
    }
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Next task, round robin over clients; `None` once stopped.
    fn next(&self) -> Option<Task> {
        let mut q = self.lock();
        loop {
            if q.stop {
                return None;
            }
            if let Some(c) = q.turn.pop_front() {
                let queue = &mut q.per_client[c as usize];
                let t = queue.pop_front();
                if !queue.is_empty() {
                    q.turn.push_back(c);
                }
                if let Some(t) = t {
                    return Some(t);
                }
                continue;
            }
            // Idle: sleep until work or stop (the timeout only bounds how
            // long a missed notification could delay shutdown).
            q = self
                .cv
                .wait_timeout(q, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The next task if one is queued now.
    fn try_next(&self) -> Option<Task> {
        let mut q = self.lock();
        if q.stop {
            return None;
        }
        while let Some(c) = q.turn.pop_front() {
            let queue = &mut q.per_client[c as usize];
            let t = queue.pop_front();
            if !queue.is_empty() {
                q.turn.push_back(c);
            }
            if t.is_some() {
                return t;
            }
        }
        None
    }
}

/// Accounts one finished (or skipped) chunk of `job`; the last one ends it.
fn chunk_done(shared: &Shared, job: &JobRun, r: Result<u64, String>) {
    // `failed` and `bytes` are Relaxed: the AcqRel decrement of `remaining`
    // below orders every chunk's updates before the last one's `finish`.
    match r {
        Ok(b) => {
            job.bytes.fetch_add(b, Ordering::Relaxed);
        }
        Err(e) => {
            if !e.is_empty() {
                eprintln!("kvring: copy for {} failed: {e}", job.id);
            }
            job.failed.store(true, Ordering::Relaxed);
        }
    }
    if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        finish(shared, job);
    }
}

/// A copy worker of lane `lane`: keeps its engine's pipeline full with
/// tasks taken round robin, and settles each chunk as its copy finishes.
pub(super) fn run(shared: &Shared, lane: usize) {
    let copier = &shared.kv.copier;
    let queue = &copier.lanes[lane];
    let chunk_tokens = shared.kv.chunk_tokens;
    let mut engine = match copier.backend.engine() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvring: a copy worker could not start its engine: {e}");
            return;
        }
    };
    let depth = engine.depth().max(1);
    let mut inflight: Vec<Option<Task>> = (0..depth).map(|_| None).collect();
    let mut busy = 0usize;
    let mut done = Vec::new();
    loop {
        engine.poll(false, &mut done);
        for (token, r) in done.drain(..) {
            if let Some(t) = inflight.get_mut(token).and_then(Option::take) {
                busy -= 1;
                chunk_done(shared, &t.job, r);
            }
        }
        if busy < depth {
            let task = if busy == 0 {
                match queue.next() {
                    Some(t) => Some(t),
                    None => break,
                }
            } else {
                queue.try_next()
            };
            if let Some(task) = task {
                let job = task.job.clone();
                // Relaxed: only decides which worker marks the job running;
                // the table's seqlock orders the state itself.
                if !job.started.swap(true, Ordering::Relaxed) {
                    let _ = shared.jobs.start(job.id, monotonic_ns());
                }
                // A job that ended meanwhile (its client died, the server
                // shuts down) copies nothing more: a dead engine's memory is
                // neither read into the pool nor written.
                if job.failed.load(Ordering::Relaxed) || !shared.jobs.is_live(job.id) {
                    chunk_done(shared, &job, Err(String::new()));
                    continue;
                }
                let token = inflight
                    .iter()
                    .position(Option::is_none)
                    .expect("a free slot");
                let job_id = job.id;
                let publish_progress = |v: u64| {
                    let _ = shared.jobs.progress(job_id, v);
                };
                let c = ChunkCopy {
                    publish: job.publish_left.as_ref().map(|left| Publish {
                        owner_slot: job.owner,
                        left,
                        done: &publish_progress,
                    }),
                    layout: &job.inst.layout,
                    inst: &job.inst,
                    chunk_tokens,
                    blocks: &task.blocks,
                    skip_blocks: task.skip_blocks,
                    object: shared.kv.pool.at(task.pool_off),
                    dir: job.dir,
                    event: job.event,
                };
                match engine.submit(&c, token) {
                    Ok(()) => {
                        inflight[token] = Some(task);
                        busy += 1;
                    }
                    Err(e) => chunk_done(shared, &job, Err(e)),
                }
                continue;
            }
        }
        if busy > 0 {
            engine.poll(true, &mut done);
            for (token, r) in done.drain(..) {
                if let Some(t) = inflight.get_mut(token).and_then(Option::take) {
                    busy -= 1;
                    chunk_done(shared, &t.job, r);
                }
            }
        }
    }
}

/// The last task of `job` is done: settle the cache, then publish.
fn finish(shared: &Shared, job: &JobRun) {
    // Relaxed: the caller's AcqRel decrement that reached zero happens
    // after every task's Release half, so all their updates are visible.
    let ok = !job.failed.load(Ordering::Relaxed);
    let bytes = job.bytes.load(Ordering::Relaxed);
    let now = monotonic_ns();
    // A store commits its objects before it reads Done, so a lookup issued
    // after Done finds them. A retrieve publishes first: its blocks are
    // written, and the holds stay ours until dropped below.
    let outcome = || {
        if ok {
            let r = match job.dir {
                Dir::ToPool => JobResult {
                    value: job.value,
                    aux: job.aux,
                },
                Dir::FromPool => JobResult {
                    value: job.value,
                    aux: bytes,
                },
            };
            shared.jobs.finish(job.id, r, now).map(|()| true)
        } else {
            shared
                .jobs
                .fail(job.id, FailReason::CopyFailed, now)
                .map(|()| false)
        }
    };
    // A store commits only if every chunk was copied; otherwise (a copy
    // failed, or the job ended early) its objects are dropped.
    let published = match job.dir {
        Dir::ToPool => {
            shared
                .kv
                .with_cache(shared, |c| c.finish_store(&job.objs, ok, bytes));
            outcome()
        }
        Dir::FromPool => {
            let published = outcome();
            shared
                .kv
                .with_cache(shared, |c| c.finish_retrieve(&job.objs, ok, bytes));
            published
        }
    };
    if let Ok(done) = published {
        shared.job_ended(job.owner, job.id, done);
    }
}
