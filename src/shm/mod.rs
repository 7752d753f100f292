//! The segment's byte layout (the ABI of the shared-memory segment, not to be
//! confused with [`crate::kv::layout`], an engine's KV-cache layout): the
//! header, the server-written client blocks, each client's own memory (its
//! [`ClientBlock`], in an object of its own) and the region table here;
//! the op stats region in [`OpStats`]; the rows `tests/layout_doc.rs`
//! compares with `shm_layout.md` in `doc`. Each struct is declared once with
//! `shm_struct!`, which asserts every field's offset at compile time.
//!
//! Every field is an atomic: no Rust reference to plain data is ever formed
//! over memory another process writes. Fields marked "identity" are written
//! once before `layout_version` is published and never again.

use crate::shm_struct::shm_struct;
use crate::sync::{AtomicU32, AtomicU64};
use crate::wire::wire_enum;
use crossbeam_utils::CachePadded;
use std::mem::size_of;

mod lanes;
mod models;
mod ops;

#[doc(hidden)]
pub mod doc;

pub use lanes::{
    LaneStat, LaneStatValues, LaneStats, LaneStatsValues, WorkerStat, WorkerStatValues,
    LANE_WORKERS, MAX_DEVICES, MAX_LANES,
};
pub use models::{ModelRowState, ModelStat, ModelStatValues, ModelStats, ModelStatsValues, MODEL_ROWS};
pub use ops::{OpStat, OpStatValues, OpStats, OpStatsValues, HIST_BUCKETS, OP_STAT_SLOTS};

/// Page size the layout is built on; every region starts on a page boundary so
/// that each can be mapped with its own protection.
pub const PAGE: usize = 4096;
/// Cache line size the layout separates writers by (`CachePadded` on x86-64
/// and aarch64, where the adjacent-line prefetcher pairs 64-byte lines).
pub const LINE: usize = 128;
/// `"KVRINGSG"` as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVRINGSG");
/// Version of this layout. Any change to a table in `shm_layout.md` bumps it.
pub const LAYOUT_VERSION: u32 = 11;

