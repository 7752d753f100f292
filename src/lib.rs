//! kvring: a node-local KV-cache runtime. Inference engine processes (an
//! engine's scheduler and each GPU worker) and one cache server on the same
//! host talk through lock-free request and completion rings in POSIX shared
//! memory; KV blocks move between the engines' paged caches and the
//! server's pool by the server's own copies, never through the rings.
//!
//! An engine uses [`Client`]: connect, register its KV cache once
//! ([`Registration`]), then [`Lookup`] (a [`Lease`] on the hits), [`Store`]
//! and [`Retrieve`] (each a [`Job`]). Handles release what they hold when
//! dropped. `examples/engine.rs` is a whole engine in one file.
//!
//! Module map (README.md has the picture):
//! * [`ring`]: the SPSC frame ring (producer, consumer, frame header);
//! * [`shm`] and [`shm_struct`]: the segment's byte layout, each shared
//!   struct declared once (`shm_layout.md` in tables);
//! * [`wire`] and [`proto`]: wire enums declared once; opcodes, status
//!   codes, requests, replies and bootstrap messages;
//! * [`jobs`]: the job table (slots, seqlock, state machine, ids);
//! * [`segment`]: creating, attaching and replacing the segment;
//!   [`client_memory`]: each client session's own writable object (its
//!   block, request ring and job words); [`job_words`]: the words that
//!   order an engine's GPU work after the server's copies and let a client
//!   give a job up; [`doorbell`]: the pipes clients wake the server with;
//! * [`wait`] and [`futex`]: spin, yield, then park (a shared futex, or the
//!   server's doorbells), with deadlines;
//! * [`liveness`]: locks, pidfds and start times that prove a process alive;
//! * [`bootstrap`] and [`rundir`]: the Unix socket, credentials and
//!   descriptor passing; server names and paths;
//! * [`kv`]: KV cache geometry, chunk objects and chunk hashes;
//! * [`device`]: device UUIDs and IPC event handles;
//! * `gpu` (feature `cuda`): one safe RAII layer over the CUDA driver;
//! * [`client`]: the engine's end (the server is the `kvring-server`
//!   package, which `kvring serve` runs; an engine never links it);
//! * [`inspect`]: a read-only snapshot of a segment and its anomalies;
//! * [`error`]: the public error type.

/// Items compiled only outside the loom model check (which builds just the
/// ring, the job table and what they use).
macro_rules! not_loom {
    ($($item:item)*) => { $( #[cfg(not(kvring_loom))] $item )* };
}

pub mod jobs;
pub mod ring;
pub mod shm_struct;
pub(crate) mod sync;
pub mod wire;

not_loom! {
    pub mod bootstrap;
    pub mod client;
    pub mod client_memory;
    pub mod device;
    pub mod doorbell;
    pub mod error;
    pub mod futex;
    pub mod inspect;
    pub mod job_words;
    pub mod kv;
    pub mod liveness;
    pub mod proto;
    pub mod rundir;
    pub mod segment;
    pub mod shm;
    pub mod units;
    pub mod wait;

    pub use client::{
        Client, ClientBuilder, ClientOptions, Completion, DelayJob, HostKvCache, Job, KvSpec,
        Lease, LeaseId, Lookup, LookupPoll, Memory, PendingLookup, RawChannel, Registration,
        Retrieve, Store,
    };
    pub use device::{DeviceUuid, IpcEventHandle};
    pub use error::{Error, Result};
}

#[cfg(all(feature = "cuda", not(kvring_loom)))]
pub mod gpu;
