//! Registrations: each an engine's KV cache whose memory the server has
//! mapped once (host memory: sealed memfds received over the bootstrap
//! socket; device memory: opened by the copy backend through
//! [`DeviceOpener`]), with its layout, model, world size and rank.
//!
//! A registration is shared (`Arc`) with the copy tasks that use it, so its
//! mappings outlive an unregister or the client's death until the last copy
//! that reads them has finished.
//!
//! This module knows no copy backend: the backend implements
//! [`DeviceOpener`], and what it opens is kept here opaque.

use crate::kv::KvLayout;
use crate::proto::kv::{CudaRegion, MemKind, RegisterKv, TensorRegion};
use memmap2::{MmapOptions, MmapRaw};
use std::any::Any;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

/// Largest world size (tensor-parallel ranks) a registration may name.
pub const MAX_WORLD_SIZE: u32 = 4096;

/// Rank tag of objects every rank shares (MLA).
pub const SHARED_RANK: u32 = 0xffff;

/// One tensor in host memory, mapped into the server.
pub struct HostTensor {
    _map: MmapRaw,
    ptr: *mut u8,
    bytes: u64,
}

// SAFETY: the mapping is owned here and only accessed through raw pointers
// by copy code that stays in bounds (`bytes`).
unsafe impl Send for HostTensor {}
// SAFETY: `&HostTensor` gives only the address and size.
unsafe impl Sync for HostTensor {}

/// What the copy backend opened for a registration in device memory (its
/// device, the tensors' memory and address table), kept until the
/// registration goes; only the backend that made it looks inside.
pub type DeviceMemory = Box<dyn Any + Send + Sync>;

/// Opens the device memory a registration names (the copy backend).
pub trait DeviceOpener {
    /// Opens the device memory of registration `req` of client `slot`:
    /// `regions` as sent, `fds` the descriptors that came with it.
    fn open_device(
        &self,
        slot: u32,
        req: &RegisterKv,
        regions: &[CudaRegion],
        fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal>;
}

impl HostTensor {
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A registered KV cache.
pub struct Registration {
    pub id: u32,
    pub owner_slot: u32,
    pub owner_session: u32,
    pub model_id: u64,
    pub world_size: u32,
    pub rank: u32,
    pub layout: KvLayout,
    pub fingerprint: u64,
    /// Host memory: the tensors' mappings (empty for device memory).
    pub tensors: Vec<HostTensor>,
    /// Device memory: what the copy backend opened.
    pub device: Option<DeviceMemory>,
    /// The device the registration named ([0; 16]: none): its copies go
    /// to that device's copy lane.
    pub device_uuid: [u8; 16],
}

impl Registration {
    /// Whether every rank shares one object per chunk (MLA).
    pub fn shared_objects(&self) -> bool {
        self.layout.parts() == 1
    }

    /// The rank tag of this instance's objects.
    pub fn rank_tag(&self) -> u32 {
        rank_tag(
            self.world_size,
            if self.shared_objects() {
                SHARED_RANK
            } else {
                self.rank
            },
        )
    }
}

/// `world_size << 16 | rank` (rank `SHARED_RANK` for shared objects).
pub fn rank_tag(world_size: u32, rank: u32) -> u32 {
    (world_size << 16) | (rank & 0xffff)
}

/// What every instance of one (model, world size) agrees on: how lookups
/// of that model expand a chunk into objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub fingerprint: u64,
    pub shared_objects: bool,
    pub(crate) members: u32,
}

/// Every registered instance.
#[derive(Default)]
pub struct Registry {
    next_id: u32,
    instances: HashMap<u32, Arc<Registration>>,
    groups: HashMap<(u64, u32), Group>,
}

/// Why a registration was refused: the status and the text of the reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({status:?})")]
pub struct Refusal {
    pub status: crate::proto::Status,
    pub reason: String,
}

impl Refusal {
    pub fn new(status: crate::proto::Status, reason: impl Into<String>) -> Refusal {
        Refusal {
            status,
            reason: reason.into(),
        }
    }

    /// A registration that names something impossible (`InvalidArgument`).
    pub fn invalid(reason: impl Into<String>) -> Refusal {
        Refusal::new(crate::proto::Status::InvalidArgument, reason)
    }
}

fn bad(text: impl Into<String>) -> Refusal {
    Refusal::invalid(text)
}

/// Maps `bytes` at `offset` of a sealed memfd, after checking the seal and
/// the size, so the mapping can never fault (the engine cannot shrink it).
fn map_region(fd: &OwnedFd, offset: u64, bytes: u64) -> Result<HostTensor, Refusal> {
    // SAFETY: F_GET_SEALS only reads the descriptor's seal set.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(bad(
            "tensor memory must be a memfd sealed with F_SEAL_SHRINK (HostKvCache does this)",
        ));
    }
    let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| bad(format!("fstat: {e}")))?;
    let size = st.st_size as u64;
    let end = offset
        .checked_add(bytes)
        .ok_or_else(|| bad("region offset overflows"))?;
    if end > size {
        return Err(bad(format!(
            "region [{offset}, {end}) exceeds the memory object's {size} bytes"
        )));
    }
    let page = crate::shm::PAGE as u64;
    let start = offset / page * page;
    // Populated: the page tables are built once here, not by faults in the
    // first copies.
    let map = MmapOptions::new()
        .offset(start)
        .len((end - start) as usize)
        .populate()
        .map_raw(fd)
        .map_err(|e| bad(format!("mmap: {e}")))?;
    // SAFETY: `offset - start` < one page, inside the mapping.
    let ptr = unsafe { map.as_mut_ptr().add((offset - start) as usize) };
    Ok(HostTensor {
        _map: map,
        ptr,
        bytes,
    })
}

