//! A KV cache's memory layout: where every row of its geometry lives in the
//! engine's allocations. One descriptor covers every layout engines use —
//! per-layer tensors or one buffer for all layers, K and V apart or side by
//! side in one row, any order of blocks, layers, heads and tokens — as a
//! per-layer offset and three strides ([`LayerPlacement`]).
//!
//! Row (`layer`, `block`, `head`, `token`) of K starts at
//! `k_offset + block * block_stride + head * head_stride + token *
//! token_stride` in allocation `alloc` of its layer, and is
//! [`KvGeometry::k_bytes`] long; V's likewise from `v_offset`. Named layouts
//! are built by [`super::LayoutPreset`]; any other by [`KvLayout::new`].
//!
//! [`KvLayout::validate`] proves that every address any block id produces
//! lies inside its allocation and that no two rows share a byte, or says
//! which layer breaks which rule.

use super::geometry::{GeometryError, KvGeometry};
use super::overlap::RowBox;
use super::plan::CopyPlan;
use super::preset::LayoutPreset;
use crate::shm_struct::shm_struct;
use bytemuck::{Pod, Zeroable};

shm_struct! {
    /// Where one layer's rows live (`shm_layout.md`, "LayerPlacement").
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
    pub struct LayerPlacement {
        /// Index of the allocation holding the layer.
        [0] pub alloc: u32,
        /// Zero on the wire.
        [4] pub(crate) _reserved: u32,
        /// Byte offset of the K row of block 0, head 0, token 0.
        [8] pub k_offset: u64,
        /// Byte offset of the V row of block 0, head 0, token 0 (0 when the
        /// geometry has no V).
        [16] pub v_offset: u64,
        /// Bytes between blocks.
        [24] pub block_stride: u64,
        /// Bytes between heads.
        [32] pub head_stride: u64,
        /// Bytes between tokens.
        [40] pub token_stride: u64,
    }
}

impl LayerPlacement {
    /// A layer in allocation `alloc` with K and V rows starting at
    /// `k_offset` and `v_offset`, and the strides (bytes) between blocks,
    /// heads and tokens.
    pub const fn new(
        alloc: u32,
        k_offset: u64,
        v_offset: u64,
        block_stride: u64,
        head_stride: u64,
        token_stride: u64,
    ) -> LayerPlacement {
        LayerPlacement {
            alloc,
            _reserved: 0,
            k_offset,
            v_offset,
            block_stride,
            head_stride,
            token_stride,
        }
    }

    /// Byte offset of part `part` (0 K, 1 V) of row (`block`, `head`,
    /// `token`) in the layer's allocation. Only meaningful for a validated
    /// layout and indices in range.
    #[inline]
    pub fn row(&self, part: u32, block: u32, head: u32, token: u32) -> u64 {
        let base = if part == 0 { self.k_offset } else { self.v_offset };
        base + u64::from(block) * self.block_stride
            + u64::from(head) * self.head_stride
            + u64::from(token) * self.token_stride
    }
}

/// K or V, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    K,
    V,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Part::K => "K",
            Part::V => "V",
        })
    }
}

/// Most allocations one layout may span (one per layer at most is what
/// engines need; the bound keeps a registration message within one
/// bootstrap message).
pub const MAX_ALLOCATIONS: usize = 1024;

