//! Deterministic KV contents for the demo, the tests and the benchmarks: a
//! token's rows of one layer (every head's K and V) are a function of a
//! content id (the rank, or a shared id for MLA), the chunk hash (so the
//! whole prefix), the layer and the token's place in its chunk — not of the
//! block size, so engines of any block size agree on a chunk's contents. A
//! retrieve that lands a wrong chunk, block, layer, head, token, part or
//! rank fails byte for byte.
//!
//! Contents are written and read through a [`KvMemory`] with the layout's
//! own runs ([`super::CopyPlan`]), the addressing the server copies with.

use super::{ChunkHash, KvLayout};

/// One contiguous run of an engine's KV memory: `bytes` at `offset` of
/// allocation `alloc`, and where it sits (`at`) in the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub alloc: u32,
    pub offset: u64,
    pub bytes: u64,
    pub at: u64,
}

/// An engine's KV memory (host or device) that tests can write and read.
pub trait KvMemory {
    fn kv_layout(&self) -> &KvLayout;
    /// Writes each run's bytes from `src[at..at + bytes]`.
    fn write_runs(&self, runs: &[Run], src: &[u8]);
    /// Reads each run's bytes into `dst[at..at + bytes]`.
    fn read_runs(&self, runs: &[Run], dst: &mut [u8]);
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of token `t` of a chunk, one layer.
pub fn token_seed(content: u32, hash: &ChunkHash, layer: u32, t: u32) -> u64 {
    let h = u64::from_le_bytes(hash[..8].try_into().expect("8 bytes"))
        ^ u64::from_le_bytes(hash[8..].try_into().expect("8 bytes")).rotate_left(17);
    let mut s = h ^ (u64::from(content) << 48) ^ (u64::from(layer) << 24) ^ u64::from(t);
    splitmix(&mut s)
}

/// Fills `out` with the bytes seeded `seed`.
pub fn fill(seed: u64, out: &mut [u8]) {
    let mut s = seed;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&splitmix(&mut s).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = splitmix(&mut s).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
}

/// The chunk object a store of `blocks` holding this content makes
/// (`[layer][token][head][K then V]`), block positions before
/// `skip_blocks` filled with `poison`.
pub fn object(
    layout: &KvLayout,
    content: u32,
    hash: &ChunkHash,
    n_blocks: u32,
    skip_blocks: u32,
    poison: u8,
) -> Vec<u8> {
    let g = layout.geometry();
    let chunk = n_blocks * g.block_tokens;
    let token_rows = (u64::from(g.heads) * g.row_bytes()) as usize;
    let mut out = vec![0u8; g.object_bytes(chunk) as usize];
    for layer in 0..g.layers {
        for t in 0..chunk {
            let at = g.object_row(chunk, layer, t, 0) as usize;
            let dst = &mut out[at..at + token_rows];
            if t < skip_blocks * g.block_tokens {
                dst.fill(poison);
            } else {
                fill(token_seed(content, hash, layer, t), dst);
            }
        }
    }
    out
}

/// The runs that hold `blocks` of a cache of `layout`, placed as their
/// chunk object has them.
pub fn chunk_runs(layout: &KvLayout, blocks: &[u32]) -> Vec<Run> {
    let g = layout.geometry();
    let chunk = blocks.len() as u32 * g.block_tokens;
    let plan = layout.plan();
    let mut runs = Vec::new();
    for layer in 0..g.layers {
        let alloc = layout.layers()[layer as usize].alloc;
        for (j, &b) in blocks.iter().enumerate() {
            plan.for_each_run(layout, chunk, layer, b, j as u32, |_, offset, at, bytes| {
                runs.push(Run {
                    alloc,
                    offset,
                    bytes,
                    at,
                })
            });
        }
    }
    runs
}

/// Writes one chunk's contents into `blocks` of `cache`.
pub fn write_chunk(cache: &(impl KvMemory + ?Sized), content: u32, hash: &ChunkHash, blocks: &[u32]) {
    let l = cache.kv_layout();
    let obj = object(l, content, hash, blocks.len() as u32, 0, 0);
    cache.write_runs(&chunk_runs(l, blocks), &obj);
}

/// The first byte of a chunk that differs from what it should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "layer {layer} block {block} (#{index} of the chunk) token {token} head {head} {part} byte {byte}: {got:#04x}, expected {want:#04x}"
)]
pub struct Mismatch {
    pub layer: u32,
    pub block: u32,
    /// The block's position in the chunk.
    pub index: usize,
    /// Token in the block, head, K or V, byte in the part.
    pub token: u32,
    pub head: u32,
    pub part: super::Part,
    pub byte: u64,
    pub got: u8,
    pub want: u8,
}

/// Checks one chunk's contents in `blocks` of `cache`: blocks before
/// `skip_blocks` must still hold `poison` bytes, the rest the chunk's bytes.
/// Returns the bytes checked, or where the first difference is.
pub fn verify_chunk(
    cache: &(impl KvMemory + ?Sized),
    content: u32,
    hash: &ChunkHash,
    blocks: &[u32],
    skip_blocks: u32,
    poison: u8,
) -> Result<u64, Mismatch> {
    let l = cache.kv_layout();
    let g = l.geometry();
    let want = object(l, content, hash, blocks.len() as u32, skip_blocks, poison);
    let mut got = vec![0u8; want.len()];
    cache.read_runs(&chunk_runs(l, blocks), &mut got);
    let Some(at) = want.iter().zip(&got).position(|(a, b)| a != b) else {
        return Ok(want.len() as u64);
    };
    let chunk = blocks.len() as u64 * u64::from(g.block_tokens);
    let row = at as u64 / g.row_bytes();
    let within = at as u64 % g.row_bytes();
    let (token_row, head) = (row / u64::from(g.heads), row % u64::from(g.heads));
    let (layer, token) = (token_row / chunk, token_row % chunk);
    let index = (token / u64::from(g.block_tokens)) as usize;
    let (part, byte) = if within < g.k_bytes() {
        (super::Part::K, within)
    } else {
        (super::Part::V, within - g.k_bytes())
    };
    Err(Mismatch {
        layer: layer as u32,
        block: blocks[index],
        index,
        token: (token % u64::from(g.block_tokens)) as u32,
        head: head as u32,
        part,
        byte,
        got: got[at],
        want: want[at],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Dtype, KvGeometry, KvShape, LayoutPreset};

    #[test]
    fn a_written_chunk_verifies_in_every_layout() {
        let shape = KvShape { layers: 2, blocks: 20, block_tokens: 16, heads: 2, head_dim: 16 };
        for p in LayoutPreset::ALL {
            let Ok(l) = KvLayout::preset(p, KvGeometry::mha(shape, Dtype::Bf16)) else { continue };
            let cache = crate::HostKvCache::new(l, 64).unwrap();
            cache.fill(0xee);
            let h = [7u8; 16];
            let blocks = [4, 11, 18, 5];
            write_chunk(&cache, 0, &h, &blocks);
            verify_chunk(&cache, 0, &h, &blocks, 0, 0).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        }
    }
}
