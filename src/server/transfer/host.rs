//! The host backend: slab-by-slab copies between mapped engine memory and
//! the pool, done in `submit` with streaming stores ([`super::nt_copy`]).

use super::backend::{Backend, BackendKind, ChunkCopy, CopyError, CopyExecutor, Dir};
use super::nt_copy;
use crate::proto::kv::{CudaRegion, RegisterKv};
use crate::server::registry::{DeviceMemory, DeviceOpener, Refusal};
use std::os::fd::OwnedFd;

/// The host backend.
pub struct HostBackend;

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn executor(&self) -> Result<Box<dyn CopyExecutor>, CopyError> {
        Ok(Box::new(HostExecutor { done: Vec::new() }))
    }
}

impl DeviceOpener for HostBackend {
    fn open_device(
        &self,
        _slot: u32,
        _req: &RegisterKv,
        _regions: &[CudaRegion],
        _fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal> {
        Err(Refusal::invalid(format!(
            "device memory needs the CUDA backend; this server copies with the {} backend (kvring serve --backend cuda)",
            self.name()
        )))
    }
}

struct HostExecutor {
    done: Vec<(usize, Result<u64, CopyError>)>,
}

impl CopyExecutor for HostExecutor {
    fn depth(&self) -> usize {
        1
    }

    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), CopyError> {
        let r = host_copy(c);
        self.done.push((token, r));
        Ok(())
    }

    fn poll(&mut self, _wait: bool, out: &mut Vec<(usize, Result<u64, CopyError>)>) {
        out.append(&mut self.done);
    }
}

/// The host copy of one chunk (slab pieces, four at a time, streaming).
pub(super) fn host_copy(c: &ChunkCopy<'_>) -> Result<u64, CopyError> {
    let l = c.layout;
    let slab = l.slab_bytes() as usize;
    let mut pieces = Vec::with_capacity((l.parts() * l.num_layers) as usize * c.blocks.len());
    for part in 0..l.parts() {
        for layer in 0..l.num_layers {
            for (j, &block) in c.blocks.iter().enumerate().skip(c.skip_blocks as usize) {
                let (t, off) = l.slab_at(layer, part, block);
                // Device memory has no host mapping (no tensors here).
                let tensor = c
                    .inst
                    .tensors
                    .get(t as usize)
                    .ok_or(CopyError::NotHostMemory)?;
                let obj_off = l.object_offset(c.chunk_tokens, layer, part, j as u32);
                debug_assert!(off + slab as u64 <= tensor.bytes());
                // SAFETY: `block < num_blocks` was checked when the job
                // was accepted, so the slab lies inside the tensor's
                // mapping (`slab_at` tiles the tensor exactly); the
                // object range lies inside the pool range the cache
                // allocated for `object_bytes`. Only addresses here.
                let (eng, obj) = unsafe {
                    (
                        tensor.ptr().add(off as usize),
                        c.object.add(obj_off as usize),
                    )
                };
                pieces.push(match c.dir {
                    Dir::ToPool => (obj, eng as *const u8),
                    Dir::FromPool => (eng, obj as *const u8),
                });
            }
        }
    }
    // SAFETY: every piece is a slab inside a live mapping (above); the
    // destinations are distinct slabs of one object (store) or distinct
    // blocks of the engine's cache (retrieve: block ids are distinct,
    // checked at acceptance), so no two overlap, and a
    // pool object never overlaps engine memory. The engine's memory may
    // change under the copy (its bytes are the engine's business) but
    // cannot shrink (sealed), so no access faults. Raw pointers only: no
    // reference to shared memory is formed.
    unsafe { nt_copy::copy_pieces(&pieces, slab) };
    // The streaming stores land before the job's completion is published
    // (a Release store after this returns).
    nt_copy::fence();
    Ok((pieces.len() * slab) as u64)
}
