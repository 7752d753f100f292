//! The events as vLLM's `vllm.distributed.kv_events` encodes them (msgspec
//! structs): a batch is a msgpack array `[ts, [events], data_parallel_rank]`;
//! each event a map tagged `"type"` with vLLM's field names, in vLLM's
//! order, then kvring's own fields (decoders of vLLM's classes, Dynamo's
//! and llm-d's skip keys they do not know). Written with `rmp-serde`'s
//! named-field encoder.

use serde::Serialize;

/// The tier an event names (`medium`): vLLM's names where vLLM has one.
pub(super) const MEDIUM_POOL: &str = "CPU";
pub(super) const MEDIUM_DISK: &str = "STORAGE";
pub(super) const MEDIUM_REMOTE: &str = "REMOTE";

/// kvring's identity of an object: which model, tenant salt, layout and
/// rank it is of, and its chunk hash (all 128 bits).
#[derive(Serialize, Clone, Copy, Debug)]
pub(super) struct ObjectFields {
    pub model_id: u64,
    pub salt: u64,
    pub layout: u64,
    pub world_size: u32,
    /// 65535: one object for every rank (MLA).
    pub rank: u32,
    #[serde(with = "serde_bytes")]
    pub chunk_hash: [u8; 16],
}

impl ObjectFields {
    /// The object's block hash in events: the first 8 bytes (little
    /// endian) of BLAKE3 over "kvring-event-v1", the model id, salt,
    /// layout and `world_size << 16 | rank` (8, 8, 8 and 4 bytes, little
    /// endian) and the chunk
    /// hash. Distinct for every object, so a consumer that knows only
    /// vLLM's fields still counts each object once.
    pub(super) fn block_hash(&self) -> u64 {
        let tag = (self.world_size << 16) | self.rank;
        block_hash(self.model_id, self.salt, self.layout, tag, &self.chunk_hash)
    }

    /// The block hash of the object of `chunk` with the same model, salt,
    /// layout and rank (the parent's).
    pub(super) fn with_chunk(&self, chunk: [u8; 16]) -> ObjectFields {
        ObjectFields {
            chunk_hash: chunk,
            ..*self
        }
    }
}

fn block_hash(model: u64, salt: u64, layout: u64, rank: u32, chunk: &[u8; 16]) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"kvring-event-v1");
    h.update(&model.to_le_bytes());
    h.update(&salt.to_le_bytes());
    h.update(&layout.to_le_bytes());
    h.update(&rank.to_le_bytes());
    h.update(chunk);
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

#[derive(Serialize, Debug)]
#[serde(tag = "type")]
pub(super) enum Event {
    BlockStored {
        block_hashes: [u64; 1],
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        medium: &'static str,
        lora_name: Option<String>,
        #[serde(flatten)]
        object: ObjectFields,
    },
    BlockRemoved {
        block_hashes: [u64; 1],
        medium: &'static str,
        #[serde(flatten)]
        object: ObjectFields,
        /// The tiers below that have the object or are being given it.
        to: Vec<&'static str>,
    },
    AllBlocksCleared {},
}

/// `[ts, events, data_parallel_rank]`.
#[derive(Serialize, Debug)]
pub(super) struct Batch<'a>(pub f64, pub &'a [Event], pub Option<i32>);

/// A batch's msgpack bytes.
pub(super) fn encode(batch: &Batch<'_>) -> Vec<u8> {
    rmp_serde::to_vec_named(batch).expect("events encode to msgpack")
}
