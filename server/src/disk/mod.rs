//! The local disk tier's store (what the `--disk` tier of the server
//! builds on): chunk objects in segment files under one directory,
//! read and written with direct I/O (io_uring, several transfers in
//! flight), each record the remote tier's value format (bound to its key,
//! sealed) with the object on blocks of its own, an index in memory
//! rebuilt from the files when a server starts on them, and a byte budget
//! kept by dropping the oldest segment.

mod aligned;
pub(crate) mod health;
pub mod io;
mod seg_index;
mod segment;
mod store;
pub(crate) mod tier;

pub use aligned::{AlignedBuf, BLOCK};
pub use segment::record_bytes;
pub use store::{DiskStats, DiskStore, Get, LOCK_FILE, QUEUE_DEPTH};

#[cfg(test)]
mod tests;
