//! KV-cache layouts: where a block's keys and values sit in an engine's
//! paged cache, and where they sit in a stored chunk object.
//!
//! A *slab* is what one block holds for one layer and one part (K or V; MLA
//! has a single part): `block_tokens * num_heads * head_dim * elem_bytes`
//! contiguous bytes in every supported layout. A copy between an engine's
//! cache and a chunk object is therefore a list of slab-sized pieces.
//!
//! The chunk object is layout-independent: `[part][layer][token][head * dim]`
//! with `chunk_tokens` tokens, so engines of different paged layouts (or
//! block sizes) with the same model geometry share stored objects.

use crate::shm_struct::shm_struct;
use crate::wire::wire_enum;
use bytemuck::{Pod, Zeroable};

wire_enum! {
    /// The paged layouts an engine's KV cache may have.
    pub enum KvLayoutKind: u32 {
        /// vLLM flash-attention: one tensor per layer, `[2, NB, BS, H, D]`.
        FlashAttn = 1 => "flash-attn [2,NB,BS,H,D] per layer",
        /// FlashInfer: one tensor per layer, `[NB, 2, BS, H, D]`.
        FlashInfer = 2 => "flashinfer [NB,2,BS,H,D] per layer",
        /// MLA: one tensor per layer, `[NB, BS, D]` (one part, `num_heads` 1).
        Mla = 3 => "mla [NB,BS,D] per layer",
        /// Cross-layer: one tensor, `[NB, L, 2, BS, H, D]`.
        CrossLayer = 4 => "cross-layer [NB,L,2,BS,H,D]",
    }
}

/// The element type of a KV cache: what a layout needs of it is its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dtype {
    /// 8-bit floats (e4m3, e5m2) or int8.
    Fp8,
    F16,
    Bf16,
    F32,
}

impl Dtype {
    /// Bytes per element.
    pub const fn bytes(self) -> u32 {
        match self {
            Dtype::Fp8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// The dimensions of a paged KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Layers (L).
    pub layers: u32,
    /// Blocks in the paged cache (NB).
    pub blocks: u32,
    /// Tokens per block (BS).
    pub block_tokens: u32,
    /// KV heads (H); 1 for MLA.
    pub heads: u32,
    /// Head dimension (D; MLA: the latent dimension).
    pub head_dim: u32,
}

shm_struct! {
    /// An engine's KV-cache geometry, as sent at registration (`shm_layout.md`,
    /// "KvLayout"). Built with [`KvLayout::new`] (or [`KvLayout::mla`]); the
    /// fields read as the wire has them.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvring::kv::{Dtype, KvLayout, KvLayoutKind, KvShape};
    ///
    /// // Llama-3-8B in vLLM's flash-attention layout: 32 layers, 8 KV heads of
    /// // 128, bf16, 16-token blocks.
    /// let shape = KvShape { layers: 32, blocks: 1024, block_tokens: 16, heads: 8, head_dim: 128 };
    /// let layout = KvLayout::new(KvLayoutKind::FlashAttn, shape, Dtype::Bf16);
    /// layout.validate(256).unwrap();
    /// assert_eq!(layout.slab_bytes(), 16 * 8 * 128 * 2);
    /// assert_eq!(layout.num_tensors(), 32);
    /// assert_eq!(layout.shape(), shape);
    ///
    /// // MLA: one part, one "head" of the latent dimension.
    /// let mla = KvLayout::mla(61, 512, 64, 576, Dtype::Bf16);
    /// assert_eq!((mla.parts(), mla.num_heads), (1, 1));
    /// ```
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
    pub struct KvLayout {
        /// [`KvLayoutKind`] code.
        [0] pub kind: u32,
        [4] pub num_layers: u32,
        /// Blocks in the paged cache (NB).
        [8] pub num_blocks: u32,
        /// Tokens per block (BS).
        [12] pub block_tokens: u32,
        /// KV heads (H); 1 for MLA.
        [16] pub num_heads: u32,
        /// Head dimension (D; MLA: the latent dimension).
        [20] pub head_dim: u32,
        /// Bytes per element: 1, 2 or 4.
        [24] pub elem_bytes: u32,
        /// Zero on the wire; private so a layout is built by a constructor.
        [28] pub(crate) _reserved: u32,
    }
}

const _: () = assert!(std::mem::size_of::<KvLayout>() == 32);

/// Why a [`KvLayout`] is refused (registration answers with this text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("unknown layout kind {0}")]
    UnknownKind(u32),
    #[error("{0} layers: must be 1..={MAX_LAYERS}")]
    Layers(u32),
    #[error("{0} blocks: must be 1..={MAX_BLOCKS}")]
    Blocks(u32),
    #[error("{0} heads: must be 1..={MAX_HEADS}")]
    Heads(u32),
    #[error("MLA layout with {0} heads: must be 1")]
    MlaHeads(u32),
    #[error("head dim {0}: must be 1..={MAX_HEAD_DIM}")]
    HeadDim(u32),
    #[error("element size {0}: must be 1, 2 or 4")]
    ElemBytes(u32),
    #[error(
        "block size {block_tokens} tokens does not divide the server's chunk size of {chunk_tokens} tokens"
    )]
    BlockTokens { block_tokens: u32, chunk_tokens: u32 },
    #[error("reserved field is not zero")]
    Reserved,
    #[error("tensor size overflows")]
    TensorOverflow,
    #[error("tensor of {0} bytes exceeds {MAX_TENSOR_BYTES}")]
    TensorBytes(u64),
}

