//! The CUDA backend: engines' KV caches in device memory, the pool in pinned
//! host memory, and the server's own kernels in between.
//!
//! Per chunk, on the worker's own stream (no engine SMs beyond one short
//! kernel, no host callback, no lock on any driver thread):
//!
//! * STORE: [wait for the engine's IPC event] -> block ids to the device ->
//!   `kv_copy` gathers the chunk's runs from the paged cache into a device
//!   staging buffer -> one copy-engine transfer staging -> pinned pool object
//!   -> record an event;
//! * RETRIEVE: [wait for the engine's event] -> block ids -> one transfer
//!   pool object -> staging -> `kv_copy` scatters the runs into the paged
//!   cache -> record an event.
//!
//! Each worker keeps four chunks in flight per device by default
//! ([`DEPTH`], one staging slot each; `--cuda-depth`), so one chunk's
//! transfer overlaps the next one's kernel, and several workers keep the
//! copy engines busy. The worker learns a chunk is done by polling its event
//! (`cuEventQuery`, ~30 ns), never from a host callback: the deadlock of a
//! callback needing a lock held by a thread that waits on the stream cannot
//! happen.
//!
//! * [`backend`]: the devices found at start, engines' device memory opened
//!   by IPC handle or VMM fd at registration;
//! * [`devices`]: what the backend and the executors share;
//! * [`executor`]: one worker's streams and staging slots; submit and poll;
//! * [`pool_pin`]: the pool registered with the driver (`cuMemHostRegister`,
//!   portable) in segments on a background thread, so start-up does not
//!   wait for it; an object never spans two segments (the pool allocator
//!   keeps to them), and a copy into a segment not registered yet waits for
//!   it.

pub mod backend;
mod devices;
mod executor;
mod pool_pin;

pub use backend::CudaBackend;
pub use pool_pin::PIN_SEGMENT;

use std::time::Duration;

/// Chunks one worker keeps in flight per device (one staging slot each),
/// unless the server's config (`--cuda-depth`) says otherwise: four keep a
/// chunk's transfer overlapping the next one's kernel with room for jitter.
pub const DEPTH: usize = 4;

/// Longest a chunk copy may take on the device before it is reported failed.
const COPY_DEADLINE: Duration = Duration::from_secs(60);
