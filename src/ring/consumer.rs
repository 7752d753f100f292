//! The consuming side of a ring.

use super::frame::{frame_bytes, FrameHeader, HEADER_BYTES, HEADER_WORDS};
use super::{RingError, RingPtrs};
use crate::sync::{AtomicU64, Ordering};

/// Reads frames out of a ring. Exactly one `Consumer` may exist per ring.
///
/// Frames are copied out of shared memory before anything in them is
/// interpreted, and every length is checked against the frame bound and the
/// bytes actually published. Space is handed back to the producer at
/// [`Consumer::release`], so a batch costs one release store.
pub struct Consumer {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *const AtomicU64,
    mask: u64,
    capacity: u64,
    max_frame: usize,
    /// Our head, including consumed but unreleased frames.
    local_head: u64,
    /// The head last stored to shared memory.
    released_head: u64,
    /// Last tail value read from shared memory (validated).
    cached_tail: u64,
}

// SAFETY: the raw pointers address shared memory whose lifetime the creator
// guarantees (see `Consumer::new`); a Consumer is used by one thread at a time.
unsafe impl Send for Consumer {}

impl Consumer {
    /// Builds the consumer of a ring and takes over its current indices.
    ///
    /// # Safety
    /// `ptrs` must point at a mapped ring (valid `head`, `tail` and
    /// `capacity / 8` data words) for as long as the consumer lives, and no
    /// other consumer may read this ring.
    pub unsafe fn new(ptrs: RingPtrs) -> Result<Self, RingError> {
        if !super::valid_shape(ptrs.capacity, ptrs.max_frame) {
            return Err(RingError::Corrupt("bad ring geometry"));
        }
        // SAFETY: the caller guarantees `head` and `tail` are valid. The head
        // is ours; Acquire on tail pairs with the producer's Release store.
        let (head, tail) = unsafe {
            (
                (*ptrs.head).load(Ordering::Relaxed),
                (*ptrs.tail).load(Ordering::Acquire),
            )
        };
        if tail % 8 != 0 || head % 8 != 0 || tail.wrapping_sub(head) > ptrs.capacity as u64 {
            return Err(RingError::Corrupt("indices out of range at attach"));
        }
        Ok(Consumer {
            head: ptrs.head,
            tail: ptrs.tail,
            data: ptrs.data,
            mask: (ptrs.capacity as u64 / 8) - 1,
            capacity: ptrs.capacity as u64,
            max_frame: ptrs.max_frame,
            local_head: head,
            released_head: head,
            cached_tail: tail,
        })
    }

    /// Largest payload one frame can carry.
    #[inline]
    pub fn max_payload(&self) -> usize {
        self.max_frame - HEADER_BYTES
    }

    /// Reloads the producer's tail and validates it.
    #[inline]
    fn refresh_tail(&mut self) -> Result<(), RingError> {
        // SAFETY: `tail` is valid for our lifetime (constructor contract).
        // Acquire pairs with the producer's Release store in `publish`: the
        // frame words before that tail are visible to the loads below.
        let tail = unsafe { (*self.tail).load(Ordering::Acquire) };
        if tail < self.cached_tail
            || tail.wrapping_sub(self.released_head) > self.capacity
            || tail < self.local_head
            || tail % 8 != 0
        {
            return Err(RingError::Corrupt("producer tail out of range"));
        }
        self.cached_tail = tail;
        Ok(())
    }

    /// Bytes published and not yet consumed. Reads the shared tail only when
    /// the cached copy says the ring is empty.
    #[inline]
    pub fn available(&mut self) -> Result<usize, RingError> {
        if self.local_head == self.cached_tail {
            self.refresh_tail()?;
        }
        Ok((self.cached_tail - self.local_head) as usize)
    }

    /// Whether a frame is waiting (one shared read at most).
    #[inline]
    pub fn has_frame(&mut self) -> Result<bool, RingError> {
        Ok(self.available()? > 0)
    }

    /// The next frame's header, validated but not consumed.
    #[inline]
    pub fn peek(&mut self) -> Result<Option<FrameHeader>, RingError> {
        let avail = self.available()?;
        if avail == 0 {
            return Ok(None);
        }
        if avail < HEADER_BYTES {
            return Err(RingError::Corrupt("partial frame header"));
        }
        let mut words = [0u64; HEADER_WORDS];
        let base = self.local_head / 8;
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.load(base + i as u64);
        }
        let h = FrameHeader::from_words(words);
        let len = h.len as usize;
        if len > self.max_payload() {
            return Err(RingError::Corrupt("frame length over the bound"));
        }
        if frame_bytes(len) > avail {
            return Err(RingError::Corrupt("frame longer than the published bytes"));
        }
        Ok(Some(h))
    }

    /// Copies the next frame out: its header, and its payload into `buf`
    /// (which must hold `max_payload()` bytes rounded up to words). Returns
    /// `None` when the ring is empty. The space is released at `release`.
    #[inline]
    pub fn pop(&mut self, buf: &mut [u64]) -> Result<Option<FrameHeader>, RingError> {
        let Some(h) = self.peek()? else {
            return Ok(None);
        };
        let len = h.len as usize;
        let words = len.div_ceil(8);
        assert!(
            buf.len() >= words,
            "pop buffer smaller than the frame bound"
        );
        let base = self.local_head / 8 + HEADER_WORDS as u64;
        for (i, w) in buf[..words].iter_mut().enumerate() {
            *w = self.load(base + i as u64);
        }
        self.local_head += frame_bytes(len) as u64;
        Ok(Some(h))
    }

    /// Skips the next frame without copying its payload.
    pub fn skip(&mut self) -> Result<Option<FrameHeader>, RingError> {
        let Some(h) = self.peek()? else {
            return Ok(None);
        };
        self.local_head += frame_bytes(h.len as usize) as u64;
        Ok(Some(h))
    }

    /// Hands consumed space back to the producer. Returns whether anything
    /// was released.
    #[inline]
    pub fn release(&mut self) -> bool {
        if self.local_head == self.released_head {
            return false;
        }
        // SAFETY: `head` is valid for our lifetime and written only by us.
        // Release pairs with the producer's Acquire load of head: our copies
        // out of the released space happen before it is overwritten.
        unsafe { (*self.head).store(self.local_head, Ordering::Release) };
        self.released_head = self.local_head;
        true
    }

    /// The consumer's current (local) head position.
    pub fn head(&self) -> u64 {
        self.local_head
    }

    #[inline(always)]
    fn load(&self, word: u64) -> u64 {
        let idx = (word & self.mask) as usize;
        // SAFETY: idx < capacity / 8 by the mask, and `data` addresses that
        // many words (constructor contract). Relaxed: ordered after the
        // Acquire load of tail in `refresh_tail`.
        unsafe { (*self.data.add(idx)).load(Ordering::Relaxed) }
    }
}