/// Why a layout is refused (registration answers with this text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("{placements} layer placements for {layers} layers")]
    Placements { layers: u32, placements: usize },
    #[error("{0} allocations: must be 1..={MAX_ALLOCATIONS}")]
    Allocations(usize),
    #[error("allocation {0} is empty")]
    EmptyAllocation(u32),
    #[error("layer {layer}: allocation {alloc} named, {allocations} given")]
    NoAllocation {
        layer: u32,
        alloc: u32,
        allocations: usize,
    },
    #[error("layer {0}: reserved field is not zero")]
    Reserved(u32),
    #[error("layer {0}: a V offset for a geometry without V")]
    VOffsetWithoutV(u32),
    #[error("layer {layer} {part}: addresses overflow 64 bits")]
    Overflow { layer: u32, part: Part },
    #[error(
        "layer {layer} {part}: rows reach byte {end}, past the {bytes} bytes of allocation {alloc}"
    )]
    OutOfBounds {
        layer: u32,
        part: Part,
        end: u64,
        alloc: u32,
        bytes: u64,
    },
    #[error(
        "layer {layer} {part}: its strides (block {block}, head {head}, token {token}) put two rows on the same bytes"
    )]
    RowsOverlap {
        layer: u32,
        part: Part,
        block: u64,
        head: u64,
        token: u64,
    },
    #[error("layer {0} {1} and layer {2} {3} share bytes")]
    LayersOverlap(u32, Part, u32, Part),
    #[error("preset {preset}: {reason}")]
    Preset {
        preset: &'static str,
        reason: &'static str,
    },
}

/// A KV cache's geometry and where each layer of it lives in the engine's
/// allocations, whose sizes it carries.
///
/// # Examples
///
/// ```
/// use kvring::kv::{Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
///
/// // Llama-3-8B as vLLM 0.33 lays it out by default: one buffer for all
/// // layers, `[L, B, N, H, K|V]`.
/// let shape = KvShape { layers: 32, blocks: 1024, block_tokens: 16, heads: 8, head_dim: 128 };
/// let g = KvGeometry::mha(shape, Dtype::Bf16);
/// let layout = KvLayout::preset(LayoutPreset::Lbnhc, g)?;
/// layout.validate(256)?;
/// assert_eq!(layout.allocations(), &[32 * 1024 * g.page_bytes()]);
/// // A block of one layer is one contiguous run: copied in one piece.
/// assert_eq!(layout.plan().run_bytes(), g.page_bytes());
///
/// // vLLM 0.21: a `[2, NB, BS, H, D]` tensor per layer.
/// let old = KvLayout::preset(LayoutPreset::FlashAttn, g)?;
/// assert_eq!(old.allocations().len(), 32);
/// // Same geometry: the two engines share stored objects.
/// assert_eq!(old.fingerprint(256), layout.fingerprint(256));
/// # Ok::<(), kvring::kv::LayoutError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    geometry: KvGeometry,
    allocations: Vec<u64>,
    layers: Vec<LayerPlacement>,
    preset: Option<LayoutPreset>,
}

impl KvLayout {
    /// A layout of `geometry` whose layers are placed by `layers` (one per
    /// layer) in allocations of `allocations` bytes each. Check it with
    /// [`KvLayout::validate`] (registration does).
    pub fn new(geometry: KvGeometry, allocations: Vec<u64>, layers: Vec<LayerPlacement>) -> Self {
        KvLayout {
            geometry,
            allocations,
            layers,
            preset: None,
        }
    }

    pub(super) fn named(mut self, preset: LayoutPreset) -> Self {
        self.preset = Some(preset);
        self
    }

    /// The named layout `preset` of `geometry`, densely packed.
    pub fn preset(preset: LayoutPreset, geometry: KvGeometry) -> Result<KvLayout, LayoutError> {
        preset.build(geometry)
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Bytes of each allocation.
    pub fn allocations(&self) -> &[u64] {
        &self.allocations
    }

    /// Each layer's placement.
    pub fn layers(&self) -> &[LayerPlacement] {
        &self.layers
    }

    /// The preset it was built from, if any.
    pub fn preset_name(&self) -> Option<&'static str> {
        self.preset.map(LayoutPreset::name)
    }

    /// The same layout with allocation `i` `bytes` long (what the engine
    /// actually allocated, padding included).
    pub fn with_allocation_bytes(mut self, i: usize, bytes: u64) -> Self {
        if let Some(a) = self.allocations.get_mut(i) {
            *a = bytes;
        }
        self
    }

    /// Blocks per chunk of `chunk_tokens`.
    pub fn blocks_per_chunk(&self, chunk_tokens: u32) -> u32 {
        self.geometry.blocks_per_chunk(chunk_tokens)
    }

