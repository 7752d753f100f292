//! The copy worker loop, and how a job's chunks add up to its end.

use super::backend::{ChunkCopy, ChunkOutcome, CopyError, CopyExecutor, CopyWord};
use super::job::Dir;
use super::job::{JobRun, Task};
use super::lanes::Pop;
use crate::Shared;
use kvring::jobs::{FailReason, JobResult};
use kvring::liveness::monotonic_ns;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accounts one task of its job (a chunk, or one layer group of it): the
/// last of a layer group lands the group, the last of all ends the job.
fn chunk_done(shared: &Shared, task: &Task, outcome: ChunkOutcome) {
    let job = &*task.job;
    // `failed`, `event_timed_out` and `bytes` are Relaxed: the AcqRel
    // decrement of `remaining` below orders every chunk's updates before
    // the last one's `finish`, which reads them.
    match outcome {
        ChunkOutcome::Copied(b) => {
            job.bytes.fetch_add(b, Ordering::Relaxed);
        }
        ChunkOutcome::Failed(e) => {
            tracing::warn!(job = %job.id, "copy failed: {e}");
            job.failed.store(true, Ordering::Relaxed);
        }
        ChunkOutcome::Skipped => {
            job.failed.store(true, Ordering::Relaxed);
        }
        ChunkOutcome::EventTimeout => {
            // Counted once per job (the first chunk to time out). Relaxed:
            // published to `finish` by the AcqRel decrement below, as the
            // other flags; the lane's counter is for observers only.
            if !job.event_timed_out.swap(true, Ordering::Relaxed) {
                let lane = shared.kv.copier.lane_of(&job.inst.device_uuid);
                shared.seg.mapping.lanes().lanes[lane]
                    .events_timed_out
                    .fetch_add(1, Ordering::Relaxed);
            }
            job.failed.store(true, Ordering::Relaxed);
        }
    }
    job.group_settled(task.group);
    // AcqRel: each worker's Release publishes its chunk's counters above;
    // the last one's Acquire sees every worker's, so `finish` reads them all.
    if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        finish(shared, job);
    }
}

/// Where `task` stands with the engine event its job comes after, asked
/// from the host (no stream of the server waits on the device for another
/// process): ready (or none), not yet, or past the job's deadline.
fn event_state(
    executor: &mut dyn CopyExecutor,
    task: &Task,
    now: Instant,
) -> Result<EventState, CopyError> {
    let Some(ev) = &task.job.event else {
        return Ok(EventState::Ready);
    };
    if ev.seen() {
        return Ok(EventState::Ready);
    }
    if executor.engine_event_ready(&task.job.inst, &ev.handle)? {
        ev.mark_seen();
        return Ok(EventState::Ready);
    }
    if ev.deadline.is_some_and(|d| now >= d) {
        return Ok(EventState::TimedOut);
    }
    Ok(EventState::NotYet)
}

#[derive(Clone, Copy)]
enum EventState {
    Ready,
    NotYet,
    TimedOut,
}

/// How soon a worker asks again for the events its held-back tasks wait
/// for (a query costs about 32 ns; one per job, not per chunk): at first
/// after `EVENT_POLL_MIN`, then twice as long each time none completed, up
/// to `EVENT_POLL_MAX` (an engine stuck for long costs a worker about 1,000
/// scans a second, whatever else it copies meanwhile).
const EVENT_POLL_MIN: Duration = Duration::from_micros(20);
const EVENT_POLL_MAX: Duration = Duration::from_millis(1);

/// Copy worker `worker` of lane `lane` (below `WORD_WORKERS`): keeps its
/// executor's pipeline full with tasks taken round robin, and settles each
/// chunk as its copy finishes. A task whose job comes after an engine's
/// event that has not completed waits in the worker's `held` list, asked
/// about again on a backoff (once per job), while the worker serves every
/// other task; past the job's deadline it fails.
pub fn run(shared: &Shared, lane: usize, worker: u32) {
    let executor = match shared.kv.copier.backend.executor() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("a copy worker could not start its executor: {e}");
            return;
        }
    };
    let mut w = Worker::new(shared, lane, worker, executor);
    loop {
        w.settle_finished();
        w.show();
        if w.busy >= w.depth {
            w.executor.poll(true, &mut w.done);
            continue;
        }
        w.scan_held();
        let task = match w.next_task() {
            Next::Task(t) => t,
            Next::Stopped => break,
            Next::Later => continue,
        };
        if let Some(task) = w.admit(task) {
            w.submit(task);
        }
    }
    w.stop();
}

/// What a worker does next.
enum Next {
    /// Copy this task (if its job still wants it).
    Task(Task),
    /// Nothing to take now: go round again.
    Later,
    /// The lane stopped and nothing is in flight.
    Stopped,
}

