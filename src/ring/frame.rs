//! The frame header every ring message starts with.
//!
//! A frame is a 24-byte [`FrameHeader`] followed by `len` payload bytes, padded
//! to a multiple of 8. Frames are laid out back to back in the ring's data area
//! and may wrap around its end (both sides copy word by word through the index
//! mask), so no space is lost to padding frames and completion credits can be
//! counted exactly.

use bytemuck::{Pod, Zeroable};

crate::shm_struct::shm_struct! {
    /// Header of every frame in a request or completion ring.
    ///
    /// Byte-level layout (little-endian, as the host writes it) is in
    /// `shm_layout.md`, table "Frame header".
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct FrameHeader {
        /// Payload bytes that follow the header (not counting padding).
        [0] pub len: u32,
        /// Operation code (see `proto::Opcode`).
        [4] pub opcode: u16,
        /// Operation-specific flags ([`FrameFlags`]).
        [6] pub flags: u16,
        /// Session tag of the client slot that wrote the request; echoed back
        /// in its completion. A frame whose tag is not the slot's current
        /// session is rejected, so a late write of a previous occupant is
        /// never served.
        [8] pub session: u32,
        /// Completion status (0 = ok, otherwise a `proto::Status` code). Zero
        /// in requests.
        [12] pub status: i32,
        /// Caller's correlation value, echoed unchanged in the completion.
        [16] pub user_data: u64,
    }
}

const _: () = {
    assert!(core::mem::size_of::<FrameHeader>() == 24);
    assert!(core::mem::align_of::<FrameHeader>() == 8);
};

bitflags::bitflags! {
    /// `FrameHeader::flags` bits (the field stays a `u16`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct FrameFlags: u16 {
        /// More frames of the same request follow. The receiver appends this
        /// frame's payload and answers only the last frame, so a request may
        /// exceed the frame bound (up to the server's `max_request_bytes`).
        const MORE = 1;
    }
}

/// Size of the header in bytes.
pub const HEADER_BYTES: usize = core::mem::size_of::<FrameHeader>();
/// Size of the header in 8-byte words.
pub const HEADER_WORDS: usize = HEADER_BYTES / 8;

/// Bytes a frame with `payload_len` payload bytes occupies in a ring.
#[inline]
pub const fn frame_bytes(payload_len: usize) -> usize {
    HEADER_BYTES + ((payload_len + 7) & !7)
}

impl FrameHeader {
    /// The header as the three words it occupies in a ring.
    #[inline]
    pub fn to_words(&self) -> [u64; HEADER_WORDS] {
        bytemuck::cast(*self)
    }

    /// Rebuilds a header from the three words read out of a ring.
    #[inline]
    pub fn from_words(w: [u64; HEADER_WORDS]) -> Self {
        bytemuck::cast(w)
    }
}
