//! The layouts engines use, by name: vLLM 0.33/0.34's six orders of one
//! buffer for all layers, and the per-layer tensors of earlier versions.
//! Each builds a densely packed [`KvLayout`]; an engine whose memory has
//! padding or another order describes it with [`KvLayout::new`].

use super::geometry::KvGeometry;
use super::layout::{KvLayout, LayerPlacement, LayoutError};

/// A named KV-cache layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LayoutPreset {
    /// vLLM 0.33+ default: one buffer, `[L, B, N, H, K|V]` (per-layer pages).
    Lbnhc,
    /// One buffer, `[L, B, H, N, K|V]` (HND pages).
    Lbhnc,
    /// One buffer, block outermost: `[B, L, N, H, K|V]` (a block's pages of
    /// every layer are one run).
    Blnhc,
    /// One buffer, block outermost: `[B, L, H, N, K|V]`.
    Blhnc,
    /// One buffer, `[L, H, B, N, K|V]`.
    Lhbnc,
    /// One buffer, `[B, H, L, N, K|V]`.
    Bhlnc,
    /// vLLM <= 0.21 flash-attention: a `[2, NB, BS, H, D]` tensor per layer.
    FlashAttn,
    /// Flash-attention HND: a `[2, NB, H, BS, D]` tensor per layer.
    FlashAttnHnd,
    /// vLLM 0.24 / FlashInfer: a `[NB, 2, BS, H, D]` tensor per layer.
    FlashInfer,
    /// FlashInfer HND: a `[NB, 2, H, BS, D]` tensor per layer.
    FlashInferHnd,
    /// vLLM 0.26: K and V packed in the last dimension, a `[NB, BS, H, 2D]`
    /// tensor per layer.
    Packed,
    /// vLLM 0.26 HND: a `[NB, H, BS, 2D]` tensor per layer.
    PackedHnd,
    /// MLA before 0.33: a `[NB, BS, D]` tensor per layer.
    Mla,
    /// Cross-layer (vLLM 0.26's `register_cross_layers_kv_cache`): one
    /// `[NB, L, 2, BS, H, D]` tensor.
    CrossLayer,
}

/// The dimensions an order is written in, outermost first.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dim {
    /// Layers.
    L,
    /// Blocks.
    B,
    /// Heads.
    H,
    /// Tokens.
    N,
    /// K then V (2 parts of one head size), for per-part layouts.
    P,
}

use Dim::{B, H, L, N, P};

impl LayoutPreset {
    pub const ALL: [LayoutPreset; 14] = [
        LayoutPreset::Lbnhc,
        LayoutPreset::Lbhnc,
        LayoutPreset::Blnhc,
        LayoutPreset::Blhnc,
        LayoutPreset::Lhbnc,
        LayoutPreset::Bhlnc,
        LayoutPreset::FlashAttn,
        LayoutPreset::FlashAttnHnd,
        LayoutPreset::FlashInfer,
        LayoutPreset::FlashInferHnd,
        LayoutPreset::Packed,
        LayoutPreset::PackedHnd,
        LayoutPreset::Mla,
        LayoutPreset::CrossLayer,
    ];

