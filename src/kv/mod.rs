//! What engines and the server agree on about KV caches: what a cache holds
//! ([`geometry`]), where it lives in the engine's memory ([`layout`], with
//! named [`preset`]s), how a chunk moves as runs ([`plan`]), the
//! [`layer_groups`] a retrieve may land in, keys
//! ([`hash`]), and deterministic test contents ([`pattern`]).
//!
//! A stored **chunk object** is independent of the memory layout: `[layer]
//! [token][head][K then V]` for `chunk_tokens` tokens, so engines of any
//! layouts (and block sizes) with one geometry share stored objects.

pub mod geometry;
pub mod hash;
pub mod layer_groups;
pub mod layout;
mod overlap;
pub mod pattern;
pub mod plan;
pub mod preset;

pub use geometry::{Dtype, GeometryError, GeometryFlags, KvGeometry, KvShape};
pub use hash::{
    chain_seed, chunk_chain, chunk_hashes, engine_key, model_id, prompt_keys, salt_id, tail_hash, ChainState, ChunkHash,
};
pub use layer_groups::LayerGroups;
pub use layout::{KvLayout, LayerPlacement, LayoutError, Part};
pub use plan::CopyPlan;
pub use preset::LayoutPreset;

/// Chunk size (tokens) a server uses unless told otherwise.
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;
