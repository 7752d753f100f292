//! The protocol: ring opcodes, completion status codes, and the bootstrap
//! socket's messages. Every struct that crosses a process boundary is
//! `repr(C)` + `Pod` with compile-time size and offset assertions; its table
//! is in `shm_layout.md`.

pub mod kv;

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

/// Protocol version spoken over the bootstrap socket and the rings.
pub const PROTOCOL_VERSION: u32 = 1;
/// `"KVRBOOT1"`: first word of every bootstrap message.
pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"KVRBOOT1");

/// Ring opcodes.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    /// Echo: the completion carries the request's payload back unchanged.
    Ping = 1,
    /// Starts a delay job ([`DelayJobRequest`]); the completion carries its
    /// [`JobId`](crate::jobs::JobId).
    DelayJob = 2,
    /// Releases a finished job (payload: its `JobId`): the slot becomes a
    /// tombstone. Header-only completion.
    ReleaseJob = 3,
    /// Longest stored prefix of a prompt ([`kv::LookupRequest`]); a job whose
    /// result is the number of hit chunks. Takes read leases on the hits.
    Lookup = 10,
    /// Copies chunks from an engine's cache into the pool
    /// ([`kv::StoreRequest`]); a job.
    Store = 11,
    /// Copies leased chunks into an engine's cache
    /// ([`kv::RetrieveRequest`]); a job, all or nothing.
    Retrieve = 12,
    /// Ends a lease's holds on a range of chunks ([`kv::FreeLocksRequest`]).
    FreeLookupLocks = 13,
    /// Ends a lease ([`kv::EndSessionRequest`]).
    EndSession = 14,
    /// Drops every stored object not leased or being written
    /// ([`kv::ClearReply`]).
    Clear = 15,
    /// The cache's counters ([`kv::StatsReply`]).
    Stats = 16,
    /// The server's configuration ([`kv::ConfigReply`]).
    GetConfig = 17,
    /// The caller's job events on a device (payload: the device UUID, 16
    /// bytes): `kv::JOB_EVENTS` CUDA IPC event handles of 64 bytes.
    JobEvents = 18,
}

impl Opcode {
    pub fn from_u16(v: u16) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Ping,
            2 => Opcode::DelayJob,
            3 => Opcode::ReleaseJob,
            10 => Opcode::Lookup,
            11 => Opcode::Store,
            12 => Opcode::Retrieve,
            13 => Opcode::FreeLookupLocks,
            14 => Opcode::EndSession,
            15 => Opcode::Clear,
            16 => Opcode::Stats,
            17 => Opcode::GetConfig,
            18 => Opcode::JobEvents,
            _ => return None,
        })
    }

    /// Bytes (whole frame) the completion of a request with this opcode and
    /// payload length may take in the completion ring. Both sides compute it:
    /// the client reserves this much credit before submitting, the server
    /// serves a request only when this much completion space is free, so a
    /// completion is never dropped.
    pub fn completion_bound(self, request_len: usize) -> usize {
        use crate::ring::{frame_bytes, HEADER_BYTES};
        match self {
            Opcode::Ping => frame_bytes(request_len),
            Opcode::DelayJob | Opcode::Lookup | Opcode::Store | Opcode::Retrieve => {
                frame_bytes(size_of::<crate::jobs::JobId>())
            }
            Opcode::ReleaseJob | Opcode::FreeLookupLocks | Opcode::EndSession => HEADER_BYTES,
            Opcode::Clear => frame_bytes(size_of::<kv::ClearReply>()),
            Opcode::Stats => frame_bytes(size_of::<kv::StatsReply>()),
            Opcode::GetConfig => frame_bytes(size_of::<kv::ConfigReply>()),
            Opcode::JobEvents => frame_bytes(kv::JOB_EVENTS * 64),
        }
    }
}

/// Completion status codes (`FrameHeader::status`, and bootstrap replies).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Status {
    #[error("ok")]
    Ok = 0,
    #[error("unknown opcode")]
    UnknownOpcode = -1,
    #[error("bad request length")]
    BadLength = -2,
    #[error("bad session tag")]
    BadSession = -3,
    #[error("no free client slot")]
    NoFreeSlot = -4,
    #[error("permission denied (different user)")]
    PermissionDenied = -5,
    #[error("protocol version mismatch")]
    VersionMismatch = -6,
    #[error("malformed message")]
    Malformed = -7,
    #[error("server shutting down")]
    ShuttingDown = -8,
    #[error("no free job slot (every slot holds an unreleased job)")]
    NoFreeJobSlot = -9,
    #[error("unknown job (never issued by this server instance)")]
    UnknownJob = -10,
    #[error("job expired (its slot was reused)")]
    JobExpired = -11,
    #[error("job owned by another client")]
    NotJobOwner = -12,
    #[error("job not finished")]
    JobNotFinished = -13,
    #[error("invalid argument")]
    InvalidArgument = -14,
    #[error("no lease: the chunks were not leased by that lookup (or the lease ended)")]
    NoLease = -15,
    #[error("unknown engine instance (not registered by this client)")]
    UnknownInstance = -16,
    #[error("server error")]
    ServerError = -17,
}

