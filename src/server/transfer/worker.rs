//! The copy worker loop, and how a job's chunks add up to its end.

use super::backend::{ChunkCopy, ChunkOutcome, Dir, Publish};
use super::job::{JobRun, Task};
use crate::jobs::{FailReason, JobResult};
use crate::liveness::monotonic_ns;
use crate::server::Shared;
use std::sync::atomic::Ordering;

/// Accounts one chunk of `job`; the last one ends it.
fn chunk_done(shared: &Shared, job: &JobRun, outcome: ChunkOutcome) {
    // `failed` and `bytes` are Relaxed: the AcqRel decrement of `remaining`
    // below orders every chunk's updates before the last one's `finish`.
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
    }
    // AcqRel: each worker's Release publishes its chunk's counters above;
    // the last one's Acquire sees every worker's, so `finish` reads them all.
    if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        finish(shared, job);
    }
}

/// A copy worker of lane `lane`: keeps its executor's pipeline full with
/// tasks taken round robin, and settles each chunk as its copy finishes.
pub fn run(shared: &Shared, lane: usize) {
    let copier = &shared.kv.copier;
    let queue = copier.lane(lane);
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
    loop {
        // Settle what finished (here or in the blocking poll below).
        executor.poll(false, &mut done);
        for (token, r) in done.drain(..) {
            if let Some(t) = inflight.get_mut(token).and_then(Option::take) {
                busy -= 1;
                chunk_done(shared, &t.job, r.into());
            }
        }
        if busy < depth {
            // With nothing in flight, sleep for work; else take only what
            // is queued now.
            let Some(task) = queue.pop(busy == 0) else {
                if busy == 0 {
                    break; // stopped
                }
                executor.poll(true, &mut done);
                continue;
            };
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
                chunk_done(shared, &job, ChunkOutcome::Skipped);
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
                    chunks_left: left,
                    publish_progress: &publish_progress,
                }),
                inst: &job.inst,
                chunk_tokens,
                blocks: &task.blocks,
                skip_blocks: task.skip_blocks,
                object: shared.kv.pool.at(task.pool_off),
                dir: job.dir,
                event: job.event,
            };
            match executor.submit(&c, token) {
                Ok(()) => {
                    inflight[token] = Some(task);
                    busy += 1;
                }
                Err(e) => chunk_done(shared, &job, ChunkOutcome::Failed(e)),
            }
        } else {
            executor.poll(true, &mut done);
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
