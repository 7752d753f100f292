//! kvring: a node-local KV-cache runtime. Inference engine processes and one
//! cache server on the same host talk through lock-free request and
//! completion rings in POSIX shared memory.
//!
//! Module map (see README.md for the picture):
//! * [`ring`]: the SPSC frame ring (producer, consumer, frame header);
//! * [`jobs`]: the job table (slots, seqlock, state machine, ids);
//! * [`layout`]: the segment's byte layout (`shm_layout.md` in tables);
//! * [`segment`]: creating, attaching and replacing the segment;
//! * [`wait`] and [`futex`]: spin, yield, then a shared futex, with deadlines;
//! * [`liveness`]: locks, pidfds and start times that prove a process alive;
//! * [`bootstrap`]: the Unix socket, credentials and descriptor passing;
//! * [`proto`]: opcodes, status codes and bootstrap messages;
//! * [`server`] and [`client`]: the two ends.

pub(crate) mod sync;

pub mod jobs;
pub mod ring;

#[cfg(not(loom))]
pub mod bootstrap;
#[cfg(not(loom))]
pub mod client;
#[cfg(not(loom))]
pub mod cuda;
#[cfg(not(loom))]
pub mod demo;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod futex;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod fuzz;
#[cfg(not(loom))]
pub mod kv;
#[cfg(not(loom))]
pub mod layout;
#[cfg(not(loom))]
pub mod liveness;
#[cfg(not(loom))]
pub mod observe;
#[cfg(not(loom))]
pub mod proto;
#[cfg(not(loom))]
pub mod rundir;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod server;
#[cfg(not(loom))]
pub mod wait;

#[cfg(not(loom))]
pub use client::{
    Client, ClientBuilder, ClientOptions, Completion, DelayJob, DeviceUuid, HostKvCache,
    IpcEventHandle, Job, KvSpec, Lease, LeaseId, Lookup, Memory, RawChannel, Registration,
    Retrieve, Store,
};
#[cfg(not(loom))]
pub use error::{Error, Result};
#[cfg(not(loom))]
pub use server::{ServerConfig, ServerHandle};
