//! The CUDA measurement itself (see the parent module).

use crate::kv::{bench_geometry, bench_layout, bench_model, geometry_json, shuffled};
use crate::peers::{kvring_client, kvring_server_with, stop_server};
use kvring::client::cuda_cache::{CudaKvCache, Export};
use kvring::gpu::{Context, DeviceBuffer, HostRegistration, Stream};
use kvring::jobs::JobStatus;
use kvring::kv::pattern::{self, KvMemory, Run};
use kvring::kv::{chunk_hashes, ChunkHash, KvLayout, LayoutPreset};
use kvring::wait::WaitPolicy;
use kvring::{KvSpec, LeaseId, Lookup, Retrieve, Store};
use serde_json::json;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

/// Tokens per job and GPU (Llama-3-8B: 1024 blocks, 2 GiB).
const JOB_TOKENS: u32 = 16_384;
/// Tokens per chunk (`--chunk-tokens`), set once at the start of `run`.
static CHUNK_TOKENS: OnceLock<u32> = OnceLock::new();

/// Tokens per chunk: the server's and the engine caches'.
fn chunk() -> u32 {
    *CHUNK_TOKENS
        .get()
        .unwrap_or(&kvring::kv::DEFAULT_CHUNK_TOKENS)
}

/// Chunks per job and GPU.
fn chunks() -> u32 {
    JOB_TOKENS / chunk()
}
const ZERO_COPY_CTAS: u32 = 32;
/// What the destination blocks hold until a retrieve writes them.
const POISON: u8 = 0x11;

/// A rate over many iterations: the median, and the 99th percentile of the
/// times as a rate (the slow tail; the slowest iteration below 51).
#[derive(Clone, Copy)]
struct Rate {
    median: f64,
    p99: f64,
}

impl Rate {
    /// Of rates (GB/s), one per iteration.
    fn of(mut v: Vec<f64>) -> Rate {
        v.sort_by(f64::total_cmp);
        Rate {
            median: v[v.len() / 2],
            p99: v[((v.len() - 1) as f64 * 0.01).round() as usize],
        }
    }

    /// Of `bytes` moved in each of `secs`.
    fn of_secs(bytes: u64, secs: impl IntoIterator<Item = f64>) -> Rate {
        Rate::of(secs.into_iter().map(|s| bytes as f64 / s / 1e9).collect())
    }
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