/// Bounds on a layout's dimensions.
pub const MAX_LAYERS: u32 = 1024;
pub const MAX_HEADS: u32 = 1024;
pub const MAX_HEAD_DIM: u32 = 1 << 16;
pub const MAX_BLOCKS: u32 = 1 << 31;
/// Largest single tensor the server maps (1 TiB).
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;

impl KvLayout {
    /// A layout of `kind` with the dimensions `shape` and elements of
    /// `dtype`. Check it with [`KvLayout::validate`] (registration does).
    pub const fn new(kind: KvLayoutKind, shape: KvShape, dtype: Dtype) -> KvLayout {
        KvLayout {
            kind: kind as u32,
            num_layers: shape.layers,
            num_blocks: shape.blocks,
            block_tokens: shape.block_tokens,
            num_heads: shape.heads,
            head_dim: shape.head_dim,
            elem_bytes: dtype.bytes(),
            _reserved: 0,
        }
    }

    /// An MLA layout: one part per layer, `[NB, BS, D]`, one head of the
    /// latent dimension `latent_dim`.
    pub const fn mla(
        layers: u32,
        blocks: u32,
        block_tokens: u32,
        latent_dim: u32,
        dtype: Dtype,
    ) -> KvLayout {
        KvLayout::new(
            KvLayoutKind::Mla,
            KvShape {
                layers,
                blocks,
                block_tokens,
                heads: 1,
                head_dim: latent_dim,
            },
            dtype,
        )
    }

    /// The same layout with `blocks` blocks.
    pub const fn with_blocks(mut self, blocks: u32) -> KvLayout {
        self.num_blocks = blocks;
        self
    }

    /// The dimensions.
    pub const fn shape(&self) -> KvShape {
        KvShape {
            layers: self.num_layers,
            blocks: self.num_blocks,
            block_tokens: self.block_tokens,
            heads: self.num_heads,
            head_dim: self.head_dim,
        }
    }

    pub fn kind(&self) -> Option<KvLayoutKind> {
        KvLayoutKind::decode(self.kind).ok()
    }

