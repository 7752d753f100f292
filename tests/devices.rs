//! Several devices behind one server, on the host backend with simulated
//! devices (`--simulated-devices`): each device has its own copy lane, as a
//! CUDA server has per GPU.
//!
//! One client drives two devices: a 256 MiB store backlog on device 0 does
//! not hold up a small store on device 1 (with one lane, the client's queue
//! would serve it after the whole backlog). Tensor-parallel ranks on two
//! devices are a scenario of the backend conformance suite
//! (`tests/conformance.rs`).

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::{
    chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::{HostKvCache, KvSpec, Lookup, Retrieve, Store};
use std::time::{Duration, Instant};

/// A prompt of `chunks` chunks that opens with `seed`.
fn prompt(seed: u32, chunks: u32) -> Vec<u32> {
    std::iter::once(seed)
        .chain((1..chunks * CHUNK).map(|i| i.wrapping_mul(2_654_435_761)))
        .collect()
}

#[test]
fn one_devices_backlog_never_holds_up_another_device() {
    let s = Fixture::new(
        "lanes",
        Duration::from_secs(120),
        &[
            "--backend",
            "host",
            "--simulated-devices",
            "2",
            "--copy-threads",
            "1",
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "512MiB",
        ],
    );
    let mut c = s.client();
    // Device 0: 8 MiB chunk objects (32 layers, 8 heads of 128), 32 chunks.
    let shape = KvShape {
        layers: 32,
        blocks: 128,
        block_tokens: 16,
        heads: 8,
        head_dim: 128,
    };
    let big = KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16)).unwrap();
    let big_cache = HostKvCache::new(big.clone(), CHUNK).unwrap();
    let big_inst = c
        .register_host(
            &KvSpec::new(model_id("big"), 1, 0).on_device(simulated_device_uuid(0)),
            &big_cache,
        )
        .unwrap();
    // Device 1: one small chunk.
    let small_cache = HostKvCache::new(small_layout(), CHUNK).unwrap();
    let small_inst = c
        .register_host(
            &KvSpec::new(model_id("small"), 1, 0).on_device(simulated_device_uuid(1)),
            &small_cache,
        )
        .unwrap();
    let sh = chunk_hashes(&prompt(2, 1), CHUNK);
    pattern::write_chunk(&small_cache, 0, &sh[0], &[0, 1, 2, 3]);
    let mut worst_ratio = 0f64;
    for round in 0..3u32 {
        let bh = chunk_hashes(&prompt(100 + round, 32), CHUNK);
        let blocks: Vec<u32> = (0..128).collect();
        let t0 = Instant::now();
        let backlog = c.store(Store::new(&big_inst, &bh, &blocks)).unwrap();
        let sh = chunk_hashes(&prompt(1000 + round, 1), CHUNK);
        pattern::write_chunk(&small_cache, round, &sh[0], &[0, 1, 2, 3]);
        let small = c
            .store(Store::new(&small_inst, &sh, &[0, 1, 2, 3]))
            .unwrap();
        let st = small.wait(far()).unwrap();
        let small_took = t0.elapsed();
        assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
        // The backlog on the other device is still being copied.
        let big_then = backlog.status().unwrap();
        assert!(
            matches!(big_then, JobStatus::Pending | JobStatus::Running),
            "round {round}: device 1's store waited for device 0's backlog ({big_then:?} after {small_took:?})"
        );
        let st = backlog.wait(far()).unwrap();
        let big_took = t0.elapsed();
        assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
        c.release_job(small).unwrap();
        c.release_job(backlog).unwrap();
        eprintln!(
            "round {round}: device 1's 1-chunk store done after {small_took:?}, device 0's 256 MiB backlog after {big_took:?}"
        );
        worst_ratio = worst_ratio.max(small_took.as_secs_f64() / big_took.as_secs_f64());
        // The small chunk round-trips (its lane copies correctly).
        let lease = c.lookup(Lookup::new(model_id("small"), 1, &sh)).unwrap();
        small_cache.fill(0x5a);
        let job = c
            .retrieve(Retrieve::new(&small_inst, &lease, &[8, 9, 10, 11]))
            .unwrap();
        assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
        c.release_job(job).unwrap();
        c.release_job(lease.into_id().job()).unwrap();
        pattern::verify_chunk(&small_cache, round, &sh[0], &[8, 9, 10, 11], 0, 0x5a).unwrap();
    }
    eprintln!("small store / backlog time: at most {worst_ratio:.4}");
}
