//! The copy lanes: one queue per device (plus one for engines with no
//! device), each holding per-client queues served round robin.

use super::backend::Backend;
use super::job::Task;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct Queues {
    per_client: Vec<VecDeque<Task>>,
    /// Clients with queued tasks, in service order.
    turn: VecDeque<u32>,
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

impl Lane {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next task, round robin over clients, sleeping at most `wait` for
    /// one (`None`: not at all). `Err(true)` once stopped, `Err(false)` when
    /// none came.
    pub(super) fn pop_within(&self, wait: Option<Duration>) -> Result<Task, bool> {
        let until = wait.and_then(|w| std::time::Instant::now().checked_add(w));
        let mut q = self.lock();
        loop {
            if q.stop {
                return Err(true);
            }
            if let Some(t) = q.pop_round_robin() {
                return Ok(t);
            }
            if wait.is_none() {
                return Err(false);
            }
            // Sleep until work, stop or the end of `wait` (a 100 ms slice
            // bounds how long a missed notification could delay shutdown).
            let mut slice = Duration::from_millis(100);
            if let Some(until) = until {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(false);
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

    /// Queues a job's tasks (all of one client and one registration).
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
    pub fn drop_queued(&self) {
        for lane in &self.lanes {
            let taken = {
                let mut q = lane.lock();
                q.turn.clear();
                q.per_client.iter_mut().map(std::mem::take).collect::<Vec<_>>()
            };
            // Dropped with the lane unlocked.
            drop(taken);
        }
    }
}
