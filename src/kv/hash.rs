//! Keys: chained chunk hashes over token ids, and 64-bit ids for model names
//! and tenant salts. Computed by the client library, identically in every
//! process: equal prefixes give equal keys.

/// A chunk's identity: BLAKE3 of the previous chunk's hash and this chunk's
/// token ids, truncated to 128 bits.
pub type ChunkHash = [u8; 16];

const CHAIN_SEED: &[u8] = b"kvring-chunk-chain-v1";

fn id64(domain: &[u8], s: &[u8]) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(domain);
    h.update(s);
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The 64-bit id of a model name (never 0).
pub fn model_id(name: &str) -> u64 {
    id64(b"kvring-model-v1", name.as_bytes()).max(1)
}

/// The 64-bit id of a tenant salt; no salt is 0.
pub fn salt_id(salt: Option<&str>) -> u64 {
    salt.map_or(0, |s| id64(b"kvring-salt-v1", s.as_bytes()).max(1))
}

/// The chain's state before a prompt's first chunk: what
/// [`chunk_chain`] starts from for chunk 0.
pub fn chain_seed() -> ChainState {
    *blake3::hash(CHAIN_SEED).as_bytes()
}

/// The chain's full state after a chunk (its first 16 bytes are the
/// chunk's [`ChunkHash`]): what the next chunk's hash is computed from.
pub type ChainState = [u8; 32];

/// Hashes of the full chunks of `tokens` (a partial tail chunk is not
/// hashed: only full chunks are stored or looked up).
pub fn chunk_hashes(tokens: &[u32], chunk_tokens: u32) -> Vec<ChunkHash> {
    chunk_chain(chain_seed(), tokens, chunk_tokens).0
}

/// Hashes of the full chunks of `tokens`, continuing the chain from
/// `prev` (the state after the chunk before them, or [`chain_seed`]),
/// and the state after the last of them.
pub fn chunk_chain(
    mut prev: ChainState,
    tokens: &[u32],
    chunk_tokens: u32,
) -> (Vec<ChunkHash>, ChainState) {
    assert!(chunk_tokens > 0, "chunk size must be positive");
    let hashes = tokens
        .chunks_exact(chunk_tokens as usize)
        .map(|chunk| {
            let mut h = blake3::Hasher::new();
            h.update(&prev);
            if cfg!(target_endian = "little") {
                // The same bytes as the loop below, in one call.
                h.update(bytemuck::cast_slice(chunk));
            } else {
                for t in chunk {
                    h.update(&t.to_le_bytes());
                }
            }
            prev = *h.finalize().as_bytes();
            prev[..16].try_into().expect("16 bytes")
        })
        .collect();
    (hashes, prev)
}

/// The key of a prompt's tail: its whole blocks of `block_tokens` past its
/// last whole chunk, hashed as one more link of the chain (BLAKE3 of the
/// chain's state and the tail's token ids, as a chunk's, over fewer tokens:
/// never a chunk's key). Stored as a chunk of fewer blocks, so that a hit
/// can end on a block. None where the prompt has no such block, or no whole
/// chunk before it.
pub fn tail_hash(tokens: &[u32], chunk_tokens: u32, block_tokens: u32) -> Option<ChunkHash> {
    prompt_keys(tokens, chunk_tokens, block_tokens).1
}

/// A prompt's keys in one pass over its tokens: its whole chunks'
/// ([`chunk_hashes`]) and its tail's ([`tail_hash`]).
pub fn prompt_keys(
    tokens: &[u32],
    chunk_tokens: u32,
    block_tokens: u32,
) -> (Vec<ChunkHash>, Option<ChunkHash>) {
    assert!(
        block_tokens > 0 && chunk_tokens % block_tokens == 0,
        "the block size must divide the chunk size"
    );
    let ct = chunk_tokens as usize;
    let whole = tokens.len() / ct * ct;
    let end = tokens.len() / block_tokens as usize * block_tokens as usize;
    let (hashes, state) = chunk_chain(chain_seed(), &tokens[..whole], chunk_tokens);
    let tail = (whole > 0 && end > whole)
        .then(|| chunk_chain(state, &tokens[whole..end], (end - whole) as u32).0[0]);
    (hashes, tail)
}

/// The key of engine `id` a client sends in its hello: BLAKE3
/// ("kvring-engine-v1" || id). The server keeps it and never writes it to
/// shared memory, so engines that do not know `id` cannot act as this one.
pub fn engine_key(id: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"kvring-engine-v1");
    h.update(id.as_bytes());
    *h.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_hashes_and_the_chain_carries_history() {
        let a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        b[700] = 7;
        let (ha, hb) = (chunk_hashes(&a, 256), chunk_hashes(&b, 256));
        assert_eq!(ha.len(), 3, "the partial tail is not hashed");
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // The same chunk after a different prefix is a different chunk.
        let mut c = a.clone();
        c[0] = 99;
        let hc = chunk_hashes(&c, 256);
        assert!(ha.iter().zip(&hc).all(|(x, y)| x != y));
        assert_ne!(model_id("llama"), model_id("qwen"));
        assert_eq!(salt_id(None), 0);
        assert_ne!(salt_id(Some("tenant-a")), salt_id(Some("tenant-b")));
    }

    #[test]
    fn a_tail_is_keyed_by_its_whole_blocks_and_the_prefix_before_them() {
        let a: Vec<u32> = (0..280).map(|t| t * 31 + 7).collect();
        // 2 chunks of 96, then 80 of the 88 tokens left in whole blocks.
        let t = tail_hash(&a, 96, 16).unwrap();
        assert!(!chunk_hashes(&a, 96).contains(&t));
        // Tokens past the last whole block do not change it; one inside does,
        // and so does one of the prefix.
        assert_eq!(tail_hash(&a[..279], 96, 16), Some(t));
        let mut b = a.clone();
        b[250] ^= 1;
        assert_ne!(tail_hash(&b, 96, 16), Some(t));
        let mut c = a.clone();
        c[3] ^= 1;
        assert_ne!(tail_hash(&c, 96, 16), Some(t));
        // None without a whole chunk before it, or without a whole block.
        assert_eq!(tail_hash(&a[..90], 96, 16), None);
        assert_eq!(tail_hash(&a[..200], 96, 16), None);
        assert_eq!(prompt_keys(&a, 96, 16), (chunk_hashes(&a, 96), Some(t)));
    }

    #[test]
    fn a_chain_continued_from_a_state_equals_the_whole_chain() {
        let a: Vec<u32> = (0..1000).map(|t| t * 7919).collect();
        let whole = chunk_hashes(&a, 100);
        let (head, state) = chunk_chain(chain_seed(), &a[..300], 100);
        let (tail, _) = chunk_chain(state, &a[300..], 100);
        assert_eq!([head, tail].concat(), whole);
        assert_eq!(state[..16], whole[2]);
        // The hashes are over the tokens' little-endian bytes.
        let mut h = blake3::Hasher::new();
        h.update(&chain_seed());
        for t in &a[..100] {
            h.update(&t.to_le_bytes());
        }
        assert_eq!(h.finalize().as_bytes()[..16], whole[0]);
    }
}
