//! The server's side of the job table: allocation, the state machine, and
//! reclamation of a departed client's jobs.
//!
//! Shared-memory slots carry everything a client may read; the allocator's
//! bookkeeping (which slots are free, which jobs each client owns) is private
//! to the server and guarded by one mutex, taken by the structural operations
//! (submit, release, client gone, shutdown). State changes of a running job
//! (start, progress, finish, fail) take only the slot's seqlock.
//!
//! Every transition is checked under the slot's lock against the id's
//! generation and the current state, so a stale id (a job already failed
//! because its client died, a slot since reused) changes nothing.
//!
//! The slots live in shared memory, so their words are untrusted. The
//! server's own writers of a slot exclude each other with a private mutex
//! (one of [`STRIPES`], by index) before they take the slot's seqlock, so
//! the seqlock is always free when they come: a lock word found odd was
//! written by another process. Such a slot is **retired** at once (never
//! waited for, never used again, counted: [`JobTable::retired`]), and the
//! operation fails with [`TableError::Retired`]. No server thread spins on
//! a job slot.

use super::slot::{JobSlot, SlotUpdate, SlotWriter};
use super::{
    step, FailReason, JobId, JobKind, JobResult, JobState, TableError, Transition, MAX_GENERATION,
};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Private mutexes the server's writers of a slot take first (slot `i`:
/// stripe `i % STRIPES`).
pub const STRIPES: usize = 64;

/// What a new job is.
#[derive(Clone, Copy, Debug)]
pub struct NewJob {
    pub kind: JobKind,
    pub owner_slot: u32,
    pub owner_session: u32,
    pub user_data: u64,
    /// CLOCK_MONOTONIC ns.
    pub now_ns: u64,
}

/// How a release went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// The job is now a tombstone.
    Now,
    /// It already was one (releasing twice is harmless).
    Already,
}

const NOT_OWNED: u32 = u32::MAX;

struct Alloc {
    /// Slots a new job may take: never-used ones first, then tombstones in
    /// the order they were released (the oldest is reused first).
    free: VecDeque<u32>,
    /// Per client slot: indices of its jobs not released yet.
    owned: Vec<Vec<u32>>,
    /// Per job index: its position in its owner's `owned` list.
    pos: Vec<u32>,
    /// Per job index: its owner's client slot, or NOT_OWNED.
    owner: Vec<u32>,
}

impl Alloc {
    fn own(&mut self, client: u32, index: u32) {
        let list = &mut self.owned[client as usize];
        self.pos[index as usize] = list.len() as u32;
        self.owner[index as usize] = client;
        list.push(index);
    }

    fn disown(&mut self, index: u32) {
        let client = self.owner[index as usize];
        if client == NOT_OWNED {
            return;
        }
        let list = &mut self.owned[client as usize];
        let at = self.pos[index as usize] as usize;
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            self.pos[moved as usize] = at as u32;
        }
        self.owner[index as usize] = NOT_OWNED;
        self.pos[index as usize] = NOT_OWNED;
    }

    /// Puts a tombstoned slot back at the end of the free queue, unless its
    /// generation is exhausted (then it is retired, never wrapped).
    fn recycle(&mut self, index: u32, generation: u64) {
        // (A retired slot is skipped when it comes up in the free queue.)
        if generation < MAX_GENERATION {
            self.free.push_back(index);
        }
    }
}

/// The server's job table over `job_slots` slots in shared memory (or on the
/// heap, for tests).
pub struct JobTable {
    slots: *const JobSlot,
    len: u32,
    epoch: u64,
    alloc: Mutex<Alloc>,
    stripes: Box<[Mutex<()>]>,
    /// Per slot: retired (its lock word was found written by another
    /// process).
    retired_flags: Box<[AtomicBool]>,
    retired: AtomicU64,
    _heap: Option<Box<[JobSlot]>>,
}

// SAFETY: the slots are atomics only, written under their seqlock; the
// private bookkeeping is behind a mutex. The creator of a raw table keeps the
// memory mapped for the table's life (see `from_raw`).
unsafe impl Send for JobTable {}
// SAFETY: as above.
unsafe impl Sync for JobTable {}

