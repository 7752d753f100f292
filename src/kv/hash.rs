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

/// Hashes of the full chunks of `tokens` (a partial tail chunk is not
/// hashed: only full chunks are stored or looked up).
pub fn chunk_hashes(tokens: &[u32], chunk_tokens: u32) -> Vec<ChunkHash> {
    assert!(chunk_tokens > 0, "chunk size must be positive");
    let mut prev: [u8; 32] = *blake3::hash(CHAIN_SEED).as_bytes();
    tokens
        .chunks_exact(chunk_tokens as usize)
        .map(|chunk| {
            let mut h = blake3::Hasher::new();
            h.update(&prev);
            for t in chunk {
                h.update(&t.to_le_bytes());
            }
            prev = *h.finalize().as_bytes();
            prev[..16].try_into().expect("16 bytes")
        })
        .collect()
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
}
