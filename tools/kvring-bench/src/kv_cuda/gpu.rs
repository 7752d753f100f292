//! The CUDA measurement itself (see the parent module).

use crate::kv::{llama_layout, shuffled};
use crate::peers::{kvring_client, kvring_server_with, stop_server};
use kvring::client::cuda_cache::{CudaKvCache, Export};
use kvring::gpu::{Context, DeviceBuffer, HostRegistration, Stream};
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern};
use kvring::wait::WaitPolicy;
use kvring::{KvSpec, LeaseId, Lookup, Retrieve, Store};
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

/// Pinned host memory (mmap + cuMemHostRegister), unregistered and
/// unmapped on drop.
struct Pinned {
    p: *mut u8,
    n: usize,
    reg: Option<HostRegistration>,
}

impl Pinned {
    fn new(ctx: &std::sync::Arc<Context>, n: usize) -> Pinned {
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
        // SAFETY: the mapping above, unmapped in `Drop` only after the
        // registration is dropped.
        let reg = unsafe { HostRegistration::new(ctx, p as *mut u8, n) }.unwrap();
        Pinned {
            p: p as *mut u8,
            n,
            reg: Some(reg),
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        drop(self.reg.take());
        // SAFETY: unmaps what `new` mapped, after unregistering it.
        unsafe { libc::munmap(self.p as *mut c_void, self.n) };
    }
}

/// GB/s of `f` (which queues on `stream`), timed with host clock around a
/// synchronize; median of `reps`.
fn timed(stream: &Stream, bytes: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut v = Vec::new();
    for i in 0..=reps {
        stream.synchronize().unwrap();
        let t = Instant::now();
        f();
        stream.synchronize().unwrap();
        if i > 0 {
            v.push(bytes as f64 / t.elapsed().as_nanos() as f64);
        }
    }
    median(v)
}

/// One pinned-memcpy direction on every device at once: per device the
/// median GB/s, and the median aggregate (all bytes over the slowest).
fn concurrent_ceiling(ndev: usize, bytes: usize, reps: usize, d2h: bool) -> (Vec<f64>, f64) {
    let start = std::sync::Barrier::new(ndev);
    let end = std::sync::Barrier::new(ndev);
    let times: Vec<Vec<f64>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..ndev)
            .map(|ord| {
                let (start, end) = (&start, &end);
                sc.spawn(move || {
                    let ctx = Context::by_ordinal(ord as i32).unwrap();
                    let stream = Stream::new(&ctx).unwrap();
                    let dev = DeviceBuffer::new(&ctx, bytes).unwrap();
                    let host = Pinned::new(&ctx, bytes);
                    let mut secs = Vec::new();
                    for i in 0..=reps {
                        start.wait();
                        let t = Instant::now();
                        if d2h {
                            // SAFETY: both buffers hold `bytes` bytes and
                            // outlive the synchronize below.
                            unsafe { stream.copy_dtoh_async(host.p, dev.ptr(), bytes) }.unwrap();
                        } else {
                            // SAFETY: the device buffer and the pinned host
                            // buffer hold `bytes` bytes each and outlive the
                            // synchronize below.
                            unsafe { stream.copy_htod_async(dev.ptr(), host.p, bytes) }.unwrap();
                        }
                        stream.synchronize().unwrap();
                        let el = t.elapsed().as_secs_f64();
                        end.wait();
                        if i > 0 {
                            secs.push(el);
                        }
                    }
                    drop(stream);
                    drop(host);
                    secs
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let per: Vec<f64> = times
        .iter()
        .map(|t| median(t.iter().map(|s| bytes as f64 / s / 1e9).collect()))
        .collect();
    let agg = median(
        (0..reps)
            .map(|r| {
                let slowest = times.iter().map(|t| t[r]).fold(0f64, f64::max);
                (ndev * bytes) as f64 / slowest / 1e9
            })
            .collect(),
    );
    (per, agg)
}

pub fn run(json_out: bool, passes: usize, copy_threads: Option<u32>, devices: Option<usize>) {
    let devs = match kvring::gpu::probe() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no usable GPU: {e}");
            std::process::exit(1);
        }
    };
    let ndev = devices.unwrap_or(devs.len());
    if ndev == 0 || ndev > devs.len() {
        eprintln!("--devices {ndev}: this machine has {} GPUs", devs.len());
        std::process::exit(2);
    }
    // Four workers per GPU, each with the backend's chunks in flight, keep
    // the copy engines fed; more streams only add contention for them.
    let threads = copy_threads.unwrap_or(4);
    // 1024 source and 1024 destination blocks, disjoint, random.
    let l = llama_layout(2 * BLOCKS);
    let obj = l.object_bytes(CHUNK);
    let chunks = BLOCKS / 16;
    let bytes = u64::from(chunks) * obj;
    let pool_mib = (bytes >> 20) + 1024;
    let pool_mib = pool_mib + (ndev as u64 - 1) * (bytes >> 20);
    eprintln!(
        "{ndev} x {}: {chunks} chunks of {} MiB per job and GPU ({} GiB), {threads} copy threads per GPU, pool {pool_mib} MiB",
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
    // One engine cache (one TP rank) per GPU.
    let caches: Vec<CudaKvCache> = (0..ndev)
        .map(|ord| CudaKvCache::new(l, CHUNK, ord as i32, Export::Ipc).unwrap())
        .collect();
    // The default staged path, then the zero-copy kernels (32 CTAs).
    let staged = measure(&caches, &hashes, &src, &dst, threads, pool_mib, passes, 0);
    let zc = measure(
        &caches,
        &hashes,
        &src,
        &dst,
        threads,
        pool_mib,
        passes,
        ZERO_COPY_CTAS,
    );
    let reps = passes.max(3);
    // The ceiling: pinned memcpy on every GPU at once.
    let (d2h_per, d2h_all) = concurrent_ceiling(ndev, bytes as usize, reps, true);
    let (h2d_per, h2d_all) = concurrent_ceiling(ndev, bytes as usize, reps, false);
    // Single-GPU ceilings and the per-block baseline, on GPU 0.
    let ctx = Context::by_ordinal(0).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let dev = DeviceBuffer::new(&ctx, bytes as usize).unwrap();
    let host = Pinned::new(&ctx, bytes as usize);
    let d2h = timed(&stream, bytes as usize, reps, || {
        // SAFETY: the device buffer and the pinned host buffer hold `bytes`
        // bytes and outlive the stream's work (`timed` synchronizes).
        unsafe { stream.copy_dtoh_async(host.p, dev.ptr(), bytes as usize) }.unwrap();
    });
    let h2d = timed(&stream, bytes as usize, reps, || {
        // SAFETY: as for `d2h`, the other way.
        unsafe { stream.copy_htod_async(dev.ptr(), host.p, bytes as usize) }.unwrap();
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
    let base = caches[0].device_base();
    let per_block = timed(&stream, pieces.len() * slab, reps, || {
        for (i, off) in pieces.iter().enumerate() {
            // SAFETY: each piece is a slab of the cache; the host range is
            // inside the pinned buffer (`pieces.len() * slab` <= `bytes`).
            unsafe { stream.copy_dtoh_async(host.p.add(i * slab), base + off, slab) }.unwrap();
        }
    });
    let pinned = d2h.min(h2d);
    let (store_gbps, retrieve_gbps) = (staged.store_all, staged.retrieve_all);
    eprintln!(
        "{ndev} GPU(s): store {store_gbps:.2} GB/s, retrieve {retrieve_gbps:.2} GB/s; pinned memcpy on all at once D2H {d2h_all:.2}, H2D {h2d_all:.2}; GPU 0 alone D2H {d2h:.2}, H2D {h2d:.2}; per-block memcpy {per_block:.2} GB/s"
    );
    let per_device: Vec<serde_json::Value> = (0..ndev)
        .map(|i| {
            json!({
                "ordinal": i,
                "name": devs[i].name,
                "store_gbps": staged.store[i],
                "retrieve_gbps": staged.retrieve[i],
                "pinned_memcpy_gbps": { "d2h": d2h_per[i], "h2d": h2d_per[i] },
                "store_over_pinned_d2h": staged.store[i] / d2h_per[i],
                "retrieve_over_pinned_h2d": staged.retrieve[i] / h2d_per[i],
            })
        })
        .collect();
    let out = json!({
        "bench": "kv",
        "backend": "cuda",
        "device": devs[0].name,
        "devices": ndev,
        "per_device": per_device,
        "aggregate": {
            "store_gbps": store_gbps,
            "retrieve_gbps": retrieve_gbps,
            "pinned_memcpy_gbps": { "d2h": d2h_all, "h2d": h2d_all },
            "store_over_pinned_d2h": store_gbps / d2h_all,
            "retrieve_over_pinned_h2d": retrieve_gbps / h2d_all,
        },
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
        "zero_copy": { "ctas": ZERO_COPY_CTAS, "store_gbps": zc.store_all, "retrieve_gbps": zc.retrieve_all },
        "ratios": {
            "store_over_pinned_d2h": store_gbps / d2h_all,
            "retrieve_over_pinned_h2d": retrieve_gbps / h2d_all,
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
    drop(stream);
    drop(dev);
}

/// Medians of one server configuration: per GPU and aggregate.
struct Rates {
    store: Vec<f64>,
    retrieve: Vec<f64>,
    store_all: f64,
    retrieve_all: f64,
}

/// One server configuration: every rank (GPU) stores at the same moment,
/// the scheduler looks the prompt up once, every rank retrieves with that
/// lease at the same moment; every retrieved byte checked after the last
/// pass.
#[allow(clippy::too_many_arguments)]
fn measure(
    caches: &[CudaKvCache],
    hashes: &[kvring::kv::ChunkHash],
    src: &[u32],
    dst: &[u32],
    threads: u32,
    pool_mib: u64,
    passes: usize,
    zero_copy_ctas: u32,
) -> Rates {
    let ndev = caches.len();
    let world = ndev as u32;
    let l = *caches[0].layout();
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
    let model = model_id("bench-llama-3-8b");
    let far = || Instant::now() + Duration::from_secs(120);
    let mut sched = kvring_client(&name);
    let sync = std::sync::Barrier::new(ndev + 1);
    let lease_slot = std::sync::Mutex::new(None);
    let path = if zero_copy_ctas == 0 {
        "staged"
    } else {
        "zero-copy"
    };
    // Per rank: (store secs, retrieve secs) of each timed pass.
    let times: Vec<Vec<(f64, f64)>> = std::thread::scope(|sc| {
        let ranks: Vec<_> = caches
            .iter()
            .enumerate()
            .map(|(rank, cache)| {
                let (sync, lease_slot, name) = (&sync, &lease_slot, &name);
                sc.spawn(move || {
                    let mut c = kvring_client(name);
                    let inst = c
                        .register_cuda(&KvSpec::new(model, world, rank as u32), cache)
                        .unwrap();
                    let bpc = inst.blocks_per_chunk() as usize;
                    let mut out = Vec::new();
                    for pass in 0..=passes {
                        cache.fill(0x11).unwrap();
                        for (h, b) in hashes.iter().zip(src.chunks(bpc)) {
                            pattern::write_chunk(cache, rank as u32, h, b);
                        }
                        sync.wait(); // the pool is clear, everyone ready
                        let t = Instant::now();
                        let job = c.store(Store::new(&inst, hashes, src)).unwrap();
                        let r = job.wait(far()).unwrap();
                        let st = t.elapsed().as_secs_f64();
                        assert!(
                            matches!(r, JobStatus::Done(r) if r.value == hashes.len() as u64 && r.aux == 0),
                            "{r:?}"
                        );
                        c.release_job(job).unwrap();
                        sync.wait(); // every rank stored
                        sync.wait(); // the scheduler's lease is there
                        let lease: LeaseId = lease_slot.lock().unwrap().expect("lease");
                        let t = Instant::now();
                        let job = c.retrieve(Retrieve::new(&inst, lease, dst)).unwrap();
                        let r = job.wait(far()).unwrap();
                        let rt = t.elapsed().as_secs_f64();
                        assert!(matches!(r, JobStatus::Done(r) if r.aux == bytes), "{r:?}");
                        c.release_job(job).unwrap();
                        sync.wait(); // every rank retrieved
                        eprintln!(
                            "{path} pass {pass} GPU {rank}: store {:.2} GB/s, retrieve {:.2} GB/s",
                            bytes as f64 / st / 1e9,
                            bytes as f64 / rt / 1e9
                        );
                        if pass > 0 {
                            out.push((st, rt));
                        }
                    }
                    for (h, b) in hashes.iter().zip(dst.chunks(bpc)) {
                        pattern::verify_chunk(cache, rank as u32, h, b, 0, 0x11)
                            .expect("retrieved bytes differ");
                    }
                    out
                })
            })
            .collect();
        for _ in 0..=passes {
            sched.clear().unwrap();
            sync.wait(); // ranks store
            sync.wait(); // stored
                         // The ranks' retrieves take the holds; the lookup job goes now.
            let lease = sched.lookup(Lookup::new(model, world, hashes)).unwrap();
            assert_eq!(lease.hits(), hashes.len() as u64, "{lease:?}");
            let lease = lease.into_id();
            sched.release_job(lease.job()).unwrap();
            *lease_slot.lock().unwrap() = Some(lease);
            sync.wait(); // ranks retrieve
            sync.wait(); // retrieved
        }
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(sched);
    stop_server(child);
    let per = |f: fn(&(f64, f64)) -> f64| -> Vec<f64> {
        times
            .iter()
            .map(|t| median(t.iter().map(|x| bytes as f64 / f(x) / 1e9).collect()))
            .collect()
    };
    let all = |f: fn(&(f64, f64)) -> f64| -> f64 {
        median(
            (0..passes)
                .map(|p| {
                    let slowest = times.iter().map(|t| f(&t[p])).fold(0f64, f64::max);
                    (ndev as u64 * bytes) as f64 / slowest / 1e9
                })
                .collect(),
        )
    };
    Rates {
        store: per(|x| x.0),
        retrieve: per(|x| x.1),
        store_all: all(|x| x.0),
        retrieve_all: all(|x| x.1),
    }
}
