//! The producing side of a ring.

use super::frame::{frame_bytes, FrameHeader};
use super::{RingError, RingPtrs};
use crate::sync::{AtomicU64, Ordering};

/// Writes frames into a ring. Exactly one `Producer` may exist per ring.
///
/// Frames are written with [`Producer::write`] and become visible to the
/// consumer only at [`Producer::publish`], so a batch costs one release store.
pub struct Producer {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *const AtomicU64,
    mask: u64,
    capacity: u64,
    max_frame: usize,
    /// Our tail, including written but unpublished frames.
    local_tail: u64,
    /// The tail last stored to shared memory.
    published_tail: u64,
    /// Last head value read from shared memory (validated).
    cached_head: u64,
}

// SAFETY: the raw pointers address shared memory whose lifetime the creator
// guarantees (see `Producer::new`); a Producer is used by one thread at a time.
unsafe impl Send for Producer {}

impl Producer {
    /// Builds the producer of a ring and takes over its current indices.
    ///
    /// # Safety
    /// `ptrs` must point at a mapped ring (valid `head`, `tail` and
    /// `capacity / 8` data words) for as long as the producer lives, and no
    /// other producer may write this ring.
    pub unsafe fn new(ptrs: RingPtrs) -> Result<Self, RingError> {
        if !super::valid_shape(ptrs.capacity, ptrs.max_frame) {
            return Err(RingError::Corrupt("bad ring geometry"));
        }
        // SAFETY: the caller guarantees `tail` and `head` are valid.
        let (tail, head) = unsafe {
            // Acquire on head pairs with the consumer's Release store of head;
            // the tail is ours, nobody else writes it.
            (
                (*ptrs.tail).load(Ordering::Relaxed),
                (*ptrs.head).load(Ordering::Acquire),
            )
        };
        if tail % 8 != 0 || head % 8 != 0 || tail.wrapping_sub(head) > ptrs.capacity as u64 {
            return Err(RingError::Corrupt("indices out of range at attach"));
        }
        Ok(Producer {
            head: ptrs.head,
            tail: ptrs.tail,
            data: ptrs.data,
            mask: (ptrs.capacity as u64 / 8) - 1,
            capacity: ptrs.capacity as u64,
            max_frame: ptrs.max_frame,
            local_tail: tail,
            published_tail: tail,
            cached_head: head,
        })
    }

    /// Largest payload one frame can carry.
    #[inline]
    pub fn max_payload(&self) -> usize {
        self.max_frame - super::HEADER_BYTES
    }

    /// Free bytes as of the cached head (no shared read).
    #[inline]
    fn cached_free(&self) -> u64 {
        self.capacity - (self.local_tail - self.cached_head)
    }

    /// Reloads the consumer's head and validates it.
    fn refresh_head(&mut self) -> Result<(), RingError> {
        // SAFETY: `head` is valid for our lifetime (constructor contract).
        // Acquire pairs with the consumer's Release store of head, made after
        // it copied out the frames it released: our overwrite comes after.
        let head = unsafe { (*self.head).load(Ordering::Acquire) };
        if head < self.cached_head || head > self.local_tail || head % 8 != 0 {
            return Err(RingError::Corrupt("consumer head out of range"));
        }
        self.cached_head = head;
        Ok(())
    }

    /// Free bytes in the ring now (reads the shared head).
    pub fn free(&mut self) -> Result<usize, RingError> {
        self.refresh_head()?;
        Ok(self.cached_free() as usize)
    }

    /// Whether `need` bytes can be written now. Reads the shared head only
    /// when the cached copy says there is not enough room.
    #[inline]
    pub fn has_room(&mut self, need: usize) -> Result<bool, RingError> {
        if (self.cached_free() as usize) < need {
            self.refresh_head()?;
        }
        Ok(self.cached_free() as usize >= need)
    }

    /// Bytes written and not yet consumed, as of the last head read.
    pub fn in_flight(&self) -> usize {
        (self.local_tail - self.cached_head) as usize
    }

    /// Fails with `Full` unless `need` bytes are free (reads the shared head
    /// only when the cached copy says there is not enough).
    #[inline]
    fn ensure(&mut self, need: usize) -> Result<(), RingError> {
        if !self.has_room(need)? {
            return Err(RingError::Full {
                need,
                free: self.cached_free() as usize,
            });
        }
        Ok(())
    }

    /// Writes one frame without publishing it. Fails with `TooLarge` when the
    /// payload exceeds the frame bound, `Full` when there is no room now.
    #[inline]
    pub fn write(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), RingError> {
        let need = frame_bytes(payload.len());
        if need > self.max_frame {
            return Err(RingError::TooLarge {
                len: payload.len(),
                max: self.max_payload(),
            });
        }
        self.ensure(need)?;
        let mut h = *header;
        h.len = payload.len() as u32;
        let mut w = self.local_tail / 8;
        for word in h.to_words() {
            self.store(w, word);
            w += 1;
        }
        let mut chunks = payload.chunks_exact(8);
        for c in &mut chunks {
            self.store(w, u64::from_ne_bytes(c.try_into().expect("8-byte chunk")));
            w += 1;
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.store(w, u64::from_ne_bytes(last));
        }
        self.local_tail += need as u64;
        Ok(())
    }

    /// Writes a frame whose payload is given as 8-byte words.
    #[inline]
    pub fn write_words(&mut self, header: &FrameHeader, payload: &[u64]) -> Result<(), RingError> {
        let need = super::HEADER_BYTES + payload.len() * 8;
        if need > self.max_frame {
            return Err(RingError::TooLarge {
                len: payload.len() * 8,
                max: self.max_payload(),
            });
        }
        self.ensure(need)?;
        let mut h = *header;
        h.len = (payload.len() * 8) as u32;
        let mut w = self.local_tail / 8;
        for word in h.to_words() {
            self.store(w, word);
            w += 1;
        }
        for &word in payload {
            self.store(w, word);
            w += 1;
        }
        self.local_tail += need as u64;
        Ok(())
    }

    /// Makes every written frame visible to the consumer. Returns whether
    /// anything new was published.
    #[inline]
    pub fn publish(&mut self) -> bool {
        if self.local_tail == self.published_tail {
            return false;
        }
        // SAFETY: `tail` is valid for our lifetime and written only by us.
        // Release pairs with the consumer's Acquire load of tail: the frame
        // words stored above are visible before the new tail is.
        unsafe { (*self.tail).store(self.local_tail, Ordering::Release) };
        self.published_tail = self.local_tail;
        true
    }

    /// Writes and publishes one frame.
    #[inline]
    pub fn push(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), RingError> {
        self.write(header, payload)?;
        self.publish();
        Ok(())
    }

    /// The producer's current (local) tail position.
    pub fn tail(&self) -> u64 {
        self.local_tail
    }

    #[inline(always)]
    fn store(&self, word: u64, value: u64) {
        let idx = (word & self.mask) as usize;
        // SAFETY: idx < capacity / 8 by the mask, and `data` addresses that many
        // words (constructor contract). Relaxed: published by the Release
        // store of tail in `publish`.
        unsafe { (*self.data.add(idx)).store(value, Ordering::Relaxed) };
    }
}
