//! What a KV cache holds, independent of where it lives: layers, blocks,
//! tokens per block, heads, the K and V widths and the element size. Two
//! engines of one model (and one rank) with the same geometry (block count
//! and block size aside) store interchangeable chunk objects, whatever
//! their memory layouts.

use crate::shm_struct::shm_struct;
use bytemuck::{Pod, Zeroable};

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

/// The dimensions of a paged KV cache with K and V of one head size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Layers (L).
    pub layers: u32,
    /// Blocks in the paged cache (NB).
    pub blocks: u32,
    /// Tokens per block (BS).
    pub block_tokens: u32,
    /// KV heads (H).
    pub heads: u32,
    /// Head size (D) of K and of V.
    pub head_dim: u32,
}

bitflags::bitflags! {
    /// `KvGeometry::flags` bits (the field stays `u32`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct GeometryFlags: u32 {
        /// Every rank of the world holds the same KV (MLA's latent cache,
        /// replicated across tensor-parallel ranks): ranks share one object
        /// per chunk.
        const SHARED = 1;
    }
}

/// Bounds on a geometry.
pub const MAX_LAYERS: u32 = 1024;
pub const MAX_HEADS: u32 = 1024;
pub const MAX_HEAD_DIM: u32 = 1 << 16;
pub const MAX_BLOCKS: u32 = 1 << 31;

shm_struct! {
    /// A KV cache's geometry, as sent at registration (`shm_layout.md`,
    /// "KvGeometry"). Each token of each layer holds, per head, a **row** of
    /// `k_dim` K elements then `v_dim` V elements (`v_dim` 0: no V, as MLA's
    /// latent). Built with [`KvGeometry::mha`] or [`KvGeometry::mla`].
    ///
    /// # Examples
    ///
    /// ```
    /// use kvring::kv::{Dtype, KvGeometry, KvShape};
    ///
    /// // Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks.
    /// let shape = KvShape { layers: 32, blocks: 1024, block_tokens: 16, heads: 8, head_dim: 128 };
    /// let g = KvGeometry::mha(shape, Dtype::Bf16);
    /// assert_eq!(g.row_bytes(), 2 * 128 * 2);
    /// assert_eq!(g.parts(), 2);
    ///
    /// // DeepSeek-V3's MLA: one 576-wide latent per token, shared by every rank.
    /// let mla = KvGeometry::mla(61, 512, 64, 576, Dtype::Bf16);
    /// assert_eq!((mla.heads, mla.parts(), mla.shared()), (1, 1, true));
    /// ```
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
    pub struct KvGeometry {
        [0] pub layers: u32,
        /// Blocks in the paged cache (NB).
        [4] pub blocks: u32,
        /// Tokens per block (BS).
        [8] pub block_tokens: u32,
        /// KV heads (H); 1 for MLA.
        [12] pub heads: u32,
        /// K elements per head and token (MLA: the latent plus rope width).
        [16] pub k_dim: u32,
        /// V elements per head and token; 0: no V (MLA).
        [20] pub v_dim: u32,
        /// Bytes per element: 1, 2 or 4.
        [24] pub elem_bytes: u32,
        /// [`GeometryFlags`] bits.
        [28] pub flags: u32,
    }
}

/// Why a geometry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    #[error("{0} layers: must be 1..={MAX_LAYERS}")]
    Layers(u32),
    #[error("{0} blocks: must be 1..={MAX_BLOCKS}")]
    Blocks(u32),
    #[error("{0} heads: must be 1..={MAX_HEADS}")]
    Heads(u32),
    #[error("K width {0}: must be 1..={MAX_HEAD_DIM} elements")]
    KDim(u32),
    #[error("V width {0}: must be 0..={MAX_HEAD_DIM} elements")]
    VDim(u32),
    #[error("element size {0}: must be 1, 2 or 4")]
    ElemBytes(u32),
    #[error("unknown geometry flags {0:#x}")]
    Flags(u32),
    #[error(
        "block size {block_tokens} tokens does not divide the server's chunk size of {chunk_tokens} tokens"
    )]
    BlockTokens { block_tokens: u32, chunk_tokens: u32 },
}

