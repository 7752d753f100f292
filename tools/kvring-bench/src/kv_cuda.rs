//! The KV data path on the CUDA backend, in one run (Llama-3-8B geometry:
//! 32 layers, 8 KV heads, head dim 128, 2-byte elements, 16-token blocks,
//! 256-token chunks; 1024 random blocks = 64 chunks = 2 GiB per job):
//!
//! * `store_gbps` / `retrieve_gbps`: a STORE (RETRIEVE) job of the 1024
//!   blocks from (into) an engine's GPU cache, submit to done;
//! * `pinned_memcpy_gbps`: one 2 GiB cuMemcpy device -> pinned host and back
//!   (the PCIe ceiling);
//! * `per_block_memcpy_gbps`: one cuMemcpyAsync per 32 KiB layer/K|V/block
//!   piece into pinned memory, what vLLM's swap_blocks and a naive server do.

use crate::kv::{llama_layout, shuffled};
use crate::peers::{kvring_client, kvring_server_with, stop_server};
use kvring::cuda::engine_cache::{CudaKvCache, Export};
use kvring::cuda::{ck, sys, Context};
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern};
use kvring::wait::WaitPolicy;
use serde_json::json;
use std::ffi::c_void;
use std::time::{Duration, Instant};

const CHUNK: u32 = 256;
const BLOCKS: u32 = 1024;
const ZERO_COPY_CTAS: u32 = 32;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Pinned host memory (mmap + cuMemHostRegister), freed on drop.
struct Pinned {
    p: *mut u8,
    n: usize,
}

impl Pinned {
    fn new(n: usize) -> Pinned {
        // SAFETY: an anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping above.
        ck(
            unsafe { sys::cuMemHostRegister_v2(p, n, sys::CU_MEMHOSTREGISTER_PORTABLE) },
            "register",
        )
        .unwrap();
        Pinned { p: p as *mut u8, n }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: unregisters and unmaps what `new` made.
        unsafe {
            sys::cuMemHostUnregister(self.p as *mut c_void);
            libc::munmap(self.p as *mut c_void, self.n);
        }
    }
}

/// GB/s of `f` (which queues on `stream`), timed with host clock around a
/// synchronize; median of `reps`.
fn timed(stream: sys::CUstream, bytes: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut v = Vec::new();
    for i in 0..=reps {
        // SAFETY: a live stream.
        unsafe { ck(sys::cuStreamSynchronize(stream), "sync").unwrap() };
        let t = Instant::now();
        f();
        // SAFETY: as above.
        unsafe { ck(sys::cuStreamSynchronize(stream), "sync").unwrap() };
        if i > 0 {
            v.push(bytes as f64 / t.elapsed().as_nanos() as f64);
        }
    }
    median(v)
}

