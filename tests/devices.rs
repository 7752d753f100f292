//! Several devices behind one server, on the host backend with simulated
//! devices (`--simulated-devices`): each device has its own copy lane, as a
//! CUDA server has per GPU.
//!
//! * One client drives two devices: a 256 MiB store backlog on device 0
//!   does not hold up a small store on device 1 (with one lane, the
//!   client's queue would serve it after the whole backlog).
//! * Tensor-parallel ranks on two devices store and retrieve concurrently,
//!   every byte checked.

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern, KvLayout, KvLayoutKind};
use kvring::server::simulated_device_uuid;
use kvring::HostKvCache;
use std::time::{Duration, Instant};

const CHUNK: u32 = 64;

fn far() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn prompt(seed: u32, chunks: u32) -> Vec<u32> {
    std::iter::once(seed)
        .chain((1..chunks * CHUNK).map(|i| i.wrapping_mul(2_654_435_761)))
        .collect()
}

#[test]
fn one_devices_backlog_never_holds_up_another_device() {
    let _w = watchdog(Duration::from_secs(120));
    let s = Scope::new("lanes");
    let _srv = s.server(&[
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
    ]);
    let mut c = s.client();
    // Device 0: 8 MiB chunk objects (32 layers, 8 heads of 128), 32 chunks.
    let big = KvLayout {
        kind: KvLayoutKind::FlashAttn as u32,
        num_layers: 32,
        num_blocks: 128,
        block_tokens: 16,
        num_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        _reserved: 0,
    };
    let big_cache = HostKvCache::new(big, CHUNK).unwrap();
    let big_inst = c
        .register_host_cache_on(model_id("big"), 1, 0, &big_cache, simulated_device_uuid(0))
        .unwrap();
    // Device 1: one small chunk.
    let small_cache = HostKvCache::new(small_layout(), CHUNK).unwrap();
    let small_inst = c
        .register_host_cache_on(
            model_id("small"),
            1,
            0,
            &small_cache,
            simulated_device_uuid(1),
        )
        .unwrap();
    let sh = chunk_hashes(&prompt(2, 1), CHUNK);
    pattern::write_chunk(&small_cache, 0, &sh[0], &[0, 1, 2, 3]);
    let mut worst_ratio = 0f64;
    for round in 0..3u32 {
        let bh = chunk_hashes(&prompt(100 + round, 32), CHUNK);
        let blocks: Vec<u32> = (0..128).collect();
        let t0 = Instant::now();
        let backlog = c.store(&big_inst, 0, &bh, &blocks).unwrap();
        let sh = chunk_hashes(&prompt(1000 + round, 1), CHUNK);
        pattern::write_chunk(&small_cache, round, &sh[0], &[0, 1, 2, 3]);
        let small = c.store(&small_inst, 0, &sh, &[0, 1, 2, 3]).unwrap();
        let st = c.wait_job(small, far()).unwrap();
        let small_took = t0.elapsed();
        assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
        // The backlog on the other device is still being copied.
        let big_then = c.job_status(backlog).unwrap();
        assert!(
            matches!(big_then, JobStatus::Pending | JobStatus::Running),
            "round {round}: device 1's store waited for device 0's backlog ({big_then:?} after {small_took:?})"
        );
        let st = c.wait_job(backlog, far()).unwrap();
        let big_took = t0.elapsed();
        assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
        c.release_job(small).unwrap();
        c.release_job(backlog).unwrap();
        eprintln!(
            "round {round}: device 1's 1-chunk store done after {small_took:?}, device 0's 256 MiB backlog after {big_took:?}"
        );
        worst_ratio = worst_ratio.max(small_took.as_secs_f64() / big_took.as_secs_f64());
        // The small chunk round-trips (its lane copies correctly).
        let lease = c.lookup(model_id("small"), 1, 0, &sh).unwrap();
        c.wait_job(lease, far()).unwrap();
        small_cache.fill(0x5a);
        let id = c
            .retrieve(&small_inst, lease, 0, &[8, 9, 10, 11], 0)
            .unwrap();
        assert!(matches!(c.wait_job(id, far()).unwrap(), JobStatus::Done(_)));
        c.release_job(id).unwrap();
        c.release_job(lease).unwrap();
        pattern::verify_chunk(&small_cache, round, &sh[0], &[8, 9, 10, 11], 0, 0x5a).unwrap();
    }
    eprintln!("small store / backlog time: at most {worst_ratio:.4}");
}

#[test]
fn tensor_parallel_ranks_on_two_devices_store_and_retrieve_concurrently() {
    let _w = watchdog(Duration::from_secs(120));
    let s = Scope::new("tp-devices");
    let _srv = s.server(&[
        "--backend",
        "host",
        "--simulated-devices",
        "2",
        "--copy-threads",
        "2",
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        "256MiB",
    ]);
    const ROUNDS: u32 = 20;
    let model = model_id("tp2");
    std::thread::scope(|sc| {
        let ranks: Vec<_> = (0..2u32)
            .map(|rank| {
                let s = &s;
                sc.spawn(move || {
                    let mut c = s.client();
                    let dev = simulated_device_uuid(rank);
                    let cache = HostKvCache::new(small_layout(), CHUNK).unwrap();
                    let fresh = HostKvCache::new(small_layout(), CHUNK).unwrap();
                    let inst = c
                        .register_host_cache_on(model, 2, rank, &cache, dev)
                        .unwrap();
                    let finst = c
                        .register_host_cache_on(model, 2, rank, &fresh, dev)
                        .unwrap();
                    for round in 0..ROUNDS {
                        let hs = chunk_hashes(&prompt(round, 8), CHUNK);
                        let blocks: Vec<u32> = (0..32).collect();
                        for (h, b) in hs.iter().zip(blocks.chunks(4)) {
                            pattern::write_chunk(&cache, rank, h, b);
                        }
                        let id = c.store(&inst, 0, &hs, &blocks).unwrap();
                        assert!(matches!(c.wait_job(id, far()).unwrap(), JobStatus::Done(_)));
                        c.release_job(id).unwrap();
                        // A lookup hits only once both ranks stored: poll.
                        let deadline = far();
                        let lease = loop {
                            let lease = c.lookup(model, 2, 0, &hs).unwrap();
                            match c.wait_job(lease, far()).unwrap() {
                                JobStatus::Done(r) if r.value == 8 => break lease,
                                _ => {
                                    // (A lookup without a hit has no lease.)
                                    let _ = c.end_session(lease);
                                    c.release_job(lease).unwrap();
                                }
                            }
                            assert!(Instant::now() < deadline, "the other rank never stored");
                            std::thread::sleep(Duration::from_millis(1));
                        };
                        fresh.fill(0xc3);
                        let db: Vec<u32> = (32..64).collect();
                        let id = c.retrieve(&finst, lease, 0, &db, 0).unwrap();
                        assert!(matches!(c.wait_job(id, far()).unwrap(), JobStatus::Done(_)));
                        c.release_job(id).unwrap();
                        // This rank's own lookup also held the other rank's
                        // chunks: end it.
                        c.end_session(lease).unwrap();
                        c.release_job(lease).unwrap();
                        for (h, b) in hs.iter().zip(db.chunks(4)) {
                            pattern::verify_chunk(&fresh, rank, h, b, 0, 0xc3)
                                .unwrap_or_else(|e| panic!("rank {rank} round {round}: {e}"));
                        }
                    }
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    });
    let mut c = s.client();
    let st = c.stats().unwrap();
    assert_eq!(st.stored_chunks, 2 * 8 * u64::from(ROUNDS), "{st:?}");
    assert_eq!(st.leases, 0);
}