shm_struct! {
    /// Segment header, at offset 0. Written by the server only.
    pub struct SegmentHeader => SegmentHeaderValues {
        /// Identity: [`MAGIC`].
        [0] pub magic: AtomicU64,
        /// Identity: [`LAYOUT_VERSION`], stored last (Release) once everything
        /// else is initialised; 0 until then.
        [8] pub layout_version: AtomicU32,
        /// Identity: bytes of this header region ([`PAGE`]).
        [12] pub header_bytes: AtomicU32,
        /// Identity: total segment size in bytes.
        [16] pub segment_bytes: AtomicU64,
        /// Identity: server instance epoch (start time in ns since the Unix epoch,
        /// strictly greater than the epoch of any segment it replaced).
        [24] pub epoch: AtomicU64,
        /// Identity: server process id.
        [32] pub server_pid: AtomicU32,
        /// Identity: server user id.
        [36] pub server_uid: AtomicU32,
        /// Identity: server process start time (clock ticks since boot, field 22
        /// of `/proc/PID/stat`), so a reused pid is not taken for the server.
        [40] pub server_start_ticks: AtomicU64,
        /// Identity: creation time, ns since the Unix epoch.
        [48] pub created_unix_ns: AtomicU64,
        /// Identity: number of client slots.
        [56] pub max_clients: AtomicU32,
        /// Identity: number of job slots.
        [60] pub job_slots: AtomicU32,
        /// Identity: request ring data bytes per client.
        [64] pub req_ring_bytes: AtomicU32,
        /// Identity: completion ring data bytes per client.
        [68] pub cq_ring_bytes: AtomicU32,
        /// Identity: largest frame (header + padded payload) in either ring.
        [72] pub max_frame_bytes: AtomicU32,
        [76] pub _reserved0: AtomicU32,
        /// Identity: offset of the first server-written client block.
        [80] pub server_clients_off: AtomicU64,
        /// Identity: stride of server-written client blocks.
        [88] pub server_client_stride: AtomicU64,
        /// Identity: bytes of each client's own memory object (its
        /// [`ClientBlock`] page, its request ring's data and its job words).
        [96] pub client_memory_bytes: AtomicU64,
        /// Identity: offset of the job table.
        [104] pub jobs_off: AtomicU64,
        /// Identity: bytes per job slot.
        [112] pub job_stride: AtomicU64,
        /// Identity: offset of the operation stats region ([`OpStats`]).
        [120] pub op_stats_off: AtomicU64,
        /// Identity: offset of the copy lanes region ([`LaneStats`]).
        [128] pub lanes_off: AtomicU64,
        /// Identity: offset of the lookups-by-model region ([`ModelStats`]).
        [136] pub models_off: AtomicU64,
        [144] pub _reserved1: [AtomicU64; 14],
        /// Live: CLOCK_MONOTONIC ns of the server's last heartbeat.
        [256] pub heartbeat_ns: CachePadded<AtomicU64>,
        /// Live: the server's ring thread is (about to be) parked on the
        /// clients' doorbells (each client's pipe). Read by clients after
        /// publishing a request: nonzero asks them to ring theirs.
        [384] pub server_sleeping: CachePadded<AtomicU32>,
        /// Live: [`ServerState`] as u32.
        [512] pub server_state: AtomicU32,
        /// Live: clients currently connected.
        [516] pub clients_connected: AtomicU32,
        /// Live: clients accepted since start.
        [520] pub clients_accepted: AtomicU64,
        /// Live: clients whose slot was reclaimed after they died or left.
        [528] pub clients_reclaimed: AtomicU64,
        /// Live: connections refused (bad credentials, full, bad hello).
        [536] pub clients_refused: AtomicU64,
        /// Live: jobs allocated.
        [544] pub jobs_submitted: AtomicU64,
        /// Live: jobs that ended `Done`.
        [552] pub jobs_done: AtomicU64,
        /// Live: jobs that ended `Failed` (any reason).
        [560] pub jobs_failed: AtomicU64,
        /// Live: jobs tombstoned (released by their owner or reclaimed).
        [568] pub jobs_released: AtomicU64,
        /// Live: job submissions refused for want of a free job slot.
        [576] pub jobs_refused: AtomicU64,
        /// Live: job slots retired because another process wrote their
        /// lock word (never used again).
        [584] pub jobs_retired: AtomicU64,
        /// Live: bytes of the pool ready for copies (pinned with the
        /// driver by the CUDA backend, which pins it piece by piece after
        /// the start; all of it at once for the host backend).
        [592] pub pool_ready_bytes: AtomicU64,
        /// Live: the cache's counters, word for word the fields of the STATS
        /// reply (`proto::kv::StatsReply`), each stored Relaxed after every
        /// cache operation (each word is current; they are not one snapshot).
        [600] pub cache_stats: [AtomicU64; CACHE_STATS_WORDS],
        [984] pub _reserved2: [AtomicU64; 5],
    }
}

/// Words of `SegmentHeader::cache_stats`.
pub const CACHE_STATS_WORDS: usize = 48;

const _: () = {
    assert!(size_of::<SegmentHeader>() == 1024);
    assert!(std::mem::size_of::<crate::proto::kv::StatsReply>() == CACHE_STATS_WORDS * 8);
    assert!(size_of::<SegmentHeader>() <= PAGE);
};

wire_enum! {
    /// `SegmentHeader::server_state` values.
    pub enum ServerState: u32 {
        /// Creating the segment and its threads.
        Starting = 0 => "starting",
        /// Serving.
        Running = 1 => "running",
        /// Stopping: refusing connections, ending jobs.
        ShuttingDown = 2 => "shuttingdown",
        /// Stopped; the segment stays for observers until it is unlinked.
        Stopped = 3 => "stopped",
    }
}