/// A copy worker's state.
struct Worker<'a> {
    shared: &'a Shared,
    lane: &'a super::lanes::Lane,
    /// This lane's words and this worker's, in the segment (observers see
    /// a worker with work whose beat stopped).
    stat: &'a kvring::shm::LaneStat,
    me: &'a kvring::shm::WorkerStat,
    worker: u32,
    executor: Box<dyn CopyExecutor>,
    depth: usize,
    /// Tasks in the executor, by token.
    inflight: Vec<Option<Task>>,
    busy: usize,
    /// Copies the executor reported finished.
    done: Vec<(usize, Result<u64, CopyError>)>,
    /// Held back for their engine's event, oldest first; and those whose
    /// event was seen, to be copied before anything new is taken.
    held: VecDeque<Task>,
    ready: VecDeque<Task>,
    event_poll: Duration,
    next_scan: Instant,
    /// One answer per job per scan.
    asked: HashMap<*const JobRun, EventState>,
    /// This worker's copy numbers (in its jobs' `entered` / `done` words).
    seq: u32,
    copies: u64,
    /// The gauges last stored: in flight, held, copies.
    shown: (u32, u32, u64),
    /// Tasks whose copy may still run on the device: kept (with their job,
    /// its client's memory and its words) for the server's life.
    wedged: Vec<Task>,
}

