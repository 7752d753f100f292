//! Asynchronous jobs: a table of slots in the segment, written only by the
//! server and read by clients without a round trip.
//!
//! The contract (what a status poll can answer, see [`JobStatus`]):
//!
//! * a job id ([`JobId`]) carries the server's epoch, the slot index and the
//!   slot's generation at allocation; a slot's generation is bumped at every
//!   allocation, so every generation up to the current one was issued once;
//! * a slot goes `Pending -> Running -> Done | Failed -> Tombstoned` (a job
//!   may also fail straight from `Pending`); it is tombstoned when its owner
//!   releases it (or the owner dies) and keeps its outcome readable; it is
//!   reused, generation bumped, only when no never-used slot is left, oldest
//!   tombstone first;
//! * nothing ever goes back to a non-terminal state for the same generation,
//!   so a finished, released, reused, forged or foreign id can never read
//!   `Pending` or `Running`.
//!
//! Layers: [`slot`] is the shared struct and its seqlock (model-checked with
//! loom); `table` is the server's allocator and state machine; `reader` is
//! the client's decoder of a slot into a [`JobStatus`].

pub mod slot;

#[cfg(not(kvring_loom))]
mod reader;
#[cfg(not(kvring_loom))]
mod table;

#[cfg(not(kvring_loom))]
pub use reader::{JobInfo, JobReader, ReadError};
#[cfg(not(kvring_loom))]
pub use slot::JobSlotValues;
pub use slot::{JobSlot, SlotStatus};
#[cfg(not(kvring_loom))]
pub use table::{JobTable, NewJob, Released};

#[cfg(all(test, kvring_loom))]
mod loom_tests;
#[cfg(all(test, not(kvring_loom)))]
mod tests;

use crate::shm_struct::shm_struct;
use crate::wire::wire_enum;
use bytemuck::{Pod, Zeroable};

/// Number of bits of a job id's `key` that hold the slot index.
pub const INDEX_BITS: u32 = 24;
/// Largest generation a slot may reach (40 bits); a slot that reaches it is
/// retired rather than wrapped, so ids never alias.
pub const MAX_GENERATION: u64 = (1 << (64 - INDEX_BITS)) - 1;

shm_struct! {
    /// A job's identity. 16 bytes on the wire (`shm_layout.md`, "JobId").
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
    pub struct JobId {
        /// Epoch of the server instance that issued it.
        [0] pub epoch: u64,
        /// `generation << 24 | index`.
        [8] pub key: u64,
    }
}

const _: () = {
    assert!(std::mem::size_of::<JobId>() == 16);
};

impl JobId {
    /// Builds an id. `index` must fit 24 bits and `generation` 40 bits.
    pub fn new(epoch: u64, index: u32, generation: u64) -> JobId {
        debug_assert!(index < (1 << INDEX_BITS) && generation <= MAX_GENERATION);
        JobId {
            epoch,
            key: (generation << INDEX_BITS) | u64::from(index),
        }
    }

    /// The slot index.
    pub fn index(&self) -> u32 {
        (self.key & ((1 << INDEX_BITS) - 1)) as u32
    }

    /// The slot's generation when the job was allocated (0 is never issued).
    pub fn generation(&self) -> u64 {
        self.key >> INDEX_BITS
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {}#{} (epoch {})",
            self.index(),
            self.generation(),
            self.epoch
        )
    }
}

wire_enum! {
    /// `JobSlot::state` values.
    pub enum JobState: u32 {
        /// Never allocated since the segment was created.
        Free = 0 => "free",
        /// Submitted, not started.
        Pending = 1 => "pending",
        /// Started.
        Running = 2 => "running",
        /// Finished with a result.
        Done = 3 => "done",
        /// Finished with a failure reason.
        Failed = 4 => "failed",
        /// Finished and released by its owner; the outcome stays readable.
        Tombstoned = 5 => "tombstoned",
    }
}

impl JobState {
    /// Whether a job in this state has finished.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Tombstoned
        )
    }
}

wire_enum! {
    /// `JobSlot::kind` values: which operation a job runs.
    pub enum JobKind: u32 {
        /// A timed job for health checks, tests and benchmarks of the job path
        /// (`Opcode::DelayJob`).
        Delay = 1 => "delay",
        /// LOOKUP: result value = hit chunks (prefix), aux = chunks asked.
        Lookup = 2 => "lookup",
        /// STORE: result value = chunks present after it, aux = chunks that got
        /// no space.
        Store = 3 => "store",
        /// RETRIEVE: result value = chunks copied, aux = bytes copied.
        Retrieve = 4 => "retrieve",
    }
}

wire_enum! {
    /// Why a job failed (`JobSlot::fail_reason`; 0 means it did not).
    pub enum FailReason: u32 {
        other Other;
        /// Its owner disconnected or died before it finished.
        ClientGone = 1 => "client_gone",
        /// The server shut down before it finished.
        ServerShutdown = 2 => "server_shutdown",
        /// The submitter asked for a failure (delay jobs).
        Requested = 3 => "requested",
        /// A copy between an engine's cache and the pool failed.
        CopyFailed = 4 => "copy_failed",
        /// The engine's event (the STORE's or RETRIEVE's `after`) did not
        /// complete within the server's engine-event timeout (chunks not
        /// copied by then never are).
        EngineEventTimeout = 5 => "engine_event_timeout",
        /// Its client gave it up (its `cancel` job word): what was not
        /// copied by then never is, and a store does not commit.
        Cancelled = 6 => "cancelled",
    }
}