    /// The address, for closures that run on other threads.
    fn addr(&self) -> usize {
        self.p as usize
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
/// synchronize, `reps` times after a warm-up.
fn timed(stream: &Stream, bytes: usize, reps: usize, mut f: impl FnMut()) -> Rate {
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
    Rate::of(v)
}

/// Two sides run at the same moment, `reps` times after a warm-up: each
/// side's closure gets the iteration (0: the warm-up), prepares what it
/// needs, calls `go` (both sides leave it together) and does its timed
/// work. Per timed iteration: side A's seconds, side B's, and the seconds
/// from the first start to the last end.
fn together<A, B>(reps: usize, a: A, b: B) -> Vec<[f64; 3]>
where
    A: FnMut(usize, &dyn Fn()) + Send,
    B: FnMut(usize, &dyn Fn()) + Send,
{
    let (start, end) = (Barrier::new(2), Barrier::new(2));
    fn side(
        reps: usize,
        start: &Barrier,
        end: &Barrier,
        mut f: impl FnMut(usize, &dyn Fn()),
    ) -> Vec<(Instant, Instant)> {
        let mut out = Vec::new();
        for i in 0..=reps {
            let t0 = Cell::new(None);
            f(i, &|| {
                start.wait();
                t0.set(Some(Instant::now()));
            });
            let t1 = Instant::now();
            end.wait();
            out.push((t0.get().expect("the side called go"), t1));
        }
        out
    }
    let (ta, tb) = std::thread::scope(|sc| {
        let (s, e) = (&start, &end);
        let ha = sc.spawn(move || side(reps, s, e, a));
        let hb = sc.spawn(move || side(reps, s, e, b));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    ta.iter()
        .zip(&tb)
        .skip(1)
        .map(|(&(a0, a1), &(b0, b1))| {
            let wall = a1.max(b1) - a0.min(b0);
            [
                (a1 - a0).as_secs_f64(),
                (b1 - b0).as_secs_f64(),
                wall.as_secs_f64(),
            ]
        })
        .collect()
}

/// Two directions at the same moment, `bytes` each way: each direction's
/// rate, their sum (per iteration) and the total (both directions' bytes
/// over the time until both are done).
struct Both {
    d2h: Rate,
    h2d: Rate,
    sum: Rate,
    total: Rate,
}

impl Both {
    fn of(bytes: u64, t: &[[f64; 3]]) -> Both {
        let gbps = |s: f64| bytes as f64 / s / 1e9;
        Both {
            d2h: Rate::of(t.iter().map(|x| gbps(x[0])).collect()),
            h2d: Rate::of(t.iter().map(|x| gbps(x[1])).collect()),
            sum: Rate::of(t.iter().map(|x| gbps(x[0]) + gbps(x[1])).collect()),
            total: Rate::of(t.iter().map(|x| 2.0 * gbps(x[2])).collect()),
        }
    }

    fn to_json(&self, d2h: &str, h2d: &str, bytes: u64) -> serde_json::Value {
        json!({
            "bytes_each_way": bytes,
            d2h: self.d2h.median,
            h2d: self.h2d.median,
            "sum": self.sum.median,
            "total": self.total.median,
            "p99": {
                d2h: self.d2h.p99,
                h2d: self.h2d.p99,
                "sum": self.sum.p99,
                "total": self.total.p99,
            },
        })
    }
}

/// The pinned-memcpy ceiling both ways at once on GPU 0: a D2H and an H2D
/// of `bytes` each, on two streams (and buffers) of their own.
fn bidirectional_ceiling(bytes: usize, reps: usize) -> Both {
    let ctx = Context::by_ordinal(0).unwrap();
    let (dev_a, dev_b) = (
        DeviceBuffer::new(&ctx, bytes).unwrap(),
        DeviceBuffer::new(&ctx, bytes).unwrap(),
    );
    let (host_a, host_b) = (Pinned::new(&ctx, bytes), Pinned::new(&ctx, bytes));
    let (sa, sb) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
    let (da, db) = (dev_a.ptr(), dev_b.ptr());
    let (ha, hb) = (host_a.addr(), host_b.addr());
    let t = together(
        reps,
        move |_, go| {
            go();
            // SAFETY: `dev_a` and `host_a` hold `bytes` bytes each and
            // outlive the synchronize below (they drop after `together`).
            unsafe { sa.copy_dtoh_async(ha as *mut u8, da, bytes) }.unwrap();
            sa.synchronize().unwrap();
        },
        move |_, go| {
            go();
            // SAFETY: as above, `dev_b` and `host_b`.
            unsafe { sb.copy_htod_async(db, hb as *const u8, bytes) }.unwrap();
            sb.synchronize().unwrap();
        },
    );
    drop((dev_a, dev_b, host_a, host_b));
    Both::of(bytes as u64, &t)
}

/// One pinned-memcpy direction on every device at once: per device the
/// rate, and the aggregate (all bytes over the slowest).
fn concurrent_ceiling(ndev: usize, bytes: usize, reps: usize, d2h: bool) -> (Vec<Rate>, Rate) {
    let start = Barrier::new(ndev);
    let end = Barrier::new(ndev);
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
    let per: Vec<Rate> = times
        .iter()
        .map(|t| Rate::of_secs(bytes as u64, t.iter().copied()))
        .collect();
    let agg = Rate::of_secs(
        (ndev * bytes) as u64,
        (0..reps).map(|r| times.iter().map(|t| t[r]).fold(0f64, f64::max)),
    );
    (per, agg)
}

/// The runs of chunks of `blocks` (in order, as many blocks each as
/// `blocks.len() / chunks`), placed as a buffer of their objects back to
/// back has them.
fn chunks_runs(layout: &KvLayout, chunks: usize, blocks: &[u32]) -> Vec<Run> {
    let bpc = blocks.len() / chunks;
    let obj = layout.object_bytes(chunk());
    blocks
        .chunks(bpc)
        .enumerate()
        .flat_map(|(i, b)| {
            pattern::chunk_runs(layout, b)
                .into_iter()
                .map(move |mut r| {
                    r.at += i as u64 * obj;
                    r
                })
        })
        .collect()
}

/// Writes the chunks' contents (`pattern::write_chunk`'s bytes) into their
/// blocks, in one write: a device cache reads and writes back the whole
/// range a write touches, so one write per chunk would move the whole cache
/// each time.
fn write_chunks(cache: &impl KvMemory, content: u32, hashes: &[ChunkHash], blocks: &[u32]) {
    let l = cache.kv_layout();
    let (obj, bpc) = (
        l.object_bytes(chunk()) as usize,
        l.blocks_per_chunk(chunk()),
    );
    let mut buf = vec![0u8; hashes.len() * obj];
    for (h, out) in hashes.iter().zip(buf.chunks_mut(obj)) {
        out.copy_from_slice(&pattern::object(l, content, h, bpc, 0, 0));
    }
    cache.write_runs(&chunks_runs(l, hashes.len(), blocks), &buf);
}

/// Sets every byte of the blocks to `POISON`, in one write.
fn poison(cache: &impl KvMemory, chunks: usize, blocks: &[u32]) {
    let l = cache.kv_layout();
    let buf = vec![POISON; chunks * l.object_bytes(chunk()) as usize];
    cache.write_runs(&chunks_runs(l, chunks, blocks), &buf);
}

/// Checks that the blocks hold the chunks' contents, read in one piece;
/// panics with the first difference. Returns the bytes checked.
fn verify_chunks(cache: &impl KvMemory, content: u32, hashes: &[ChunkHash], blocks: &[u32]) -> u64 {
    let l = cache.kv_layout();
    let (obj, bpc) = (
        l.object_bytes(chunk()) as usize,
        l.blocks_per_chunk(chunk()),
    );
    let mut got = vec![0u8; hashes.len() * obj];
    cache.read_runs(&chunks_runs(l, hashes.len(), blocks), &mut got);
    for (i, (h, g)) in hashes.iter().zip(got.chunks(obj)).enumerate() {
        if pattern::object(l, content, h, bpc, 0, 0) != g {
            let b = &blocks[i * bpc as usize..][..bpc as usize];
            let e = pattern::verify_chunk(cache, content, h, b, 0, POISON)
                .expect_err("a chunk differs in one read and not in another");
            panic!("retrieved bytes differ: chunk {i}: {e}");
        }
    }
    got.len() as u64
}

pub fn run(
    json_out: bool,
    passes: usize,
    copy_threads: Option<u32>,
    devices: Option<usize>,
    preset: LayoutPreset,
    chunk_tokens: u32,
) {
    if chunk_tokens == 0 || JOB_TOKENS % chunk_tokens != 0 {
        eprintln!("--chunk-tokens {chunk_tokens}: must divide {JOB_TOKENS}");
        std::process::exit(2);
    }
    CHUNK_TOKENS.set(chunk_tokens).expect("run once");
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
    let (model, g0) = bench_geometry(preset, 0);
    if g0.shared() && ndev > 1 {
        eprintln!(
            "layout {}: every rank shares one object per chunk; run it with --devices 1",
            preset.name()
        );
        std::process::exit(2);
    }
    // Four workers per GPU, each with the backend's chunks in flight, keep
    // the copy engines fed; more streams only add contention for them.
    let threads = copy_threads.unwrap_or(4);
    // CHUNKS chunks of source and of destination blocks, disjoint, random.
    let bpc = g0.blocks_per_chunk(chunk());
    let nblocks = chunks() * bpc;
    let l = bench_layout(preset, 2 * nblocks);
    let g = *l.geometry();
    let obj = l.object_bytes(chunk());
    let bytes = u64::from(chunks()) * obj;
    let pool_mib = (bytes >> 20) + 1024;
    let pool_mib = pool_mib + (ndev as u64 - 1) * (bytes >> 20);
    eprintln!(
        "{ndev} x {}: layout {} ({} allocation(s), {}-byte runs) of {model}, {} chunks of {:.1} MiB per job and GPU ({:.2} GiB), {threads} copy threads per GPU, pool {pool_mib} MiB, {passes} passes",
        devs[0].name,
        preset.name(),
        l.allocations().len(),
        l.plan().run_bytes(),
        chunks(),
        obj as f64 / f64::from(1 << 20),
        bytes as f64 / f64::from(1 << 30),
    );
    let tokens: Vec<u32> = (0..chunks() * chunk())
        .map(|i| i.wrapping_mul(7919) ^ 3)
        .collect();
    let hashes = chunk_hashes(&tokens, chunk());
    let perm = shuffled(g.blocks, 7);
    let n = nblocks as usize;
    let (src, dst) = (perm[..n].to_vec(), perm[n..2 * n].to_vec());
    // One engine cache (one TP rank) per GPU, allocated as the layout says
    // (one allocation per layout allocation, each 64 KiB aligned); the
    // sources hold the rank's contents, the rest poison.
    let caches: Vec<CudaKvCache> = (0..ndev)
        .map(|ord| CudaKvCache::new(l.clone(), chunk(), ord as i32, Export::Ipc).unwrap())
        .collect();
    std::thread::scope(|sc| {
        for (rank, cache) in caches.iter().enumerate() {
            let (hashes, src) = (&hashes, &src);
            sc.spawn(move || {
                cache.fill(POISON).unwrap();
                write_chunks(cache, rank as u32, hashes, src);
            });
        }
    });
    // The default staged path, then the zero-copy kernels (32 CTAs).
    let staged = measure(
        &caches, preset, &hashes, &src, &dst, threads, pool_mib, passes, 0,
    );
    let zc = measure(
        &caches,
        preset,
        &hashes,
        &src,
        &dst,
        threads,
        pool_mib,
        passes,
        ZERO_COPY_CTAS,
    );
    // A store and a retrieve at the same moment, by two engines on GPU 0.
    let conc = measure_concurrent(&caches[0], &hashes, &src, &dst, threads, passes);
    let reps = passes.max(3);
    // The ceiling: pinned memcpy on every GPU at once, each way.
    let (d2h_per, d2h_all) = concurrent_ceiling(ndev, bytes as usize, reps, true);
    let (h2d_per, h2d_all) = concurrent_ceiling(ndev, bytes as usize, reps, false);
    // GPU 0 both ways at once.
    let bidir = bidirectional_ceiling(bytes as usize, reps);
    // Single-GPU ceilings and the per-block baselines, on GPU 0.
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
    // The engines' own copy patterns, on GPU 0's cache memory whatever the
    // layout (every preset of one geometry spans the same bytes): one
    // cuMemcpyAsync per K or V piece of one block of one layer, at the
    // places of a per-layer `[2, NB, ...]` tensor (vLLM's swap_blocks on
    // the flash-attention layout: 32 KiB for Llama-3-8B) ...
    let base = caches[0].device_base();
    let cache_bytes = caches[0].bytes();
    let parts = u64::from(g.parts());
    let piece = g.page_bytes() / parts;
    let pieces: Vec<u64> = src
        .iter()
        .flat_map(|&b| {
            (0..u64::from(g.layers) * parts)
                .map(move |lp| (lp * u64::from(g.blocks) + u64::from(b)) * piece)
        })
        .collect();
    assert!(pieces.iter().all(|&o| o + piece <= cache_bytes));
    assert!(pieces.len() as u64 * piece <= bytes);
    let per_block = timed(&stream, pieces.len() * piece as usize, reps, || {
        for (i, off) in pieces.iter().enumerate() {
            // SAFETY: each piece lies in the cache's allocation (asserted
            // above); the host range is inside the pinned buffer
            // (`pieces.len() * piece` <= `bytes`).
            unsafe {
                stream.copy_dtoh_async(host.p.add(i * piece as usize), base + off, piece as usize)
            }
            .unwrap();
        }
    });
    // ... and one per block of every layer, contiguous as in a block-
    // outermost layout (`blnhc`, `cross-layer`): vLLM's native CPU
    // offloading, 2 MiB for Llama-3-8B; sources D2H, destinations H2D.
    let xblock = u64::from(g.layers) * g.page_bytes();
    assert!(src
        .iter()
        .chain(&dst)
        .all(|&b| (u64::from(b) + 1) * xblock <= cache_bytes));
    assert!(src.len() as u64 * xblock <= bytes);
    let xd2h = timed(&stream, src.len() * xblock as usize, reps, || {
        for (i, &b) in src.iter().enumerate() {
            let (at, off) = (i * xblock as usize, u64::from(b) * xblock);
            // SAFETY: each block lies in the cache's allocation and each
            // host range in the pinned buffer (both asserted above).
            unsafe { stream.copy_dtoh_async(host.p.add(at), base + off, xblock as usize) }.unwrap();
        }
    });
    let xh2d = timed(&stream, dst.len() * xblock as usize, reps, || {
        for (i, &b) in dst.iter().enumerate() {
            let (at, off) = (i * xblock as usize, u64::from(b) * xblock);
            // SAFETY: as for the D2H blocks.
            unsafe { stream.copy_htod_async(base + off, host.p.add(at), xblock as usize) }.unwrap();
        }
    });
    let pinned = d2h.median.min(h2d.median);
    let (store_gbps, retrieve_gbps) = (staged.store_all.median, staged.retrieve_all.median);
    table(
        preset,
        ndev,
        &[
            (
                "store (staged)",
                staged.store_all,
                Some((d2h_all, "pinned D2H")),
            ),
            (
                "retrieve (staged)",
                staged.retrieve_all,
                Some((h2d_all, "pinned H2D")),
            ),
            (
                "store (zero-copy)",
                zc.store_all,
                Some((d2h_all, "pinned D2H")),
            ),
            (
                "retrieve (zero-copy)",
                zc.retrieve_all,
                Some((h2d_all, "pinned H2D")),
            ),
            ("pinned memcpy D2H (all GPUs)", d2h_all, None),
            ("pinned memcpy H2D (all GPUs)", h2d_all, None),
            ("pinned memcpy D2H (GPU 0)", d2h, None),
            ("pinned memcpy H2D (GPU 0)", h2d, None),
            (
                "both ways at once: D2H",
                bidir.d2h,
                Some((d2h, "one-way D2H")),
            ),
            (
                "both ways at once: H2D",
                bidir.h2d,
                Some((h2d, "one-way H2D")),
            ),
            ("both ways at once: total", bidir.total, None),
            (
                "concurrent: store",
                conc.both.d2h,
                Some((bidir.d2h, "both-ways D2H")),
            ),
            (
                "concurrent: retrieve",
                conc.both.h2d,
                Some((bidir.h2d, "both-ways H2D")),
            ),
            (
                "concurrent: total",
                conc.both.total,
                Some((bidir.total, "both-ways total")),
            ),
            (
                &format!("per-block memcpy {} D2H", size(piece)),
                per_block,
                None,
            ),
            (
                &format!("cross-layer block memcpy {} D2H", size(xblock)),
                xd2h,
                None,
            ),
            (
                &format!("cross-layer block memcpy {} H2D", size(xblock)),
                xh2d,
                None,
            ),
            (
                "store over per-block",
                staged.store_all,
                Some((per_block, "per-block")),
            ),
            (
                "store over cross-layer",
                staged.store_all,
                Some((xd2h, "cross-layer D2H")),
            ),
            (
                "retrieve over cross-layer",
                staged.retrieve_all,
                Some((xh2d, "cross-layer H2D")),
            ),
        ],
    );
    let per_device: Vec<serde_json::Value> = (0..ndev)
        .map(|i| {
            json!({
                "ordinal": i,
                "name": devs[i].name,
                "store_gbps": staged.store[i].median,
                "retrieve_gbps": staged.retrieve[i].median,
                "pinned_memcpy_gbps": { "d2h": d2h_per[i].median, "h2d": h2d_per[i].median },
                "store_over_pinned_d2h": staged.store[i].median / d2h_per[i].median,
                "retrieve_over_pinned_h2d": staged.retrieve[i].median / h2d_per[i].median,
                "p99": {
                    "store_gbps": staged.store[i].p99,
                    "retrieve_gbps": staged.retrieve[i].p99,
                    "pinned_memcpy_gbps": { "d2h": d2h_per[i].p99, "h2d": h2d_per[i].p99 },
                },
            })
        })
        .collect();
    // Blocks per job, blocks and bytes of each GPU's cache.
    let mut geometry = geometry_json(&l, chunk());
    geometry["blocks"] = nblocks.into();
    geometry["cache_blocks"] = g.blocks.into();
    geometry["cache_bytes"] = cache_bytes.into();
    let out = json!({
        "bench": "kv",
        "backend": "cuda",
        "layout": preset.name(),
        "device": devs[0].name,
        "devices": ndev,
        "per_device": per_device,
        "aggregate": {
            "store_gbps": store_gbps,
            "retrieve_gbps": retrieve_gbps,
            "pinned_memcpy_gbps": { "d2h": d2h_all.median, "h2d": h2d_all.median },
            "store_over_pinned_d2h": store_gbps / d2h_all.median,
            "retrieve_over_pinned_h2d": retrieve_gbps / h2d_all.median,
        },
        "geometry": geometry,
        "copy_threads": threads,
        "passes": passes,
        "reps": reps,
        "store_gbps": store_gbps,
        "retrieve_gbps": retrieve_gbps,
        "retrieved_bytes_checked": staged.checked + zc.checked + conc.checked,
        "pinned_memcpy_gbps": { "d2h": d2h.median, "h2d": h2d.median },
        "per_block_memcpy_gbps": per_block.median,
        "per_block_memcpy_bytes": piece,
        "cross_layer_block_memcpy_gbps": {
            "block_bytes": xblock,
            "d2h": xd2h.median,
            "h2d": xh2d.median,
            "p99": { "d2h": xd2h.p99, "h2d": xh2d.p99 },
        },
        "bidirectional_memcpy_gbps": bidir.to_json("d2h", "h2d", bytes),
        "concurrent_store_retrieve_gbps": conc.both.to_json("store", "retrieve", bytes),
        "zero_copy": {
            "ctas": ZERO_COPY_CTAS,
            "store_gbps": zc.store_all.median,
            "retrieve_gbps": zc.retrieve_all.median,
            "p99": { "store_gbps": zc.store_all.p99, "retrieve_gbps": zc.retrieve_all.p99 },
        },
        "p99": {
            "store_gbps": staged.store_all.p99,
            "retrieve_gbps": staged.retrieve_all.p99,
            "pinned_memcpy_gbps": { "d2h": d2h.p99, "h2d": h2d.p99 },
            "pinned_memcpy_all_gbps": { "d2h": d2h_all.p99, "h2d": h2d_all.p99 },
            "per_block_memcpy_gbps": per_block.p99,
        },
        "ratios": {
            "store_over_pinned_d2h": store_gbps / d2h_all.median,
            "retrieve_over_pinned_h2d": retrieve_gbps / h2d_all.median,
            "store_over_per_block": store_gbps / per_block.median,
            "retrieve_over_per_block": retrieve_gbps / per_block.median,
            "store_over_cross_layer_block_d2h": store_gbps / xd2h.median,
            "retrieve_over_cross_layer_block_h2d": retrieve_gbps / xh2d.median,
            "bidirectional_total_over_one_way_sum": bidir.total.median / (d2h.median + h2d.median),
            "concurrent_total_over_bidirectional_total": conc.both.total.median / bidir.total.median,
            "concurrent_store_over_bidirectional_d2h": conc.both.d2h.median / bidir.d2h.median,
            "concurrent_retrieve_over_bidirectional_h2d": conc.both.h2d.median / bidir.h2d.median,
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

/// "2 MiB", "32 KiB", "72 KiB", or bytes.
fn size(b: u64) -> String {
    if b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// A line of the table: a figure, and the figure it is a share of.
type Row<'a> = (&'a str, Rate, Option<(Rate, &'a str)>);

/// The figures side by side on stderr: median and p99 GB/s, and a
/// figure's median over another's where one is named.
fn table(preset: LayoutPreset, ndev: usize, rows: &[Row]) {
    eprintln!(
        "\nlayout {}, {ndev} GPU(s); GB/s (p99: the slow tail)",
        preset.name()
    );
    eprintln!("{:<36} {:>8} {:>8}   ratio", "", "median", "p99");
    for (name, r, over) in rows {
        let ratio = over
            .map(|(c, what)| format!("{:.3} of {what}", r.median / c.median))
            .unwrap_or_default();
        eprintln!("{name:<36} {:>8.2} {:>8.2}   {ratio}", r.median, r.p99);
    }
    eprintln!();
}

/// One server configuration's rates: per GPU and aggregate, and the
/// retrieved bytes checked.
struct Rates {
    store: Vec<Rate>,
    retrieve: Vec<Rate>,
    store_all: Rate,
    retrieve_all: Rate,
    checked: u64,
}

/// One server configuration: every rank (GPU) stores at the same moment,
/// the scheduler looks the prompt up once, every rank retrieves with that
/// lease at the same moment. The destinations are poisoned before the last
/// pass and every retrieved byte is checked after it.
#[allow(clippy::too_many_arguments)]
fn measure(
    caches: &[CudaKvCache],
    preset: LayoutPreset,
    hashes: &[ChunkHash],
    src: &[u32],
    dst: &[u32],
    threads: u32,
    pool_mib: u64,
    passes: usize,
    zero_copy_ctas: u32,
) -> Rates {
    let ndev = caches.len();
    let world = ndev as u32;
    let bytes = hashes.len() as u64 * caches[0].layout().object_bytes(chunk());
    let extra: Vec<String> = vec![
        "--pool-mib".into(),
        pool_mib.to_string(),
        "--chunk-tokens".into(),
        chunk().to_string(),
        "--copy-threads".into(),
        threads.to_string(),
        "--prefault".into(),
        "--backend".into(),
        "cuda".into(),
        "--cuda-zero-copy-ctas".into(),
        zero_copy_ctas.to_string(),
    ];
    let (child, name) = kvring_server_with("kvcuda", WaitPolicy::default(), &extra, false);
    let model = bench_model(preset);
    let far = || Instant::now() + Duration::from_secs(120);
    let mut sched = kvring_client(&name);
    let sync = Barrier::new(ndev + 1);
    let lease_slot = std::sync::Mutex::new(None);
    let path = if zero_copy_ctas == 0 {
        "staged"
    } else {
        "zero-copy"
    };
    // Per rank: (store secs, retrieve secs) of each timed pass, and the
    // bytes checked.
    let times: Vec<(Vec<(f64, f64)>, u64)> = std::thread::scope(|sc| {
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
                    let mut out = Vec::new();
                    for pass in 0..=passes {
                        if pass == passes {
                            poison(cache, hashes.len(), dst);
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
                    let checked = verify_chunks(cache, rank as u32, hashes, dst);
                    (out, checked)
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
    let per = |f: fn(&(f64, f64)) -> f64| -> Vec<Rate> {
        times
            .iter()
            .map(|(t, _)| Rate::of_secs(bytes, t.iter().map(f)))
            .collect()
    };
    let all = |f: fn(&(f64, f64)) -> f64| -> Rate {
        Rate::of_secs(
            ndev as u64 * bytes,
            (0..passes).map(|p| times.iter().map(|(t, _)| f(&t[p])).fold(0f64, f64::max)),
        )
    };
    Rates {
        store: per(|x| x.0),
        retrieve: per(|x| x.1),
        store_all: all(|x| x.0),
        retrieve_all: all(|x| x.1),
        checked: times.iter().map(|(_, c)| c).sum(),
    }
}

/// A store and a retrieve at the same moment (`d2h`: the store, `h2d`: the
/// retrieve), and the retrieved bytes checked.
struct Concurrent {
    both: Both,
    checked: u64,
}

/// Two engines on GPU 0, one model, each with its own client: engine A
/// stores `hashes` from `src` of `cache` while engine B (a second cache
/// of the same layout) retrieves other chunks, stored from its own sources
/// beforehand, into its destinations; the same bytes each way. Every
/// retrieved byte is checked after the last pass (before which the
/// destinations are poisoned).
fn measure_concurrent(
    cache: &CudaKvCache,
    hashes: &[ChunkHash],
    src: &[u32],
    dst: &[u32],
    threads: u32,
    passes: usize,
) -> Concurrent {
    let l = cache.layout();
    let obj = l.object_bytes(chunk());
    let bytes = hashes.len() as u64 * obj;
    let preset = l
        .preset_name()
        .and_then(LayoutPreset::from_name)
        .expect("a preset");
    // B's chunks: another prompt of as many chunks, content 0.
    let tokens: Vec<u32> = (0..hashes.len() as u32 * chunk())
        .map(|i| i.wrapping_mul(104_729) ^ 0x5a5a)
        .collect();
    let other = chunk_hashes(&tokens, chunk());
    let peer = CudaKvCache::new(l.clone(), chunk(), 0, Export::Ipc).unwrap();
    peer.fill(POISON).unwrap();
    write_chunks(&peer, 0, &other, src);
    // Room for both prompts.
    let pool_mib = 2 * (bytes >> 20) + 1024;
    let extra: Vec<String> = vec![
        "--pool-mib".into(),
        pool_mib.to_string(),
        "--chunk-tokens".into(),
        chunk().to_string(),
        "--copy-threads".into(),
        threads.to_string(),
        "--prefault".into(),
        "--backend".into(),
        "cuda".into(),
    ];
    let (child, name) = kvring_server_with("kvcuda-both", WaitPolicy::default(), &extra, false);
    let model = bench_model(preset);
    let far = || Instant::now() + Duration::from_secs(120);
    let spec = KvSpec::new(model, 1, 0);
    let (mut ca, mut cb) = (kvring_client(&name), kvring_client(&name));
    let (ia, ib) = (
        ca.register_cuda(&spec, cache).unwrap(),
        cb.register_cuda(&spec, &peer).unwrap(),
    );
    let n = hashes.len() as u64;
    let t = together(
        passes,
        |_, go| {
            go();
            let job = ca.store(Store::new(&ia, hashes, src)).unwrap();
            let r = job.wait(far()).unwrap();
            assert!(
                matches!(r, JobStatus::Done(r) if r.value == n && r.aux == 0),
                "{r:?}"
            );
            ca.release_job(job).unwrap();
        },
        |pass, go| {
            // A pool holding B's prompt only, and B's lease on it.
            cb.clear().unwrap();
            let job = cb.store(Store::new(&ib, &other, src)).unwrap();
            let r = job.wait(far()).unwrap();
            assert!(matches!(r, JobStatus::Done(r) if r.value == n), "{r:?}");
            cb.release_job(job).unwrap();
            let lease = cb.lookup(Lookup::new(model, 1, &other)).unwrap();
            assert_eq!(lease.hits(), n, "{lease:?}");
            let lease = lease.into_id();
            cb.release_job(lease.job()).unwrap();
            if pass == passes {
                poison(&peer, other.len(), dst);
            }
            go();
            let job = cb.retrieve(Retrieve::new(&ib, lease, dst)).unwrap();
            let r = job.wait(far()).unwrap();
            assert!(matches!(r, JobStatus::Done(r) if r.aux == bytes), "{r:?}");
            cb.release_job(job).unwrap();
        },
    );
    let checked = verify_chunks(&peer, 0, &other, dst);
    drop((ia, ib));
    drop((ca, cb));
    stop_server(child);
    let both = Both::of(bytes, &t);
    for (i, x) in t.iter().enumerate() {
        eprintln!(
            "concurrent pass {}: store {:.2} GB/s, retrieve {:.2} GB/s, total {:.2} GB/s",
            i + 1,
            bytes as f64 / x[0] / 1e9,
            bytes as f64 / x[1] / 1e9,
            2.0 * bytes as f64 / x[2] / 1e9
        );
    }
    Concurrent { both, checked }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvring::HostKvCache;

    /// The batched writes and checks agree with the library's per-chunk
    /// ones, for every layout, and a poisoned block is caught.
    #[test]
    fn batched_pattern_matches_per_chunk() {
        for preset in LayoutPreset::ALL {
            let bpc = bench_geometry(preset, 0).1.blocks_per_chunk(chunk());
            let l = bench_layout(preset, 6 * bpc);
            let cache = HostKvCache::new(l, chunk()).unwrap();
            let tokens: Vec<u32> = (0..3 * chunk()).collect();
            let hashes = chunk_hashes(&tokens, chunk());
            let blocks = shuffled(6 * bpc, 3);
            let (src, dst) = blocks.split_at(3 * bpc as usize);
            cache.fill(POISON);
            write_chunks(&cache, 2, &hashes, src);
            for (h, b) in hashes.iter().zip(src.chunks(bpc as usize)) {
                pattern::verify_chunk(&cache, 2, h, b, 0, 0).unwrap();
            }
            assert_eq!(
                verify_chunks(&cache, 2, &hashes, src),
                3 * cache.layout().object_bytes(chunk())
            );
            for (h, b) in hashes.iter().zip(dst.chunks(bpc as usize)) {
                pattern::write_chunk(&cache, 2, h, b);
            }
            verify_chunks(&cache, 2, &hashes, dst);
            poison(&cache, 3, dst);
            for (h, b) in hashes.iter().zip(dst.chunks(bpc as usize)) {
                pattern::verify_chunk(&cache, 2, h, b, bpc, POISON).unwrap();
            }
            let caught = std::panic::catch_unwind(|| verify_chunks(&cache, 2, &hashes, dst));
            assert!(caught.is_err(), "{}", preset.name());
        }
    }

    /// The baselines' offsets are where a per-layer `[2, NB, ...]` tensor
    /// (flash-attn, its layers 64 KiB aligned back to back as in a
    /// `CudaKvCache`) keeps a block's K and V, and where a block-outermost
    /// layout keeps a block of all layers.
    #[test]
    fn baseline_offsets_are_the_engines_pieces() {
        let fa = bench_layout(LayoutPreset::FlashAttn, 2048);
        let g = *fa.geometry();
        let piece = g.page_bytes() / 2;
        assert_eq!(piece, 32 << 10);
        let mut alloc_at = vec![0u64];
        for &b in fa.allocations() {
            alloc_at.push(alloc_at.last().unwrap() + b.div_ceil(1 << 16) * (1 << 16));
        }
        for layer in [0u32, 7, 31] {
            let p = &fa.layers()[layer as usize];
            for part in 0..2u32 {
                for b in [0u32, 5, 2047] {
                    let at = alloc_at[p.alloc as usize] + p.row(part, b, 0, 0);
                    let lp = u64::from(layer * 2 + part);
                    assert_eq!(at, (lp * u64::from(g.blocks) + u64::from(b)) * piece);
                }
            }
        }
        let xblock = u64::from(g.layers) * g.page_bytes();
        assert_eq!(xblock, 2 << 20);
        for preset in [LayoutPreset::Blnhc, LayoutPreset::CrossLayer] {
            let bl = bench_layout(preset, 2048);
            for b in [0u32, 9, 2047] {
                let lo = bl.layers()[0].row(0, b, 0, 0);
                assert_eq!(lo, u64::from(b) * xblock, "{}", preset.name());
            }
            assert_eq!(bl.allocations(), &[2048 * xblock]);
        }
    }
}