impl From<crate::jobs::TableError> for Status {
    fn from(e: crate::jobs::TableError) -> Status {
        use crate::jobs::TableError as E;
        match e {
            E::Full => Status::NoFreeJobSlot,
            E::Unknown => Status::UnknownJob,
            E::Expired => Status::JobExpired,
            E::NotOwner => Status::NotJobOwner,
            E::NotFinished | E::WrongState(_) => Status::JobNotFinished,
        }
    }
}

impl Status {
    pub fn from_i32(v: i32) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            -1 => Status::UnknownOpcode,
            -2 => Status::BadLength,
            -3 => Status::BadSession,
            -4 => Status::NoFreeSlot,
            -5 => Status::PermissionDenied,
            -6 => Status::VersionMismatch,
            -7 => Status::Malformed,
            -8 => Status::ShuttingDown,
            -9 => Status::NoFreeJobSlot,
            -10 => Status::UnknownJob,
            -11 => Status::JobExpired,
            -12 => Status::NotJobOwner,
            -13 => Status::JobNotFinished,
            -14 => Status::InvalidArgument,
            -15 => Status::NoLease,
            -16 => Status::UnknownInstance,
            -17 => Status::ServerError,
            _ => return None,
        })
    }
}

/// Longest a delay job may take in all (pending + running): one hour.
pub const MAX_DELAY_US: u64 = 3_600_000_000;

/// Request payload of [`Opcode::DelayJob`]: a job that stays `Pending` for
/// `pending_us`, `Running` for `running_us` (publishing the microseconds
/// it has run as progress every `progress_every_us`, 0 = never), then ends
/// `Done(result_value, result_aux)`, or `Failed(fail_reason)` when that is
/// nonzero. It exercises the whole job path (table, timers, wake-ups) for
/// health checks, tests and benchmarks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DelayJobRequest {
    pub pending_us: u64,
    pub running_us: u64,
    pub progress_every_us: u64,
    pub result_value: u64,
    pub result_aux: u64,
    pub fail_reason: u32,
    pub _reserved: u32,
}

const _: () = {
    assert!(size_of::<DelayJobRequest>() == 48);
    assert!(offset_of!(DelayJobRequest, running_us) == 8);
    assert!(offset_of!(DelayJobRequest, progress_every_us) == 16);
    assert!(offset_of!(DelayJobRequest, result_value) == 24);
    assert!(offset_of!(DelayJobRequest, result_aux) == 32);
    assert!(offset_of!(DelayJobRequest, fail_reason) == 40);
};

impl DelayJobRequest {
    /// Checks the bounds; the message names the one that failed.
    pub fn validate(&self) -> Result<(), String> {
        let total = self.pending_us.checked_add(self.running_us);
        if total.is_none_or(|t| t > MAX_DELAY_US) {
            return Err(format!(
                "pending {} us + running {} us exceeds {MAX_DELAY_US} us",
                self.pending_us, self.running_us
            ));
        }
        if self._reserved != 0 {
            return Err("reserved field is not zero".into());
        }
        Ok(())
    }
}

/// Bootstrap message kinds.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BootKind {
    Hello = 1,
    Welcome = 2,
    Goodbye = 3,
    /// [`kv::RegisterKv`].
    Register = 4,
    /// [`kv::RegisterReply`].
    RegisterReply = 5,
    /// [`kv::UnregisterKv`].
    Unregister = 6,
    /// [`kv::AttachFds`].
    AttachFds = 7,
}

/// Client -> server, first message on the bootstrap socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Hello {
    pub magic: u64,
    /// [`BootKind::Hello`].
    pub kind: u32,
    pub protocol: u32,
    /// Layout version the client understands.
    pub layout_version: u32,
    pub _reserved: u32,
}

const _: () = {
    assert!(size_of::<Hello>() == 24);
    assert!(offset_of!(Hello, kind) == 8);
    assert!(offset_of!(Hello, protocol) == 12);
    assert!(offset_of!(Hello, layout_version) == 16);
};

/// Server -> client, answer to [`Hello`]. On success it carries the segment's
/// descriptor (SCM_RIGHTS).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Welcome {
    pub magic: u64,
    /// [`BootKind::Welcome`].
    pub kind: u32,
    /// [`Status`]; anything but Ok means refused (no descriptor attached).
    pub status: i32,
    pub protocol: u32,
    pub layout_version: u32,
    /// Assigned client slot.
    pub slot: u32,
    /// Session tag to put in every request frame.
    pub session: u32,
    /// Server epoch (also in the segment header).
    pub epoch: u64,
    pub segment_bytes: u64,
    pub server_pid: u32,
    pub _reserved: u32,
}

const _: () = {
    assert!(size_of::<Welcome>() == 56);
    assert!(offset_of!(Welcome, kind) == 8);
    assert!(offset_of!(Welcome, status) == 12);
    assert!(offset_of!(Welcome, protocol) == 16);
    assert!(offset_of!(Welcome, layout_version) == 20);
    assert!(offset_of!(Welcome, slot) == 24);
    assert!(offset_of!(Welcome, session) == 28);
    assert!(offset_of!(Welcome, epoch) == 32);
    assert!(offset_of!(Welcome, segment_bytes) == 40);
    assert!(offset_of!(Welcome, server_pid) == 48);
};

/// Client -> server: clean disconnect. The client has unmapped its rings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Goodbye {
    pub magic: u64,
    /// [`BootKind::Goodbye`].
    pub kind: u32,
    pub _reserved: u32,
}

const _: () = assert!(size_of::<Goodbye>() == 16);