impl<'a> Worker<'a> {
    fn new(
        shared: &'a Shared,
        lane: usize,
        worker: u32,
        executor: Box<dyn CopyExecutor>,
    ) -> Worker<'a> {
        let stat = &shared.seg.mapping.lanes().lanes[lane];
        let depth = executor.depth().max(1);
        Worker {
            shared,
            lane: shared.kv.copier.lane(lane),
            stat,
            me: &stat.worker[worker as usize],
            worker,
            executor,
            depth,
            inflight: (0..depth).map(|_| None).collect(),
            busy: 0,
            done: Vec::new(),
            held: VecDeque::new(),
            ready: VecDeque::new(),
            event_poll: EVENT_POLL_MIN,
            next_scan: Instant::now(),
            asked: HashMap::new(),
            seq: 0,
            copies: 0,
            shown: (u32::MAX, u32::MAX, u64::MAX),
            wedged: Vec::new(),
        }
    }

    /// Settles what finished (here or in a blocking poll).
    fn settle_finished(&mut self) {
        self.executor.poll(false, &mut self.done);
        for (token, r) in self.done.drain(..) {
            if let Some(t) = self.inflight.get_mut(token).and_then(Option::take) {
                self.busy -= 1;
                self.copies += 1;
                settle(self.shared, t, r, &mut self.wedged);
            }
        }
    }

    /// Stores this worker's beat, and its gauges when they change.
    fn show(&mut self) {
        // Relaxed stores of this worker's own words: observers read each
        // on its own.
        self.me.beat_ns.store(monotonic_ns(), Ordering::Relaxed);
        let now = (
            self.busy as u32,
            (self.held.len() + self.ready.len()) as u32,
            self.copies,
        );
        if now != self.shown {
            self.shown = now;
            self.me.in_flight.store(now.0, Ordering::Relaxed);
            self.me.held.store(now.1, Ordering::Relaxed);
            self.me.copies.store(now.2, Ordering::Relaxed);
        }
    }

    /// Asks about the held tasks' events, on the backoff's schedule: a task
    /// whose event completed moves to `ready`; one past its deadline, or of
    /// a job that ended meanwhile, is settled here.
    fn scan_held(&mut self) {
        let now = Instant::now();
        if self.held.is_empty() || now < self.next_scan {
            return;
        }
        self.asked.clear();
        let mut moved = false;
        for _ in 0..self.held.len() {
            let t = self.held.pop_front().expect("held task");
            // Relaxed: a hint only, as in `admit`: a job that ended copies
            // nothing more; `finish` settles it through `remaining`.
            if t.job.failed.load(Ordering::Relaxed) || !self.shared.jobs.is_live(t.job.id) {
                chunk_done(self.shared, &t, ChunkOutcome::Skipped);
                continue;
            }
            let key = Arc::as_ptr(&t.job);
            let state = match self.asked.get(&key) {
                Some(&st) => Ok(st),
                None => event_state(self.executor.as_mut(), &t, now),
            };
            match state {
                Ok(st) => {
                    self.asked.insert(key, st);
                    match st {
                        EventState::Ready => {
                            moved = true;
                            self.ready.push_back(t);
                        }
                        EventState::NotYet => self.held.push_back(t),
                        EventState::TimedOut => {
                            chunk_done(self.shared, &t, ChunkOutcome::EventTimeout)
                        }
                    }
                }
                // The job fails; its other held tasks are skipped at the
                // next scan (`failed` is set).
                Err(e) => chunk_done(self.shared, &t, ChunkOutcome::Failed(e)),
            }
        }
        self.event_poll = if moved {
            EVENT_POLL_MIN
        } else {
            (self.event_poll * 2).min(EVENT_POLL_MAX)
        };
        self.next_scan = now + self.event_poll;
    }

    /// A ready task, else one from the lane: with nothing in flight or
    /// held, it sleeps for work; with tasks held, only until their events
    /// are asked about again; else it takes only what is queued now.
    fn next_task(&mut self) -> Next {
        if let Some(t) = self.ready.pop_front() {
            return Next::Task(t);
        }
        let wait = match (self.busy, self.held.is_empty()) {
            (0, true) => Some(Duration::MAX),
            (0, false) => Some(self.next_scan.saturating_duration_since(Instant::now())),
            _ => None,
        };
        match self.lane.pop_within(self.stat, self.me, wait) {
            Pop::Task(t) => Next::Task(t),
            Pop::Stopped if self.busy == 0 => Next::Stopped,
            Pop::Stopped | Pop::Empty => {
                if self.busy > 0 {
                    // Until a copy finishes (a chunk takes about 0.1-1 ms);
                    // held tasks are asked about after.
                    self.executor.poll(true, &mut self.done);
                }
                Next::Later
            }
        }
    }

    /// `task` if its copy is to start now; else it is held for its
    /// engine's event or settled (its job ended, was given up, or its
    /// event timed out or failed).
    fn admit(&mut self, task: Task) -> Option<Task> {
        let job = &task.job;
        // A job that ended meanwhile (its client died, the server shuts
        // down) or that its client gave up copies nothing more: a dead
        // engine's memory is neither read into the pool nor written. (A
        // give-up after this check is caught by the copy itself.)
        if job.failed.load(Ordering::Relaxed)
            || !self.shared.jobs.is_live(job.id)
            || job.word.cancelled()
        {
            chunk_done(self.shared, &task, ChunkOutcome::Skipped);
            return None;
        }
        match event_state(self.executor.as_mut(), &task, Instant::now()) {
            Ok(EventState::Ready) => Some(task),
            Ok(EventState::NotYet) => {
                if job.event.as_ref().is_some_and(|e| e.mark_waited()) {
                    // Relaxed: a counter.
                    self.stat.events_waited.fetch_add(1, Ordering::Relaxed);
                }
                if self.held.is_empty() {
                    self.event_poll = EVENT_POLL_MIN;
                    self.next_scan = Instant::now() + self.event_poll;
                }
                self.held.push_back(task);
                None
            }
            Ok(EventState::TimedOut) => {
                chunk_done(self.shared, &task, ChunkOutcome::EventTimeout);
                None
            }
            Err(e) => {
                chunk_done(self.shared, &task, ChunkOutcome::Failed(e));
                None
            }
        }
    }

    /// Starts `task`'s copy (its job is marked running by the first).
    fn submit(&mut self, task: Task) {
        let job = task.job.clone();
        // Relaxed: only decides which worker marks the job running (once
        // its engine's event completed); the table's seqlock orders the
        // state itself.
        if !job.started.swap(true, Ordering::Relaxed) {
            let _ = self.shared.jobs.start(job.id, monotonic_ns());
        }
        let token = self
            .inflight
            .iter()
            .position(Option::is_none)
            .expect("a free slot");
        self.seq = self.seq.wrapping_add(1).max(1);
        let c = ChunkCopy {
            word: CopyWord {
                job: &job.word,
                worker: self.worker,
                seq: self.seq,
            },
            inst: &job.inst,
            chunk_tokens: self.shared.kv.chunk_tokens,
            blocks: &task.blocks,
            skip_blocks: task.skip_blocks,
            layers: task.layers.clone(),
            object: self.shared.kv.pool.at(task.pool_off),
            dir: job.dir,
        };
        match self.executor.submit(&c, token) {
            Ok(()) => {
                self.inflight[token] = Some(task);
                self.busy += 1;
            }
            Err(e) => {
                self.copies += 1;
                settle(self.shared, task, Err(e), &mut self.wedged)
            }
        }
    }

    /// The worker's end (the lane stopped, nothing in flight).
    fn stop(self) {
        // Relaxed: this worker's own gauges, for observers only.
        self.me.in_flight.store(0, Ordering::Relaxed);
        self.me.held.store(0, Ordering::Relaxed);
        // Held tasks of a stopping server go as its queued ones do: their
        // jobs are failed (ServerShutdown) by the shutdown that follows,
        // and their streams released when the last task of each goes
        // (`JobWord`'s drop).
        drop((self.held, self.ready));
        // Never released: their copies may still run as the process exits;
        // nor is the executor then (its streams would be drained on drop,
        // waiting for them).
        if !self.wedged.is_empty() {
            std::mem::forget(self.wedged);
            std::mem::forget(self.executor);
        }
    }
}

