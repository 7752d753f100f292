//! What the CUDA backend and every worker's executor share: the devices,
//! the engines' device memory opened so far, the pinned pool.

use super::pool_pin::PoolPin;
use crate::transfer::backend::CopyError;
use kvring::gpu::kernels::Kernels;
use kvring::gpu::{Context, CudaError, DeviceBuffer, OpenedMemory};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// One device: its context and kernels.
pub struct CudaDevice {
    pub ctx: Arc<Context>,
    pub kernels: Kernels,
}

/// What a registration in device memory needs on the server: its device,
/// the layer table in device memory (what `kv_copy` reads: per layer the
/// device addresses of its K and V rows of block 0 and its strides), the
/// alignment every address of it has, and the allocations' opened memory,
/// kept open while the registration lives.
pub struct DeviceTable {
    pub device: Arc<CudaDevice>,
    pub layers: DeviceBuffer,
    /// The largest power of two up to 16 dividing every address and size
    /// the kernel computes for this registration (the object's aside).
    pub align: u32,
    pub(super) _memory: Vec<Arc<OpenedMemory>>,
}

/// (client slot, IPC handle) of an opened allocation.
type OpenedKey = (u32, [u8; 64]);

/// What the backend and every worker's executor share.
pub(super) struct BackendState {
    pub(super) devices: HashMap<[u8; 16], Arc<CudaDevice>>,
    /// Allocations each client has opened, so each is opened once.
    pub(super) opened: Mutex<HashMap<OpenedKey, Weak<OpenedMemory>>>,
    pub(super) pin: Arc<PoolPin>,
    pub(super) pool_base: usize,
    pub(super) pool_len: u64,
    /// 0: the staged path (kernel + copy engine); N: the zero-copy path,
    /// kernels reading or writing the pinned pool directly with at most N
    /// CTAs.
    pub(super) zero_copy_ctas: u32,
    /// Chunks each worker keeps in flight per device.
    pub(super) depth: usize,
}

impl Drop for BackendState {
    /// The last user of the backend is gone (the copy workers are joined):
    /// stop pinning, so the pool's registrations all end with `pin`, before
    /// the server unmaps the pool.
    fn drop(&mut self) {
        self.pin.stop();
    }
}

impl BackendState {
    /// The pool offset of an object of `bytes` bytes at `object`, once its
    /// pool segment is pinned.
    pub(super) fn pinned_pool_offset(&self, object: *mut u8, bytes: u64) -> Result<u64, CopyError> {
        let off = (object as usize)
            .checked_sub(self.pool_base)
            .ok_or(CopyError::OutsidePool)? as u64;
        if off + bytes > self.pool_len {
            return Err(CopyError::OutsidePool);
        }
        self.pin.wait_pinned(off, bytes)?;
        Ok(off)
    }

    pub(super) fn open_ipc(
        &self,
        slot: u32,
        dev: &CudaDevice,
        handle: &[u8; 64],
    ) -> Result<Arc<OpenedMemory>, CudaError> {
        let mut opened = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        opened.retain(|_, w| w.strong_count() > 0);
        if let Some(m) = opened.get(&(slot, *handle)).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(OpenedMemory::open_ipc(&dev.ctx, handle)?);
        opened.insert((slot, *handle), Arc::downgrade(&m));
        Ok(m)
    }
}
