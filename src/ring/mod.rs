//! Single-producer single-consumer frame rings, io_uring style.
//!
//! A ring is three things that may live in different pages (and, in the
//! segment, do: each index sits in the region of the process that writes it):
//!
//! * `tail`: a free-running `u64` byte position, written only by the producer;
//! * `head`: a free-running `u64` byte position, written only by the consumer;
//! * `data`: `capacity` bytes (a power of two, a multiple of 8), addressed as
//!   8-byte words through `position & (capacity - 1)`.
//!
//! `tail - head` is the number of bytes in flight; it is never more than
//! `capacity`, so full and empty are unambiguous and positions never wrap in
//! practice (2^64 bytes). Each side keeps a private copy of its own index and a
//! cached copy of the peer's, and reads the peer's shared index only when the
//! cached one says the ring is full (producer) or empty (consumer).
//!
//! Ordering, the whole protocol:
//! * the producer writes a frame's words (relaxed), then stores `tail` with
//!   Release; the consumer loads `tail` with Acquire before reading those
//!   words, so it sees them complete;
//! * the consumer copies the frame out (relaxed loads), then stores `head` with
//!   Release; the producer loads `head` with Acquire before overwriting that
//!   space, so the consumer's reads happen before the overwrite.
//!
//! Both indices are untrusted when read by the other side: a value that breaks
//! `head <= tail <= head + capacity` or goes backwards is reported as
//! [`RingError::Corrupt`] and the ring must be abandoned.

mod consumer;
mod frame;
mod producer;

pub use consumer::Consumer;
pub use frame::{frame_bytes, FrameFlags, FrameHeader, HEADER_BYTES, HEADER_WORDS};
pub use producer::Producer;

/// Smallest ring data area, in bytes.
pub const MIN_CAPACITY: usize = 4096;
/// Largest ring data area, in bytes (the ring's positions are byte counts in a
/// `u64`, the data area is indexed with 32-bit word offsets in the layout).
pub const MAX_CAPACITY: usize = 1 << 30;

/// Errors of ring operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The frame does not fit the ring's frame bound; the caller must split it.
    #[error("frame of {len} payload bytes exceeds the ring's bound of {max} payload bytes")]
    TooLarge { len: usize, max: usize },
    /// Not enough free space now; retry after the consumer moves.
    #[error("ring full: {need} bytes needed, {free} free")]
    Full { need: usize, free: usize },
    /// The peer broke a ring invariant (bad index or frame); the ring is dead.
    #[error("ring corrupt: {0}")]
    Corrupt(&'static str),
}

/// A ring size or frame bound out of its bounds (see [`check_geometry`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingGeometryError {
    #[error("ring capacity {0} must be a power of two in {MIN_CAPACITY}..={MAX_CAPACITY}")]
    Capacity(usize),
    #[error(
        "frame bound {max_frame} must be a multiple of 8 in {}..={} (a quarter of the ring)",
        HEADER_BYTES + 64,
        capacity / 4
    )]
    FrameBound { max_frame: usize, capacity: usize },
}

/// Checks a ring geometry: capacity a power of two within bounds, the frame
/// bound a multiple of 8 that leaves room for at least four maximal frames.
pub fn check_geometry(capacity: usize, max_frame: usize) -> Result<(), RingGeometryError> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(RingGeometryError::Capacity(capacity));
    }
    if max_frame % 8 != 0 || max_frame < HEADER_BYTES + 64 || max_frame > capacity / 4 {
        return Err(RingGeometryError::FrameBound {
            max_frame,
            capacity,
        });
    }
    Ok(())
}

/// The shape every ring must have for the index arithmetic to hold (the
/// configuration bounds of [`check_geometry`] are stricter).
pub(crate) fn valid_shape(capacity: usize, max_frame: usize) -> bool {
    capacity.is_power_of_two()
        && capacity >= 8
        && max_frame % 8 == 0
        && max_frame >= HEADER_BYTES
        && max_frame <= capacity
}

/// Where a ring lives. The pointers must stay valid (mapped) for as long as a
/// [`Producer`] or [`Consumer`] built from them exists.
#[derive(Clone, Copy, Debug)]
pub struct RingPtrs {
    /// The consumer-written index.
    pub head: *const crate::sync::AtomicU64,
    /// The producer-written index.
    pub tail: *const crate::sync::AtomicU64,
    /// The data area: `capacity / 8` words.
    pub data: *const crate::sync::AtomicU64,
    /// Data area size in bytes.
    pub capacity: usize,
    /// Largest frame (header + padded payload) in bytes.
    pub max_frame: usize,
}

#[cfg(not(kvring_loom))]
#[doc(hidden)]
pub mod heap;
#[cfg(all(test, kvring_loom))]
mod loom_tests;
#[cfg(all(test, not(kvring_loom)))]
mod tests;
