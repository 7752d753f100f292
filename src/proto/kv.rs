//! The KV operations' wire structs: ring request payloads (a fixed header,
//! then arrays), completion payloads, and the registration messages of the
//! bootstrap socket. Tables in `shm_layout.md`.

use crate::jobs::JobId;
use crate::kv::{KvGeometry, LayerPlacement};
use crate::shm_struct::shm_struct;
use crate::wire::wire_enum;
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

shm_struct! {
    /// LOOKUP: `n_chunks` chained chunk hashes (16 bytes each) follow.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct LookupRequest {
        [0] pub model_id: u64,
        [8] pub salt: u64,
        [16] pub world_size: u32,
        [20] pub n_chunks: u32,
    }
}

shm_struct! {
    /// STORE: `n_chunks` chunk hashes (16 bytes each), then
    /// `n_chunks * blocks_per_chunk` block ids (u32) follow.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct StoreRequest {
        [0] pub instance: u32,
        [4] pub n_chunks: u32,
        [8] pub salt: u64,
        /// [`KvFlags`].
        [16] pub flags: u32,
        /// The job's entry in the caller's job words (below `JOB_WORDS`).
        [20] pub word: u32,
        /// The job's generation in that entry ([`crate::job_words`]).
        [24] pub generation: u32,
        [28] pub _reserved: u32,
        /// With `KvFlags::EVENT`: the CUDA IPC event the engine recorded
        /// after writing the blocks; the server queues the copies once it
        /// sees the event complete (polled from the host), or fails the job
        /// `EngineEventTimeout` at its deadline.
        [32] pub event: [u8; 64],
    }
}

bitflags::bitflags! {
    /// `StoreRequest::flags` / `RetrieveRequest::flags` bits (the fields stay
    /// `u32`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct KvFlags: u32 {
        /// `event` is set.
        const EVENT = 1;
    }
}

shm_struct! {
    /// DESCRIBE: the token ids of `n_chunks` consecutive chunks of a prompt
    /// (`n_chunks * chunk_tokens` u32 follow), for the server's event stream
    /// (`kvring serve --kv-events`): the server computes the chunks' hashes
    /// itself, continuing the chain from `prev`, so what it publishes for a
    /// chunk hash is always the tokens that hash names. Sent ahead of the
    /// stores of those chunks, and only to a server whose
    /// [`ConfigReply::flags`] has [`ConfigFlags::EVENTS`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct DescribeRequest {
        [0] pub model_id: u64,
        [8] pub salt: u64,
        /// The chain's state after the chunk before the first of these
        /// ([`crate::kv::ChainState`]); [`crate::kv::chain_seed`] for a
        /// prompt's first chunk.
        [16] pub prev: [u8; 32],
        [48] pub n_chunks: u32,
        [52] pub _reserved: u32,
    }
}

shm_struct! {
    /// RETRIEVE: `n_chunks * blocks_per_chunk` block ids (u32) follow. Chunks
    /// `first_chunk ..` of the lookup `lease` are copied into them, layer
    /// group after layer group; the first `skip_tokens` tokens (a multiple
    /// of the block size) are left alone.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct RetrieveRequest {
        [0] pub lease: JobId,
        [16] pub instance: u32,
        [20] pub first_chunk: u32,
        [24] pub n_chunks: u32,
        [28] pub skip_tokens: u32,
        /// [`KvFlags`].
        [32] pub flags: u32,
        /// The job's entry in the caller's job words (below `JOB_WORDS`).
        [36] pub word: u32,
        /// The job's generation in that entry ([`crate::job_words`]).
        [40] pub generation: u32,
        /// The layer groups the chunks land in, one after another
        /// ([`crate::kv::LayerGroups`]; 0 counts as 1): the server moves the
        /// job's `landed` word as each group lands.
        [44] pub layer_groups: u32,
        /// With `KvFlags::EVENT`: the CUDA IPC event the engine recorded
        /// after it stopped using the blocks; the server's copies come
        /// after it (polled from the host).
        [48] pub event: [u8; 64],
    }
}

