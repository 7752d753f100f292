//! Registrations: each an engine's KV cache whose memory the server has
//! mapped once (host memory: sealed memfds received over the bootstrap
//! socket; device memory: opened by the copy backend through
//! [`DeviceOpener`]) or reaches by cross-memory attach (memory in the
//! engine process's own address space, [`PeerMemory`]), with its layout,
//! model, world size and rank.
//!
//! A registration is shared (`Arc`) with the copy tasks that use it, so its
//! mappings outlive an unregister or the client's death until the last copy
//! that reads them has finished.
//!
//! This module knows no copy backend: the backend implements
//! [`DeviceOpener`], and what it opens is kept here opaque.

use super::peer_memory::PeerMemory;
use super::refusal::Refusal;
use kvring::kv::{CopyPlan, KvLayout};
use kvring::liveness::PidFd;
use kvring::proto::kv::{KvAllocation, MemKind, MemoryPiece, RegisterKv, RegisterTables};
use memmap2::{MmapOptions, MmapRaw};
use std::any::Any;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

/// Largest world size (tensor-parallel ranks) a registration may name.
pub const MAX_WORLD_SIZE: u32 = 4096;

/// Rank tag of objects every rank shares (MLA).
pub const SHARED_RANK: u32 = 0xffff;

/// One allocation in host memory, mapped into the server.
pub struct MappedAllocation {
    _map: MmapRaw,
    ptr: *mut u8,
    bytes: u64,
}

// SAFETY: the mapping is owned here and only accessed through raw pointers
// by copy code that stays in bounds (`bytes`).
unsafe impl Send for MappedAllocation {}
// SAFETY: `&MappedAllocation` gives only the address and size.
unsafe impl Sync for MappedAllocation {}

/// What the copy backend opened for a registration in device memory (its
/// device, the allocations' memory and the layer table), kept until the
/// registration goes; only the backend that made it looks inside.
pub type DeviceMemory = Box<dyn Any + Send + Sync>;

