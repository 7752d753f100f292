//! The protocol: ring opcodes, completion status codes, and the bootstrap
//! socket's messages. Every struct that crosses a process boundary is
//! `repr(C)` + `Pod` with compile-time size and offset assertions; its table
//! is in `shm_layout.md`.

pub mod kv;

use crate::jobs::JobKind;
use crate::shm_struct::shm_struct;
use crate::wire::wire_enum;

use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Protocol version spoken over the bootstrap socket and the rings.
pub const PROTOCOL_VERSION: u32 = 4;
/// `"KVRBOOT1"`: first word of every bootstrap message.
pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"KVRBOOT1");

wire_enum! {
    /// Ring opcodes. Each entry is an operation's whole declaration on this
    /// side of the handler: its code, its stable name (docs, stats, the
    /// inspector) and its [`OpSpec`]. The per-operation tables (the
    /// stats index, the completion bound, the fuzz target's opcode list, the
    /// server's timed list) are derived from it.
    pub enum Opcode: u16 as OpSpec {
        /// Echo: the completion carries the request's payload back unchanged.
        Ping = 1 => "ping", OpSpec::reply(Reply::Echo);
        /// Starts a delay job ([`DelayJobRequest`]); the completion carries its
        /// [`JobId`](crate::jobs::JobId).
        DelayJob = 2 => "delay_job", OpSpec::job(JobKind::Delay);
        /// Releases a finished job (payload: its `JobId`): the slot becomes a
        /// tombstone. Header-only completion.
        ReleaseJob = 3 => "release_job", OpSpec::reply(Reply::Empty);
        /// Longest stored prefix of a prompt ([`kv::LookupRequest`]); a job whose
        /// result is the number of hit chunks. Takes read leases on the hits.
        Lookup = 10 => "lookup", OpSpec::job(JobKind::Lookup);
        /// Copies chunks from an engine's cache into the pool
        /// ([`kv::StoreRequest`]); a job.
        Store = 11 => "store", OpSpec::job(JobKind::Store);
        /// Copies leased chunks into an engine's cache
        /// ([`kv::RetrieveRequest`]); a job, all or nothing.
        Retrieve = 12 => "retrieve", OpSpec::job(JobKind::Retrieve);
        /// Ends a lease's holds on a range of chunks ([`kv::FreeLocksRequest`]).
        FreeLookupLocks = 13 => "free_lookup_locks", OpSpec::reply(Reply::Empty);
        /// Ends a lease ([`kv::EndSessionRequest`]).
        EndSession = 14 => "end_session", OpSpec::reply(Reply::Empty);
        /// Drops every stored object not leased or being written
        /// ([`kv::ClearReply`]).
        Clear = 15 => "clear", OpSpec::reply(Reply::Fixed(size_of::<kv::ClearReply>()));
        /// The cache's counters ([`kv::StatsReply`]).
        Stats = 16 => "stats", OpSpec::reply(Reply::Fixed(size_of::<kv::StatsReply>()));
        /// The server's configuration ([`kv::ConfigReply`]).
        GetConfig = 17 => "get_config", OpSpec::reply(Reply::Fixed(size_of::<kv::ConfigReply>()));
        /// The token ids of chunks about to be stored, for the server's event
        /// stream ([`kv::DescribeRequest`]).
        Describe = 18 => "describe", OpSpec::reply(Reply::Empty);
    }
}

/// What an operation's completion carries (when its status is Ok).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The request's payload, unchanged.
    Echo,
    /// Nothing (status only).
    Empty,
    /// At most this many bytes.
    Fixed(usize),
}

/// An operation's properties, given in its [`Opcode`] entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSpec {
    /// What its completion carries.
    pub reply: Reply,
    /// The kind of job it starts (its completion carries the job's id), or
    /// None when it is served at once.
    pub job: Option<JobKind>,
}

impl OpSpec {
    /// An operation served at once, answered with `reply`.
    pub const fn reply(reply: Reply) -> OpSpec {
        OpSpec { reply, job: None }
    }

    /// An operation that starts a job of `kind`; the completion carries its
    /// [`JobId`](crate::jobs::JobId).
    pub const fn job(kind: JobKind) -> OpSpec {
        OpSpec {
            reply: Reply::Fixed(size_of::<crate::jobs::JobId>()),
            job: Some(kind),
        }
    }
}

/// Number of operations (`Opcode::ALL.len()`).
pub const OPS: usize = Opcode::ALL.len();