shm_struct! {
    /// FREE_LOOKUP_LOCKS: ends the lease's holds on chunks
    /// `first_chunk .. first_chunk + n_chunks` (`n_chunks` u32::MAX: to the end).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct FreeLocksRequest {
        [0] pub lease: JobId,
        [16] pub first_chunk: u32,
        [20] pub n_chunks: u32,
    }
}

shm_struct! {
    /// END_SESSION: ends everything the lease still holds and marks its objects
    /// recently used.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct EndSessionRequest {
        [0] pub lease: JobId,
    }
}

shm_struct! {
    /// Completion of CLEAR.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct ClearReply {
        [0] pub objects: u64,
        [8] pub bytes: u64,
    }
}

shm_struct! {
    /// Completion of GET_CONFIG: what an engine must agree with.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct ConfigReply {
        [0] pub chunk_tokens: u32,
        [4] pub copy_threads: u32,
        [8] pub pool_bytes: u64,
        [16] pub max_request_bytes: u32,
        [20] pub lease_ttl_ms: u32,
        /// [`BackendKind`] code.
        [24] pub backend: u32,
        /// [`ConfigFlags`].
        [28] pub flags: u32,
    }
}

bitflags::bitflags! {
    /// `ConfigReply::flags` bits (the field stays `u32`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct ConfigFlags: u32 {
        /// The server publishes KV events: engines DESCRIBE the chunks
        /// they store, so the events carry their token ids.
        const EVENTS = 1;
    }
}

shm_struct! {
    /// Completion of STATS: the cache counters, as the segment header has them.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable, serde::Serialize)]
    pub struct StatsReply {
        [0] pub pool_bytes: u64,
        [8] pub pool_used_bytes: u64,
        [16] pub objects: u64,
        [24] pub leases: u64,
        [32] pub instances: u64,
        [40] pub lookups: u64,
        [48] pub lookup_chunks: u64,
        [56] pub lookup_hit_chunks: u64,
        [64] pub stores: u64,
        [72] pub stored_chunks: u64,
        [80] pub stored_bytes: u64,
        [88] pub store_no_space_chunks: u64,
        [96] pub retrieves: u64,
        [104] pub retrieved_chunks: u64,
        [112] pub retrieved_bytes: u64,
        [120] pub evicted_objects: u64,
        [128] pub evicted_bytes: u64,
        [136] pub leases_expired: u64,
        /// Objects an operator pinned (never evicted nor cleared).
        [144] pub pinned_objects: u64,
        /// Bytes of those objects.
        [152] pub pinned_bytes: u64,
        /// Chunks a lookup found in the second tier (and brought into the
        /// pool) beyond those the pool had: part of `lookup_hit_chunks`.
        [160] pub lookup_l2_hit_chunks: u64,
        /// The second tier's state, a [`TierState`] (`StatsReply::tier_state`).
        [168] pub l2_state: u64,
        /// Objects written to the second tier.
        [176] pub l2_written_objects: u64,
        /// Objects not written: the tier's queue full, the tier down, or
        /// too many bytes waiting to be written.
        [184] pub l2_write_dropped_objects: u64,
        /// Objects read from the second tier into the pool.
        [192] pub l2_loaded_objects: u64,
        /// Objects asked of the second tier and not there.
        [200] pub l2_missed_objects: u64,
        /// Values that are not the object their key names (read as misses).
        [208] pub l2_corrupt_objects: u64,
        /// Bytes written to and read from the second tier (values).
        [216] pub l2_bytes_out: u64,
        [224] pub l2_bytes_in: u64,
        /// Commands that failed: timeouts and connection errors (the tier
        /// goes down), error replies about one key (a miss or a dropped write).
        [232] pub l2_errors: u64,
        /// Operations queued for or running on the tier now.
        [240] pub l2_queue: u64,
        /// Chunks a lookup found on the disk tier (and brought into the
        /// pool) beyond those the pool had: part of `lookup_hit_chunks`.
        [248] pub lookup_disk_hit_chunks: u64,
        /// The disk tier's state, a [`TierState`] (`StatsReply::disk_tier_state`).
        [256] pub disk_state: u64,
        /// Objects written to the disk tier.
        [264] pub disk_written_objects: u64,
        /// Objects not written: the tier's queue full, the tier down (after
        /// I/O errors), a write that failed, or too many bytes waiting.
        [272] pub disk_write_dropped_objects: u64,
        /// Objects read from the disk tier into the pool.
        [280] pub disk_loaded_objects: u64,
        /// Objects asked of the disk tier and not there.
        [288] pub disk_missed_objects: u64,
        /// Records that are not the object their key names (read as misses).
        [296] pub disk_corrupt_objects: u64,
        /// Record bytes written to and read from the disk tier.
        [304] pub disk_bytes_out: u64,
        [312] pub disk_bytes_in: u64,
        /// Reads and writes that failed (an I/O error, a full disk, a
        /// deadline passed).
        [320] pub disk_errors: u64,
        /// Operations queued for or running on the disk tier now.
        [328] pub disk_queue: u64,
        /// Objects on the disk tier now, and the bytes of its segment files.
        [336] pub disk_objects: u64,
        [344] pub disk_used_bytes: u64,
        /// The disk tier's byte budget (`--disk-bytes`).
        [352] pub disk_capacity_bytes: u64,
        /// KV events published on the node's event stream (`--kv-events`).
        [360] pub events_published: u64,
        /// Event records dropped because the stream's queue was full (a
        /// resync follows).
        [368] pub events_dropped: u64,
        /// Resyncs published: "all cleared", then every object the pool
        /// holds (at the start, after dropped records, at a subscriber's
        /// request).
        [376] pub events_resyncs: u64,
    }
}

