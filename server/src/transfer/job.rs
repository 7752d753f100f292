//! A STORE or RETRIEVE job as the copy workers see it, and its chunks.

use crate::registry::Registration;
use kvring::client_memory::OwnedClientMemory;
use kvring::job_words::Words;
use kvring::jobs::JobId;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Engine cache -> pool object (STORE).
    ToPool,
    /// Pool object -> engine cache (RETRIEVE).
    FromPool,
}

/// The inference engine's CUDA IPC event a job's copies come after. The
/// workers poll it from the host (`CopyExecutor::engine_event_ready`) and
/// queue a chunk's copy only once it has completed: no stream of the server
/// ever waits on the device for it, so an engine whose stream never reaches
/// its event (or that died first) holds up nobody else.
pub struct EngineEvent {
    pub handle: [u8; 64],
    /// Past this, the job fails `EngineEventTimeout` (chunks not yet
    /// copied are not; `None`: a timeout too large to count, never).
    pub deadline: Option<Instant>,
    /// Some worker saw it complete: the others need not ask the driver.
    seen: AtomicBool,
    /// Some worker found it not yet complete (counted once per job).
    waited: AtomicBool,
}

impl EngineEvent {
    pub fn new(handle: [u8; 64], timeout: Duration) -> EngineEvent {
        EngineEvent {
            handle,
            deadline: Instant::now().checked_add(timeout),
            seen: AtomicBool::new(false),
            waited: AtomicBool::new(false),
        }
    }

    /// Marks that a worker found the event not yet complete; true the
    /// first time (the job counts as one that waited).
    pub fn mark_waited(&self) -> bool {
        // Relaxed: a flag for a counter, ordering nothing else.
        !self.waited.swap(true, Ordering::Relaxed)
    }

    /// Whether a worker saw it complete.
    pub fn seen(&self) -> bool {
        // Acquire pairs with the Release store in `mark_seen`: a worker that
        // reads true skips the driver's query, and the event's completion
        // (the engine's writes) happened before that store.
        self.seen.load(Ordering::Acquire)
    }

    pub fn mark_seen(&self) {
        // Release pairs with the Acquire load in `seen`.
        self.seen.store(true, Ordering::Release);
    }
}

/// The job's entry in its client's job words ([`kvring::job_words`]); holds
/// the client's memory (and so its words' registration with the driver)
/// until the job's last copy is over. Dropped, it releases the job's
/// streams if nothing did (a job whose tasks a stopping server dropped): it
/// is dropped only once no copy of the job can run, and a job one of whose
/// copies may still run on the device is never dropped (see
/// `JobRun::wedged`).
pub struct JobWord {
    pub(crate) memory: Arc<OwnedClientMemory>,
    /// Below `JOB_WORDS` (checked at acceptance).
    pub entry: u32,
    pub generation: u32,
}

impl JobWord {
    pub fn words(&self) -> Words<'_> {
        self.memory.words()
    }

    /// Whether the client gave the job up.
    pub fn cancelled(&self) -> bool {
        self.words().cancelled(self.entry, self.generation)
    }

    /// Every copy of the job is over: streams waiting for it go on.
    pub fn release(&self) {
        self.words().release(self.entry, self.generation);
    }
}

impl Drop for JobWord {
    fn drop(&mut self) {
        // Forward only: a no-op after `finish` released it, or once the
        // client moved the entry on.
        self.release();
    }
}

/// A STORE or RETRIEVE job in flight.
pub struct JobRun {
    pub id: JobId,
    pub owner: u32,
    pub dir: Dir,
    pub inst: Arc<Registration>,
    /// Objects written (store) or held (retrieve).
    pub objs: Vec<u32>,
    /// The job's result words (store: present chunks and no-space chunks;
    /// retrieve: chunk count; bytes are added as the copies finish).
    pub value: u64,
    pub aux: u64,
    /// The inference engine's event every chunk copy comes after.
    pub event: Option<EngineEvent>,
    /// Its entry in the client's job words.
    pub word: JobWord,
    pub(super) remaining: AtomicU32,
    /// Its layer groups, as they land.
    pub(super) groups: Landing,
    pub(super) started: AtomicBool,
    pub(super) failed: AtomicBool,
    /// Failed because its engine event did not complete in time.
    pub(super) event_timed_out: AtomicBool,
    /// A copy of it may still run on the device (it never finished, or its
    /// end is unknown): its streams are not released by the server, and
    /// the task holding it is kept for the server's life.
    pub(super) wedged: AtomicBool,
    pub(super) bytes: AtomicU64,
}

