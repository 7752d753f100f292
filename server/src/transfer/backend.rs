//! What the lanes and workers need from a copy backend: the [`Backend`]
//! (one per server) and the [`CopyExecutor`] it gives each worker.

use super::job::{Dir, JobWord};
use crate::registry::{DeviceOpener, Registration};
use std::time::Duration;

/// One chunk to copy: `blocks` of the engine's cache <-> the object at
/// `object`, layers `layers` of it (all of them but for a RETRIEVE in layer
/// groups). Blocks before `skip_blocks` are left alone.
pub struct ChunkCopy<'a> {
    pub inst: &'a Registration,
    pub chunk_tokens: u32,
    pub blocks: &'a [u32],
    pub skip_blocks: u32,
    pub layers: std::ops::Range<u32>,
    pub object: *mut u8,
    pub dir: Dir,
    /// Where the copy reports itself in its job's words.
    pub word: CopyWord<'a>,
}

/// A copy's place in its job's words ([`kvring::job_words`]): before it
/// touches the engine's memory it stores `seq` into the job's
/// `entered[worker]` and reads `cancel` (copying nothing if the job was
/// given up), and `done[worker]` becomes `seq` once it no longer can.
pub struct CopyWord<'a> {
    pub job: &'a JobWord,
    /// The copy worker's index in its lane (below `WORD_WORKERS`).
    pub worker: u32,
    /// This copy's number among the worker's copies (never 0).
    pub seq: u32,
}

pub use kvring::proto::kv::BackendKind;

/// Why a chunk copy did not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CopyError {
    /// A driver call failed, or the copy failed on the device.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Device(#[from] kvring::gpu::CudaError),
    /// The device did not finish the copy in time.
    #[error("the device did not finish the copy in {} s", .0.as_secs())]
    Timeout(Duration),
    #[error("object outside the pool")]
    OutsidePool,
    #[error("a pool object spans two registrations")]
    SpansPinSegments,
    #[error("the pool was not pinned in time")]
    PinTimeout,
    #[error("pinning the pool failed: {0}")]
    PinFailed(String),
    #[error("host copy of device memory")]
    NotHostMemory,
    /// A copy to or from memory in the engine process's address space.
    #[error(transparent)]
    Peer(#[from] crate::peer_memory::PeerCopyError),
    #[error("{blocks} blocks per chunk exceed {capacity}")]
    TooManyBlocks { blocks: usize, capacity: usize },
    #[error("no free staging slot")]
    NoFreeSlot,
    /// The copy was queued on the device, then a driver call about it
    /// failed: whether it ran, and when, is unknown.
    #[cfg(feature = "cuda")]
    #[error("a queued copy's end is unknown: {0}")]
    Unsettled(kvring::gpu::CudaError),
}

impl CopyError {
    /// The copy may still touch the engine's memory (it was queued on the
    /// device and never seen to finish).
    pub fn may_still_run(&self) -> bool {
        match self {
            CopyError::Timeout(_) => true,
            #[cfg(feature = "cuda")]
            CopyError::Unsettled(_) => true,
            _ => false,
        }
    }
}

/// How one chunk of a job ended.
#[derive(Debug)]
pub enum ChunkOutcome {
    /// Copied: this many bytes moved.
    Copied(u64),
    /// The copy failed (the job fails).
    Failed(CopyError),
    /// Not copied because the job had already ended (failed, or its owner
    /// is gone): nothing to report.
    Skipped,
    /// Not copied: the engine's event did not complete before the job's
    /// deadline.
    EventTimeout,
}

impl From<Result<u64, CopyError>> for ChunkOutcome {
    fn from(r: Result<u64, CopyError>) -> Self {
        match r {
            Ok(bytes) => ChunkOutcome::Copied(bytes),
            Err(e) => ChunkOutcome::Failed(e),
        }
    }
}

/// What moves the bytes: it gives each copy worker its own executor, and
/// opens engines' device memory at registration (`DeviceOpener`).
pub trait Backend: DeviceOpener + Send + Sync {
    fn name(&self) -> &'static str;
    fn kind(&self) -> BackendKind;
    /// A copy executor for one worker thread (its streams, staging buffers).
    fn executor(&self) -> Result<Box<dyn CopyExecutor>, CopyError>;
    /// Client `slot` left: drop what the backend keeps for it.
    fn client_gone(&self, _slot: u32) {}
    /// The UUIDs of the devices this backend copies with (one copy lane
    /// each).
    fn device_uuids(&self) -> Vec<[u8; 16]> {
        Vec::new()
    }
    /// Bytes of the pool ready for copies (the CUDA backend pins it piece
    /// by piece after the start); `None`: all of it.
    fn pool_ready_bytes(&self) -> Option<u64> {
        None
    }
}

/// One worker's copy executor. A copy may finish after `submit` returns (on
/// a GPU stream); finished copies are collected with `poll`, which never
/// runs a callback: the worker polls, so no lock is ever taken on a
/// driver's thread.
pub trait CopyExecutor {
    /// Most copies this executor keeps in flight.
    fn depth(&self) -> usize;
    /// Starts copying one chunk; `token` comes back from `poll`. The
    /// registration and the pool object stay valid until then (the worker
    /// holds the task).
    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), CopyError>;
    /// Whether the inference engine's event `handle` (on the device of
    /// `inst`) has completed, asked from the host without waiting; a copy
    /// ordered after it is submitted only once it has. Backends with no
    /// device events have none to wait for.
    fn engine_event_ready(
        &mut self,
        _inst: &Registration,
        _handle: &[u8; 64],
    ) -> Result<bool, CopyError> {
        Ok(true)
    }
    /// Appends finished copies (token, bytes moved or why not) to `out`;
    /// with `wait`, returns only once at least one finished (or none is in
    /// flight).
    fn poll(&mut self, wait: bool, out: &mut Vec<(usize, Result<u64, CopyError>)>);
}

/// Why the CUDA backend could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaUnavailable {
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Gpu(#[from] kvring::gpu::GpuError),
    #[cfg(feature = "cuda")]
    #[error("spawn the pinning thread: {0}")]
    Spawn(std::io::Error),
    #[cfg(not(feature = "cuda"))]
    #[error("this build of kvring has no CUDA support (the `cuda` feature is off)")]
    NotBuilt,
}
