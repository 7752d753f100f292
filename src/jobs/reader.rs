//! The reading side of the job table: what clients and observers use to turn
//! a job id into a [`JobStatus`] without a round trip.
//!
//! A read copies the slot out under its seqlock (a handful of loads), then
//! decodes the private copy. A slot whose sequence stays odd (a writer
//! preempted, or a server that died mid-write) is retried with a bound, never
//! spun on forever.

use super::slot::{JobSlot, SlotSnapshot, SlotStatus};
use super::{decode, JobId, JobKind, JobStatus};
use std::time::{Duration, Instant};

/// How long a read keeps retrying a slot whose writer is inside.
const BUSY_LIMIT: Duration = Duration::from_millis(20);

/// Why a slot could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// A writer stayed inside the slot past the retry bound.
    #[error("job slot {0} stayed locked by a writer for {BUSY_LIMIT:?}")]
    Busy(u32),
    /// The slot holds a combination no server writes.
    #[error("job slot {0} holds an inconsistent state")]
    Inconsistent(u32),
}

/// Everything an observer may want to know of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobInfo {
    pub id: JobId,
    pub status: JobStatus,
    pub kind: Option<JobKind>,
    pub owner_slot: u32,
    pub owner_session: u32,
    pub progress: u64,
    pub user_data: u64,
    /// CLOCK_MONOTONIC ns; 0 where the step has not happened.
    pub submitted_ns: u64,
    pub started_ns: u64,
    pub finished_ns: u64,
    pub released_ns: u64,
}

/// A reader over a job table it does not write.
#[derive(Clone, Copy)]
pub struct JobReader<'a> {
    slots: &'a [JobSlot],
    epoch: u64,
}

/// Retries `f` until it returns `Some`: spins first, then yields, until
/// `BUSY_LIMIT`.
fn retry<T>(index: u32, mut f: impl FnMut() -> Option<T>) -> Result<T, ReadError> {
    for _ in 0..128 {
        if let Some(v) = f() {
            return Ok(v);
        }
        std::hint::spin_loop();
    }
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if start.elapsed() > BUSY_LIMIT {
            return Err(ReadError::Busy(index));
        }
        std::thread::yield_now();
    }
}

impl<'a> JobReader<'a> {
    /// A reader of `slots`, written by the server of `epoch`.
    pub fn new(slots: &'a [JobSlot], epoch: u64) -> JobReader<'a> {
        JobReader { slots, epoch }
    }

    /// A reader of a heap table.
    pub fn of_table(t: &'a super::JobTable) -> JobReader<'a> {
        JobReader::new(t.slots(), t.epoch())
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// The status of `id`: one consistent copy of its slot, decoded.
    #[inline]
    pub fn status(&self, id: JobId) -> Result<JobStatus, ReadError> {
        let Some(slot) = self.slot_of(id) else {
            return Ok(JobStatus::Unknown);
        };
        let index = id.index();
        let s: SlotStatus = retry(index, || slot.try_read_status())?;
        decode(id, self.epoch, self.capacity(), &s).ok_or(ReadError::Inconsistent(index))
    }

    fn slot_of(&self, id: JobId) -> Option<&'a JobSlot> {
        if id.epoch != self.epoch || id.generation() == 0 {
            return None;
        }
        self.slots.get(id.index() as usize)
    }

    /// A consistent copy of slot `index` (observers); `None` out of range.
    pub fn snapshot(&self, index: u32) -> Result<Option<SlotSnapshot>, ReadError> {
        let Some(slot) = self.slots.get(index as usize) else {
            return Ok(None);
        };
        retry(index, || slot.try_snapshot()).map(Some)
    }

    /// Everything about `id`; `None` for an id this table never issued or
    /// whose slot was reused.
    pub fn info(&self, id: JobId) -> Result<Option<JobInfo>, ReadError> {
        let Some(slot) = self.slot_of(id) else {
            return Ok(None);
        };
        let snap = retry(id.index(), || slot.try_snapshot())?;
        let status = decode(id, self.epoch, self.capacity(), &snap.status)
            .ok_or(ReadError::Inconsistent(id.index()))?;
        if matches!(status, JobStatus::Unknown | JobStatus::Expired) {
            return Ok(None);
        }
        Ok(Some(JobInfo {
            id,
            status,
            kind: JobKind::decode(snap.kind).ok(),
            owner_slot: snap.owner_slot,
            owner_session: snap.owner_session,
            progress: snap.progress,
            user_data: snap.user_data,
            submitted_ns: snap.submitted_ns,
            started_ns: snap.started_ns,
            finished_ns: snap.finished_ns,
            released_ns: snap.released_ns,
        }))
    }

    /// The id of the job slot `index` holds now (or held last), if any.
    pub fn current_id(&self, index: u32) -> Result<Option<JobId>, ReadError> {
        let Some(snap) = self.snapshot(index)? else {
            return Ok(None);
        };
        Ok(
            (snap.status.generation != 0 && snap.status.generation <= super::MAX_GENERATION)
                .then(|| JobId::new(self.epoch, index, snap.status.generation)),
        )
    }
}
