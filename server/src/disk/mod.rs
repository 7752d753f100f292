//! The local disk tier's store (what the `--disk` tier of the server
//! builds on): chunk objects in segment files under one directory, read
//! and written with direct I/O, each record the remote tier's value format
//! (bound to its key, sealed), an index in memory rebuilt from the files
//! when a server starts on them, and a byte budget kept by dropping the
//! oldest segment.

mod aligned;
pub(crate) mod health;
mod segment;
mod store;
pub(crate) mod tier;

pub use aligned::{AlignedBuf, BLOCK};
pub use store::{record_bytes, DiskStats, DiskStore, LOCK_FILE};

#[cfg(test)]
mod tests;
