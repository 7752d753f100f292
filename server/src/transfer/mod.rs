//! Transfers: the copy workers that move chunk objects between engines' KV
//! caches and the pool, so the ring loop never waits on a copy.
//!
//! A STORE or RETRIEVE job is split into one task per chunk. Tasks wait in
//! per-client queues served round robin, so one client's large job cannot
//! stall another's: every client with work gets the next free worker in
//! turn. A job ends when its last task does; the worker that finishes it
//! commits (store) or drops holds (retrieve) in the cache, then publishes the
//! job's outcome in the job table and wakes the owner.
//!
//! Tasks are queued in one **lane per device** ([`lanes`]), each with its
//! own workers (and, on the CUDA backend, each worker's streams and staging
//! buffers on that device only), plus a lane for engines with no device: a
//! backlog on one GPU never holds up another GPU's copies, even for one
//! client that drives several devices. A registration names its device by
//! UUID (device memory: the GPU it lives on; host memory: optionally the GPU
//! its worker runs on). The host backend can split its workers into
//! simulated device lanes (`--simulated-devices`), so the same scheduling is
//! tested without GPUs.
//!
//! The copy itself is the backend's ([`Backend`], each worker running its
//! own [`CopyExecutor`]): memcpy with streaming stores on the host
//! ([`host`], [`nt_copy`]), kernels and copy engines on a GPU (`cuda`, with
//! the `cuda` feature). The worker loop is in [`worker`].

mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
mod host;
mod job;
mod lanes;
mod nt_copy;
mod worker;

pub use backend::{Backend, BackendKind, CudaUnavailable};
pub use host::HostBackend;
pub use job::{Dir, EngineEvent, JobRun, JobWord, Task};
pub use lanes::Copier;
pub use worker::run;

use super::pool::PoolMemory;

/// The CUDA backend over `pool` (zero-copy kernels with at most
/// `zero_copy_ctas` CTAs, 0 for the staged path; `depth` chunks in flight
/// per worker and device, `None` for `cuda::DEPTH`), with a line saying
/// what it found, and the pool's registration segment (no object may span
/// two).
pub fn open_cuda(
    pool: &PoolMemory,
    zero_copy_ctas: u32,
    depth: Option<u32>,
) -> Result<(Box<dyn Backend>, String, u64), CudaUnavailable> {
    #[cfg(feature = "cuda")]
    {
        let depth = depth.map_or(cuda::DEPTH, |d| d as usize);
        let b = cuda::CudaBackend::new(pool, zero_copy_ctas, depth)?;
        let note = format!("cuda: {}", b.summary);
        Ok((Box::new(b), note, cuda::PIN_SEGMENT))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (pool, zero_copy_ctas, depth);
        Err(CudaUnavailable::NotBuilt)
    }
}
