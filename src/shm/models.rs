//! The lookups-by-model region: per (model, salt), what lookups asked for
//! and found, in chunks and tokens. Rows are taken in the order models are
//! first looked up; once [`MODEL_ROWS`]` - 1` are taken, every further
//! (model, salt) is counted in the last row, marked
//! [`ModelRowState::Others`] (the metrics label it `model="other"`), so the
//! totals stay exact whatever the cardinality.

use crate::shm_struct::shm_struct;
use crate::sync::{AtomicU32, AtomicU64};
use crate::wire::wire_enum;
use std::mem::size_of;

/// Rows of the region (the last one takes every (model, salt) beyond).
pub const MODEL_ROWS: usize = 64;

wire_enum! {
    /// `ModelStat::state` values.
    pub enum ModelRowState: u32 {
        /// Not taken yet.
        Free = 0 => "free",
        /// One model and salt (`model_id`, `salt`).
        One = 1 => "one",
        /// Every model and salt that found no row of its own.
        Others = 2 => "others",
    }
}

shm_struct! {
    /// One row. Written by the server's lookups (one at a time, under the
    /// cache's lock), read word by word by observers.
    pub struct ModelStat => ModelStatValues {
        /// [`ModelRowState`] as u32; stored (Release) after `model_id` and
        /// `salt`, so a reader that sees it set (Acquire) reads them right.
        [0] pub state: AtomicU32,
        [4] pub _reserved0: AtomicU32,
        [8] pub model_id: AtomicU64,
        [16] pub salt: AtomicU64,
        /// LOOKUP requests (counter).
        [24] pub lookups: AtomicU64,
        /// Chunks asked for (counter).
        [32] pub chunks: AtomicU64,
        /// Chunks found (counter).
        [40] pub hit_chunks: AtomicU64,
        /// Tokens asked for: chunks times the server's chunk size (counter).
        [48] pub tokens: AtomicU64,
        /// Tokens found (counter).
        [56] pub hit_tokens: AtomicU64,
    }
}

shm_struct! {
    /// The lookups-by-model region, at `models_off`.
    pub struct ModelStats => ModelStatsValues {
        [0] pub rows: [ModelStat; MODEL_ROWS],
    }
}

const _: () = {
    assert!(size_of::<ModelStat>() == 64);
    assert!(size_of::<ModelStats>() == 64 * MODEL_ROWS);
};