wire_enum! {
    /// `StatsReply::l2_state`: the state of the tier below the pool.
    pub enum TierState: u64 {
        /// No such tier.
        None = 0 => "none",
        /// Started, not yet answered.
        Connecting = 1 => "connecting",
        /// Answering: operations are taken.
        Up = 2 => "up",
        /// Not answering: nothing waits on it, it is probed again.
        Down = 3 => "down",
    }
}

impl StatsReply {
    /// The second (remote) tier's state (`Err` for a code this build does
    /// not know).
    pub fn tier_state(&self) -> Result<TierState, crate::wire::Unknown<u64>> {
        TierState::decode(self.l2_state)
    }

    /// The disk tier's state (`Err` for a code this build does not know).
    pub fn disk_tier_state(&self) -> Result<TierState, crate::wire::Unknown<u64>> {
        TierState::decode(self.disk_state)
    }
}

wire_enum! {
    /// `ConfigReply::backend`: what the server copies with.
    pub enum BackendKind: u32 {
        /// Host memory copies (engines' caches in host memory).
        Host = 1 => "host",
        /// The CUDA data plane (GPU and host caches).
        Cuda = 2 => "cuda",
    }
}

wire_enum! {
    /// `RegisterKv::mem_kind`: how the KV cache's memory is handed over.
    pub enum MemKind: u32 {
        /// Host memory: sealed memfds passed with the message (SCM_RIGHTS).
        HostFd = 1 => "host_fd",
        /// Device memory: a legacy CUDA IPC handle per allocation
        /// (`cuMemAlloc` memory).
        CudaIpc = 2 => "cuda_ipc",
        /// Device memory: CUDA VMM memory exported as POSIX fds (one per
        /// physical chunk), passed with the message; the server maps an
        /// allocation's chunks contiguously, in order.
        CudaVmmFd = 3 => "cuda_vmm_fd",
        /// Host memory in the registering process's own address space (any
        /// allocation: a CPU tensor, a malloc'd buffer): each allocation's
        /// `offset` is its address there. No descriptor; the server copies
        /// with cross-memory attach (`process_vm_readv`/`process_vm_writev`)
        /// into the process on the other end of the connection, which
        /// consents by registering.
        ProcessVm = 4 => "process_vm",
    }
}

shm_struct! {
    /// One allocation a registration's layout addresses: the `bytes` at
    /// `offset` of some memory, which is the IPC allocation `ipc_handle`
    /// (kind 2), the concatenation of pieces `first_piece ..
    /// first_piece + n_pieces` (kinds 1 and 3), or the registering
    /// process's address space (kind 4: `offset` is the address; no
    /// pieces).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct KvAllocation {
        [0] pub ipc_handle: [u8; 64],
        [64] pub offset: u64,
        [72] pub bytes: u64,
        [80] pub first_piece: u32,
        [84] pub n_pieces: u32,
    }
}

