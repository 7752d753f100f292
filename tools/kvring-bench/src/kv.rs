//! The KV data path on the host backend, in one run:
//!
//! * `store_gbps` / `retrieve_gbps`: a STORE (RETRIEVE) job of many 32 MiB
//!   chunks (Llama-3-8B geometry: 32 layers, 8 KV heads, head dim 128,
//!   2-byte elements, 16-token blocks, 256-token chunks) from (into) random
//!   blocks of an engine's host cache laid out as `--layout` (default
//!   `lbnhc`, vLLM's default), client-observed from submit to done;
//! * `memcpy_gbps`: the same number of bytes copied by plain memcpy between
//!   two warm buffers with the same number of threads: the ceiling;
//! * `lookup_us`: client-observed time from submitting a LOOKUP of a
//!   128-chunk prompt whose prefix is stored to reading its answer.
//!
//! `--memory process` registers the same cache by its address in this
//! process (memory kind `process_vm`, as vLLM's CPU cache is registered):
//! the server then copies by cross-memory attach instead of through its
//! mapping of the memfd, and the ratios to memcpy compare the two.

use crate::peers::{cpus, kvring_client, kvring_server_with, pin, stop_server};
use crate::stats::Summary;
use kvring::client::Memory;
use kvring::jobs::JobStatus;
use kvring::kv::{
    chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::wait::WaitPolicy;
use kvring::{HostKvCache, Job, KvSpec, Lookup, Retrieve, Store};
use serde_json::json;
use std::time::{Duration, Instant};

const CHUNK: u32 = 256;
const CHUNKS: u32 = 24;

/// Llama-3-8B's per-rank KV geometry: 32 layers, 8 KV heads of 128, bf16,
/// 16-token blocks (a block of one layer: 64 KiB; of all layers: 2 MiB).
pub fn llama_geometry(num_blocks: u32) -> KvGeometry {
    let shape = KvShape {
        layers: 32,
        blocks: num_blocks,
        block_tokens: 16,
        heads: 8,
        head_dim: 128,
    };
    KvGeometry::mha(shape, Dtype::Bf16)
}

/// The model a layout is measured with: Llama-3-8B, except for `mla`, which
/// holds one latent per token and no V: DeepSeek-V3's (61 layers, a
/// 576-wide bf16 latent, 64-token blocks).
pub fn bench_geometry(preset: LayoutPreset, num_blocks: u32) -> (&'static str, KvGeometry) {
    if preset == LayoutPreset::Mla {
        (
            "deepseek-v3",
            KvGeometry::mla(61, num_blocks, 64, 576, Dtype::Bf16),
        )
    } else {
        ("llama-3-8b", llama_geometry(num_blocks))
    }
}

/// The bench model's cache of `num_blocks` blocks laid out as `preset`.
pub fn bench_layout(preset: LayoutPreset, num_blocks: u32) -> KvLayout {
    let (_, g) = bench_geometry(preset, num_blocks);
    KvLayout::preset(preset, g).unwrap_or_else(|e| panic!("layout {}: {e}", preset.name()))
}

/// The preset named `name`, or exit with the list of names.
pub fn parse_layout(name: &str) -> LayoutPreset {
    LayoutPreset::from_name(name).unwrap_or_else(|| {
        let names: Vec<&str> = LayoutPreset::ALL.iter().map(|p| p.name()).collect();
        eprintln!("unknown layout {name:?}; one of: {}", names.join(", "));
        std::process::exit(2);
    })
}

/// What the JSON says about the geometry and layout measured.
pub fn geometry_json(layout: &KvLayout, chunk_tokens: u32) -> serde_json::Value {
    let g = layout.geometry();
    let preset = layout.preset_name().and_then(LayoutPreset::from_name);
    json!({
        "model": preset.map(|p| bench_geometry(p, 0).0),
        "layers": g.layers, "kv_heads": g.heads, "head_dim": g.k_dim, "v_dim": g.v_dim,
        "elem_bytes": g.elem_bytes, "block_tokens": g.block_tokens,
        "chunk_tokens": chunk_tokens, "chunk_bytes": layout.object_bytes(chunk_tokens),
        "allocations": layout.allocations().len(),
        "run_bytes": layout.plan().run_bytes(),
        "runs_per_page": layout.plan().runs_per_page(),
    })
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

pub fn run(
    json_out: bool,
    passes: usize,
    lookups: usize,
    copy_threads: Option<u32>,
    preset: LayoutPreset,
    process_memory: bool,
) {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let threads = copy_threads.unwrap_or((ncpu - 1).clamp(1, kvring::job_words::WORD_WORKERS));
    // Twice the blocks a job moves: disjoint sources and destinations.
    let bpc = bench_geometry(preset, 0).1.blocks_per_chunk(CHUNK);
    let l = bench_layout(preset, CHUNKS * bpc * 2);
    let obj = l.object_bytes(CHUNK);
    let pool_mib = ((u64::from(CHUNKS) * obj) >> 20) + 256;
    eprintln!(
        "layout {} ({} allocation(s), {}-byte runs): {CHUNKS} chunks of {:.1} MiB per job, {threads} copy threads, pool {pool_mib} MiB, {passes} passes",
        preset.name(),
        l.allocations().len(),
        l.plan().run_bytes(),
        obj as f64 / f64::from(1 << 20)
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
    let cache = HostKvCache::new(l.clone(), CHUNK).unwrap();
    let spec = KvSpec::new(bench_model(preset), 1, 0);
    let inst = if process_memory {
        // The memfd's mapping in this process, by address.
        let addrs = (0..l.allocations().len() as u32).map(|a| cache.at(a, 0, 1) as u64);
        c.register(&spec, &l, &Memory::process(addrs), &[])
    } else {
        c.register_host(&spec, &cache)
    }
    .unwrap();
    let tokens: Vec<u32> = (0..CHUNKS * CHUNK).map(|i| i.wrapping_mul(7919)).collect();
    let hashes = chunk_hashes(&tokens, CHUNK);
    let bpc = inst.blocks_per_chunk() as usize;
    // Random, disjoint block sets: stores read `src`, retrieves write `dst`.
    let perm = shuffled(l.geometry().blocks, 1);
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
        let lease = c
            .lookup(Lookup::new(bench_model(preset), 1, &hashes))
            .unwrap();
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
    let mut checked = 0;
    for (h, b) in hashes.iter().zip(dst.chunks(bpc)) {
        checked += pattern::verify_chunk(&cache, 0, h, b, 0, 0).expect("retrieved bytes differ");
    }
    assert_eq!(checked, bytes);
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
    let small = KvLayout::preset(
        LayoutPreset::Lbnhc,
        KvGeometry::mha(
            KvShape {
                layers: 1,
                blocks: 128 * 16,
                block_tokens: 16,
                heads: 1,
                head_dim: 8,
            },
            Dtype::Bf16,
        ),
    )
    .expect("small layout");
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
        "memory": if process_memory { "process_vm" } else { "memfd" },
        "layout": preset.name(),
        "geometry": geometry_json(&l, CHUNK),
        "chunks_per_job": CHUNKS,
        "copy_threads": threads,
        "passes": passes,
        "store_gbps": store_gbps,
        "retrieve_gbps": retrieve_gbps,
        "memcpy_gbps": memcpy,
        "retrieved_bytes_checked": checked,
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

/// The model id of the bench model measured with `preset`.
pub fn bench_model(preset: LayoutPreset) -> u64 {
    model_id(&format!("bench-{}", bench_geometry(preset, 0).0))
}