impl Registry {
    /// Registers a KV cache for client `slot`/`session`; `backend` opens
    /// device memory.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        slot: u32,
        session: u32,
        chunk_tokens: u32,
        req: &RegisterKv,
        table: &[u8],
        fds: &[OwnedFd],
        backend: &(impl DeviceOpener + ?Sized),
    ) -> Result<Arc<Registration>, Refusal> {
        let host = match MemKind::decode(req.mem_kind) {
            Ok(MemKind::HostFd) => true,
            Ok(MemKind::CudaIpc | MemKind::CudaVmmFd) => false,
            Err(_) => return Err(bad(format!("unknown memory kind {}", req.mem_kind))),
        };
        let region_bytes = if host {
            std::mem::size_of::<TensorRegion>()
        } else {
            std::mem::size_of::<CudaRegion>()
        };
        if table.len() != req.n_tensors as usize * region_bytes {
            return Err(Refusal::new(
                crate::proto::Status::Malformed,
                "tensor table length differs from n_tensors",
            ));
        }
        if req.world_size == 0 || req.world_size > MAX_WORLD_SIZE || req.rank >= req.world_size {
            return Err(bad(format!(
                "rank {} of world size {}: need rank < world size <= {MAX_WORLD_SIZE}",
                req.rank, req.world_size
            )));
        }
        if req.model_id == 0 {
            return Err(bad("model id 0 is reserved"));
        }
        let layout = req.layout;
        layout
            .validate(chunk_tokens)
            .map_err(|e| bad(e.to_string()))?;
        if req.n_tensors != layout.num_tensors() {
            return Err(bad(format!(
                "{} tensor regions for a layout of {} tensors",
                req.n_tensors,
                layout.num_tensors()
            )));
        }
        let fingerprint = layout.fingerprint(chunk_tokens);
        let shared = layout.parts() == 1;
        let gkey = (req.model_id, req.world_size);
        if let Some(g) = self.groups.get(&gkey) {
            if g.fingerprint != fingerprint || g.shared_objects != shared {
                return Err(bad(
                    "layout differs from the model's other registered ranks (layers, heads, head dim, element size)",
                ));
            }
        }
        let (tensors, dev) = if host {
            let mut tensors = Vec::with_capacity(req.n_tensors as usize);
            for (i, c) in table.chunks_exact(region_bytes).enumerate() {
                let r: TensorRegion = bytemuck::pod_read_unaligned(c);
                let fd = fds.get(r.fd_index as usize).ok_or_else(|| {
                    bad(format!(
                        "tensor {i}: descriptor {} of {} sent",
                        r.fd_index,
                        fds.len()
                    ))
                })?;
                tensors.push(
                    map_region(fd, r.offset, layout.tensor_bytes())
                        .map_err(|r| Refusal::new(r.status, format!("tensor {i}: {}", r.reason)))?,
                );
            }
            (tensors, None)
        } else {
            let regions: Vec<CudaRegion> = table
                .chunks_exact(region_bytes)
                .map(bytemuck::pod_read_unaligned)
                .collect();
            (
                Vec::new(),
                Some(backend.open_device(slot, req, &regions, fds)?),
            )
        };
        self.next_id = self.next_id.wrapping_add(1).max(1);
        while self.instances.contains_key(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1).max(1);
        }
        let inst = Arc::new(Registration {
            id: self.next_id,
            owner_slot: slot,
            owner_session: session,
            model_id: req.model_id,
            world_size: req.world_size,
            rank: req.rank,
            layout,
            fingerprint,
            tensors,
            device: dev,
            device_uuid: req.device_uuid,
        });
        self.groups
            .entry(gkey)
            .or_insert(Group {
                fingerprint,
                shared_objects: shared,
                members: 0,
            })
            .members += 1;
        self.instances.insert(inst.id, inst.clone());
        Ok(inst)
    }

    fn remove(&mut self, id: u32) {
        let Some(inst) = self.instances.remove(&id) else {
            return;
        };
        let gkey = (inst.model_id, inst.world_size);
        if let Some(g) = self.groups.get_mut(&gkey) {
            g.members -= 1;
            if g.members == 0 {
                self.groups.remove(&gkey);
            }
        }
    }

    /// Unregisters `id` if client `slot`/`session` registered it.
    pub fn unregister(&mut self, slot: u32, session: u32, id: u32) -> bool {
        match self.instances.get(&id) {
            Some(i) if i.owner_slot == slot && i.owner_session == session => {
                self.remove(id);
                true
            }
            _ => false,
        }
    }

    /// Drops every instance of client `slot`. Returns how many.
    pub fn client_gone(&mut self, slot: u32) -> usize {
        let ids: Vec<u32> = self
            .instances
            .values()
            .filter(|i| i.owner_slot == slot)
            .map(|i| i.id)
            .collect();
        for id in &ids {
            self.remove(*id);
        }
        ids.len()
    }

    /// Registration `id` if client `slot`/`session` owns it.
    pub fn get(&self, slot: u32, session: u32, id: u32) -> Option<Arc<Registration>> {
        self.instances
            .get(&id)
            .filter(|i| i.owner_slot == slot && i.owner_session == session)
            .cloned()
    }

    /// The group of (model, world size), if any instance of it is registered.
    pub fn group(&self, model_id: u64, world_size: u32) -> Option<Group> {
        self.groups.get(&(model_id, world_size)).copied()
    }

    pub fn len(&self) -> usize {
        self.instances.len()
    }

    /// Instances client `slot` has registered.
    pub fn count_of(&self, slot: u32) -> usize {
        self.instances
            .values()
            .filter(|i| i.owner_slot == slot)
            .count()
    }
}