impl JobTable {
    /// A table over `len` slots at `slots`, for a server of `epoch` and
    /// `max_clients` client slots. The slots must be zeroed (a fresh segment).
    ///
    /// # Safety
    /// `slots` must point at `len` `JobSlot`s that stay mapped for the
    /// table's life, and no other `JobTable` may write them.
    pub unsafe fn from_raw(slots: *const JobSlot, len: u32, epoch: u64, max_clients: u32) -> Self {
        JobTable {
            slots,
            len,
            epoch,
            alloc: Mutex::new(Alloc {
                free: (0..len).collect(),
                owned: (0..max_clients).map(|_| Vec::new()).collect(),
                pos: vec![NOT_OWNED; len as usize],
                owner: vec![NOT_OWNED; len as usize],
            }),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            retired_flags: (0..len).map(|_| AtomicBool::new(false)).collect(),
            retired: AtomicU64::new(0),
            _heap: None,
        }
    }

    /// A table over zeroed heap memory (tests and models).
    pub fn on_heap(len: u32, epoch: u64, max_clients: u32) -> Self {
        let heap: Box<[JobSlot]> = (0..len).map(|_| JobSlot::new()).collect();
        // SAFETY: the boxed slots live in the table and are never moved out.
        let mut t = unsafe { Self::from_raw(heap.as_ptr(), len, epoch, max_clients) };
        t._heap = Some(heap);
        t
    }

