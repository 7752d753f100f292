//! Deterministic KV contents for the demo, the tests and the benchmarks: a
//! slab's bytes are a function of a content id (the rank, or a shared id for
//! MLA), the chunk hash (so the whole prefix), the layer, the part and the
//! block's place in its chunk. A retrieve that lands a wrong chunk, block,
//! layer, part or rank fails byte for byte.

use super::{ChunkHash, KvLayout};

/// A paged KV cache whose slabs can be written and read (host or device).
pub trait Slabs {
    fn slab_layout(&self) -> &KvLayout;
    fn put_slab(&self, layer: u32, part: u32, block: u32, bytes: &[u8]);
    fn get_slab(&self, layer: u32, part: u32, block: u32, out: &mut [u8]);
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one slab.
pub fn slab_seed(content: u32, hash: &ChunkHash, layer: u32, part: u32, j: u32) -> u64 {
    let h = u64::from_le_bytes(hash[..8].try_into().expect("8 bytes"))
        ^ u64::from_le_bytes(hash[8..].try_into().expect("8 bytes")).rotate_left(17);
    let mut s = h
        ^ (u64::from(content) << 48)
        ^ (u64::from(layer) << 24)
        ^ (u64::from(part) << 20)
        ^ u64::from(j);
    splitmix(&mut s)
}

/// Fills `out` with the bytes of the slab seeded `seed`.
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

/// Writes one chunk's contents into `blocks` of `cache`.
pub fn write_chunk(cache: &(impl Slabs + ?Sized), content: u32, hash: &ChunkHash, blocks: &[u32]) {
    let l = *cache.slab_layout();
    let mut slab = vec![0u8; l.slab_bytes() as usize];
    for layer in 0..l.num_layers {
        for part in 0..l.parts() {
            for (j, &b) in blocks.iter().enumerate() {
                fill(slab_seed(content, hash, layer, part, j as u32), &mut slab);
                cache.put_slab(layer, part, b, &slab);
            }
        }
    }
}

/// The first byte of a chunk that differs from what it should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "layer {layer} part {part} block {block} (#{index} of the chunk): byte {byte} is {got:#04x}, expected {want:#04x}"
)]
pub struct Mismatch {
    pub layer: u32,
    pub part: u32,
    pub block: u32,
    /// The block's position in the chunk.
    pub index: usize,
    /// The byte's offset in the slab.
    pub byte: usize,
    pub got: u8,
    pub want: u8,
}

/// Checks one chunk's contents in `blocks` of `cache`: blocks before
/// `skip_blocks` must still hold `poison` bytes, the rest the chunk's bytes.
/// Returns the bytes checked, or where the first difference is.
pub fn verify_chunk(
    cache: &(impl Slabs + ?Sized),
    content: u32,
    hash: &ChunkHash,
    blocks: &[u32],
    skip_blocks: u32,
    poison: u8,
) -> Result<u64, Mismatch> {
    let l = *cache.slab_layout();
    let n = l.slab_bytes() as usize;
    let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
    let mut checked = 0u64;
    for layer in 0..l.num_layers {
        for part in 0..l.parts() {
            for (j, &b) in blocks.iter().enumerate() {
                if (j as u32) < skip_blocks {
                    want.fill(poison);
                } else {
                    fill(slab_seed(content, hash, layer, part, j as u32), &mut want);
                }
                cache.get_slab(layer, part, b, &mut got);
                if want != got {
                    let at = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(Mismatch {
                        layer,
                        part,
                        block: b,
                        index: j,
                        byte: at,
                        got: got[at],
                        want: want[at],
                    });
                }
                checked += n as u64;
            }
        }
    }
    Ok(checked)
}
