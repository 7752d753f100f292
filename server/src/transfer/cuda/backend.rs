//! The CUDA backend: finding the devices and loading their kernels at
//! start, opening engines' device memory at registration, and handing each
//! copy worker its executor.

use super::devices::{BackendState, CudaDevice, DeviceTable};
use super::executor::CudaExecutor;
use super::pool_pin::PoolPin;
use crate::pool::PoolMemory;
use crate::refusal::Refusal;
use crate::registry::{DeviceMemory, DeviceOpener};
use crate::transfer::backend::{Backend, BackendKind, CopyError, CopyExecutor, CudaUnavailable};
use kvring::gpu::kernels::Kernels;
use kvring::gpu::kernels::LayerEntry;
use kvring::gpu::{Context, DeviceBuffer, GpuError, OpenedMemory};
use kvring::kv::plan::align_of;
use kvring::kv::KvLayout;
use kvring::proto::kv::{KvAllocation, MemKind, MemoryPiece, RegisterKv};
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
        prefer_hardware_queues();
        let devs = kvring::gpu::probe()?;
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

/// Hardware work queues the server asks the driver for per device, unless
/// `CUDA_DEVICE_MAX_CONNECTIONS` is set.
pub const HARDWARE_QUEUES: u32 = 32;

/// Sets `CUDA_DEVICE_MAX_CONNECTIONS` to [`HARDWARE_QUEUES`] when it is not
/// set, before this process initialises CUDA (later it has no effect). With
/// the driver's default of 8, the copy workers' streams (two per worker and
/// device, one per direction) share hardware queues and a store's transfer
/// can wait behind a retrieve's on one: measured on an H200, a retrieve
/// alone reached 0.94 of the pinned ceiling with 8 queues and 0.96-0.97
/// with 32, and stores and retrieves together 0.96-0.98 of the
/// both-ways ceiling. Called at server start, before the server's threads
/// exist; a process embedding the server that starts CUDA threads of its own
/// first should set the variable itself.
fn prefer_hardware_queues() {
    const VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, HARDWARE_QUEUES.to_string());
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

    fn pool_ready_bytes(&self) -> Option<u64> {
        Some(self.state.pin.pinned_bytes())
    }

    fn device_uuids(&self) -> Vec<[u8; 16]> {
        let mut v: Vec<[u8; 16]> = self.state.devices.keys().copied().collect();
        v.sort_unstable();
        v
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
        layout: &KvLayout,
        allocs: &[KvAllocation],
        pieces: &[MemoryPiece],
        fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal> {
        let dev = self.state.devices.get(&req.device_uuid).ok_or_else(|| {
            refuse(format!(
                "no device with UUID {} on this server",
                kvring::gpu::hex(&req.device_uuid)
            ))
        })?;
        let mut memory = Vec::with_capacity(allocs.len());
        let mut windows = Vec::with_capacity(allocs.len());
        for (i, a) in allocs.iter().enumerate() {
            let mem = if req.mem_kind == MemKind::CudaIpc as u32 {
                self.state.open_ipc(slot, dev, &a.ipc_handle)
            } else {
                // Indices checked by the registry.
                let own = &pieces[a.first_piece as usize..][..a.n_pieces as usize];
                let chunks: Vec<(i32, u64)> = own
                    .iter()
                    .flat_map(|p| {
                        fds[p.first_fd as usize..][..p.n_fds as usize]
                            .iter()
                            .map(move |fd| (fd.as_raw_fd(), p.fd_bytes))
                    })
                    .collect();
                OpenedMemory::import_vmm_fds(&dev.ctx, &chunks).map(Arc::new)
            }
            .map_err(|e| refuse(format!("allocation {i}: {e}")))?;
            // The window [offset, offset + bytes) must lie in the memory as
            // the driver sees it; the layout was validated against `bytes`.
            let end = a.offset.checked_add(a.bytes);
            if end.is_none_or(|e| e > mem.size()) {
                return Err(refuse(format!(
                    "allocation {i}: [{}, +{}) exceeds its memory of {} bytes",
                    a.offset,
                    a.bytes,
                    mem.size()
                )));
            }
            windows.push(mem.base() + a.offset);
            memory.push(mem);
        }
        let plan = layout.plan();
        let mut align = plan.align;
        let entries: Vec<LayerEntry> = layout
            .layers()
            .iter()
            .map(|p| {
                let base = windows[p.alloc as usize];
                let v = if plan.parts == 2 {
                    base + p.v_offset
                } else {
                    0
                };
                align = align.min(align_of(base + p.k_offset));
                if plan.parts == 2 {
                    align = align.min(align_of(v));
                }
                LayerEntry {
                    base: [base + p.k_offset, v],
                    block_stride: p.block_stride,
                    head_stride: p.head_stride,
                    token_stride: p.token_stride,
                }
            })
            .collect();
        let table = DeviceBuffer::new(&dev.ctx, std::mem::size_of_val(entries.as_slice()))
            .map_err(|e| refuse(e.to_string()))?;
        table
            .write(bytemuck::cast_slice(&entries))
            .map_err(|e| refuse(e.to_string()))?;
        Ok(Box::new(DeviceTable {
            device: dev.clone(),
            layers: table,
            align,
            _memory: memory,
        }))
    }
}
