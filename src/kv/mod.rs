//! What engines and the server agree on about KV caches: paged layouts and
//! chunk objects ([`layout`]), keys ([`hash`]), and deterministic test
//! contents ([`pattern`]).

pub mod hash;
pub mod layout;
pub mod pattern;

pub use hash::{chunk_hashes, model_id, salt_id, ChunkHash};
pub use layout::{Dtype, KvLayout, KvLayoutKind, KvShape};

/// Chunk size (tokens) a server uses unless told otherwise.
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;