pub fn run(json_out: bool, passes: usize, copy_threads: Option<u32>) {
    let devs = match kvring::cuda::probe() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no usable GPU: {e}");
            std::process::exit(1);
        }
    };
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    // Four workers with four chunks in flight each keep the copy engines
    // fed; more streams only add contention for them.
    let _ = ncpu;
    let threads = copy_threads.unwrap_or(4);
    // 1024 source and 1024 destination blocks, disjoint, random.
    let l = llama_layout(2 * BLOCKS);
    let obj = l.object_bytes(CHUNK);
    let chunks = BLOCKS / 16;
    let bytes = u64::from(chunks) * obj;
    let pool_mib = (bytes >> 20) + 1024;
    eprintln!(
        "{}: {chunks} chunks of {} MiB per job ({} GiB), {threads} copy threads, pool {pool_mib} MiB",
        devs[0].name,
        obj >> 20,
        bytes >> 30
    );
    let tokens: Vec<u32> = (0..chunks * CHUNK)
        .map(|i| i.wrapping_mul(7919) ^ 3)
        .collect();
    let hashes = chunk_hashes(&tokens, CHUNK);
    let perm = shuffled(l.num_blocks, 7);
    let n = BLOCKS as usize;
    let (src, dst) = (perm[..n].to_vec(), perm[n..2 * n].to_vec());
    let cache = CudaKvCache::new(l, CHUNK, 0, Export::Ipc).unwrap();
    cache.fill(0x11).unwrap();
    let bpc = (CHUNK / l.block_tokens) as usize;
    for (h, b) in hashes.iter().zip(src.chunks(bpc)) {
        pattern::write_chunk(&cache, 0, h, b);
    }
    // The default staged path, then the zero-copy kernels (32 CTAs).
    let (store, retrieve) = measure(&cache, &hashes, &src, &dst, threads, pool_mib, passes, 0);
    let (zc_store, zc_retrieve) = measure(
        &cache,
        &hashes,
        &src,
        &dst,
        threads,
        pool_mib,
        passes,
        ZERO_COPY_CTAS,
    );
    // Ceilings, in this process, on the same device.
    let ctx = Context::by_ordinal(0).unwrap();
    ctx.bind().unwrap();
    let mut stream = std::ptr::null_mut();
    let mut dev = 0;
    // SAFETY: valid out-pointers.
    unsafe {
        ck(sys::cuStreamCreate(&mut stream, 1), "stream").unwrap();
        ck(sys::cuMemAlloc_v2(&mut dev, bytes as usize), "alloc").unwrap();
    }
    let host = Pinned::new(bytes as usize);
    let reps = passes.max(3);
    // SAFETY (both closures): the device buffer and the pinned host buffer
    // hold `bytes` bytes.
    let d2h = timed(stream, bytes as usize, reps, || unsafe {
        ck(
            sys::cuMemcpyDtoHAsync_v2(host.p as *mut c_void, dev, bytes as usize, stream),
            "d2h",
        )
        .unwrap();
    });
    let h2d = timed(stream, bytes as usize, reps, || unsafe {
        ck(
            sys::cuMemcpyHtoDAsync_v2(dev, host.p as *const c_void, bytes as usize, stream),
            "h2d",
        )
        .unwrap();
    });
    // One cuMemcpyAsync per 32 KiB piece of the cache's random blocks.
    let slab = l.slab_bytes() as usize;
    let pieces: Vec<u64> = src
        .iter()
        .flat_map(|&b| {
            (0..l.num_layers).flat_map(move |layer| {
                (0..2).map(move |part| {
                    let (t, off) = l.slab_at(layer, part, b);
                    (u64::from(t), off)
                })
            })
        })
        .map(|(t, off)| t * l.tensor_bytes().div_ceil(1 << 16) * (1 << 16) + off)
        .collect();
    let base = cache.device_base();
    let per_block = timed(stream, pieces.len() * slab, reps, || {
        for (i, off) in pieces.iter().enumerate() {
            // SAFETY: each piece is a slab of the cache; the host range is
            // inside the pinned buffer.
            unsafe {
                ck(
                    sys::cuMemcpyDtoHAsync_v2(
                        host.p.add(i * slab) as *mut c_void,
                        base + off,
                        slab,
                        stream,
                    ),
                    "piece",
                )
                .unwrap();
            }
        }
    });
    let pinned = d2h.min(h2d);
    let (store_gbps, retrieve_gbps) = (store, retrieve);
    eprintln!(
        "store {store_gbps:.2} GB/s, retrieve {retrieve_gbps:.2} GB/s; pinned memcpy D2H {d2h:.2}, H2D {h2d:.2}; per-block memcpy {per_block:.2} GB/s"
    );
    let out = json!({
        "bench": "kv",
        "backend": "cuda",
        "device": devs[0].name,
        "geometry": {
            "layers": 32, "kv_heads": 8, "head_dim": 128, "elem_bytes": 2,
            "block_tokens": 16, "chunk_tokens": CHUNK, "chunk_bytes": obj, "blocks": BLOCKS,
        },
        "copy_threads": threads,
        "passes": passes,
        "store_gbps": store_gbps,
        "retrieve_gbps": retrieve_gbps,
        "pinned_memcpy_gbps": { "d2h": d2h, "h2d": h2d },
        "per_block_memcpy_gbps": per_block,
        "zero_copy": { "ctas": ZERO_COPY_CTAS, "store_gbps": zc_store, "retrieve_gbps": zc_retrieve },
        "ratios": {
            "store_over_pinned_d2h": store_gbps / d2h,
            "retrieve_over_pinned_h2d": retrieve_gbps / h2d,
            "store_over_per_block": store_gbps / per_block,
            "retrieve_over_per_block": retrieve_gbps / per_block,
            "pinned_min": pinned,
        },
    });
    if json_out {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
    // SAFETY: frees the device buffer and stream made above.
    unsafe {
        sys::cuMemFree_v2(dev);
        sys::cuStreamDestroy_v2(stream);
    }
}

