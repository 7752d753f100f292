//! A ring in ordinary heap memory, for tests and fuzz targets of the ring
//! algorithm itself (the segment's rings live in shared memory).

use super::{Consumer, Producer, RingPtrs};
use std::sync::atomic::AtomicU64;

/// Both indices and the data words of one ring, on the heap.
pub struct HeapRing {
    pub head: AtomicU64,
    pub tail: AtomicU64,
    pub data: Vec<AtomicU64>,
    pub max_frame: usize,
}

impl HeapRing {
    /// A zeroed ring of `capacity` bytes (boxed: its address is fixed).
    pub fn new(capacity: usize, max_frame: usize) -> Box<HeapRing> {
        Box::new(HeapRing {
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            data: (0..capacity / 8).map(|_| AtomicU64::new(0)).collect(),
            max_frame,
        })
    }

    /// Where the ring lives, for `Producer::new` and `Consumer::new`.
    pub fn ptrs(&self) -> RingPtrs {
        RingPtrs {
            head: &self.head,
            tail: &self.tail,
            data: self.data.as_ptr(),
            capacity: self.data.len() * 8,
            max_frame: self.max_frame,
        }
    }

    /// A producer and a consumer of this ring.
    ///
    /// # Safety
    /// The ring must outlive both, and no other producer or consumer of it
    /// may exist.
    pub unsafe fn pair(&self) -> (Producer, Consumer) {
        // SAFETY: the caller keeps the ring alive and the halves unique.
        unsafe {
            (
                Producer::new(self.ptrs()).expect("a valid ring"),
                Consumer::new(self.ptrs()).expect("a valid ring"),
            )
        }
    }
}