impl JobRun {
    /// A job of `chunks` chunks, each copied as one task per layer group
    /// (`groups`: 1 unless a RETRIEVE asked for more).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        owner: u32,
        dir: Dir,
        inst: Arc<Registration>,
        objs: Vec<u32>,
        value: u64,
        aux: u64,
        (chunks, groups): (u32, u32),
        event: Option<EngineEvent>,
        word: JobWord,
    ) -> Arc<JobRun> {
        Arc::new(JobRun {
            word,
            id,
            owner,
            dir,
            inst,
            objs,
            value,
            aux,
            event,
            remaining: AtomicU32::new(chunks * groups.max(1)),
            groups: Landing::new(chunks, groups),
            started: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            event_timed_out: AtomicBool::new(false),
            wedged: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
        })
    }

    /// A task of layer group `group` settled (its copy is over, or never
    /// ran): once every chunk of that group and of each group before it
    /// settled, the job's `landed` word says so, and streams waiting for
    /// those groups go on. Not while a copy of the job may still run on
    /// the device (its client gives it up). With one group, the job's end
    /// (`JobWord::release`) is its landing.
    pub(super) fn group_settled(&self, group: u32) {
        if let Some(landed) = self.groups.settled(group, &self.wedged) {
            let w = &self.word;
            let value = w
                .generation
                .wrapping_sub(self.groups.len())
                .wrapping_add(landed);
            w.words().land(w.entry, value);
        }
    }
}

/// A job's layer groups as their tasks settle: how many of each are left,
/// and how many groups (counted from the first) landed.
pub(super) struct Landing {
    left: Box<[AtomicU32]>,
    landed: Mutex<u32>,
}

impl Landing {
    /// `groups` groups (at least 1) of `chunks` tasks each.
    pub fn new(chunks: u32, groups: u32) -> Landing {
        Landing {
            left: (0..groups.max(1)).map(|_| AtomicU32::new(chunks)).collect(),
            landed: Mutex::new(0),
        }
    }

    pub fn len(&self) -> u32 {
        self.left.len() as u32
    }

    /// A task of `group` settled: `Some(n)` when that made the first `n`
    /// groups land (more than before), unless `wedged` (a copy of the job
    /// may still run; read once the group's tasks are all seen). `None`
    /// with a single group: the job's end lands it.
    pub fn settled(&self, group: u32, wedged: &AtomicBool) -> Option<u32> {
        if self.left.len() == 1 {
            return None;
        }
        // AcqRel: each task's Release publishes what it stored before
        // (`wedged`); the last of the group acquires them all (the
        // decrements form one release sequence).
        if self.left[group as usize].fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        let mut landed = self.landed.lock().unwrap_or_else(|e| e.into_inner());
        let before = *landed;
        // Acquire: a zero read is the end of that group's release sequence,
        // so its tasks' `wedged` stores are visible below.
        while (*landed as usize) < self.left.len()
            && self.left[*landed as usize].load(Ordering::Acquire) == 0
        {
            *landed += 1;
        }
        // Relaxed: ordered by the Acquire loads above.
        if *landed == before || wedged.load(Ordering::Relaxed) {
            return None;
        }
        Some(*landed)
    }
}

/// One chunk of a job, or the layers of one of its layer groups.
pub struct Task {
    pub job: Arc<JobRun>,
    /// Pool offset of the object.
    pub pool_off: u64,
    pub blocks: Vec<u32>,
    pub skip_blocks: u32,
    /// The layers it copies, and their layer group.
    pub layers: Range<u32>,
    pub group: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_land_in_order_whatever_order_their_tasks_settle_in() {
        let ok = AtomicBool::new(false);
        let l = Landing::new(2, 3);
        // Group 1 completes first: nothing lands until group 0 does.
        assert_eq!(l.settled(1, &ok), None);
        assert_eq!(l.settled(1, &ok), None);
        assert_eq!(l.settled(0, &ok), None);
        assert_eq!(l.settled(0, &ok), Some(2));
        assert_eq!(l.settled(2, &ok), None);
        assert_eq!(l.settled(2, &ok), Some(3));
        // A job with one group lands at its end only.
        let one = Landing::new(2, 1);
        assert_eq!(one.settled(0, &ok), None);
        assert_eq!(one.settled(0, &ok), None);
        // A copy that may still run holds every later landing back.
        let wedged = AtomicBool::new(true);
        let l = Landing::new(1, 2);
        assert_eq!(l.settled(0, &wedged), None);
        assert_eq!(l.settled(1, &wedged), None);
    }
}