impl KvGeometry {
    /// Multi-head attention: K and V of `shape.head_dim` elements per head.
    pub const fn mha(shape: KvShape, dtype: Dtype) -> KvGeometry {
        KvGeometry {
            layers: shape.layers,
            blocks: shape.blocks,
            block_tokens: shape.block_tokens,
            heads: shape.heads,
            k_dim: shape.head_dim,
            v_dim: shape.head_dim,
            elem_bytes: dtype.bytes(),
            flags: 0,
        }
    }

    /// MLA: one latent of `width` elements per token (latent plus rope; an
    /// fp8 variant's scales included), no V, the same on every rank.
    pub const fn mla(
        layers: u32,
        blocks: u32,
        block_tokens: u32,
        width: u32,
        dtype: Dtype,
    ) -> KvGeometry {
        KvGeometry {
            layers,
            blocks,
            block_tokens,
            heads: 1,
            k_dim: width,
            v_dim: 0,
            elem_bytes: dtype.bytes(),
            flags: GeometryFlags::SHARED.bits(),
        }
    }

    /// The same geometry with V `v_dim` elements wide (a model whose value
    /// head size differs from its key head size).
    pub const fn with_v_dim(mut self, v_dim: u32) -> KvGeometry {
        self.v_dim = v_dim;
        self
    }

    /// The same geometry with `blocks` blocks.
    pub const fn with_blocks(mut self, blocks: u32) -> KvGeometry {
        self.blocks = blocks;
        self
    }

    /// The same geometry with `block_tokens` tokens per block.
    pub const fn with_block_tokens(mut self, block_tokens: u32) -> KvGeometry {
        self.block_tokens = block_tokens;
        self
    }

    /// Whether every rank holds the same KV (ranks share objects).
    pub fn shared(&self) -> bool {
        self.flags & GeometryFlags::SHARED.bits() != 0
    }

    /// Checks every bound and that `block_tokens` divides `chunk_tokens`.
    pub fn validate(&self, chunk_tokens: u32) -> Result<(), GeometryError> {
        if !(1..=MAX_LAYERS).contains(&self.layers) {
            return Err(GeometryError::Layers(self.layers));
        }
        if !(1..=MAX_BLOCKS).contains(&self.blocks) {
            return Err(GeometryError::Blocks(self.blocks));
        }
        if !(1..=MAX_HEADS).contains(&self.heads) {
            return Err(GeometryError::Heads(self.heads));
        }
        if !(1..=MAX_HEAD_DIM).contains(&self.k_dim) {
            return Err(GeometryError::KDim(self.k_dim));
        }
        if self.v_dim > MAX_HEAD_DIM {
            return Err(GeometryError::VDim(self.v_dim));
        }
        if ![1, 2, 4].contains(&self.elem_bytes) {
            return Err(GeometryError::ElemBytes(self.elem_bytes));
        }
        if GeometryFlags::from_bits(self.flags).is_none() {
            return Err(GeometryError::Flags(self.flags));
        }
        if self.block_tokens == 0 || chunk_tokens % self.block_tokens != 0 {
            return Err(GeometryError::BlockTokens {
                block_tokens: self.block_tokens,
                chunk_tokens,
            });
        }
        Ok(())
    }

    /// K and V (2), or K alone (1).
    pub fn parts(&self) -> u32 {
        if self.v_dim == 0 {
            1
        } else {
            2
        }
    }

    /// Bytes of one head's K for one token.
    pub fn k_bytes(&self) -> u64 {
        u64::from(self.k_dim) * u64::from(self.elem_bytes)
    }

    /// Bytes of one head's V for one token.
    pub fn v_bytes(&self) -> u64 {
        u64::from(self.v_dim) * u64::from(self.elem_bytes)
    }

