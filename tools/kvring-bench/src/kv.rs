//! The KV data path on the host backend, in one run:
//!
//! * `store_gbps` / `retrieve_gbps`: a STORE (RETRIEVE) job of many 32 MiB
//!   chunks (Llama-3-8B geometry: 32 layers, 8 KV heads, head dim 128,
//!   2-byte elements, 16-token blocks, 256-token chunks) from (into) random
//!   blocks of an engine's host cache, client-observed from submit to done;
//! * `memcpy_gbps`: the same number of bytes copied by plain memcpy between
//!   two warm buffers with the same number of threads: the ceiling;
//! * `lookup_us`: client-observed time from submitting a LOOKUP of a
//!   128-chunk prompt whose prefix is stored to reading its answer.

use crate::peers::{cpus, kvring_client, kvring_server_with, pin, stop_server};
use crate::stats::Summary;
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern, Dtype, KvLayout, KvLayoutKind, KvShape};
use kvring::wait::WaitPolicy;
use kvring::{HostKvCache, Job, KvSpec, Lookup, Retrieve, Store};
use serde_json::json;
use std::time::{Duration, Instant};

const CHUNK: u32 = 256;
const CHUNKS: u32 = 24;

/// Llama-3-8B's per-rank KV geometry (flash-attention layout).
pub fn llama_layout(num_blocks: u32) -> KvLayout {
    let shape = KvShape {
        layers: 32,
        blocks: num_blocks,
        block_tokens: 16,
        heads: 8,
        head_dim: 128,
    };
    KvLayout::new(KvLayoutKind::FlashAttn, shape, Dtype::Bf16)
}

/// Waits for a job that must end `Done`; it is released when the handle
/// drops here.
fn done(job: Job) -> kvring::jobs::JobResult {
    match job.wait(Instant::now() + Duration::from_secs(120)).unwrap() {
        JobStatus::Done(r) => r,
        other => panic!("{}: {other:?}", job.id()),
    }
}

/// A random permutation of `0..n` (xorshift; fixed seed).
pub fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..v.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

/// GB/s of `threads` threads each memcpy-ing its share of `bytes` between
/// two warm buffers, `reps` times; the median pass.
fn memcpy_gbps(bytes: usize, threads: usize, reps: usize) -> f64 {
    let per = bytes / threads;
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|i| (vec![i as u8 + 1; per], vec![0u8; per]))
        .collect();
    let mut rates = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
        rates.push((per * threads) as f64 / t.elapsed().as_nanos() as f64);
    }
    rates.remove(0); // warm-up
    rates.sort_by(f64::total_cmp);
    std::hint::black_box(&bufs);
    rates[rates.len() / 2]
}