/// Median store and retrieve GB/s of one server configuration; every
/// retrieved byte checked after the last pass.
#[allow(clippy::too_many_arguments)]
fn measure(
    cache: &CudaKvCache,
    hashes: &[kvring::kv::ChunkHash],
    src: &[u32],
    dst: &[u32],
    threads: u32,
    pool_mib: u64,
    passes: usize,
    zero_copy_ctas: u32,
) -> (f64, f64) {
    let l = *cache.layout();
    let bytes = hashes.len() as u64 * l.object_bytes(CHUNK);
    let extra: Vec<String> = vec![
        "--pool-mib".into(),
        pool_mib.to_string(),
        "--copy-threads".into(),
        threads.to_string(),
        "--prefault".into(),
        "--backend".into(),
        "cuda".into(),
        "--cuda-zero-copy-ctas".into(),
        zero_copy_ctas.to_string(),
    ];
    let (child, name) = kvring_server_with("kvcuda", WaitPolicy::default(), &extra, false);
    let mut c = kvring_client(&name);
    let inst = c
        .register_cuda_cache(model_id("bench-llama-3-8b"), 1, 0, cache)
        .unwrap();
    let bpc = inst.blocks_per_chunk() as usize;
    let far = || Instant::now() + Duration::from_secs(120);
    let (mut store, mut retrieve) = (Vec::new(), Vec::new());
    for pass in 0..=passes {
        c.clear().unwrap();
        cache.fill(0x11).unwrap();
        for (h, b) in hashes.iter().zip(src.chunks(bpc)) {
            pattern::write_chunk(cache, 0, h, b);
        }
        let t = Instant::now();
        let id = c.store(&inst, 0, hashes, src).unwrap();
        let r = c.wait_job(id, far()).unwrap();
        let st = t.elapsed();
        assert!(
            matches!(r, JobStatus::Done(r) if r.value == hashes.len() as u64 && r.aux == 0),
            "{r:?}"
        );
        c.release_job(id).unwrap();
        let lease = c
            .lookup(model_id("bench-llama-3-8b"), 1, 0, hashes)
            .unwrap();
        c.wait_job(lease, far()).unwrap();
        c.release_job(lease).unwrap();
        let t = Instant::now();
        let id = c.retrieve(&inst, lease, 0, dst, 0).unwrap();
        let r = c.wait_job(id, far()).unwrap();
        let rt = t.elapsed();
        assert!(matches!(r, JobStatus::Done(r) if r.aux == bytes), "{r:?}");
        c.release_job(id).unwrap();
        eprintln!(
            "{} pass {pass}: store {:.2} GB/s, retrieve {:.2} GB/s",
            if zero_copy_ctas == 0 {
                "staged"
            } else {
                "zero-copy"
            },
            bytes as f64 / st.as_nanos() as f64,
            bytes as f64 / rt.as_nanos() as f64
        );
        if pass > 0 {
            store.push(bytes as f64 / st.as_nanos() as f64);
            retrieve.push(bytes as f64 / rt.as_nanos() as f64);
        }
    }
    for (h, b) in hashes.iter().zip(dst.chunks(bpc)) {
        pattern::verify_chunk(cache, 0, h, b, 0, 0x11).expect("retrieved bytes differ");
    }
    drop(c);
    stop_server(child);
    (median(store), median(retrieve))
}