    /// Checks every bound and that `block_tokens` divides `chunk_tokens`.
    /// The error says which check failed.
    pub fn validate(&self, chunk_tokens: u32) -> Result<(), LayoutError> {
        let kind = self.kind().ok_or(LayoutError::UnknownKind(self.kind))?;
        if !(1..=MAX_LAYERS).contains(&self.num_layers) {
            return Err(LayoutError::Layers(self.num_layers));
        }
        if !(1..=MAX_BLOCKS).contains(&self.num_blocks) {
            return Err(LayoutError::Blocks(self.num_blocks));
        }
        if !(1..=MAX_HEADS).contains(&self.num_heads) {
            return Err(LayoutError::Heads(self.num_heads));
        }
        if kind == KvLayoutKind::Mla && self.num_heads != 1 {
            return Err(LayoutError::MlaHeads(self.num_heads));
        }
        if !(1..=MAX_HEAD_DIM).contains(&self.head_dim) {
            return Err(LayoutError::HeadDim(self.head_dim));
        }
        if ![1, 2, 4].contains(&self.elem_bytes) {
            return Err(LayoutError::ElemBytes(self.elem_bytes));
        }
        if self.block_tokens == 0 || chunk_tokens % self.block_tokens != 0 {
            return Err(LayoutError::BlockTokens {
                block_tokens: self.block_tokens,
                chunk_tokens,
            });
        }
        if self._reserved != 0 {
            return Err(LayoutError::Reserved);
        }
        // Every size below must fit comfortably: computed with checked math.
        let t = self
            .checked_tensor_bytes()
            .ok_or(LayoutError::TensorOverflow)?;
        if t > MAX_TENSOR_BYTES {
            return Err(LayoutError::TensorBytes(t));
        }
        Ok(())
    }

    /// K and V (2), or one part for MLA.
    pub fn parts(&self) -> u32 {
        if self.kind() == Some(KvLayoutKind::Mla) {
            1
        } else {
            2
        }
    }

    /// Bytes one token holds for one layer and part.
    pub fn token_bytes(&self) -> u64 {
        u64::from(self.num_heads) * u64::from(self.head_dim) * u64::from(self.elem_bytes)
    }

    /// Bytes of one slab (one block, one layer, one part).
    pub fn slab_bytes(&self) -> u64 {
        u64::from(self.block_tokens) * self.token_bytes()
    }

    /// Number of tensors the engine registers.
    pub fn num_tensors(&self) -> u32 {
        match self.kind() {
            Some(KvLayoutKind::CrossLayer) => 1,
            _ => self.num_layers,
        }
    }

    fn checked_tensor_bytes(&self) -> Option<u64> {
        let slab = u64::from(self.block_tokens)
            .checked_mul(u64::from(self.num_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.elem_bytes))?;
        let per_block = match self.kind()? {
            KvLayoutKind::CrossLayer => slab.checked_mul(2 * u64::from(self.num_layers))?,
            KvLayoutKind::Mla => slab,
            _ => slab.checked_mul(2)?,
        };
        per_block.checked_mul(u64::from(self.num_blocks))
    }

    /// Bytes of each tensor (every tensor of a layout has the same size).
    /// Only meaningful for a validated layout.
    pub fn tensor_bytes(&self) -> u64 {
        self.checked_tensor_bytes().unwrap_or(u64::MAX)
    }

    /// Where slab (`layer`, `part`, `block`) lives: (tensor index, byte
    /// offset in it). The caller has checked the indices are in range.
    #[inline]
    pub fn slab_at(&self, layer: u32, part: u32, block: u32) -> (u32, u64) {
        let slab = self.slab_bytes();
        let (l, p, b) = (u64::from(layer), u64::from(part), u64::from(block));
        let nb = u64::from(self.num_blocks);
        match self.kind() {
            Some(KvLayoutKind::FlashAttn) => (layer, (p * nb + b) * slab),
            Some(KvLayoutKind::FlashInfer) => (layer, (b * 2 + p) * slab),
            Some(KvLayoutKind::Mla) => (layer, b * slab),
            Some(KvLayoutKind::CrossLayer) => {
                (0, ((b * u64::from(self.num_layers) + l) * 2 + p) * slab)
            }
            None => (0, 0),
        }
    }

    /// Blocks per chunk of `chunk_tokens`.
    pub fn blocks_per_chunk(&self, chunk_tokens: u32) -> u32 {
        chunk_tokens / self.block_tokens
    }

    /// Bytes of a chunk object of `chunk_tokens` tokens.
    pub fn object_bytes(&self, chunk_tokens: u32) -> u64 {
        u64::from(self.parts())
            * u64::from(self.num_layers)
            * u64::from(chunk_tokens)
            * self.token_bytes()
    }

    /// Offset in a chunk object of block `j` of the chunk (its first token)
    /// for `layer` and `part`: `[part][layer][token][H*D]`.
    #[inline]
    pub fn object_offset(&self, chunk_tokens: u32, layer: u32, part: u32, j: u32) -> u64 {
        let row = u64::from(part) * u64::from(self.num_layers) + u64::from(layer);
        (row * u64::from(chunk_tokens) + u64::from(j) * u64::from(self.block_tokens))
            * self.token_bytes()
    }

