//! An engine's own device memory, registered where it already is: the
//! allocations of a KV cache an engine made itself (torch tensors, from
//! the caching allocator's `cudaMalloc` blocks, expandable segments, or
//! one `cuMemCreate` allocation as vLLM's extensible KV cache makes), found
//! from their addresses with the driver and exported for the server
//! ([`crate::gpu::export_range`]).
#![cfg(feature = "cuda")]

use super::registration::{KvSpec, Memory, Registration};
use super::Client;
use crate::device::DeviceUuid;
use crate::error::{Error, Result};
use crate::gpu::{export_range, RangeExport};
use crate::kv::KvLayout;
use crate::proto::kv::MemoryPiece;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The exported allocations of one KV cache, on one device: either every
/// one `cuMemAlloc` memory (legacy IPC handles) or every one VMM memory
/// (POSIX fds, held here until registered).
#[derive(Debug)]
pub struct CudaMemory {
    device: DeviceUuid,
    memory: Memory,
    fds: Vec<OwnedFd>,
}

impl CudaMemory {
    /// Exports the device memory at each `(address, bytes)` (a layout's
    /// allocations, in order). Fails with the reason when an address is not
    /// device memory this process can share, when the allocations lie on
    /// different devices, or when some are `cuMemAlloc` memory and others
    /// VMM memory.
    pub fn of(allocations: &[(u64, u64)]) -> Result<CudaMemory> {
        let mut device = None;
        let mut ipc = Vec::new();
        let mut vmm: Vec<(u64, Vec<MemoryPiece>)> = Vec::new();
        let mut fds = Vec::new();
        for (i, &(addr, bytes)) in allocations.iter().enumerate() {
            let r = export_range(addr, bytes).map_err(|e| match Error::from(e) {
                Error::InvalidArgument(m) => Error::InvalidArgument(format!("allocation {i}: {m}")),
                e => e,
            })?;
            let uuid = crate::gpu::device_uuid(r.device)?;
            if *device.get_or_insert(uuid) != uuid {
                return Err(Error::InvalidArgument(format!(
                    "allocation {i} is on device {}, allocation 0 on device {}: one registration covers one device",
                    crate::gpu::hex(&uuid),
                    crate::gpu::hex(&device.unwrap_or_default())
                )));
            }
            match r.export {
                RangeExport::Ipc { handle, offset } => ipc.push((handle, offset)),
                RangeExport::Vmm { offset, chunks } => {
                    // Runs of equal chunks become one piece.
                    let mut pieces: Vec<MemoryPiece> = Vec::new();
                    for (fd, size) in chunks {
                        match pieces.last_mut() {
                            Some(p) if p.fd_bytes == size => p.n_fds += 1,
                            _ => pieces.push(MemoryPiece {
                                first_fd: fds.len() as u32,
                                n_fds: 1,
                                fd_offset: 0,
                                fd_bytes: size,
                            }),
                        }
                        fds.push(fd);
                    }
                    vmm.push((offset, pieces));
                }
            }
            if !ipc.is_empty() && !vmm.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "allocation {i}: some allocations are cudaMalloc memory and others VMM memory; one registration takes one kind"
                )));
            }
        }
        let Some(device) = device else {
            return Err(Error::InvalidArgument("no allocation to export".into()));
        };
        let memory = if vmm.is_empty() {
            Memory::cuda_ipc(ipc)
        } else {
            Memory::cuda_vmm(vmm.iter().map(|(o, p)| (*o, p.as_slice())))
        };
        Ok(CudaMemory {
            device: DeviceUuid::from_bytes(device),
            memory,
            fds,
        })
    }

    /// The device the memory is on.
    pub fn device(&self) -> DeviceUuid {
        self.device
    }

    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The VMM mappings' fds, in the order the memory's pieces name them
    /// (none for `cuMemAlloc` memory).
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(AsFd::as_fd).collect()
    }
}

impl Client {
    /// Registers a KV cache of `layout` whose allocations are an engine's
    /// own device memory (`spec.device` is set to the memory's device).
    pub fn register_cuda_memory(
        &mut self,
        spec: &KvSpec,
        layout: &KvLayout,
        memory: &CudaMemory,
    ) -> Result<Registration> {
        let spec = spec.on_device(memory.device);
        self.register(&spec, layout, &memory.memory, &memory.fds())
    }
}
