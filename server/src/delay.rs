//! Delay jobs: timers the ring loop fires between rounds. Each job moves
//! `Pending -> Running -> Done | Failed` at the times its request asked for,
//! publishing progress while it runs.
//!
//! A timer holds only the job's id; every step goes through the job table,
//! which checks the generation and the state, so a job reclaimed in the
//! meantime (its client died) is left alone and its timer dropped.

use super::Shared;
use kvring::jobs::{FailReason, JobId, JobResult};
use kvring::liveness::monotonic_ns;
use kvring::proto::DelayJobRequest;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Start,
    Progress,
    End,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Timer {
    at: Instant,
    /// Tie-break: submission order.
    seq: u64,
    step: Step,
    index: usize,
    /// The job's token: a timer whose job was replaced does nothing.
    token: u64,
}

struct Job {
    token: u64,
    id: JobId,
    owner: u32,
    req: DelayJobRequest,
    started: Option<Instant>,
}

/// The ring loop's delay-job timers.
#[derive(Default)]
pub(super) struct DelayJobs {
    heap: BinaryHeap<Reverse<Timer>>,
    jobs: Vec<Option<Job>>,
    free: Vec<usize>,
    seq: u64,
}

impl DelayJobs {
    /// When the next timer is due, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse(t)| t.at)
    }

    fn push(&mut self, at: Instant, step: Step, index: usize) {
        let Some(job) = &self.jobs[index] else { return };
        self.seq += 1;
        self.heap.push(Reverse(Timer {
            at,
            seq: self.seq,
            step,
            index,
            token: job.token,
        }));
    }

    /// Takes over a job just submitted (`Pending`) and runs what is due now.
    pub fn schedule(
        &mut self,
        shared: &Shared,
        id: JobId,
        owner: u32,
        req: DelayJobRequest,
        now: Instant,
    ) {
        self.seq += 1;
        let job = Job {
            token: self.seq,
            id,
            owner,
            req,
            started: None,
        };
        let index = match self.free.pop() {
            Some(i) => {
                self.jobs[i] = Some(job);
                i
            }
            None => {
                self.jobs.push(Some(job));
                self.jobs.len() - 1
            }
        };
        self.push(
            now + Duration::from_micros(req.pending_us),
            Step::Start,
            index,
        );
        self.fire(shared, now);
    }

    /// Runs every timer due by `now`.
    pub fn fire(&mut self, shared: &Shared, now: Instant) {
        while let Some(Reverse(t)) = self.heap.peek().copied() {
            if t.at > now {
                break;
            }
            self.heap.pop();
            self.step(shared, t, now);
        }
    }

    fn drop_job(&mut self, index: usize) {
        self.jobs[index] = None;
        self.free.push(index);
    }

    fn step(&mut self, shared: &Shared, t: Timer, now: Instant) {
        let Some(job) = self.jobs[t.index].as_mut().filter(|j| j.token == t.token) else {
            return;
        };
        let table = &shared.jobs;
        match t.step {
            Step::Start => {
                if table.start(job.id, monotonic_ns()).is_err() {
                    return self.drop_job(t.index);
                }
                job.started = Some(now);
                let (running, every) = (job.req.running_us, job.req.progress_every_us);
                self.push(now + Duration::from_micros(running), Step::End, t.index);
                if every > 0 && every < running {
                    self.push(now + Duration::from_micros(every), Step::Progress, t.index);
                }
            }
            Step::Progress => {
                let ran = now.duration_since(job.started.unwrap_or(now));
                let every = job.req.progress_every_us;
                if table.progress(job.id, ran.as_micros() as u64).is_ok() {
                    self.push(now + Duration::from_micros(every), Step::Progress, t.index);
                }
            }
            Step::End => {
                let (id, owner, req) = (job.id, job.owner, job.req);
                self.drop_job(t.index);
                let ended = if req.fail_reason != 0 {
                    table
                        .fail(id, FailReason::from_code(req.fail_reason), monotonic_ns())
                        .map(|()| false)
                } else {
                    let r = JobResult {
                        value: req.result_value,
                        aux: req.result_aux,
                    };
                    table.finish(id, r, monotonic_ns()).map(|()| true)
                };
                if let Ok(done) = ended {
                    shared.job_ended(owner, id, done);
                }
            }
        }
    }
}