shm_struct! {
    /// `n_fds` descriptors, from `first_fd` of those sent, each giving
    /// `fd_bytes` bytes from `fd_offset` (host memfds; VMM chunks: 0).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct MemoryPiece {
        [0] pub first_fd: u32,
        [4] pub n_fds: u32,
        [8] pub fd_offset: u64,
        [16] pub fd_bytes: u64,
    }
}

shm_struct! {
    /// Bootstrap message: register an engine instance's KV cache. Followed
    /// by `n_allocs` [`KvAllocation`]s, `n_pieces` [`MemoryPiece`]s and
    /// `geometry.layers` [`LayerPlacement`]s; the memory's descriptors
    /// travel with this message and any [`AttachFds`] messages sent just
    /// before it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct RegisterKv {
        [0] pub magic: u64,
        /// `BootKind::Register`.
        [8] pub kind: u32,
        /// [`MemKind`].
        [12] pub mem_kind: u32,
        [16] pub model_id: u64,
        [24] pub world_size: u32,
        [28] pub rank: u32,
        [32] pub geometry: KvGeometry,
        [64] pub n_allocs: u32,
        [68] pub n_pieces: u32,
        /// Device memory: the device's UUID (memory kinds 2 and 3). Host
        /// memory: zero, or the device the engine's worker runs on (its copies
        /// go to that device's copy lane).
        [72] pub device_uuid: [u8; 16],
    }
}

/// Most memory pieces one registration may send (a piece is a run of
/// descriptors of one size: an allocation of any number of equal VMM chunks
/// is one piece).
pub const MAX_PIECES: usize = 2048;

/// The largest registration message: the header and the largest tables
/// ([`crate::kv::layout::MAX_ALLOCATIONS`] allocations, [`MAX_PIECES`]
/// pieces, [`crate::kv::geometry::MAX_LAYERS`] placements), under the
/// default socket buffer of a `SOCK_SEQPACKET` message.
pub const MAX_REGISTER_MESSAGE: usize = size_of::<RegisterKv>()
    + crate::kv::layout::MAX_ALLOCATIONS * size_of::<KvAllocation>()
    + MAX_PIECES * size_of::<MemoryPiece>()
    + crate::kv::geometry::MAX_LAYERS as usize * size_of::<LayerPlacement>();

/// The arrays that follow a [`RegisterKv`], decoded (every value untrusted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisterTables {
    pub allocs: Vec<KvAllocation>,
    pub pieces: Vec<MemoryPiece>,
    pub layers: Vec<LayerPlacement>,
}

impl RegisterTables {
    /// The tables' bytes as sent.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(
            self.allocs.len() * size_of::<KvAllocation>()
                + self.pieces.len() * size_of::<MemoryPiece>()
                + self.layers.len() * size_of::<LayerPlacement>(),
        );
        v.extend_from_slice(bytemuck::cast_slice(&self.allocs));
        v.extend_from_slice(bytemuck::cast_slice(&self.pieces));
        v.extend_from_slice(bytemuck::cast_slice(&self.layers));
        v
    }

    /// Decodes the tables `req` announces from `bytes`, which must hold
    /// exactly them (the geometry's layer count checked first).
    pub fn decode(req: &RegisterKv, bytes: &[u8]) -> Option<RegisterTables> {
        let (na, np) = (req.n_allocs as usize, req.n_pieces as usize);
        let nl = req.geometry.layers as usize;
        let want = na
            .checked_mul(size_of::<KvAllocation>())?
            .checked_add(np.checked_mul(size_of::<MemoryPiece>())?)?
            .checked_add(nl.checked_mul(size_of::<LayerPlacement>())?)?;
        if bytes.len() != want {
            return None;
        }
        let (a, rest) = bytes.split_at(na * size_of::<KvAllocation>());
        let (p, l) = rest.split_at(np * size_of::<MemoryPiece>());
        Some(RegisterTables {
            allocs: a
                .chunks_exact(size_of::<KvAllocation>())
                .map(bytemuck::pod_read_unaligned)
                .collect(),
            pieces: p
                .chunks_exact(size_of::<MemoryPiece>())
                .map(bytemuck::pod_read_unaligned)
                .collect(),
            layers: l
                .chunks_exact(size_of::<LayerPlacement>())
                .map(bytemuck::pod_read_unaligned)
                .collect(),
        })
    }
}