/// Settles a task whose copy ended (or could not be queued). A copy that
/// may still run on the device marks its job wedged (the server does not
/// release its streams; the client gives it up at its deadline) and its
/// task is kept, so nothing the copy uses is freed under it.
fn settle(shared: &Shared, task: Task, r: Result<u64, CopyError>, wedged: &mut Vec<Task>) {
    match r {
        Err(e) if e.may_still_run() => {
            // Relaxed: published to `finish` by `chunk_done`'s AcqRel
            // decrement, as the other counters.
            task.job.wedged.store(true, Ordering::Relaxed);
            chunk_done(shared, &task, ChunkOutcome::Failed(e));
            wedged.push(task);
        }
        r => {
            if r.is_ok() {
                zero_unwritten(shared, &task);
            }
            chunk_done(shared, &task, r.into())
        }
    }
}

/// A STORE's short chunk (a prompt's tail: fewer blocks than a chunk,
/// always a job's last): the object rows its copy did not write are zeroed,
/// so that none of the bytes the pool space held before survive in it.
/// After the copy, before the job ends (the object is not found by a
/// lookup, nor written to a tier, before then).
fn zero_unwritten(shared: &Shared, task: &Task) {
    let ct = shared.kv.chunk_tokens;
    let g = task.job.inst.layout.geometry();
    let written = task.blocks.len() as u32 * g.block_tokens;
    if task.job.dir != Dir::ToPool || written >= ct {
        return;
    }
    let object = shared.kv.pool.at(task.pool_off);
    for layer in task.layers.clone() {
        // Tokens `written..ct` of the layer: one run of the object
        // (`[layer][token][head][K then V]`), up to the next layer's row 0.
        let from = g.object_row(ct, layer, written, 0);
        let to = g.object_row(ct, layer, ct, 0);
        // SAFETY: the object is `object_bytes(ct)` bytes of the pool from
        // `pool_off`, allocated to this job (no lookup finds it and no other
        // copy touches it until the job ends), and its copy is over (the
        // device no longer writes it); `from..to` lies within it.
        unsafe { std::ptr::write_bytes(object.add(from as usize), 0, (to - from) as usize) };
    }
}

/// The last task of `job` is done: release the streams waiting for the job
/// (its `go` word), settle the cache and publish.
fn finish(shared: &Shared, job: &JobRun) {
    // A job its client gave up fails, whatever was copied: a copy that
    // started after the give-up copied nothing (and one before it was
    // waited for by the client), so a store must not commit.
    let cancelled = job.word.cancelled();
    // Relaxed: the caller's AcqRel decrement that reached zero happens
    // after every task's Release half, so all their updates are visible.
    let ok = !job.failed.load(Ordering::Relaxed) && !cancelled;
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
            // Relaxed: as `failed` above.
            let reason = if cancelled {
                FailReason::Cancelled
            } else if job.event_timed_out.load(Ordering::Relaxed) {
                FailReason::EngineEventTimeout
            } else {
                FailReason::CopyFailed
            };
            shared.jobs.fail(job.id, reason, now).map(|()| false)
        }
    };
    // Every copy of the job is over (each was settled through its
    // completion): streams ordered after the job go on, before the job
    // table says the job ended (a client that reads the end finds its
    // streams released and can reuse the entry at once). Not if a copy may
    // still run: its client gives it up (and sees the copy under way).
    // Relaxed: as `failed` above.
    if !job.wedged.load(Ordering::Relaxed) {
        job.word.release();
    }
    // A store commits only if every chunk was copied; otherwise (a copy
    // failed, or the job ended early) its objects are dropped.
    let published = match job.dir {
        Dir::ToPool => {
            shared.kv.with_cache(|c| {
                c.finish_store(&job.objs, ok, bytes);
                // Write-through: each new object goes to the write-through
                // tiers (their owner hands it over), held (readable, not
                // evicted) until written.
                if ok {
                    c.hold_for_tiers(&job.objs);
                }
            });
            // Lookups that reached these objects while they were written.
            crate::kv_ops::wake_lookups(shared);
            outcome()
        }
        Dir::FromPool => {
            let published = outcome();
            shared
                .kv
                .with_cache(|c| c.finish_retrieve(&job.objs, ok, bytes));
            published
        }
    };
    if let Ok(done) = published {
        shared.job_ended(job.owner, job.id, done);
    }
}
