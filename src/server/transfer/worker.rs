//! The copy worker loop, and how a job's chunks add up to its end.

use super::backend::{ChunkCopy, ChunkOutcome, CopyError, CopyExecutor, CopyWord, Dir};
use super::job::{JobRun, Task};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use crate::jobs::{FailReason, JobResult};
use crate::liveness::monotonic_ns;
use crate::server::tier::WriteMode;
use crate::server::Shared;
use std::sync::atomic::Ordering;

/// Accounts one chunk of `job`; the last one ends it.
fn chunk_done(shared: &Shared, job: &JobRun, outcome: ChunkOutcome) {
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

/// Copy worker `worker` of lane `lane` (below `WORD_WORKERS`): keeps its executor's pipeline full with
/// tasks taken round robin, and settles each chunk as its copy finishes.
/// A task whose job comes after an engine's event that has not completed
/// waits in the worker's `held` list, asked about again on a backoff (once
/// per job), while the worker serves every other task; past the job's
/// deadline it fails.
pub fn run(shared: &Shared, lane: usize, worker: u32) {
    let copier = &shared.kv.copier;
    let queue = copier.lane(lane);
    // This lane's words and this worker's, in the segment (observers see a
    // worker with work whose beat stopped).
    let stat = &shared.seg.mapping.lanes().lanes[lane];
    let me = &stat.worker[worker as usize];
    let mut shown = (u32::MAX, u32::MAX, u64::MAX);
    let mut copies = 0u64;
    let chunk_tokens = shared.kv.chunk_tokens;
    let mut executor = match copier.backend.executor() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("a copy worker could not start its executor: {e}");
            return;
        }
    };
    let depth = executor.depth().max(1);
    let mut inflight: Vec<Option<Task>> = (0..depth).map(|_| None).collect();
    let mut busy = 0usize;
    let mut done = Vec::new();
    // Held back for their engine's event, oldest first; and those whose
    // event was seen, to be copied before anything new is taken.
    let mut held: VecDeque<Task> = VecDeque::new();
    let mut ready: VecDeque<Task> = VecDeque::new();
    let mut event_poll = EVENT_POLL_MIN;
    let mut next_scan = Instant::now();
    // One answer per job per scan.
    let mut asked: HashMap<*const JobRun, EventState> = HashMap::new();
    // This worker's copy numbers (in its jobs' `entered` / `done` words).
    let mut seq = 0u32;
    // Tasks whose copy may still run on the device: kept (with their job,
    // its client's memory and its words) for the server's life.
    let mut wedged: Vec<Task> = Vec::new();
    loop {
        // Settle what finished (here or in the blocking poll below).
        executor.poll(false, &mut done);
        for (token, r) in done.drain(..) {
            if let Some(t) = inflight.get_mut(token).and_then(Option::take) {
                busy -= 1;
                copies += 1;
                settle(shared, t, r, &mut wedged);
            }
        }
        // Relaxed stores of this worker's own words: observers read each
        // on its own. The gauges are stored when they change.
        me.beat_ns.store(monotonic_ns(), Ordering::Relaxed);
        let now_shown = (busy as u32, (held.len() + ready.len()) as u32, copies);
        if now_shown != shown {
            shown = now_shown;
            me.in_flight.store(shown.0, Ordering::Relaxed);
            me.held.store(shown.1, Ordering::Relaxed);
            me.copies.store(shown.2, Ordering::Relaxed);
        }
        if busy >= depth {
            executor.poll(true, &mut done);
            continue;
        }
        // Ask about the held tasks' events, on the backoff's schedule: a
        // task whose event completed moves to `ready`; one past its
        // deadline, or of a job that ended meanwhile, is settled here.
        let now = Instant::now();
        if !held.is_empty() && now >= next_scan {
            asked.clear();
            let mut moved = false;
            for _ in 0..held.len() {
                let t = held.pop_front().expect("held task");
                // Relaxed: a hint only, as below: a job that ended copies
                // nothing more; `finish` settles it through `remaining`.
                if t.job.failed.load(Ordering::Relaxed) || !shared.jobs.is_live(t.job.id) {
                    chunk_done(shared, &t.job, ChunkOutcome::Skipped);
                    continue;
                }
                let key = Arc::as_ptr(&t.job);
                let state = match asked.get(&key) {
                    Some(&st) => Ok(st),
                    None => event_state(executor.as_mut(), &t, now),
                };
                match state {
                    Ok(st) => {
                        asked.insert(key, st);
                        match st {
                            EventState::Ready => {
                                moved = true;
                                ready.push_back(t);
                            }
                            EventState::NotYet => held.push_back(t),
                            EventState::TimedOut => {
                                chunk_done(shared, &t.job, ChunkOutcome::EventTimeout)
                            }
                        }
                    }
                    // The job fails; its other held tasks are skipped at the
                    // next scan (`failed` is set).
                    Err(e) => chunk_done(shared, &t.job, ChunkOutcome::Failed(e)),
                }
            }
            event_poll = if moved {
                EVENT_POLL_MIN
            } else {
                (event_poll * 2).min(EVENT_POLL_MAX)
            };
            next_scan = now + event_poll;
        }
        let task = match ready.pop_front() {
            Some(t) => t,
            // With nothing in flight or held, sleep for work; with tasks
            // held, only until their events are asked about again; else
            // take only what is queued now.
            None => match queue.pop_within(stat, me, match (busy, held.is_empty()) {
                (0, true) => Some(Duration::MAX),
                (0, false) => Some(next_scan.saturating_duration_since(Instant::now())),
                _ => None,
            }) {
                Ok(t) => t,
                Err(true) if busy == 0 => break, // stopped
                Err(_) => {
                    if busy > 0 {
                        // Until a copy finishes (a chunk takes about
                        // 0.1-1 ms); held tasks are asked about after.
                        executor.poll(true, &mut done);
                    }
                    continue;
                }
            },
        };
        let job = task.job.clone();
        // A job that ended meanwhile (its client died, the server
        // shuts down) or that its client gave up copies nothing more: a
        // dead engine's memory is neither read into the pool nor written.
        // (A give-up after this check is caught by the copy itself.)
        if job.failed.load(Ordering::Relaxed)
            || !shared.jobs.is_live(job.id)
            || job.word.cancelled()
        {
            chunk_done(shared, &job, ChunkOutcome::Skipped);
            continue;
        }
        match event_state(executor.as_mut(), &task, Instant::now()) {
            Ok(EventState::Ready) => {}
            Ok(EventState::NotYet) => {
                if task.job.event.as_ref().is_some_and(|e| e.mark_waited()) {
                    // Relaxed: a counter.
                    stat.events_waited.fetch_add(1, Ordering::Relaxed);
                }
                if held.is_empty() {
                    event_poll = EVENT_POLL_MIN;
                    next_scan = Instant::now() + event_poll;
                }
                held.push_back(task);
                continue;
            }
            Ok(EventState::TimedOut) => {
                chunk_done(shared, &job, ChunkOutcome::EventTimeout);
                continue;
            }
            Err(e) => {
                chunk_done(shared, &job, ChunkOutcome::Failed(e));
                continue;
            }
        }
        // Relaxed: only decides which worker marks the job running (once
        // its engine's event completed); the table's seqlock orders the
        // state itself.
        if !job.started.swap(true, Ordering::Relaxed) {
            let _ = shared.jobs.start(job.id, monotonic_ns());
        }
        let token = inflight
            .iter()
            .position(Option::is_none)
            .expect("a free slot");
        seq = seq.wrapping_add(1).max(1);
        let c = ChunkCopy {
            word: CopyWord {
                job: &job.word,
                worker,
                seq,
            },
            inst: &job.inst,
            chunk_tokens,
            blocks: &task.blocks,
            skip_blocks: task.skip_blocks,
            object: shared.kv.pool.at(task.pool_off),
            dir: job.dir,
        };
        match executor.submit(&c, token) {
            Ok(()) => {
                inflight[token] = Some(task);
                busy += 1;
            }
            Err(e) => {
                copies += 1;
                settle(shared, task, Err(e), &mut wedged)
            }
        }
    }
    // Relaxed: this worker's own gauges, for observers only.
    me.in_flight.store(0, Ordering::Relaxed);
    me.held.store(0, Ordering::Relaxed);
    // Held tasks of a stopping server go as its queued ones do: their jobs
    // are failed (ServerShutdown) by the shutdown that follows, and their
    // streams released when the last task of each goes (`JobWord`'s drop).
    drop((held, ready));
    // Never released: their copies may still run as the process exits; nor
    // is the executor then (its streams would be drained on drop, waiting
    // for them).
    if !wedged.is_empty() {
        std::mem::forget(wedged);
        std::mem::forget(executor);
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
            chunk_done(shared, &task.job, ChunkOutcome::Failed(e));
            wedged.push(task);
        }
        r => chunk_done(shared, &task.job, r.into()),
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
            shared.kv.with_cache(shared, |c| {
                c.finish_store(&job.objs, ok, bytes);
                // Write-through: each new object goes to the second tier
                // (its owner hands it over), held (readable, not evicted)
                // until written.
                if ok && shared.kv.tier.as_ref().is_some_and(|t| t.mode == WriteMode::Through) {
                    c.hold_for_l2(&job.objs);
                }
            });
            // Lookups that reached these objects while they were written.
            crate::server::kv_ops::wake_lookups(shared);
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