shm_struct! {
    /// Bootstrap message: descriptors for the next `RegisterKv` (when it needs
    /// more than one message can carry).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct AttachFds {
        [0] pub magic: u64,
        /// `BootKind::AttachFds`.
        [8] pub kind: u32,
        [12] pub count: u32,
    }
}

shm_struct! {
    /// Bootstrap message: unregister an instance.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct UnregisterKv {
        [0] pub magic: u64,
        /// `BootKind::Unregister`.
        [8] pub kind: u32,
        [12] pub instance: u32,
    }
}

/// Bytes of a reply's message text.
pub const REPLY_TEXT: usize = 200;

shm_struct! {
    /// Bootstrap reply to `RegisterKv`, `UnregisterKv` and `AttachFds`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct RegisterReply {
        [0] pub magic: u64,
        /// `BootKind::RegisterReply`.
        [8] pub kind: u32,
        /// 0 ok, else a `Status` code; `text` says why.
        [12] pub status: i32,
        /// The instance handle for STORE and RETRIEVE.
        [16] pub instance: u32,
        /// The server's chunk size in tokens.
        [20] pub chunk_tokens: u32,
        /// UTF-8, zero-padded.
        [24] pub text: [u8; REPLY_TEXT],
    }
}

const _: () = {
    assert!(size_of::<LookupRequest>() == 24);
    assert!(size_of::<StoreRequest>() == 96);
    assert!(size_of::<RetrieveRequest>() == 112);
    assert!(size_of::<KvAllocation>() == 88);
    assert!(size_of::<MemoryPiece>() == 24);
    assert!(size_of::<FreeLocksRequest>() == 24);
    assert!(size_of::<EndSessionRequest>() == 16);
    assert!(size_of::<ClearReply>() == 16);
    assert!(size_of::<ConfigReply>() == 32);
    assert!(size_of::<StatsReply>() == 48 * 8);
    assert!(size_of::<DescribeRequest>() == 56);
    assert!(size_of::<RegisterKv>() == 88);
    assert!(size_of::<AttachFds>() == 16);
    assert!(size_of::<UnregisterKv>() == 16);
    assert!(size_of::<RegisterReply>() == 224);
    // What shm_layout.md states.
    assert!(MAX_REGISTER_MESSAGE == 188_504);
};

impl RegisterReply {
    pub fn new(status: i32, instance: u32, chunk_tokens: u32, text: &str) -> Self {
        let mut t = [0u8; REPLY_TEXT];
        // Cut at a char boundary so the text stays valid UTF-8.
        let mut n = text.len().min(REPLY_TEXT);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        t[..n].copy_from_slice(&text.as_bytes()[..n]);
        RegisterReply {
            magic: super::BOOT_MAGIC,
            kind: super::BootKind::RegisterReply as u32,
            status,
            instance,
            chunk_tokens,
            text: t,
        }
    }

    /// The reply's text (untrusted bytes, decoded lossily).
    pub fn text(&self) -> String {
        let end = self.text.iter().position(|&b| b == 0).unwrap_or(REPLY_TEXT);
        String::from_utf8_lossy(&self.text[..end]).into_owned()
    }
}

/// Splits `bytes` into a `T` header and the rest, if long enough.
pub fn split_header<T: Pod>(bytes: &[u8]) -> Option<(T, &[u8])> {
    let n = size_of::<T>();
    (bytes.len() >= n).then(|| (bytemuck::pod_read_unaligned(&bytes[..n]), &bytes[n..]))
}

/// Reads `n` little-endian u32s from `bytes` (whose length the caller has
/// checked).
pub fn u32s(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}
