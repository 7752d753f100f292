//! Entry points of the fuzz targets (`fuzz/fuzz_targets/`) and of their
//! bounded runs in the test suite (`tests/fuzz.rs`).
//!
//! Each function takes arbitrary bytes, drives one piece of kvring that
//! reads untrusted input with them, and panics when a property breaks. An
//! input the code refuses with an error is a pass; a panic, an out-of-bounds
//! access (caught by the sanitizer under `cargo fuzz`), a hang (caught by
//! the deadlines below) or a wrong answer is a failure.
//!
//! * [`ring_frames()`]: the ring consumer against a hostile producer (any
//!   indices, any words in the data area), and producer + consumer against
//!   a model of the frames in flight;
//! * [`requests()`]: any frames (opcode, flags, payload) submitted to a live
//!   in-process server with a registered KV cache: every request is answered
//!   exactly once with a known status, jobs it creates end, the connection
//!   survives;
//! * [`registration()`]: any registration message and tables (allocations,
//!   memory pieces, layer placements) against the server's registry (with
//!   real sealed and unsealed memfds), and any layout descriptor — raw, or
//!   a preset with hostile edits — against its own addressing: whatever is
//!   accepted addresses only memory it mapped, and no two of its rows share
//!   a byte;
//! * [`l2_value()`]: the second tier's value decoder against any bytes under
//!   any key (taken only if it is exactly what sealing gives), and a sealed
//!   value damaged in one byte (always refused);
//! * [`http_request()`]: any bytes to the HTTP endpoint's request reader, in
//!   any split into reads: the same answer however they are split, never a
//!   request over the bound, a body of exactly its `Content-Length`.

mod http;
mod l2_value;
mod registration;
mod requests;
mod ring;

pub use http::http_request;
pub use l2_value::l2_value;
pub use registration::registration;
pub use requests::requests;
pub use ring::ring_frames;

/// Reads an input front to back; past its end every read is zero.
pub(crate) struct Input<'a>(&'a [u8]);

impl Input<'_> {
    pub(crate) fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    pub(crate) fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }
    pub(crate) fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