    /// What a stored object's bytes mean, independent of the paged layout
    /// and block size: objects with equal fingerprints are interchangeable.
    pub fn fingerprint(&self, chunk_tokens: u32) -> u64 {
        let mut h = blake3::Hasher::new();
        h.update(b"kvring-object-v1");
        for v in [
            self.parts(),
            self.num_layers,
            self.num_heads,
            self.head_dim,
            self.elem_bytes,
            chunk_tokens,
        ] {
            h.update(&v.to_le_bytes());
        }
        u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(kind: KvLayoutKind) -> KvLayout {
        let shape = KvShape {
            layers: 3,
            blocks: 5,
            block_tokens: 4,
            heads: if kind == KvLayoutKind::Mla { 1 } else { 2 },
            head_dim: 8,
        };
        KvLayout::new(kind, shape, Dtype::Bf16)
    }

    /// Every slab of every layout lies inside its tensor, and no two slabs
    /// overlap: the mapping is a bijection onto the tensor's bytes.
    #[test]
    fn slabs_tile_each_tensor_exactly() {
        for kind in KvLayoutKind::ALL {
            let l = layout(kind);
            l.validate(16).unwrap();
            let slab = l.slab_bytes();
            let mut seen = std::collections::HashSet::new();
            for layer in 0..l.num_layers {
                for part in 0..l.parts() {
                    for b in 0..l.num_blocks {
                        let (t, off) = l.slab_at(layer, part, b);
                        assert!(t < l.num_tensors(), "{kind:?}");
                        assert!(off + slab <= l.tensor_bytes(), "{kind:?}");
                        assert_eq!(off % slab, 0);
                        assert!(seen.insert((t, off)), "{kind:?}: overlap");
                    }
                }
            }
            let total = u64::from(l.num_tensors()) * l.tensor_bytes();
            assert_eq!(seen.len() as u64 * slab, total, "{kind:?}");
        }
    }

    #[test]
    fn objects_are_layout_independent() {
        let fa = layout(KvLayoutKind::FlashAttn);
        let fi = layout(KvLayoutKind::FlashInfer);
        let cl = layout(KvLayoutKind::CrossLayer);
        let mut small_blocks = fa;
        small_blocks.block_tokens = 2;
        assert_eq!(fa.fingerprint(16), fi.fingerprint(16));
        assert_eq!(fa.fingerprint(16), cl.fingerprint(16));
        assert_eq!(fa.fingerprint(16), small_blocks.fingerprint(16));
        assert_ne!(
            fa.fingerprint(16),
            layout(KvLayoutKind::Mla).fingerprint(16)
        );
        assert_ne!(fa.fingerprint(16), fa.fingerprint(32));
        assert_eq!(fa.object_bytes(16), 2 * 3 * 16 * 2 * 8 * 2);
        assert_eq!(fa.object_offset(16, 2, 1, 3), ((3 + 2) * 16 + 12) * 32);
    }

    #[test]
    fn bad_layouts_say_what_is_wrong() {
        let mut l = layout(KvLayoutKind::FlashAttn);
        l.block_tokens = 3;
        assert!(l.validate(16).unwrap_err().to_string().contains("does not divide"));
        let mut l = layout(KvLayoutKind::Mla);
        l.num_heads = 2;
        assert!(l.validate(16).unwrap_err().to_string().contains("MLA"));
        let mut l = layout(KvLayoutKind::FlashAttn);
        l.elem_bytes = 3;
        assert!(l.validate(16).unwrap_err().to_string().contains("element size"));
        let mut l = layout(KvLayoutKind::CrossLayer);
        l.num_blocks = MAX_BLOCKS;
        l.num_layers = MAX_LAYERS;
        l.head_dim = MAX_HEAD_DIM;
        l.num_heads = MAX_HEADS;
        assert!(l.validate(16).is_err());
        l.kind = 9;
        assert!(l.validate(16).unwrap_err().to_string().contains("unknown layout"));
    }
}