impl Opcode {
    /// Bytes (whole frame) the completion of a request with this opcode and
    /// payload length may take in the completion ring. Both sides compute it:
    /// the client reserves this much credit before submitting, the server
    /// serves a request only when this much completion space is free, so a
    /// completion is never dropped.
    pub const fn completion_bound(self, request_len: usize) -> usize {
        use crate::ring::{frame_bytes, HEADER_BYTES};
        match self.spec().reply {
            Reply::Echo => frame_bytes(request_len),
            Reply::Empty => HEADER_BYTES,
            Reply::Fixed(n) => frame_bytes(n),
        }
    }

    /// Whether the server records this operation's service time when it
    /// answers it: not a job's (recorded when the job ends), not an echo's
    /// (the client's round trip is what measures PING).
    pub const fn timed(self) -> bool {
        let spec = self.spec();
        spec.job.is_none() && !matches!(spec.reply, Reply::Echo)
    }

    /// The operation that starts jobs of `kind`.
    pub const fn of_job(kind: JobKind) -> Opcode {
        let mut i = 0;
        while i < Self::ALL.len() {
            if let Some(k) = Self::ALL[i].spec().job {
                if k as u32 == kind as u32 {
                    return Self::ALL[i];
                }
            }
            i += 1;
        }
        panic!("a job kind no operation starts")
    }
}

const _: () = {
    // Every job kind has its operation (`of_job` panics at compile time
    // otherwise), and the stats region has room for every operation.
    let mut i = 0;
    while i < JobKind::ALL.len() {
        Opcode::of_job(JobKind::ALL[i]);
        i += 1;
    }
};

wire_enum! {
    /// Completion status codes (`FrameHeader::status`, and bootstrap replies).
    #[derive(thiserror::Error)]
    pub enum Status: i32 {
        #[error("ok")]
        Ok = 0 => "ok",
        #[error("unknown opcode")]
        UnknownOpcode = -1 => "unknown_opcode",
        #[error("bad request length")]
        BadLength = -2 => "bad_length",
        #[error("bad session tag")]
        BadSession = -3 => "bad_session",
        #[error("no free client slot")]
        NoFreeSlot = -4 => "no_free_slot",
        #[error("permission denied (different user)")]
        PermissionDenied = -5 => "permission_denied",
        #[error("protocol version mismatch")]
        VersionMismatch = -6 => "version_mismatch",
        #[error("malformed message")]
        Malformed = -7 => "malformed",
        #[error("server shutting down")]
        ShuttingDown = -8 => "shutting_down",
        #[error("no free job slot (every slot holds an unreleased job)")]
        NoFreeJobSlot = -9 => "no_free_job_slot",
        #[error("unknown job (never issued by this server instance)")]
        UnknownJob = -10 => "unknown_job",
        #[error("job expired (its slot was reused)")]
        JobExpired = -11 => "job_expired",
        #[error("job owned by another client")]
        NotJobOwner = -12 => "not_job_owner",
        #[error("job not finished")]
        JobNotFinished = -13 => "job_not_finished",
        #[error("invalid argument")]
        InvalidArgument = -14 => "invalid_argument",
        #[error("no lease: the chunks were not leased by that lookup (or the lease ended)")]
        NoLease = -15 => "no_lease",
        #[error("unknown engine instance (not registered by this client)")]
        UnknownInstance = -16 => "unknown_instance",
        #[error("server error")]
        ServerError = -17 => "server_error",
        #[error("the lease belongs to another engine")]
        ForeignLease = -18 => "foreign_lease",
    }
}

impl From<crate::jobs::TableError> for Status {
    fn from(e: crate::jobs::TableError) -> Status {
        use crate::jobs::TableError as E;
        match e {
            E::Full => Status::NoFreeJobSlot,
            E::Unknown => Status::UnknownJob,
            // A retired slot's job is gone as surely as a reused one's.
            E::Expired | E::Retired => Status::JobExpired,
            E::NotOwner => Status::NotJobOwner,
            E::NotFinished | E::WrongState(_) => Status::JobNotFinished,
        }
    }
}


/// Longest a delay job may take in all (pending + running): one hour.
pub const MAX_DELAY_US: u64 = 3_600_000_000;

shm_struct! {
    /// Request payload of [`Opcode::DelayJob`]: a job that stays `Pending` for
    /// `pending_us`, `Running` for `running_us` (publishing the microseconds
    /// it has run as progress every `progress_every_us`, 0 = never), then ends
    /// `Done(result_value, result_aux)`, or `Failed(fail_reason)` when that is
    /// nonzero. It exercises the whole job path (table, timers, wake-ups) for
    /// health checks, tests and benchmarks.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct DelayJobRequest {
        [0] pub pending_us: u64,
        [8] pub running_us: u64,
        [16] pub progress_every_us: u64,
        [24] pub result_value: u64,
        [32] pub result_aux: u64,
        [40] pub fail_reason: u32,
        [44] pub _reserved: u32,
    }
}