shm_struct! {
    /// Server-written state of one client slot, at
    /// `server_clients_off + slot * server_client_stride`. The completion ring's
    /// data follows at +[`PAGE`].
    pub struct ServerClientBlock => ServerClientBlockValues {
        /// [`SlotState`] as u32.
        [0] pub state: AtomicU32,
        /// Session tag of the current occupant (bumped at every assignment, never 0
        /// for an occupied slot). Request frames must carry it.
        [4] pub session: AtomicU32,
        /// Occupant's pid (from SO_PEERCRED).
        [8] pub pid: AtomicU32,
        /// Occupant's uid (from SO_PEERCRED).
        [12] pub uid: AtomicU32,
        /// Occupant's process start time (clock ticks since boot).
        [16] pub pid_start_ticks: AtomicU64,
        /// When the occupant connected, ns since the Unix epoch.
        [24] pub connected_unix_ns: AtomicU64,
        /// Request frames served.
        [32] pub requests_served: AtomicU64,
        /// Request frames rejected (bad session, bad opcode, bad length).
        [40] pub requests_rejected: AtomicU64,
        /// Why the last occupant was disconnected ([`DisconnectReason`]).
        [48] pub disconnect_reason: AtomicU32,
        /// KV caches the occupant has registered.
        [52] pub kv_instances: AtomicU32,
        /// Completions posted.
        [56] pub completions_posted: AtomicU64,
        /// The server's descriptor of the occupant's memory (a sealed
        /// memfd): observers map it read-only through
        /// `/proc/SERVER_PID/fd/N` while the server lives.
        [64] pub memory_fd: AtomicU32,
        /// CLOCK_MONOTONIC ns of the last store to `state` (written just
        /// before it): how long a slot has been closing or quarantined.
        [72] pub state_ns: AtomicU64,
        /// Request ring head: the server consumes requests.
        [128] pub req_head: CachePadded<AtomicU64>,
        /// Completion ring tail: the server produces completions.
        [256] pub cq_tail: CachePadded<AtomicU64>,
        /// Futex word the client parks on; the server adds 1 and wakes it after
        /// posting a completion or finishing a job when `client_sleeping` is set.
        [384] pub client_doorbell: CachePadded<AtomicU32>,
    }
}

const _: () = {
    assert!(size_of::<ServerClientBlock>() <= PAGE);
};

wire_enum! {
    /// `ServerClientBlock::state` values.
    pub enum SlotState: u32 {
        /// Unoccupied.
        Free = 0 => "free",
        /// Occupied by a connected client.
        Active = 1 => "active",
        /// The client left or died; its resources are being reclaimed.
        Closing = 2 => "closing",
        /// The connection ended but the process is still alive: the slot is kept
        /// out of use until it exits (its writes reach only its own memory
        /// object, which nobody reads any more; the quarantine keeps a late
        /// reader of the slot's completion ring from seeing a stranger's).
        Quarantined = 3 => "quarantined",
    }
}

wire_enum! {
    /// `ServerClientBlock::disconnect_reason` values.
    pub enum DisconnectReason: u32 {
        /// Never disconnected (or still connected).
        None = 0 => "none",
        /// The client said goodbye.
        Goodbye = 1 => "goodbye",
        /// The bootstrap socket closed without a goodbye (the client died).
        SocketClosed = 2 => "socket closed",
        /// The client broke a ring invariant.
        RingCorrupt = 3 => "ring corrupt",
        /// The server shut down.
        ServerShutdown = 4 => "server shutdown",
    }
}

shm_struct! {
    /// Client-written state of one client, at offset 0 of the client's own
    /// memory (`crate::client_memory`: a sealed memfd), created for its
    /// session and closed when the session ends. The request ring's data follows at
    /// +[`PAGE`]. Its occupant maps the object writable (it is the only memory
    /// a client can write); the server maps it read-only and treats every word
    /// in it as untrusted.
    pub struct ClientBlock => ClientBlockValues {
        /// Request ring tail: the client produces requests.
        [0] pub req_tail: CachePadded<AtomicU64>,
        /// Completion ring head: the client consumes completions.
        [128] pub cq_head: CachePadded<AtomicU64>,
        /// The client is (about to be) parked on `client_doorbell`.
        [256] pub client_sleeping: CachePadded<AtomicU32>,
        /// CLOCK_MONOTONIC ns of the client's last call into the library.
        [384] pub heartbeat_ns: CachePadded<AtomicU64>,
        /// Requests submitted and not yet completed (for observers).
        [512] pub in_flight: AtomicU32,
        /// Completion-ring bytes not reserved by requests in flight (for
        /// observers).
        [516] pub credits: AtomicU32,
    }
}