/// Opens the device memory a registration names (the copy backend).
pub trait DeviceOpener {
    /// Opens the device memory of registration `req` of client `slot`, of
    /// the validated `layout`: `allocs` and `pieces` as sent (piece and
    /// descriptor indices checked), `fds` the descriptors that came with
    /// it. Each allocation's window must lie inside the memory opened.
    fn open_device(
        &self,
        slot: u32,
        req: &RegisterKv,
        layout: &KvLayout,
        allocs: &[KvAllocation],
        pieces: &[MemoryPiece],
        fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal>;
}

impl MappedAllocation {
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
    /// How its chunks move (from `layout`).
    pub plan: CopyPlan,
    pub fingerprint: u64,
    /// Host memory: each allocation's mapping (empty for device memory
    /// and for memory in the engine's address space).
    pub host: Vec<MappedAllocation>,
    /// Memory in the engine process's own address space.
    pub process: Option<PeerMemory>,
    /// Device memory: what the copy backend opened.
    pub device: Option<DeviceMemory>,
    /// The device the registration named ([0; 16]: none): its copies go
    /// to that device's copy lane.
    pub device_uuid: [u8; 16],
}

impl Registration {
    /// Whether every rank shares one object per chunk (MLA).
    pub fn shared_objects(&self) -> bool {
        self.layout.geometry().shared()
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
    /// Bytes of each of its chunk objects (fixed by the fingerprint).
    pub object_bytes: u64,
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

/// Checks a REGISTER's header before its tables are read: its memory
/// kind, rank and world, model id, geometry (which bounds the layer
/// table), and the counts of allocations and pieces.
fn check_request(req: &RegisterKv, chunk_tokens: u32) -> Result<MemKind, Refusal> {
    let kind = MemKind::decode(req.mem_kind)
        .map_err(|_| bad(format!("unknown memory kind {}", req.mem_kind)))?;
    if req.world_size == 0 || req.world_size > MAX_WORLD_SIZE || req.rank >= req.world_size {
        return Err(bad(format!(
            "rank {} of world size {}: need rank < world size <= {MAX_WORLD_SIZE}",
            req.rank, req.world_size
        )));
    }
    if req.model_id == 0 {
        return Err(bad("model id 0 is reserved"));
    }
    req.geometry
        .validate(chunk_tokens)
        .map_err(|e| bad(e.to_string()))?;
    if req.n_allocs as usize > kvring::kv::layout::MAX_ALLOCATIONS
        || req.n_pieces as usize > kvring::proto::kv::MAX_PIECES
    {
        return Err(bad(format!(
            "{} allocations of {} pieces: at most {} and {}",
            req.n_allocs,
            req.n_pieces,
            kvring::kv::layout::MAX_ALLOCATIONS,
            kvring::proto::kv::MAX_PIECES
        )));
    }
    Ok(kind)
}

/// Host mappings, an engine process's memory, or device memory: what
/// [`open_memory`] opened.
type OpenedMemory = (
    Vec<MappedAllocation>,
    Option<PeerMemory>,
    Option<DeviceMemory>,
);

/// The registered memory, opened as its kind says: mappings of the host
/// descriptors sent, the engine process's own memory (cross-memory
/// attach), or the device memory the backend opens.
#[allow(clippy::too_many_arguments)]
fn open_memory(
    kind: MemKind,
    slot: u32,
    peer: Option<(u32, &PidFd)>,
    req: &RegisterKv,
    layout: &KvLayout,
    t: &RegisterTables,
    fds: &[OwnedFd],
    backend: &(impl DeviceOpener + ?Sized),
) -> Result<OpenedMemory, Refusal> {
    Ok(if kind == MemKind::ProcessVm {
        let (pid, pidfd) = peer.ok_or_else(|| {
            bad("the registering process is not known (its pidfd could not be opened)")
        })?;
        let pidfd = pidfd
            .try_clone()
            .map_err(|e| bad(format!("pidfd of process {pid}: {e}")))?;
        (
            Vec::new(),
            Some(PeerMemory::open(pid, pidfd, &t.allocs)?),
            None,
        )
    } else if kind == MemKind::HostFd {
        let mut maps = Vec::with_capacity(t.allocs.len());
        for (i, a) in t.allocs.iter().enumerate() {
            let p = &t.pieces[a.first_piece as usize];
            let fd = &fds[p.first_fd as usize];
            let at = p.fd_offset + a.offset;
            maps.push(
                map_region(fd, at, a.bytes)
                    .map_err(|r| Refusal::new(r.status, format!("allocation {i}: {}", r.reason)))?,
            );
        }
        (maps, None, None)
    } else {
        let d = backend.open_device(slot, req, layout, &t.allocs, &t.pieces, fds)?;
        (Vec::new(), None, Some(d))
    })
}

fn bad(text: impl Into<String>) -> Refusal {
    Refusal::invalid(text)
}

/// Checks that every allocation names memory of its kind that was sent:
/// its pieces exist, their descriptors were sent, and its window lies in
/// the memory the pieces add up to (IPC allocations: checked against the
/// driver's size when opened; host memfds: against their size when
/// mapped).
fn check_memory(
    kind: MemKind,
    allocs: &[KvAllocation],
    pieces: &[MemoryPiece],
    fds: usize,
) -> Result<(), Refusal> {
    for (i, a) in allocs.iter().enumerate() {
        let end = a.offset.checked_add(a.bytes);
        let Some(end) = end else {
            return Err(bad(format!("allocation {i}: window overflows")));
        };
        let first = a.first_piece as usize;
        let own = first
            .checked_add(a.n_pieces as usize)
            .and_then(|e| pieces.get(first..e))
            .ok_or_else(|| {
                bad(format!(
                    "allocation {i}: pieces {first}..+{} of {} sent",
                    a.n_pieces,
                    pieces.len()
                ))
            })?;
        match kind {
            MemKind::CudaIpc if !own.is_empty() => {
                return Err(bad(format!(
                    "allocation {i}: an IPC allocation has no pieces"
                )));
            }
            MemKind::ProcessVm if !own.is_empty() => {
                return Err(bad(format!(
                    "allocation {i}: memory in the engine's address space has no pieces"
                )));
            }
            // Checked against the process's mappings when opened.
            MemKind::CudaIpc | MemKind::ProcessVm => continue,
            MemKind::HostFd if own.len() != 1 || own[0].n_fds != 1 => {
                return Err(bad(format!(
                    "allocation {i}: host memory is one memfd per allocation"
                )));
            }
            MemKind::CudaVmmFd if own.is_empty() => {
                return Err(bad(format!("allocation {i}: VMM memory needs its chunks")));
            }
            _ => {}
        }
        let mut total = 0u64;
        for p in own {
            let last = p.first_fd as usize + p.n_fds as usize;
            if p.n_fds == 0 || last > fds {
                return Err(bad(format!(
                    "allocation {i}: descriptors {}..+{} of {fds} sent",
                    p.first_fd, p.n_fds
                )));
            }
            if p.fd_bytes == 0 {
                return Err(bad(format!("allocation {i}: a piece of 0 bytes")));
            }
            if kind == MemKind::CudaVmmFd && p.fd_offset != 0 {
                return Err(bad(format!(
                    "allocation {i}: VMM chunks are mapped whole (offset 0)"
                )));
            }
            total = u64::from(p.n_fds)
                .checked_mul(p.fd_bytes)
                .and_then(|b| total.checked_add(b))
                .ok_or_else(|| bad(format!("allocation {i}: size overflows")))?;
        }
        if end > total {
            return Err(bad(format!(
                "allocation {i}: window [{}, {end}) exceeds its {total} bytes of memory",
                a.offset
            )));
        }
    }
    Ok(())
}

/// Maps `bytes` at `offset` of a sealed memfd, after checking the seal and
/// the size, so the mapping can never fault (the engine cannot shrink it).
fn map_region(fd: &OwnedFd, offset: u64, bytes: u64) -> Result<MappedAllocation, Refusal> {
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
    let page = kvring::shm::PAGE as u64;
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
    Ok(MappedAllocation {
        _map: map,
        ptr,
        bytes,
    })
}

impl Registry {
    /// Registers a KV cache for client `slot`/`session`, whose process is
    /// `peer` (pid and pidfd, from the connection): `req` and the tables
    /// that followed it (`tables`), with the descriptors `fds`; `backend`
    /// opens device memory.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        slot: u32,
        session: u32,
        peer: Option<(u32, &PidFd)>,
        chunk_tokens: u32,
        req: &RegisterKv,
        tables: &[u8],
        fds: &[OwnedFd],
        backend: &(impl DeviceOpener + ?Sized),
    ) -> Result<Arc<Registration>, Refusal> {
        let kind = check_request(req, chunk_tokens)?;
        let t = RegisterTables::decode(req, tables).ok_or_else(|| {
            Refusal::new(
                kvring::proto::Status::Malformed,
                "registration tables' length differs from what the header announces",
            )
        })?;
        check_memory(kind, &t.allocs, &t.pieces, fds.len())?;
        let layout = KvLayout::new(
            req.geometry,
            t.allocs.iter().map(|a| a.bytes).collect(),
            t.layers.clone(),
        );
        layout
            .validate(chunk_tokens)
            .map_err(|e| bad(e.to_string()))?;
        let fingerprint = layout.fingerprint(chunk_tokens);
        let shared = layout.geometry().shared();
        let gkey = (req.model_id, req.world_size);
        if let Some(g) = self.groups.get(&gkey) {
            if g.fingerprint != fingerprint || g.shared_objects != shared {
                return Err(bad(
                    "geometry differs from the model's other registered ranks (layers, heads, K and V widths, element size)",
                ));
            }
        }
        if kind == MemKind::ProcessVm && !fds.is_empty() {
            return Err(bad(
                "memory in the engine's address space takes no descriptors",
            ));
        }
        let (host, process, dev) = open_memory(kind, slot, peer, req, &layout, &t, fds, backend)?;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        while self.instances.contains_key(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1).max(1);
        }
        let plan = layout.plan();
        let inst = Arc::new(Registration {
            id: self.next_id,
            owner_slot: slot,
            owner_session: session,
            model_id: req.model_id,
            world_size: req.world_size,
            rank: req.rank,
            layout,
            plan,
            fingerprint,
            host,
            process,
            device: dev,
            device_uuid: req.device_uuid,
        });
        self.groups
            .entry(gkey)
            .or_insert(Group {
                fingerprint,
                object_bytes: inst.layout.object_bytes(chunk_tokens),
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
        // Memory in the engine's address space is the engine's again once
        // it unregisters or goes: copies still queued with the registration
        // must not touch it (a mapped memfd stays valid; this does not).
        if let Some(p) = &inst.process {
            p.revoke();
        }
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