    /// The slots, for readers of a heap table.
    pub fn slots(&self) -> &[JobSlot] {
        // SAFETY: `from_raw`'s contract: `len` slots, mapped for our life.
        unsafe { std::slice::from_raw_parts(self.slots, self.len as usize) }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn capacity(&self) -> u32 {
        self.len
    }

    fn slot(&self, index: u32) -> &JobSlot {
        &self.slots()[index as usize]
    }

    fn alloc(&self) -> std::sync::MutexGuard<'_, Alloc> {
        // A panic while holding the lock leaves the bookkeeping as it was
        // between two whole operations; keep serving.
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Slots retired so far (their lock word was found written by another
    /// process).
    pub fn retired(&self) -> u64 {
        // A counter: Relaxed.
        self.retired.load(Ordering::Relaxed)
    }

    fn is_retired(&self, index: u32) -> bool {
        // Written and read by server threads under the slot's stripe or the
        // allocator's mutex; Relaxed: a flag, ordered by those mutexes.
        self.retired_flags[index as usize].load(Ordering::Relaxed)
    }

    fn stripe(&self, index: u32) -> MutexGuard<'_, ()> {
        self.stripes[index as usize % STRIPES]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The writers' lock of slot `index`, under its stripe. The server's
    /// writers never meet each other here (the stripe), so a lock word
    /// found odd was written by another process: the slot is retired and
    /// `Retired` returned, without a wait.
    fn write(&self, index: u32) -> Result<(MutexGuard<'_, ()>, SlotWriter<'_>), TableError> {
        let stripe = self.stripe(index);
        if self.is_retired(index) {
            return Err(TableError::Retired);
        }
        match self.slot(index).try_lock(0) {
            Some(w) => Ok((stripe, w)),
            None => {
                // Relaxed: see `is_retired`; the counter is a counter.
                if !self.retired_flags[index as usize].swap(true, Ordering::Relaxed) {
                    self.retired.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "job slot {index} retired: its lock word was written by another process"
                    );
                }
                Err(TableError::Retired)
            }
        }
    }

    /// One consistent read of slot `index` under its stripe (no server
    /// writer inside): `None` when another process wrote its lock word.
    fn read<T>(&self, index: u32, f: impl FnOnce(&JobSlot) -> Option<T>) -> Option<T> {
        let _stripe = self.stripe(index);
        f(self.slot(index))
    }

    /// Checks an id's epoch and index; returns the slot.
    fn slot_of(&self, id: JobId) -> Result<&JobSlot, TableError> {
        if id.epoch != self.epoch || id.index() >= self.len || id.generation() == 0 {
            return Err(TableError::Unknown);
        }
        Ok(self.slot(id.index()))
    }

    /// Allocates a slot for a new job, `Pending`. Fails with `Full` when every
    /// slot holds an unreleased job: a live job is never overwritten.
    pub fn submit(&self, job: NewJob) -> Result<JobId, TableError> {
        let mut a = self.alloc();
        let (index, _stripe, w) = loop {
            let index = a.free.pop_front().ok_or(TableError::Full)?;
            // A retired slot leaves the free queue here.
            if let Ok((stripe, w)) = self.write(index) {
                break (index, stripe, w);
            }
        };
        let cur = w.current();
        debug_assert!(matches!(
            JobState::decode(cur.status.state).ok(),
            Some(JobState::Free | JobState::Tombstoned)
        ));
        let generation = cur.status.generation + 1;
        w.apply(&SlotUpdate {
            generation: Some(generation),
            state: Some(JobState::Pending as u32),
            kind: Some(job.kind as u32),
            owner_slot: Some(job.owner_slot),
            owner_session: Some(job.owner_session),
            fail_reason: Some(0),
            result_value: Some(0),
            result_aux: Some(0),
            progress: Some(0),
            user_data: Some(job.user_data),
            submitted_ns: Some(job.now_ns),
            started_ns: Some(0),
            finished_ns: Some(0),
            released_ns: Some(0),
        });
        drop(w);
        a.own(job.owner_slot, index);
        Ok(JobId::new(self.epoch, index, generation))
    }

    /// Runs `f` on the slot of `id` under its lock if the generation matches;
    /// `f` sees the current state and returns the update to apply.
    fn transition(
        &self,
        id: JobId,
        f: impl FnOnce(JobState) -> Result<SlotUpdate, TableError>,
    ) -> Result<JobState, TableError> {
        self.slot_of(id)?;
        let (_stripe, w) = self.write(id.index())?;
        let cur = w.current();
        let g = cur.status.generation;
        if g < id.generation() {
            return Err(TableError::Unknown);
        }
        if g > id.generation() {
            return Err(TableError::Expired);
        }
        let state = JobState::decode(cur.status.state)
            .ok()
            .ok_or(TableError::Unknown)?;
        let u = f(state)?;
        w.apply(&u);
        Ok(state)
    }

    /// `Pending -> Running`.
    pub fn start(&self, id: JobId, now_ns: u64) -> Result<(), TableError> {
        self.transition(id, |s| {
            Ok(SlotUpdate {
                state: Some(step(s, Transition::Start)? as u32),
                started_ns: Some(now_ns),
                ..Default::default()
            })
        })
        .map(|_| ())
    }

    /// Records progress of a running job.
    pub fn progress(&self, id: JobId, progress: u64) -> Result<(), TableError> {
        self.transition(id, |s| match s {
            JobState::Running => Ok(SlotUpdate {
                progress: Some(progress),
                ..Default::default()
            }),
            s => Err(TableError::WrongState(s)),
        })
        .map(|_| ())
    }

    /// `Pending | Running -> Done(result)`.
    pub fn finish(&self, id: JobId, result: JobResult, now_ns: u64) -> Result<(), TableError> {
        self.transition(id, |s| {
            Ok(SlotUpdate {
                state: Some(step(s, Transition::Finish)? as u32),
                result_value: Some(result.value),
                result_aux: Some(result.aux),
                finished_ns: Some(now_ns),
                ..Default::default()
            })
        })
        .map(|_| ())
    }

    /// `Pending | Running -> Failed(reason)`.
    pub fn fail(&self, id: JobId, reason: FailReason, now_ns: u64) -> Result<(), TableError> {
        self.transition(id, |s| {
            step(s, Transition::Fail)?;
            Ok(fail_update(reason, now_ns))
        })
        .map(|_| ())
    }

    /// `Done | Failed -> Tombstoned`, by the job's owner (client slot and
    /// session). Releasing a tombstone again is harmless.
    pub fn release(
        &self,
        id: JobId,
        owner_slot: u32,
        owner_session: u32,
        now_ns: u64,
    ) -> Result<Released, TableError> {
        let mut a = self.alloc();
        self.slot_of(id)?;
        let (stripe, w) = match self.write(id.index()) {
            Ok(x) => x,
            Err(e) => {
                // Retired: no longer the owner's to release; its bookkeeping
                // goes, the slot is never reused.
                if a.owner[id.index() as usize] == owner_slot {
                    a.disown(id.index());
                }
                return Err(e);
            }
        };
        let cur = w.current();
        let g = cur.status.generation;
        if g < id.generation() {
            return Err(TableError::Unknown);
        }
        if g > id.generation() {
            return Err(TableError::Expired);
        }
        if cur.owner_slot != owner_slot || cur.owner_session != owner_session {
            return Err(TableError::NotOwner);
        }
        let state = JobState::decode(cur.status.state)
            .ok()
            .ok_or(TableError::Unknown)?;
        if state == JobState::Tombstoned {
            return Ok(Released::Already);
        }
        w.apply(&SlotUpdate {
            state: Some(step(state, Transition::Release)? as u32),
            released_ns: Some(now_ns),
            ..Default::default()
        });
        drop(w);
        drop(stripe);
        a.disown(id.index());
        a.recycle(id.index(), g);
        Ok(Released::Now)
    }

    /// A client left (or died): its unfinished jobs end `Failed(reason)` and
    /// all its jobs become tombstones, free for reuse. Returns (failed,
    /// released).
    pub fn client_gone(&self, owner_slot: u32, reason: FailReason, now_ns: u64) -> (usize, usize) {
        let mut a = self.alloc();
        let Some(list) = a.owned.get_mut(owner_slot as usize) else {
            return (0, 0);
        };
        let jobs = std::mem::take(list);
        let mut failed = 0;
        for &index in &jobs {
            let Ok((_stripe, w)) = self.write(index) else {
                // Retired: forgotten, never reused.
                a.owner[index as usize] = NOT_OWNED;
                a.pos[index as usize] = NOT_OWNED;
                continue;
            };
            let cur = w.current();
            let state = JobState::decode(cur.status.state).ok();
            let mut u = SlotUpdate {
                state: Some(JobState::Tombstoned as u32),
                released_ns: Some(now_ns),
                ..Default::default()
            };
            debug_assert!(state.is_some_and(|s| step(s, Transition::Reclaim).is_ok()));
            if state.is_some_and(|s| step(s, Transition::Fail).is_ok()) {
                let f = fail_update(reason, now_ns);
                u.fail_reason = f.fail_reason;
                u.finished_ns = f.finished_ns;
                failed += 1;
            }
            w.apply(&u);
            drop(w);
            a.owner[index as usize] = NOT_OWNED;
            a.pos[index as usize] = NOT_OWNED;
            a.recycle(index, cur.status.generation);
        }
        (failed, jobs.len())
    }

    /// Server shutdown: every unfinished job ends `Failed(reason)`. Returns
    /// how many, and the client slots that owned one (to be woken).
    pub fn fail_all(&self, reason: FailReason, now_ns: u64) -> (usize, Vec<u32>) {
        let a = self.alloc();
        let mut owners = Vec::new();
        let mut failed = 0;
        for (client, list) in a.owned.iter().enumerate() {
            let mut any = false;
            for &index in list {
                let Ok((_stripe, w)) = self.write(index) else {
                    continue;
                };
                let state = JobState::decode(w.current().status.state).ok();
                if state.is_some_and(|s| step(s, Transition::Fail).is_ok()) {
                    w.apply(&fail_update(reason, now_ns));
                    any = true;
                    failed += 1;
                }
            }
            if any {
                owners.push(client as u32);
            }
        }
        (failed, owners)
    }

    /// Kind, submitted and finished times (CLOCK_MONOTONIC ns) of `id`, if
    /// the slot still holds it.
    pub fn timing(&self, id: JobId) -> Option<(JobKind, u64, u64)> {
        self.slot_of(id).ok()?;
        let snap = self.read(id.index(), JobSlot::try_snapshot)?;
        (snap.status.generation == id.generation())
            .then_some(())
            .and(JobKind::decode(snap.kind).ok())
            .map(|k| (k, snap.submitted_ns, snap.finished_ns))
    }

    /// Whether `id` is still pending or running (one seqlock read).
    pub fn is_live(&self, id: JobId) -> bool {
        if self.slot_of(id).is_err() {
            return false;
        }
        self.read(id.index(), JobSlot::try_read_status)
            .is_some_and(|s| {
                s.generation == id.generation()
                    && matches!(
                        JobState::decode(s.state).ok(),
                        Some(JobState::Pending | JobState::Running)
                    )
            })
    }

    /// Jobs allocated and not released yet.
    pub fn live(&self) -> usize {
        let a = self.alloc();
        a.owned.iter().map(Vec::len).sum()
    }

    /// Jobs of one client not released yet.
    pub fn live_of(&self, owner_slot: u32) -> usize {
        self.alloc()
            .owned
            .get(owner_slot as usize)
            .map_or(0, Vec::len)
    }
}

fn fail_update(reason: FailReason, now_ns: u64) -> SlotUpdate {
    SlotUpdate {
        state: Some(JobState::Failed as u32),
        // 0 means "did not fail"; a caller's `Other(0)` must still read failed.
        fail_reason: Some(match reason.code() {
            0 => u32::MAX,
            c => c,
        }),
        finished_ns: Some(now_ns),
        ..Default::default()
    }
}