    /// Bytes of one row: one head's K then V for one token.
    pub fn row_bytes(&self) -> u64 {
        self.k_bytes() + self.v_bytes()
    }

    /// Bytes one block holds for one layer (`block_tokens * heads` rows).
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.block_tokens) * u64::from(self.heads) * self.row_bytes()
    }

    /// Blocks per chunk of `chunk_tokens`.
    pub fn blocks_per_chunk(&self, chunk_tokens: u32) -> u32 {
        chunk_tokens / self.block_tokens
    }

    /// Bytes of a chunk object of `chunk_tokens` tokens:
    /// `[layer][token][head][K then V]`.
    pub fn object_bytes(&self, chunk_tokens: u32) -> u64 {
        u64::from(self.layers)
            * u64::from(chunk_tokens)
            * u64::from(self.heads)
            * self.row_bytes()
    }

    /// Offset in a chunk object of row (`layer`, `token`, `head`).
    #[inline]
    pub fn object_row(&self, chunk_tokens: u32, layer: u32, token: u32, head: u32) -> u64 {
        let t = u64::from(layer) * u64::from(chunk_tokens) + u64::from(token);
        (t * u64::from(self.heads) + u64::from(head)) * self.row_bytes()
    }

    /// What a stored object's bytes mean, independent of the memory layout,
    /// block count and block size: objects with equal fingerprints are
    /// interchangeable.
    pub fn fingerprint(&self, chunk_tokens: u32) -> u64 {
        let mut h = blake3::Hasher::new();
        h.update(b"kvring-object-v2");
        for v in [
            self.layers,
            self.heads,
            self.k_dim,
            self.v_dim,
            self.elem_bytes,
            self.flags,
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

    fn g() -> KvGeometry {
        KvGeometry::mha(
            KvShape {
                layers: 3,
                blocks: 5,
                block_tokens: 4,
                heads: 2,
                head_dim: 8,
            },
            Dtype::Bf16,
        )
    }

    #[test]
    fn objects_depend_on_meaning_not_on_paging() {
        let a = g();
        assert_eq!(a.fingerprint(16), a.with_blocks(99).fingerprint(16));
        assert_eq!(a.fingerprint(16), a.with_block_tokens(8).fingerprint(16));
        assert_ne!(a.fingerprint(16), a.fingerprint(32));
        assert_ne!(a.fingerprint(16), a.with_v_dim(4).fingerprint(16));
        let mut fp8 = a;
        fp8.elem_bytes = 1;
        assert_ne!(a.fingerprint(16), fp8.fingerprint(16));
        assert_eq!(a.object_bytes(16), 3 * 16 * 2 * 32);
        assert_eq!(a.object_row(16, 2, 5, 1), ((2 * 16 + 5) * 2 + 1) * 32);
    }

    #[test]
    fn bad_geometries_say_what_is_wrong() {
        let mut x = g();
        x.block_tokens = 3;
        assert!(x.validate(16).unwrap_err().to_string().contains("does not divide"));
        let mut x = g();
        x.elem_bytes = 3;
        assert!(x.validate(16).unwrap_err().to_string().contains("element size"));
        let mut x = g();
        x.k_dim = 0;
        assert!(x.validate(16).unwrap_err().to_string().contains("K width"));
        let mut x = g();
        x.flags = 6;
        assert!(x.validate(16).unwrap_err().to_string().contains("flags"));
        for (f, v) in [(0usize, 0u32), (1, 0), (3, 0), (0, MAX_LAYERS + 1)] {
            let mut x = g();
            match f {
                0 => x.layers = v,
                1 => x.blocks = v,
                _ => x.heads = v,
            }
            assert!(x.validate(16).is_err(), "{x:?}");
        }
        g().validate(16).unwrap();
        KvGeometry::mla(2, 4, 4, 576, Dtype::Fp8).validate(16).unwrap();
    }
}
