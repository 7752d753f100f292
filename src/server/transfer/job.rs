//! A STORE or RETRIEVE job as the copy workers see it, and its chunks.

use super::backend::Dir;
use crate::jobs::JobId;
use crate::server::registry::Registration;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Arc;

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
    /// The inference engine's CUDA IPC event every chunk copy waits for.
    pub event: Option<[u8; 64]>,
    /// Chunks still to be queued before the job event is published (None:
    /// no job event asked for).
    pub publish_left: Option<AtomicU32>,
    pub(super) remaining: AtomicU32,
    pub(super) started: AtomicBool,
    pub(super) failed: AtomicBool,
    pub(super) bytes: AtomicU64,
}

impl JobRun {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        owner: u32,
        dir: Dir,
        inst: Arc<Registration>,
        objs: Vec<u32>,
        value: u64,
        aux: u64,
        tasks: u32,
        event: Option<[u8; 64]>,
        publish: bool,
    ) -> Arc<JobRun> {
        Arc::new(JobRun {
            publish_left: publish.then(|| AtomicU32::new(tasks)),
            id,
            owner,
            dir,
            inst,
            objs,
            value,
            aux,
            event,
            remaining: AtomicU32::new(tasks),
            started: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
        })
    }
}

/// One chunk of a job.
pub struct Task {
    pub job: Arc<JobRun>,
    /// Pool offset of the object.
    pub pool_off: u64,
    pub blocks: Vec<u32>,
    pub skip_blocks: u32,
}
