//! The KV operations' wire structs: ring request payloads (a fixed header,
//! then arrays), completion payloads, and the registration messages of the
//! bootstrap socket. Tables in `shm_layout.md`.

use crate::jobs::JobId;
use crate::kv::KvLayout;
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
        /// Bit 0: `event` holds a CUDA IPC event the engine recorded after
        /// writing the blocks; the server's copies wait for it on the device.
        [16] pub flags: u32,
        [20] pub _reserved: u32,
        [24] pub event: [u8; 64],
    }
}

bitflags::bitflags! {
    /// `StoreRequest::flags` / `RetrieveRequest::flags` bits (the fields stay
    /// `u32`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct KvFlags: u32 {
        /// `event` is set.
        const EVENT = 1;
        /// Once every chunk's copy is queued on the device, the server
        /// records one of the caller's job events (see `Opcode::JobEvents`)
        /// after them all and publishes its index plus one in the job's
        /// `progress`, so the engine's stream can wait for the copies on the
        /// device (CUDA backend, device-memory instances).
        const PUBLISH_EVENT = 2;
    }
}

/// Job events per client and device.
pub const JOB_EVENTS: usize = 32;

shm_struct! {
    /// RETRIEVE: `n_chunks * blocks_per_chunk` block ids (u32) follow. Chunks
    /// `first_chunk ..` of the lookup `lease` are copied into them; the first
    /// `skip_tokens` tokens (a multiple of the block size) are left alone.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct RetrieveRequest {
        [0] pub lease: JobId,
        [16] pub instance: u32,
        [20] pub first_chunk: u32,
        [24] pub n_chunks: u32,
        [28] pub skip_tokens: u32,
        /// Bit 0: `event` holds a CUDA IPC event the engine recorded after it
        /// stopped using the blocks; the server's copies wait for it.
        [32] pub flags: u32,
        [36] pub _reserved: u32,
        [40] pub event: [u8; 64],
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
        [28] pub _reserved: u32,
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
    /// `RegisterKv::mem_kind`: how the tensors' memory is handed over.
    pub enum MemKind: u32 {
        /// Host memory: sealed memfds passed with the message (SCM_RIGHTS).
        HostFd = 1 => "host_fd",
        /// Device memory: a legacy CUDA IPC handle per tensor ([`CudaRegion`]).
        CudaIpc = 2 => "cuda_ipc",
        /// Device memory: a CUDA VMM allocation exported as a POSIX fd, passed
        /// with the message ([`CudaRegion`]).
        CudaVmmFd = 3 => "cuda_vmm_fd",
    }
}

shm_struct! {
    /// Where one tensor of a device registration lives: `offset` bytes into an
    /// allocation of `alloc_bytes`, named by `ipc_handle` (kind 2) or by
    /// descriptor `fd_index` (kind 3). The server checks `offset + tensor bytes`
    /// against the size the driver reports (IPC) or maps exactly `alloc_bytes`
    /// (VMM, which fails if the allocation is smaller).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct CudaRegion {
        [0] pub ipc_handle: [u8; 64],
        [64] pub offset: u64,
        [72] pub alloc_bytes: u64,
        [80] pub fd_index: u32,
        [84] pub _reserved: u32,
    }
}

shm_struct! {
    /// Bootstrap message: register an engine instance's KV cache. Followed by
    /// `n_tensors` [`TensorRegion`]s; the memory's descriptors travel with this
    /// message and any [`AttachFds`] messages sent just before it.
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
        [32] pub layout: KvLayout,
        [64] pub n_tensors: u32,
        [68] pub _reserved: u32,
        /// Device memory: the device's UUID (memory kinds 2 and 3). Host
        /// memory: zero, or the device the engine's worker runs on (its copies
        /// go to that device's copy lane).
        [72] pub device_uuid: [u8; 16],
    }
}

shm_struct! {
    /// Where one tensor of a registration lives: `layout.tensor_bytes()` bytes
    /// at `offset` of descriptor `fd_index` (counting the descriptors of the
    /// preceding `AttachFds` messages first, then this message's).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct TensorRegion {
        [0] pub fd_index: u32,
        [4] pub _reserved: u32,
        [8] pub offset: u64,
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
    assert!(size_of::<StoreRequest>() == 88);
    assert!(size_of::<RetrieveRequest>() == 104);
    assert!(size_of::<CudaRegion>() == 88);
    assert!(size_of::<FreeLocksRequest>() == 24);
    assert!(size_of::<EndSessionRequest>() == 16);
    assert!(size_of::<ClearReply>() == 16);
    assert!(size_of::<ConfigReply>() == 32);
    assert!(size_of::<StatsReply>() == 18 * 8);
    assert!(size_of::<RegisterKv>() == 88);
    assert!(size_of::<TensorRegion>() == 16);
    assert!(size_of::<AttachFds>() == 16);
    assert!(size_of::<UnregisterKv>() == 16);
    assert!(size_of::<RegisterReply>() == 224);
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
