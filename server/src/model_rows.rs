//! The server's side of the lookups-by-model region
//! ([`kvring::shm::ModelStats`]): which row counts each (model, salt).

use kvring::shm::{ModelRowState, ModelStats, MODEL_ROWS};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Rows taken so far, by (model, salt).
#[derive(Default)]
pub struct ModelRows {
    rows: HashMap<(u64, u64), usize>,
}

impl ModelRows {
    /// Counts one lookup of `chunks` chunks (`hits` found) for `model` and
    /// `salt`, in its row, taking one if it has none (the last row once the
    /// others are taken).
    pub fn record(
        &mut self,
        region: &ModelStats,
        (model, salt): (u64, u64),
        chunks: u64,
        hits: u64,
        chunk_tokens: u64,
    ) {
        let next = self.rows.len();
        let row = *self.rows.entry((model, salt)).or_insert_with(|| {
            let (row, state) = if next < MODEL_ROWS - 1 {
                (next, ModelRowState::One)
            } else {
                (MODEL_ROWS - 1, ModelRowState::Others)
            };
            let r = &region.rows[row];
            if state == ModelRowState::One {
                r.model_id.store(model, Ordering::Relaxed);
                r.salt.store(salt, Ordering::Relaxed);
            }
            // Release pairs with the observers' Acquire load of `state`:
            // the row's model and salt are written before.
            r.state.store(state as u32, Ordering::Release);
            row
        });
        let r = &region.rows[row];
        // Relaxed adds: counters, each read on its own.
        r.lookups.fetch_add(1, Ordering::Relaxed);
        r.chunks.fetch_add(chunks, Ordering::Relaxed);
        r.hit_chunks.fetch_add(hits, Ordering::Relaxed);
        r.tokens.fetch_add(chunks * chunk_tokens, Ordering::Relaxed);
        r.hit_tokens
            .fetch_add(hits * chunk_tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvring::shm_struct::Load;

    #[test]
    fn models_past_the_rows_are_counted_in_the_last_one() {
        // SAFETY: ModelStats is a repr(C) struct of atomics: all zeroes is
        // a valid value (every row free).
        let region: Box<ModelStats> = unsafe { Box::new(std::mem::zeroed()) };
        let mut rows = ModelRows::default();
        for m in 0..MODEL_ROWS as u64 + 10 {
            rows.record(&region, (m, 7), 4, 1, 16);
        }
        rows.record(&region, (0, 7), 2, 2, 16);
        let v = region.load_value(Ordering::Acquire);
        assert_eq!(v.rows[0].state, ModelRowState::One as u32);
        assert_eq!(
            (v.rows[0].lookups, v.rows[0].chunks, v.rows[0].hit_tokens),
            (2, 6, 48)
        );
        assert_eq!((v.rows[62].model_id, v.rows[62].salt), (62, 7));
        let last = &v.rows[MODEL_ROWS - 1];
        assert_eq!(last.state, ModelRowState::Others as u32);
        assert_eq!(
            (last.lookups, last.tokens, last.hit_tokens),
            (11, 11 * 64, 11 * 16)
        );
        let total: u64 = v.rows.iter().map(|r| r.lookups).sum();
        assert_eq!(total, MODEL_ROWS as u64 + 11);
    }
}