    /// The name (`kvring-bench kv --layout NAME`).
    pub const fn name(self) -> &'static str {
        match self {
            LayoutPreset::Lbnhc => "lbnhc",
            LayoutPreset::Lbhnc => "lbhnc",
            LayoutPreset::Blnhc => "blnhc",
            LayoutPreset::Blhnc => "blhnc",
            LayoutPreset::Lhbnc => "lhbnc",
            LayoutPreset::Bhlnc => "bhlnc",
            LayoutPreset::FlashAttn => "flash-attn",
            LayoutPreset::FlashAttnHnd => "flash-attn-hnd",
            LayoutPreset::FlashInfer => "flashinfer",
            LayoutPreset::FlashInferHnd => "flashinfer-hnd",
            LayoutPreset::Packed => "packed",
            LayoutPreset::PackedHnd => "packed-hnd",
            LayoutPreset::Mla => "mla",
            LayoutPreset::CrossLayer => "cross-layer",
        }
    }

    /// The preset named `name`.
    pub fn from_name(name: &str) -> Option<LayoutPreset> {
        LayoutPreset::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether the layout keeps every layer in one allocation.
    pub fn one_buffer(self) -> bool {
        !self.per_layer()
    }

    /// Whether each layer is its own tensor (allocation `l`).
    fn per_layer(self) -> bool {
        matches!(
            self,
            LayoutPreset::FlashAttn
                | LayoutPreset::FlashAttnHnd
                | LayoutPreset::FlashInfer
                | LayoutPreset::FlashInferHnd
                | LayoutPreset::Packed
                | LayoutPreset::PackedHnd
                | LayoutPreset::Mla
        )
    }

    /// The physical order, outermost first. Orders without `P` keep K and V
    /// side by side in one row (or have no V).
    fn order(self) -> &'static [Dim] {
        match self {
            LayoutPreset::Lbnhc => &[L, B, N, H],
            LayoutPreset::Lbhnc => &[L, B, H, N],
            LayoutPreset::Blnhc => &[B, L, N, H],
            LayoutPreset::Blhnc => &[B, L, H, N],
            LayoutPreset::Lhbnc => &[L, H, B, N],
            LayoutPreset::Bhlnc => &[B, H, L, N],
            LayoutPreset::FlashAttn => &[L, P, B, N, H],
            LayoutPreset::FlashAttnHnd => &[L, P, B, H, N],
            LayoutPreset::FlashInfer => &[L, B, P, N, H],
            LayoutPreset::FlashInferHnd => &[L, B, P, H, N],
            LayoutPreset::Packed | LayoutPreset::Mla => &[L, B, N, H],
            LayoutPreset::PackedHnd => &[L, B, H, N],
            LayoutPreset::CrossLayer => &[B, L, P, N, H],
        }
    }

    fn refuse(self, reason: &'static str) -> LayoutError {
        LayoutError::Preset {
            preset: self.name(),
            reason,
        }
    }

    /// The layout of `g` in this order, densely packed.
    pub(super) fn build(self, g: KvGeometry) -> Result<KvLayout, LayoutError> {
        let order = self.order();
        let split = order.contains(&P);
        if split && g.k_dim != g.v_dim {
            return Err(self.refuse("K and V apart need one head size for both"));
        }
        if self == LayoutPreset::Mla && (g.v_dim != 0 || g.heads != 1) {
            return Err(self.refuse("MLA needs one head and no V"));
        }
        if matches!(self, LayoutPreset::Packed | LayoutPreset::PackedHnd) && g.v_dim == 0 {
            return Err(self.refuse("packed K and V needs a V"));
        }
        // Strides from the innermost dimension out: a row (K|V, or K or V
        // alone when they are apart) is the innermost unit.
        let row = if split { g.k_bytes() } else { g.row_bytes() };
        let count = |d: Dim| -> u64 {
            match d {
                L => u64::from(g.layers),
                B => u64::from(g.blocks),
                H => u64::from(g.heads),
                N => u64::from(g.block_tokens),
                P => 2,
            }
        };
        let mut stride = [0u64; 5];
        let mut size = row;
        for &d in order.iter().rev() {
            // Per-layer tensors: layers are separate allocations.
            if d == L && self.per_layer() {
                continue;
            }
            stride[d as usize] = size;
            size = size.saturating_mul(count(d));
        }
        let per_layer = self.per_layer();
        let layers = (0..g.layers)
            .map(|l| {
                let (alloc, base) = if per_layer {
                    (l, 0)
                } else {
                    (0, u64::from(l) * stride[L as usize])
                };
                let v = match (g.v_dim, split) {
                    (0, _) => 0,
                    (_, true) => base + stride[P as usize],
                    (_, false) => base + g.k_bytes(),
                };
                LayerPlacement::new(
                    alloc,
                    base,
                    v,
                    stride[B as usize],
                    stride[H as usize],
                    stride[N as usize],
                )
            })
            .collect();
        let allocations = if per_layer {
            vec![size; g.layers as usize]
        } else {
            vec![size]
        };
        Ok(KvLayout::new(g, allocations, layers).named(self))
    }
}

impl std::fmt::Display for LayoutPreset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Dtype, KvShape};

    #[test]
    fn presets_match_the_shapes_they_name() {
        let s = KvShape {
            layers: 3,
            blocks: 5,
            block_tokens: 4,
            heads: 2,
            head_dim: 8,
        };
        let g = KvGeometry::mha(s, Dtype::Bf16);
        let (d, e) = (8u64, 2u64);
        let (nb, bs, h, l) = (5u64, 4u64, 2u64, 3u64);
        let p = |preset| KvLayout::preset(preset, g).unwrap();
        // [2, NB, BS, H, D] per layer: V starts half way through.
        let fa = p(LayoutPreset::FlashAttn);
        let pl = fa.layers()[2];
        assert_eq!((pl.alloc, pl.k_offset), (2, 0));
        assert_eq!(pl.v_offset, nb * bs * h * d * e);
        assert_eq!((pl.block_stride, pl.token_stride, pl.head_stride), (bs * h * d * e, h * d * e, d * e));
        // [NB, 2, BS, H, D]: V one block page after K.
        let fi = p(LayoutPreset::FlashInfer).layers()[0];
        assert_eq!((fi.v_offset, fi.block_stride), (bs * h * d * e, 2 * bs * h * d * e));
        // [NB, L, 2, BS, H, D].
        let cl = p(LayoutPreset::CrossLayer).layers()[1];
        assert_eq!(cl.k_offset, 2 * bs * h * d * e);
        assert_eq!(cl.block_stride, l * 2 * bs * h * d * e);
        // [L, B, H, N, K|V] in one buffer.
        let hnd = p(LayoutPreset::Lbhnc).layers()[1];
        let row = 2 * d * e;
        assert_eq!(hnd.k_offset, nb * h * bs * row);
        assert_eq!(hnd.v_offset, hnd.k_offset + d * e);
        assert_eq!((hnd.token_stride, hnd.head_stride, hnd.block_stride), (row, bs * row, h * bs * row));
        // [B, H, L, N, K|V].
        let bh = p(LayoutPreset::Bhlnc).layers()[2];
        assert_eq!((bh.k_offset, bh.head_stride, bh.block_stride), (2 * bs * row, l * bs * row, h * l * bs * row));
        assert!(KvLayout::preset(LayoutPreset::Mla, g).is_err());
        assert!(KvLayout::preset(LayoutPreset::FlashAttn, g.with_v_dim(4)).is_err());
        for preset in LayoutPreset::ALL {
            assert_eq!(LayoutPreset::from_name(preset.name()), Some(preset));
        }
    }
}