const _: () = {
    assert!(size_of::<DelayJobRequest>() == 48);
};

/// Why a [`DelayJobRequest`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DelayJobError {
    #[error("pending {pending_us} us + running {running_us} us exceeds {MAX_DELAY_US} us")]
    TooLong { pending_us: u64, running_us: u64 },
    #[error("reserved field is not zero")]
    Reserved,
}

impl DelayJobRequest {
    /// Checks the bounds; the error names the one that failed.
    pub fn validate(&self) -> Result<(), DelayJobError> {
        let total = self.pending_us.checked_add(self.running_us);
        if total.is_none_or(|t| t > MAX_DELAY_US) {
            return Err(DelayJobError::TooLong {
                pending_us: self.pending_us,
                running_us: self.running_us,
            });
        }
        if self._reserved != 0 {
            return Err(DelayJobError::Reserved);
        }
        Ok(())
    }
}

wire_enum! {
    /// Bootstrap message kinds.
    pub enum BootKind: u32 {
        /// [`Hello`].
        Hello = 1 => "hello",
        /// [`Welcome`].
        Welcome = 2 => "welcome",
        /// [`Goodbye`].
        Goodbye = 3 => "goodbye",
        /// [`kv::RegisterKv`].
        Register = 4 => "register",
        /// [`kv::RegisterReply`].
        RegisterReply = 5 => "register_reply",
        /// [`kv::UnregisterKv`].
        Unregister = 6 => "unregister",
        /// [`kv::AttachFds`].
        AttachFds = 7 => "attach_fds",
    }
}

shm_struct! {
    /// Client -> server, first message on the bootstrap socket.
    #[derive(Clone, Copy, Debug, Pod, Zeroable)]
    pub struct Hello {
        [0] pub magic: u64,
        /// [`BootKind::Hello`].
        [8] pub kind: u32,
        [12] pub protocol: u32,
        /// Layout version the client understands.
        [16] pub layout_version: u32,
        [20] pub _reserved: u32,
        /// The engine this client belongs to: `kv::engine_key(engine id)`,
        /// the same in an engine's scheduler and every worker; zero: the
        /// anonymous engine. Only clients of the engine that took a lease may
        /// use, free or end it. Kept by the server, never written to shared
        /// memory.
        [24] pub engine: [u8; 32],
    }
}

const _: () = {
    assert!(size_of::<Hello>() == 56);
};

impl Hello {
    /// The hello of this protocol and layout version, for the engine whose
    /// key is `engine` (`kv::engine_key`; zero: the anonymous engine).
    pub fn new(engine: [u8; 32]) -> Hello {
        Hello {
            magic: BOOT_MAGIC,
            kind: BootKind::Hello as u32,
            protocol: PROTOCOL_VERSION,
            layout_version: crate::shm::LAYOUT_VERSION,
            _reserved: 0,
            engine,
        }
    }
}

shm_struct! {
    /// Server -> client, answer to [`Hello`]. On success it carries three
    /// descriptors (SCM_RIGHTS): the segment (read-only), the session's own
    /// memory (`crate::client_memory`, read-write) and its doorbell
    /// (`crate::doorbell`).
    #[derive(Clone, Copy, Debug, Pod, Zeroable)]
    pub struct Welcome {
        [0] pub magic: u64,
        /// [`BootKind::Welcome`].
        [8] pub kind: u32,
        /// [`Status`]; anything but Ok means refused (no descriptor attached).
        [12] pub status: i32,
        [16] pub protocol: u32,
        [20] pub layout_version: u32,
        /// Assigned client slot.
        [24] pub slot: u32,
        /// Session tag to put in every request frame.
        [28] pub session: u32,
        /// Server epoch (also in the segment header).
        [32] pub epoch: u64,
        [40] pub segment_bytes: u64,
        [48] pub server_pid: u32,
        [52] pub _reserved: u32,
    }
}

const _: () = {
    assert!(size_of::<Welcome>() == 56);
};

shm_struct! {
    /// Client -> server: clean disconnect. The client has unmapped its rings.
    #[derive(Clone, Copy, Debug, Pod, Zeroable)]
    pub struct Goodbye {
        [0] pub magic: u64,
        /// [`BootKind::Goodbye`].
        [8] pub kind: u32,
        [12] pub _reserved: u32,
    }
}

const _: () = assert!(size_of::<Goodbye>() == 16);

impl Default for Goodbye {
    fn default() -> Goodbye {
        Goodbye {
            magic: BOOT_MAGIC,
            kind: BootKind::Goodbye as u32,
            _reserved: 0,
        }
    }
}
