//! How a chunk's rows move: as few runs as the layout allows, each
//! contiguous in both the engine's memory and the chunk object. The host
//! copy walks these runs and the GPU kernel is handed the same plan, so
//! both move the same bytes for every layout.
//!
//! A block of one layer (a *page*: `block_tokens * heads` rows) is copied
//! as `tokens * heads * parts` runs: one per row and part (K and V apart),
//! one per row (K and V side by side), one per token (heads side by side
//! too), or one for the page (tokens too: vLLM 0.33's default and the
//! block-outermost layouts).

use super::layout::KvLayout;

/// The runs of one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyPlan {
    /// Tokens a page's runs are indexed by (1: one run covers every token).
    pub tokens: u32,
    /// Heads a page's runs are indexed by (1: one run covers every head).
    pub heads: u32,
    /// Runs per (token, head): 1 (K and V side by side, or no V) or 2.
    pub parts: u32,
    /// Bytes of part 0's and part 1's runs.
    pub width: [u64; 2],
    /// Where each part's run starts in an object row.
    pub row_offset: [u64; 2],
    /// The largest power of two up to 16 dividing every offset, stride and
    /// width of the layout and of the object: runs can move in words of
    /// this size when the allocations' bases are as aligned.
    pub align: u32,
    /// The geometry's tokens per block, heads and row bytes.
    pub block_tokens: u32,
    pub all_heads: u32,
    pub row_bytes: u64,
}

/// The largest power of two up to 16 dividing `v` (16 for 0): the widest
/// word a copy can move at an address or size of `v`.
pub fn align_of(v: u64) -> u32 {
    if v == 0 {
        16
    } else {
        1 << v.trailing_zeros().min(4)
    }
}

impl CopyPlan {
    pub(super) fn new(layout: &KvLayout) -> CopyPlan {
        let g = layout.geometry();
        let layers = layout.layers();
        let (kb, vb, row) = (g.k_bytes(), g.v_bytes(), g.row_bytes());
        let packed = g.v_dim == 0 || layers.iter().all(|p| p.v_offset == p.k_offset + kb);
        let heads_merged = packed && (g.heads == 1 || layers.iter().all(|p| p.head_stride == row));
        let hrow = u64::from(g.heads) * row;
        let tokens_merged = heads_merged
            && (g.block_tokens == 1 || layers.iter().all(|p| p.token_stride == hrow));
        let (parts, width, row_offset) = if packed {
            let mut w = row;
            if heads_merged {
                w *= u64::from(g.heads);
            }
            if tokens_merged {
                w *= u64::from(g.block_tokens);
            }
            (1, [w, 0], [0, 0])
        } else {
            (2, [kb, vb], [0, kb])
        };
        let mut align = align_of(row).min(align_of(width[0])).min(align_of(kb));
        if parts == 2 {
            align = align.min(align_of(width[1]));
        }
        for p in layers {
            align = align.min(align_of(p.k_offset));
            if g.v_dim > 0 {
                align = align.min(align_of(p.v_offset));
            }
            for (n, s) in [
                (g.blocks, p.block_stride),
                (g.heads, p.head_stride),
                (g.block_tokens, p.token_stride),
            ] {
                if n > 1 {
                    align = align.min(align_of(s));
                }
            }
        }
        CopyPlan {
            tokens: if tokens_merged { 1 } else { g.block_tokens },
            heads: if heads_merged { 1 } else { g.heads },
            parts,
            width,
            row_offset,
            align,
            block_tokens: g.block_tokens,
            all_heads: g.heads,
            row_bytes: row,
        }
    }

    /// Bytes of the first part's runs (a whole page when tokens and heads
    /// are merged).
    pub fn run_bytes(&self) -> u64 {
        self.width[0]
    }

    /// Runs per page.
    pub fn runs_per_page(&self) -> u64 {
        u64::from(self.tokens) * u64::from(self.heads) * u64::from(self.parts)
    }

    /// Calls `f(part, engine offset, object offset, bytes)` for each run of
    /// page (`layer`, `block`), the `j`-th block of a chunk of
    /// `chunk_tokens`: the engine offset is in the layer's allocation.
    #[inline]
    pub fn for_each_run(
        &self,
        layout: &KvLayout,
        chunk_tokens: u32,
        layer: u32,
        block: u32,
        j: u32,
        mut f: impl FnMut(u32, u64, u64, u64),
    ) {
        let p = &layout.layers()[layer as usize];
        let first_token = u64::from(layer) * u64::from(chunk_tokens)
            + u64::from(j) * u64::from(self.block_tokens);
        for t in 0..self.tokens {
            for h in 0..self.heads {
                let obj_row = ((first_token + u64::from(t)) * u64::from(self.all_heads)
                    + u64::from(h))
                    * self.row_bytes;
                for part in 0..self.parts {
                    f(
                        part,
                        p.row(part, block, h, t),
                        obj_row + self.row_offset[part as usize],
                        self.width[part as usize],
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kv::{Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};

    /// For every preset, the runs of every page tile the object exactly and
    /// land each row's bytes where the layout says the row lives.
    #[test]
    fn runs_cover_every_row_once() {
        let s = KvShape {
            layers: 3,
            blocks: 6,
            block_tokens: 4,
            heads: 2,
            head_dim: 8,
        };
        let chunk = 8;
        for preset in LayoutPreset::ALL {
            for g in [
                KvGeometry::mha(s, Dtype::Bf16),
                KvGeometry::mha(s, Dtype::Fp8).with_v_dim(8),
                KvGeometry::mla(3, 6, 4, 24, Dtype::Bf16),
            ] {
                let Ok(l) = KvLayout::preset(preset, g) else {
                    continue;
                };
                let plan = l.plan();
                let obj = g.object_bytes(chunk) as usize;
                let mut covered = vec![0u8; obj];
                for layer in 0..g.layers {
                    for (j, block) in [5u32, 2].into_iter().enumerate() {
                        plan.for_each_run(&l, chunk, layer, block, j as u32, |part, eng, o, n| {
                            for i in 0..n {
                                covered[(o + i) as usize] += 1;
                            }
                            // The run's first byte is the row the layout names.
                            let p = &l.layers()[layer as usize];
                            let rel = o - g.object_row(chunk, layer, 0, 0);
                            let (row, within) = (rel / g.row_bytes(), rel % g.row_bytes());
                            let (t, h) = (row / u64::from(g.heads), row % u64::from(g.heads));
                            let t = t as u32 - j as u32 * g.block_tokens;
                            let want = if within >= g.k_bytes() {
                                p.row(1, block, h as u32, t) + within - g.k_bytes()
                            } else {
                                p.row(0, block, h as u32, t) + within
                            };
                            assert_eq!(eng, want, "{preset:?} part {part}");
                        });
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{preset:?}");
            }
        }
        let llama = KvGeometry::mha(s, Dtype::Bf16);
        for (preset, run) in [
            (LayoutPreset::Lbnhc, llama.page_bytes()),
            (LayoutPreset::Blnhc, llama.page_bytes()),
            (LayoutPreset::Lbhnc, llama.row_bytes()),
            (LayoutPreset::FlashAttn, llama.k_bytes()),
        ] {
            let plan = KvLayout::preset(preset, llama).unwrap().plan();
            assert_eq!(plan.run_bytes(), run, "{preset:?}");
            assert_eq!(plan.align, 16);
        }
    }
}