impl std::fmt::Display for FailReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailReason::ClientGone => write!(f, "client gone"),
            FailReason::ServerShutdown => write!(f, "server shut down"),
            FailReason::Requested => write!(f, "failure requested"),
            FailReason::CopyFailed => write!(f, "copy failed"),
            FailReason::EngineEventTimeout => {
                write!(f, "the engine's event did not complete in time")
            }
            FailReason::Cancelled => write!(f, "given up by its client"),
            FailReason::Other(c) => write!(f, "failure code {c}"),
        }
    }
}

/// A finished job's result: two words whose meaning depends on the job kind
/// (delay jobs: the values the submitter asked for).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct JobResult {
    pub value: u64,
    pub aux: u64,
}

/// What a status poll answers. Only `Pending` and `Running` are non-terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobStatus {
    /// Submitted, not started yet.
    Pending,
    /// Started, not finished.
    Running,
    /// Finished with this result, not released yet.
    Done(JobResult),
    /// Finished with this failure, not released yet.
    Failed(FailReason),
    /// Finished and released; the outcome is still readable.
    Tombstoned(Result<JobResult, FailReason>),
    /// The slot was reused since: the job finished long ago.
    Expired,
    /// This server instance never issued the id (another epoch, an index or
    /// generation never allocated).
    Unknown,
}

impl JobStatus {
    /// Whether the job can still change state.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, JobStatus::Pending | JobStatus::Running)
    }

    /// A short name ("pending", "done", ...).
    pub fn name(&self) -> &'static str {
        match self {
            JobStatus::Pending => "pending",
            JobStatus::Running => "running",
            JobStatus::Done(_) => "done",
            JobStatus::Failed(_) => "failed",
            JobStatus::Tombstoned(_) => "tombstoned",
            JobStatus::Expired => "expired",
            JobStatus::Unknown => "unknown",
        }
    }
}

/// Decodes what a consistent read of a slot says about `id`, given the epoch
/// of the server that wrote the table. Pure: every input is already a private
/// copy. `None` means the slot holds a combination no server writes (the
/// caller reports it rather than guessing).
pub fn decode(id: JobId, epoch: u64, job_slots: u32, s: &SlotStatus) -> Option<JobStatus> {
    if id.epoch != epoch || id.index() >= job_slots || id.generation() == 0 {
        return Some(JobStatus::Unknown);
    }
    let gen = id.generation();
    if s.generation < gen {
        return Some(JobStatus::Unknown);
    }
    if s.generation > gen {
        return Some(JobStatus::Expired);
    }
    let outcome = || {
        if s.fail_reason == 0 {
            Ok(JobResult {
                value: s.result_value,
                aux: s.result_aux,
            })
        } else {
            Err(FailReason::from_code(s.fail_reason))
        }
    };
    Some(match JobState::decode(s.state).ok()? {
        // A generation is only published together with a non-free state.
        JobState::Free => return None,
        JobState::Pending => JobStatus::Pending,
        JobState::Running => JobStatus::Running,
        JobState::Done => JobStatus::Done(outcome().ok()?),
        JobState::Failed => JobStatus::Failed(outcome().err()?),
        JobState::Tombstoned => JobStatus::Tombstoned(outcome()),
    })
}

/// Why a table operation did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// Every slot holds a job that is not released yet.
    #[error("no free job slot")]
    Full,
    /// This table never issued the id.
    #[error("unknown job")]
    Unknown,
    /// The slot was reused since; the job finished long ago.
    #[error("job expired (its slot was reused)")]
    Expired,
    /// The job belongs to another client.
    #[error("job owned by another client")]
    NotOwner,
    /// The job has not finished yet.
    #[error("job not finished")]
    NotFinished,
    /// The job is not in a state this transition starts from.
    #[error("job is {}", .0.name())]
    WrongState(JobState),
    /// Another process wrote the slot's lock word: the slot is retired.
    #[error("job slot retired (written by another process)")]
    Retired,
}

/// A change of a job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// The server starts running it.
    Start,
    /// It finished with a result.
    Finish,
    /// It failed.
    Fail,
    /// Its owner releases it.
    Release,
    /// Its owner is gone: fail it if unfinished, and tombstone it.
    Reclaim,
}

/// The state machine, in one place: the state `t` leads to from `s`, or why
/// it cannot happen. Terminal states only lead to `Tombstoned`, and nothing
/// leads back to `Pending` or `Running`.
pub fn step(s: JobState, t: Transition) -> Result<JobState, TableError> {
    use JobState::*;
    match (t, s) {
        (Transition::Start, Pending) => Ok(Running),
        (Transition::Finish, Pending | Running) => Ok(Done),
        (Transition::Fail, Pending | Running) => Ok(Failed),
        (Transition::Release, Done | Failed) => Ok(Tombstoned),
        (Transition::Release, Pending | Running) => Err(TableError::NotFinished),
        (Transition::Reclaim, Pending | Running | Done | Failed) => Ok(Tombstoned),
        (_, s) => Err(TableError::WrongState(s)),
    }
}