const _: () = {
    assert!(size_of::<CachePadded<AtomicU64>>() == LINE);
    assert!(size_of::<ClientBlock>() <= PAGE);
};

/// The sizes that determine a segment's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub max_clients: u32,
    pub req_ring_bytes: u32,
    pub cq_ring_bytes: u32,
    pub max_frame_bytes: u32,
    pub job_slots: u32,
}

/// Bytes per job slot in the job table.
pub const JOB_STRIDE: usize = 128;
const _: () = assert!(std::mem::size_of::<crate::jobs::JobSlot>() == JOB_STRIDE);
/// Most client slots a segment may have.
pub const MAX_CLIENTS: u32 = 4096;
/// Most job slots a segment may have (the slot index is 24 bits in a job id).
pub const MAX_JOB_SLOTS: u32 = 1 << 24;

impl Default for Geometry {
    fn default() -> Self {
        Geometry {
            max_clients: 64,
            req_ring_bytes: 128 * 1024,
            cq_ring_bytes: 128 * 1024,
            max_frame_bytes: 16 * 1024,
            job_slots: 4096,
        }
    }
}

/// Offsets computed from a [`Geometry`]: what the header's table must say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    pub server_clients_off: u64,
    pub server_client_stride: u64,
    /// Bytes of each client's own memory object (not part of the segment).
    pub client_memory_bytes: u64,
    /// Offset of the job words ([`crate::job_words`]) in a client's memory.
    pub job_words_off: u64,
    pub jobs_off: u64,
    pub job_stride: u64,
    pub op_stats_off: u64,
    pub lanes_off: u64,
    pub models_off: u64,
    pub segment_bytes: u64,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// A [`Geometry`] bound that does not hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    #[error("max clients {0} must be in 1..={MAX_CLIENTS}")]
    MaxClients(u32),
    #[error("job slots {0} must be in 1..={MAX_JOB_SLOTS}")]
    JobSlots(u32),
    /// The request ring's size or frame bound (the ring's own message).
    #[error("request ring: {0}")]
    RequestRing(crate::ring::RingGeometryError),
    /// The completion ring's size or frame bound (the ring's own message).
    #[error("completion ring: {0}")]
    CompletionRing(crate::ring::RingGeometryError),
}

impl Geometry {
    /// Checks every bound; the error says which one failed.
    pub fn validate(&self) -> Result<(), GeometryError> {
        if self.max_clients == 0 || self.max_clients > MAX_CLIENTS {
            return Err(GeometryError::MaxClients(self.max_clients));
        }
        if self.job_slots == 0 || self.job_slots > MAX_JOB_SLOTS {
            return Err(GeometryError::JobSlots(self.job_slots));
        }
        let frame = self.max_frame_bytes as usize;
        crate::ring::check_geometry(self.req_ring_bytes as usize, frame)
            .map_err(GeometryError::RequestRing)?;
        crate::ring::check_geometry(self.cq_ring_bytes as usize, frame)
            .map_err(GeometryError::CompletionRing)?;
        Ok(())
    }

    /// The region table for this geometry.
    pub fn offsets(&self) -> Offsets {
        let page = PAGE as u64;
        let n = u64::from(self.max_clients);
        let server_clients_off = page;
        let server_client_stride = page + u64::from(self.cq_ring_bytes);
        let job_words_off = round_up(page + u64::from(self.req_ring_bytes), page);
        let client_memory_bytes = job_words_off + crate::job_words::REGION_BYTES as u64;
        let jobs_off = server_clients_off + n * server_client_stride;
        let job_stride = JOB_STRIDE as u64;
        let op_stats_off = round_up(jobs_off + u64::from(self.job_slots) * job_stride, page);
        let lanes_off = op_stats_off + round_up(size_of::<OpStats>() as u64, page);
        let models_off = lanes_off + round_up(size_of::<LaneStats>() as u64, page);
        let segment_bytes = models_off + round_up(size_of::<ModelStats>() as u64, page);
        Offsets {
            server_clients_off,
            server_client_stride,
            client_memory_bytes,
            job_words_off,
            jobs_off,
            job_stride,
            op_stats_off,
            lanes_off,
            models_off,
            segment_bytes,
        }
    }
}