pub fn run(json_out: bool, passes: usize, lookups: usize, copy_threads: Option<u32>) {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let threads = copy_threads.unwrap_or((ncpu - 1).max(1));
    let l = llama_layout(CHUNKS * 16 * 2);
    let obj = l.object_bytes(CHUNK);
    let pool_mib = ((u64::from(CHUNKS) * obj) >> 20) + 256;
    eprintln!(
        "{CHUNKS} chunks of {} MiB per job, {threads} copy threads, pool {pool_mib} MiB, {passes} passes",
        obj >> 20
    );
    let extra: Vec<String> = [
        "--pool-mib".to_string(),
        pool_mib.to_string(),
        "--copy-threads".into(),
        threads.to_string(),
        "--prefault".into(),
    ]
    .into();
    // With one copy thread the server shares one CPU with nothing else; with
    // more, it may use every CPU.
    let (child, name) = kvring_server_with("kv", WaitPolicy::default(), &extra, threads == 1);
    if threads == 1 {
        pin(cpus().0);
    }
    let mut c = kvring_client(&name);
    let cache = HostKvCache::new(l, CHUNK).unwrap();
    let inst = c
        .register_host(&KvSpec::new(inst_model(), 1, 0), &cache)
        .unwrap();
    let tokens: Vec<u32> = (0..CHUNKS * CHUNK).map(|i| i.wrapping_mul(7919)).collect();
    let hashes = chunk_hashes(&tokens, CHUNK);
    let bpc = inst.blocks_per_chunk() as usize;
    // Random, disjoint block sets: stores read `src`, retrieves write `dst`.
    let perm = shuffled(l.num_blocks, 1);
    let n = CHUNKS as usize * bpc;
    let (src, dst) = (perm[..n].to_vec(), perm[n..2 * n].to_vec());
    for (h, b) in hashes.iter().zip(src.chunks(bpc)) {
        pattern::write_chunk(&cache, 0, h, b);
    }
    let bytes = u64::from(CHUNKS) * obj;

    // Store, then retrieve, `passes` times (+1 warm-up); CLEAR in between so
    // every store copies.
    let (mut store, mut retrieve) = (Vec::new(), Vec::new());
    for pass in 0..=passes {
        c.clear().unwrap();
        let t = Instant::now();
        let job = c.store(Store::new(&inst, &hashes, &src)).unwrap();
        let r = job.wait(Instant::now() + Duration::from_secs(120)).unwrap();
        let st = t.elapsed();
        assert!(
            matches!(r, JobStatus::Done(r) if r.value == u64::from(CHUNKS) && r.aux == 0),
            "{r:?}"
        );
        c.release_job(job).unwrap();
        // The retrieve takes the lease's holds; its lookup job goes now.
        let lease = c.lookup(Lookup::new(inst_model(), 1, &hashes)).unwrap();
        assert_eq!(lease.hits(), u64::from(CHUNKS));
        let lease = lease.into_id();
        c.release_job(lease.job()).unwrap();
        let t = Instant::now();
        let job = c.retrieve(Retrieve::new(&inst, lease, &dst)).unwrap();
        let r = job.wait(Instant::now() + Duration::from_secs(120)).unwrap();
        let rt = t.elapsed();
        assert!(matches!(r, JobStatus::Done(r) if r.aux == bytes), "{r:?}");
        c.release_job(job).unwrap();
        if pass > 0 {
            store.push(bytes as f64 / st.as_nanos() as f64);
            retrieve.push(bytes as f64 / rt.as_nanos() as f64);
        }
    }
    // Every retrieved byte is what was stored.
    for (h, b) in hashes.iter().zip(dst.chunks(bpc)) {
        pattern::verify_chunk(&cache, 0, h, b, 0, 0).expect("retrieved bytes differ");
    }
    let memcpy = memcpy_gbps(bytes as usize, threads as usize, passes);
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (store_gbps, retrieve_gbps) = (med(&mut store), med(&mut retrieve));
    eprintln!(
        "store {store_gbps:.2} GB/s, retrieve {retrieve_gbps:.2} GB/s, memcpy {memcpy:.2} GB/s ({threads} threads)"
    );

    // Lookup latency: a 128-chunk prompt of a small model, stored.
    let small = KvLayout::new(
        KvLayoutKind::FlashAttn,
        KvShape {
            layers: 1,
            heads: 1,
            head_dim: 8,
            blocks: 128 * 16,
            ..llama_layout(0).shape()
        },
        Dtype::Bf16,
    );
    let scache = HostKvCache::new(small, CHUNK).unwrap();
    let sinst = c
        .register_host(&KvSpec::new(model_id("bench-small"), 1, 0), &scache)
        .unwrap();
    let stokens: Vec<u32> = (0..128 * CHUNK).map(|i| i ^ 0x5555).collect();
    let shashes = chunk_hashes(&stokens, CHUNK);
    let sblocks: Vec<u32> = (0..128 * 16).collect();
    done(c.store(Store::new(&sinst, &shashes, &sblocks)).unwrap());
    // (kvring_client waits with WaitPolicy::SPIN.)
    let mut lat = Vec::with_capacity(lookups);
    for i in 0..lookups + lookups / 10 {
        let t = Instant::now();
        let lease = c
            .lookup(Lookup::new(model_id("bench-small"), 1, &shashes))
            .unwrap();
        let e = t.elapsed();
        assert_eq!(lease.hits(), 128, "{lease:?}");
        c.end_lease(lease).unwrap();
        if i >= lookups / 10 {
            lat.push(e.as_nanos() as u64);
        }
    }
    let lookup = Summary::of(lat);
    eprintln!(
        "lookup of 128 chunks: p50 {:.1} us, p99 {:.1} us",
        lookup.p50 as f64 / 1e3,
        lookup.p99 as f64 / 1e3
    );
    drop(c);
    stop_server(child);

    let out = json!({
        "bench": "kv",
        "backend": "host",
        "geometry": {
            "layers": 32, "kv_heads": 8, "head_dim": 128, "elem_bytes": 2,
            "block_tokens": 16, "chunk_tokens": CHUNK, "chunk_bytes": obj,
        },
        "chunks_per_job": CHUNKS,
        "copy_threads": threads,
        "passes": passes,
        "store_gbps": store_gbps,
        "retrieve_gbps": retrieve_gbps,
        "memcpy_gbps": memcpy,
        "ratios": {
            "store_over_memcpy": store_gbps / memcpy,
            "retrieve_over_memcpy": retrieve_gbps / memcpy,
        },
        "lookup_us": {
            "p50": lookup.p50 as f64 / 1e3,
            "p99": lookup.p99 as f64 / 1e3,
            "samples": lookup.n,
            "chunks": 128,
        },
    });
    if json_out {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
}

fn inst_model() -> u64 {
    model_id("bench-llama-3-8b")
}