    /// Bytes of a chunk object of `chunk_tokens` tokens.
    pub fn object_bytes(&self, chunk_tokens: u32) -> u64 {
        self.geometry.object_bytes(chunk_tokens)
    }

    /// See [`KvGeometry::fingerprint`].
    pub fn fingerprint(&self, chunk_tokens: u32) -> u64 {
        self.geometry.fingerprint(chunk_tokens)
    }

    /// The boxes of rows of each layer and part, in order (layer, part).
    fn boxes(&self) -> impl Iterator<Item = (u32, Part, &LayerPlacement, u64)> + '_ {
        let g = &self.geometry;
        self.layers.iter().enumerate().flat_map(move |(l, p)| {
            let k = (l as u32, Part::K, p, g.k_bytes());
            let v = (g.v_dim > 0).then_some((l as u32, Part::V, p, g.v_bytes()));
            std::iter::once(k).chain(v)
        })
    }

    /// Checks the geometry (see [`KvGeometry::validate`]), that every
    /// address any block id can produce lies inside its allocation, and
    /// that no two rows share a byte. The error says which rule which layer
    /// breaks.
    pub fn validate(&self, chunk_tokens: u32) -> Result<(), LayoutError> {
        let g = &self.geometry;
        g.validate(chunk_tokens)?;
        if self.layers.len() != g.layers as usize {
            return Err(LayoutError::Placements {
                layers: g.layers,
                placements: self.layers.len(),
            });
        }
        if !(1..=MAX_ALLOCATIONS).contains(&self.allocations.len()) {
            return Err(LayoutError::Allocations(self.allocations.len()));
        }
        if let Some(i) = self.allocations.iter().position(|&b| b == 0) {
            return Err(LayoutError::EmptyAllocation(i as u32));
        }
        for (l, p) in self.layers.iter().enumerate() {
            let layer = l as u32;
            if p._reserved != 0 {
                return Err(LayoutError::Reserved(layer));
            }
            if p.alloc as usize >= self.allocations.len() {
                return Err(LayoutError::NoAllocation {
                    layer,
                    alloc: p.alloc,
                    allocations: self.allocations.len(),
                });
            }
            if g.v_dim == 0 && p.v_offset != 0 {
                return Err(LayoutError::VOffsetWithoutV(layer));
            }
        }
        let mut boxes = Vec::with_capacity(self.layers.len() * 2);
        for (layer, part, p, width) in self.boxes() {
            let b = RowBox::new(
                p.alloc,
                if part == Part::K { p.k_offset } else { p.v_offset },
                width,
                [
                    (u64::from(g.blocks), p.block_stride),
                    (u64::from(g.heads), p.head_stride),
                    (u64::from(g.block_tokens), p.token_stride),
                ],
            );
            let end = b.end().ok_or(LayoutError::Overflow { layer, part })?;
            let bytes = self.allocations[p.alloc as usize];
            if end > bytes {
                return Err(LayoutError::OutOfBounds {
                    layer,
                    part,
                    end,
                    alloc: p.alloc,
                    bytes,
                });
            }
            if b.self_overlaps() {
                return Err(LayoutError::RowsOverlap {
                    layer,
                    part,
                    block: p.block_stride,
                    head: p.head_stride,
                    token: p.token_stride,
                });
            }
            boxes.push((b, end, layer, part));
        }
        // Sweep by start: a box can only meet the boxes that start before
        // it ends.
        boxes.sort_by_key(|(b, _, _, _)| (b.alloc, b.offset));
        for (i, (a, end, la, pa)) in boxes.iter().enumerate() {
            for (b, _, lb, pb) in &boxes[i + 1..] {
                if b.alloc != a.alloc || b.offset >= *end {
                    break;
                }
                if a.overlaps(b) {
                    let (x, y) = if (la, *pa as u8) <= (lb, *pb as u8) {
                        ((*la, *pa), (*lb, *pb))
                    } else {
                        ((*lb, *pb), (*la, *pa))
                    };
                    return Err(LayoutError::LayersOverlap(x.0, x.1, y.0, y.1));
                }
            }
        }
        Ok(())
    }

    /// How a chunk's rows move as runs (only meaningful for a validated
    /// layout).
    pub fn plan(&self) -> CopyPlan {
        CopyPlan::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Dtype, KvShape};

    fn g() -> KvGeometry {
        KvGeometry::mha(
            KvShape {
                layers: 2,
                blocks: 4,
                block_tokens: 4,
                heads: 2,
                head_dim: 8,
            },
            Dtype::Bf16,
        )
    }

    fn dense() -> KvLayout {
        KvLayout::preset(LayoutPreset::Lbnhc, g()).unwrap()
    }

    fn with_layer(f: impl FnOnce(&mut LayerPlacement)) -> KvLayout {
        let mut l = dense();
        f(&mut l.layers[1]);
        l
    }

    fn err(l: &KvLayout) -> String {
        l.validate(16).unwrap_err().to_string()
    }

    #[test]
    fn hostile_descriptors_are_refused_with_their_reason() {
        dense().validate(16).unwrap();
        let e = err(&with_layer(|p| p.block_stride = u64::MAX / 2));
        assert!(e.contains("overflow"), "{e}");
        let e = err(&with_layer(|p| p.k_offset += 1 << 20));
        assert!(e.contains("past the"), "{e}");
        let e = err(&with_layer(|p| p.k_offset = u64::MAX - 10));
        assert!(e.contains("overflow"), "{e}");
        // K and V of a layer on the same bytes.
        let e = err(&with_layer(|p| p.v_offset = p.k_offset + 2));
        assert!(e.contains("layer 1 K and layer 1 V share bytes"), "{e}");
        // Layer 1 on top of layer 0.
        let e = err(&with_layer(|p| {
            p.k_offset = 0;
            p.v_offset = 32;
        }));
        assert!(e.contains("layer 0 K and layer 1 K share bytes"), "{e}");
        // A zero stride maps every block onto the same bytes.
        let e = err(&with_layer(|p| p.block_stride = 0));
        assert!(e.contains("same bytes"), "{e}");
        let e = err(&with_layer(|p| p.token_stride = 16));
        assert!(e.contains("same bytes"), "{e}");
        let e = err(&with_layer(|p| p.alloc = 3));
        assert!(e.contains("allocation 3 named"), "{e}");
        let e = err(&with_layer(|p| p._reserved = 1));
        assert!(e.contains("reserved"), "{e}");
        let mut l = dense();
        l.layers.pop();
        assert!(err(&l).contains("1 layer placements for 2 layers"));
        let mut l = dense();
        l.allocations[0] = 0;
        assert!(err(&l).contains("empty"));
        let mut l = dense();
        l.allocations.clear();
        assert!(err(&l).contains("0 allocations"));
        let mut l = dense();
        l.geometry.blocks = 0;
        assert!(err(&l).contains("blocks"));
        let mla = KvLayout::preset(LayoutPreset::Mla, KvGeometry::mla(2, 4, 4, 64, Dtype::Fp8))
            .unwrap();
        mla.validate(16).unwrap();
        let mut bad = mla.clone();
        bad.layers[0].v_offset = 8;
        assert!(err(&bad).contains("without V"));
    }

    #[test]
    fn every_preset_is_valid_and_tiles_its_allocations() {
        for preset in LayoutPreset::ALL {
            for geo in [g(), g().with_v_dim(8), KvGeometry::mla(3, 5, 4, 24, Dtype::Fp8)] {
                let Ok(l) = KvLayout::preset(preset, geo) else {
                    continue;
                };
                l.validate(16).unwrap_or_else(|e| panic!("{preset:?}: {e}"));
                // Dense: every allocated byte is one row's.
                let rows: u64 = u64::from(geo.layers) * u64::from(geo.blocks) * geo.page_bytes();
                assert_eq!(l.allocations().iter().sum::<u64>(), rows, "{preset:?}");
                assert_eq!(l.preset_name(), Some(preset.name()));
            }
        }
    }
}
