//! The copy lanes: one queue per device (plus one for engines with no
//! device), each holding per-client queues served round robin. Each lane
//! publishes its queue depth in the segment's copy lanes region
//! ([`kvring::shm::LaneStat`]), and its workers their beat.

use super::backend::Backend;
use super::job::Task;
use kvring::liveness::monotonic_ns;
use kvring::shm::{LaneStat, LaneStats, WorkerStat};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct Queues {
    per_client: Vec<VecDeque<Task>>,
    /// Clients with queued tasks, in service order.
    turn: VecDeque<u32>,
    /// Tasks in `per_client`, as published in `LaneStat::queued`.
    queued: u64,
    stop: bool,
}

impl Queues {
    /// The next task, round robin over clients: the client whose turn it is
    /// gives one task and goes to the back if it has more.
    fn pop_round_robin(&mut self) -> Option<Task> {
        while let Some(c) = self.turn.pop_front() {
            let queue = &mut self.per_client[c as usize];
            let t = queue.pop_front();
            if !queue.is_empty() {
                self.turn.push_back(c);
            }
            if t.is_some() {
                self.queued -= 1;
                return t;
            }
        }
        None
    }
}

/// The queue of one device's workers.
pub(super) struct Lane {
    /// The device ([0; 16]: engines with no device).
    uuid: [u8; 16],
    q: Mutex<Queues>,
    cv: Condvar,
}

/// What [`Lane::pop_within`] found.
pub(super) enum Pop {
    Task(Task),
    /// None came within the wait.
    Empty,
    /// The lane stopped.
    Stopped,
}

impl Lane {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next task, round robin over clients, sleeping at most `wait` for
    /// one (`None`: not at all). `stat` is this lane's words; `me` the
    /// calling worker's, whose beat is stored at every wake-up (at least
    /// every 100 ms).
    pub(super) fn pop_within(
        &self,
        stat: &LaneStat,
        me: &WorkerStat,
        wait: Option<Duration>,
    ) -> Pop {
        let until = wait.and_then(|w| std::time::Instant::now().checked_add(w));
        let mut q = self.lock();
        loop {
            // Relaxed: observers read each word on its own.
            me.beat_ns.store(monotonic_ns(), Ordering::Relaxed);
            if q.stop {
                return Pop::Stopped;
            }
            if let Some(t) = q.pop_round_robin() {
                // Relaxed, under the lock: the last store is the depth.
                stat.queued.store(q.queued, Ordering::Relaxed);
                return Pop::Task(t);
            }
            if wait.is_none() {
                return Pop::Empty;
            }
            // Sleep until work, stop or the end of `wait` (a 100 ms slice
            // bounds how long a missed notification could delay shutdown).
            let mut slice = Duration::from_millis(100);
            if let Some(until) = until {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Pop::Empty;
                }
                slice = slice.min(left);
            }
            q = self
                .cv
                .wait_timeout(q, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The workers' queues, one lane per device, and the backend they copy
/// with.
pub struct Copier {
    lanes: Vec<Lane>,
    pub backend: Box<dyn Backend>,
}

impl Copier {
    /// A copier with a lane for engines with no device and one per entry
    /// of `devices` (at most [`kvring::shm::MAX_DEVICES`]: the caller checks).
    pub fn new(max_clients: u32, backend: Box<dyn Backend>, devices: &[[u8; 16]]) -> Copier {
        assert!(devices.len() <= kvring::shm::MAX_DEVICES);
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

    pub(super) fn lane(&self, i: usize) -> &Lane {
        &self.lanes[i]
    }

    /// The lane of device `uuid` (lane 0 for no device or one this server
    /// does not copy with).
    pub fn lane_of(&self, uuid: &[u8; 16]) -> usize {
        if *uuid == [0; 16] {
            return 0;
        }
        self.lanes.iter().position(|l| l.uuid == *uuid).unwrap_or(0)
    }

    /// Writes each lane's device and worker count into `stats` (before the
    /// server runs).
    pub fn publish_lanes(&self, stats: &LaneStats, workers: u32) {
        for (lane, stat) in self.lanes.iter().zip(&stats.lanes) {
            // Relaxed: written before the server is `running` and read by
            // observers word by word; no access pairs.
            let r = Ordering::Relaxed;
            stat.device[0].store(u64::from_le_bytes(lane.uuid[..8].try_into().expect("8")), r);
            stat.device[1].store(u64::from_le_bytes(lane.uuid[8..].try_into().expect("8")), r);
            stat.workers.store(workers, r);
        }
    }

    /// Queues a job's tasks (all of one client and one registration).
    pub fn submit(&self, stats: &LaneStats, client: u32, tasks: Vec<Task>) {
        let Some(first) = tasks.first() else {
            return;
        };
        let i = self.lane_of(&first.job.inst.device_uuid);
        let lane = &self.lanes[i];
        let mut q = lane.lock();
        let queue = &mut q.per_client[client as usize];
        let was_empty = queue.is_empty();
        let n = tasks.len();
        queue.extend(tasks);
        if was_empty {
            q.turn.push_back(client);
        }
        q.queued += n as u64;
        // Relaxed, under the lock: the last store is the depth.
        stats.lanes[i].queued.store(q.queued, Ordering::Relaxed);
        drop(q);
        if n == 1 {
            lane.cv.notify_one();
        } else {
            lane.cv.notify_all();
        }
    }

    /// Stops the workers of every lane (queued tasks stay: see
    /// [`Copier::drop_queued`]).
    pub fn stop(&self) {
        for lane in &self.lanes {
            lane.lock().stop = true;
            lane.cv.notify_all();
        }
    }

    /// Drops every queued task (the workers are stopped): a job whose last
    /// task goes releases its streams (`JobWord`'s drop); the shutdown then
    /// fails it.
    pub fn drop_queued(&self, stats: &LaneStats) {
        for (lane, stat) in self.lanes.iter().zip(&stats.lanes) {
            let taken = {
                let mut q = lane.lock();
                q.turn.clear();
                q.queued = 0;
                // Relaxed, under the lock: the last store is the depth.
                stat.queued.store(0, Ordering::Relaxed);
                q.per_client
                    .iter_mut()
                    .map(std::mem::take)
                    .collect::<Vec<_>>()
            };
            // Dropped with the lane unlocked.
            drop(taken);
        }
    }
}
