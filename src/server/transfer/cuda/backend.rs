//! The CUDA backend: finding the devices and loading their kernels at
//! start, opening engines' device memory at registration, and handing each
//! copy worker its executor.

use super::devices::{BackendState, CudaDevice, DeviceTable};
use super::executor::CudaExecutor;
use super::pool_pin::PoolPin;
use crate::gpu::kernels::Kernels;
use crate::gpu::{Context, DeviceBuffer, DeviceTensor, GpuError, OpenedMemory};
use crate::proto::kv::{CudaRegion, MemKind, RegisterKv};
use crate::proto::Status;
use crate::server::pool::PoolMemory;
use crate::server::registry::{DeviceMemory, DeviceOpener, Refusal};
use crate::server::transfer::backend::{
    Backend, BackendKind, CopyError, CopyExecutor, CudaUnavailable,
};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// The CUDA backend.
pub struct CudaBackend {
    state: Arc<BackendState>,
    /// Devices present at start (for messages).
    pub summary: String,
}

impl CudaBackend {
    /// Checks CUDA is usable, loads the kernels on every device, and starts
    /// pinning the pool in the background.
    pub fn new(
        pool: &PoolMemory,
        zero_copy_ctas: u32,
        depth: usize,
    ) -> Result<CudaBackend, CudaUnavailable> {
        let devs = crate::gpu::probe()?;
        let mut devices = HashMap::new();
        let mut summary = Vec::new();
        for d in &devs {
            let ctx = Context::by_ordinal(d.ordinal)?;
            let kernels = Kernels::load(&ctx)?;
            summary.push(format!(
                "{} {} (sm_{}{}; kernels {})",
                d.ordinal, d.name, d.compute_capability.0, d.compute_capability.1, kernels.origin
            ));
            devices.insert(d.uuid, Arc::new(CudaDevice { ctx, kernels }));
        }
        let (base, len) = (pool.at(0) as usize, pool.len());
        let first = devices
            .values()
            .next()
            .ok_or(GpuError::NoDevice)?
            .ctx
            .clone();
        let pin = PoolPin::start(first, base, len).map_err(CudaUnavailable::Spawn)?;
        Ok(CudaBackend {
            state: Arc::new(BackendState {
                devices,
                opened: Mutex::new(HashMap::new()),
                job_events: Mutex::new(HashMap::new()),
                pin,
                pool_base: base,
                pool_len: len,
                zero_copy_ctas,
                depth,
            }),
            summary: format!(
                "{}; {}; {depth} chunks in flight per worker and device",
                summary.join("; "),
                if zero_copy_ctas == 0 {
                    "staged copies (kernel + copy engine)".to_string()
                } else {
                    format!("zero-copy kernels, at most {zero_copy_ctas} CTAs")
                }
            ),
        })
    }
}

fn refuse(s: impl Into<String>) -> Refusal {
    Refusal::invalid(s)
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn device_uuids(&self) -> Vec<[u8; 16]> {
        let mut v: Vec<[u8; 16]> = self.state.devices.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn job_events(&self, slot: u32, uuid: &[u8; 16]) -> Result<Vec<[u8; 64]>, Status> {
        let dev = self
            .state
            .devices
            .get(uuid)
            .ok_or(Status::InvalidArgument)?;
        self.state
            .events_of(slot, dev)
            .map(|je| je.handles().to_vec())
            .map_err(|e| {
                tracing::error!("job events: {e}");
                Status::ServerError
            })
    }

    fn client_gone(&self, slot: u32) {
        self.state
            .job_events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| k.0 != slot);
    }

    fn executor(&self) -> Result<Box<dyn CopyExecutor>, CopyError> {
        Ok(Box::new(CudaExecutor::new(self.state.clone())))
    }
}

impl DeviceOpener for CudaBackend {
    fn open_device(
        &self,
        slot: u32,
        req: &RegisterKv,
        regions: &[CudaRegion],
        fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal> {
        let dev = self.state.devices.get(&req.device_uuid).ok_or_else(|| {
            refuse(format!(
                "no device with UUID {} on this server",
                crate::gpu::hex(&req.device_uuid)
            ))
        })?;
        let bytes = req.layout.tensor_bytes();
        let mut tensors = Vec::with_capacity(regions.len());
        let mut bases = Vec::with_capacity(regions.len());
        for (i, r) in regions.iter().enumerate() {
            let mem = if req.mem_kind == MemKind::CudaIpc as u32 {
                self.state.open_ipc(slot, dev, &r.ipc_handle)
            } else {
                let fd = fds.get(r.fd_index as usize).ok_or_else(|| {
                    refuse(format!("tensor {i}: descriptor {} not sent", r.fd_index))
                })?;
                OpenedMemory::import_vmm_fd(&dev.ctx, fd.as_raw_fd(), r.alloc_bytes).map(Arc::new)
            }
            .map_err(|e| refuse(format!("tensor {i}: {e}")))?;
            let end = r.offset.checked_add(bytes);
            if end.is_none_or(|e| e > mem.size()) {
                return Err(refuse(format!(
                    "tensor {i}: [{}, +{bytes}) exceeds its allocation of {} bytes",
                    r.offset, mem.size()
                )));
            }
            bases.push(mem.base() + r.offset);
            tensors.push(DeviceTensor {
                dptr: mem.base() + r.offset,
                bytes,
                memory: mem,
            });
        }
        let table =
            DeviceBuffer::new(&dev.ctx, bases.len() * 8).map_err(|e| refuse(e.to_string()))?;
        table
            .write(bytemuck::cast_slice(&bases))
            .map_err(|e| refuse(e.to_string()))?;
        Ok(Box::new(DeviceTable {
            device: dev.clone(),
            bases: table,
            _tensors: tensors,
        }))
    }
}
