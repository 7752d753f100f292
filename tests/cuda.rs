//! The CUDA data plane with real processes: this test process is the engine
//! (its KV cache in GPU memory, exported by IPC handle or VMM fd), the
//! `kvring` binary serves with `--backend cuda`. What the CUDA backend is
//! tested for beyond the conformance suite every backend passes
//! (`conformance.rs`): VMM exports and realistic rows, the zero-copy path,
//! host caches on a CUDA server, the engine's IPC event ordering a store
//! after the engine's own writes, the engine's stream waiting for a job
//! through its job word (and released when the server stops or dies),
//! engines stuck before their events stalling no other engine, killed
//! engines' GPU memory given back, transfers next to a stream of telemetry
//! (STATS and the inspector) under a watchdog, and ranks in two processes on
//! two GPUs.
//! Every copy is checked on deterministic contents with poisoned
//! destinations.
//!
//! Every test is `#[ignore]`d: a machine without a GPU reports them as
//! ignored; on a GPU machine run them with `--include-ignored` (where they
//! fail, saying so, if no GPU is usable).
#![cfg(feature = "cuda")]

mod common;

use common::*;
use kvring::client::cuda_cache::{CudaKvCache, EngineStream, Export, IpcEvent};
use kvring::client::CudaMemory;
use kvring::jobs::{JobResult, JobStatus};
use kvring::kv::pattern::{self, KvMemory};
use kvring::kv::{chunk_hashes, model_id, ChunkHash, KvLayout, LayoutPreset};
use kvring::{Client, Job, KvSpec, Lookup, Retrieve, Store};
use std::time::{Duration, Instant};

/// Fails the test, saying why, when there is no usable GPU (these tests run
/// only when asked for with `--include-ignored`).
fn require_gpu() {
    if let Err(why) = Cuda::available() {
        panic!("{why}");
    }
}

/// A CUDA server: 64-token chunks, a 512 MiB pool.
const CUDA_ARGS: [&str; 6] = [
    "--backend",
    "cuda",
    "--chunk-tokens",
    "64",
    "--pool-bytes",
    "512MiB",
];

/// Layouts with 80-byte rows (40 * 2 heads * 1 byte): not a multiple of 16,
/// so the bytewise path runs too.
fn layout(preset: LayoutPreset, elem: u32, blocks: u32) -> KvLayout {
    kv_layout(preset, elem, blocks, 40)
}

/// Waits (30 s at most) for a job that must end `Done`; it is released when
/// the handle drops here.
fn done30(job: Job) -> JobResult {
    match job.wait(Instant::now() + Duration::from_secs(30)).unwrap() {
        JobStatus::Done(r) => r,
        other => panic!("{}: {other:?}", job.id()),
    }
}

fn spec(model: &str) -> KvSpec {
    KvSpec::new(model_id(model), 1, 0)
}

/// `n` distinct blocks of `nb`, scattered (3 is prime to every `nb` used).
fn blocks(first: u32, n: u32, nb: u32) -> Vec<u32> {
    assert!(n <= nb && nb % 3 != 0);
    (0..n).map(|k| (first + k * 3) % nb).collect()
}

fn verify(
    cache: &impl KvMemory,
    hashes: &[ChunkHash],
    b: &[u32],
    bpc: usize,
    skip: u32,
    poison: u8,
) {
    let mut left = skip;
    for (i, (h, bl)) in hashes.iter().zip(b.chunks(bpc)).enumerate() {
        let s = left.min(bpc as u32);
        left -= s;
        if let Err(e) = pattern::verify_chunk(cache, 0, h, bl, s, poison) {
            panic!("chunk {i}: {e}");
        }
    }
}

/// [`round_trip`] with caches of `l` on GPU 0, exported as `export`.
fn round_trip_gpu(s: &Scope, sched: &mut Client, l: KvLayout, export: Export, seed: u32) {
    round_trip(
        s,
        sched,
        l.clone(),
        || CudaKvCache::new(l.clone(), CHUNK, 0, export).unwrap(),
        seed,
    );
}

/// (Every layout kind and element size round-trips on every backend: the
/// conformance suite.)
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn vmm_exported_caches_and_realistic_rows_round_trip_through_the_gpu_path() {
    require_gpu();
    let s = Fixture::new("cuda-vmm", Duration::from_secs(300), &CUDA_ARGS);
    let mut sched = s.client();
    assert_eq!(
        sched.server_config().unwrap().backend,
        kvring::proto::kv::BackendKind::Cuda.raw(),
        "a CUDA server"
    );
    // A VMM allocation exported as one POSIX fd, and realistic rows (uint4
    // path).
    let big = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    round_trip_gpu(&s, &mut sched, big.clone(), Export::VmmFd, 100);
    round_trip_gpu(&s, &mut sched, big, Export::Ipc, 101);
    // VMM memory in 20 MiB chunks, one fd each (PyTorch's expandable
    // segments): one buffer of 96 MiB over five chunks, and per-layer
    // tensors of 32 MiB, one of them starting inside a chunk and spanning
    // three.
    for (i, preset) in [
        LayoutPreset::Lbnhc,
        LayoutPreset::FlashAttn,
        LayoutPreset::Blhnc,
    ]
    .into_iter()
    .enumerate()
    {
        let l = kv_layout(preset, 2, 2048, 128);
        let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::VmmChunks(20 << 20)).unwrap();
        assert!(cache.chunks() >= 5, "{preset}: {} chunks", cache.chunks());
        drop(cache);
        round_trip_gpu(
            &s,
            &mut sched,
            l,
            Export::VmmChunks(20 << 20),
            110 + i as u32,
        );
    }
    let st = sched.stats().unwrap();
    assert_eq!(st.leases, 0);
    assert_eq!(st.instances, 0);
}

/// A cache registered as an engine registers memory it allocated itself
/// (a torch tensor's): from its addresses alone, the driver finding each
/// allocation and how to share it, not from the handles the cache made.
struct FoundByAddress(CudaKvCache);

impl KvMemory for FoundByAddress {
    fn kv_layout(&self) -> &KvLayout {
        self.0.layout()
    }
    fn write_runs(&self, runs: &[pattern::Run], src: &[u8]) {
        self.0.write_runs(runs, src)
    }
    fn read_runs(&self, runs: &[pattern::Run], dst: &mut [u8]) {
        self.0.read_runs(runs, dst)
    }
}

impl EngineCache for FoundByAddress {
    fn poison(&self, byte: u8) {
        self.0.fill(byte).expect("fill a device cache")
    }
    fn register_with(&self, c: &mut Client, spec: &KvSpec) -> kvring::Result<kvring::Registration> {
        let ranges: Vec<(u64, u64)> = self
            .0
            .addresses()
            .into_iter()
            .zip(self.0.layout().allocations().iter().copied())
            .collect();
        let memory = CudaMemory::of(&ranges)?;
        assert_eq!(memory.device(), self.0.device_uuid());
        c.register_cuda_memory(spec, self.0.layout(), &memory)
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn caches_found_by_their_addresses_round_trip_whatever_allocated_them() {
    require_gpu();
    let s = Fixture::new("cuda-found", Duration::from_secs(300), &CUDA_ARGS);
    let mut sched = s.client();
    // cuMemAlloc (legacy IPC handle), one VMM allocation (vLLM's
    // extensible cache), 20 MiB VMM chunks (torch's expandable segments):
    // one buffer, and per-layer tensors starting inside chunks.
    let exports = [Export::Ipc, Export::VmmFd, Export::VmmChunks(20 << 20)];
    for (i, export) in exports.into_iter().enumerate() {
        for (j, preset) in [LayoutPreset::Lbnhc, LayoutPreset::FlashAttn]
            .into_iter()
            .enumerate()
        {
            let l = kv_layout(preset, 2, 2048, 128);
            round_trip(
                &s,
                &mut sched,
                l.clone(),
                || FoundByAddress(CudaKvCache::new(l.clone(), CHUNK, 0, export).unwrap()),
                130 + 2 * i as u32 + j as u32,
            );
        }
    }
    // A range that runs past its cuMemAlloc allocation, and host memory.
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    let past = CudaMemory::of(&[(cache.device_base() + 4096, cache.bytes())]);
    assert!(
        matches!(&past, Err(kvring::Error::InvalidArgument(m)) if m.contains("runs past its allocation")),
        "{past:?}"
    );
    let host = vec![0u8; 4096];
    let r = CudaMemory::of(&[(host.as_ptr() as u64, 4096)]);
    assert!(
        matches!(&r, Err(kvring::Error::InvalidArgument(m)) if m.contains("device memory")),
        "{r:?}"
    );
    let st = sched.stats().unwrap();
    assert_eq!(st.instances, 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn a_store_waits_for_the_engines_event() {
    require_gpu();
    let s = Fixture::new("cuda-event", Duration::from_secs(120), &CUDA_ARGS);
    let mut c = s.client();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    cache.fill(0).unwrap();
    let inst = c.register_cuda(&spec("ev"), &cache).unwrap();
    let bpc = inst.blocks_per_chunk();
    // The engine's stream first does a long fill of a large scratch cache,
    // then fills the KV cache with 0x77, then records the event.
    let scratch_l = kv_layout(LayoutPreset::Lbnhc, 2, 1 << 14, 128);
    let scratch = CudaKvCache::new(scratch_l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    let stream = EngineStream::new(&cache).unwrap();
    let ev = IpcEvent::new(&cache).unwrap();
    for _ in 0..8 {
        stream.fill_async(&scratch, 1).unwrap();
    }
    stream.fill_async(&cache, 0x77).unwrap();
    ev.record(&stream).unwrap();
    let hashes = chunk_hashes(&prompt(5, CHUNK as usize), CHUNK);
    let b: Vec<u32> = (0..bpc).collect();
    done30(
        c.store(Store::new(&inst, &hashes, &b).after(ev.handle()))
            .unwrap(),
    );
    stream.synchronize().unwrap();
    // Retrieve into a zeroed cache: every byte is 0x77, the value written
    // after the long fill, so the store's copy ran after the event.
    let dst = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    dst.fill(0).unwrap();
    let dinst = c.register_cuda(&spec("ev"), &dst).unwrap();
    let lease = c.lookup(Lookup::new(model_id("ev"), 1, &hashes)).unwrap();
    done30(c.retrieve(Retrieve::new(&dinst, &lease, &b)).unwrap());
    let mut got = vec![0u8; l.object_bytes(CHUNK) as usize];
    dst.read_runs(&pattern::chunk_runs(&l, &b), &mut got);
    if let Some(at) = got.iter().position(|&x| x != 0x77) {
        panic!("object byte {at} is {:#04x}", got[at]);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn transfers_and_telemetry_run_together_without_a_hang() {
    require_gpu();
    let s = Fixture::new("cuda-telemetry", Duration::from_secs(120), &CUDA_ARGS);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Telemetry: STATS over the ring and the inspector reading the segment,
    // as fast as they go.
    let telemetry = {
        let (dir, name, stop) = (s.dir.clone(), s.name.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::builder(&name).runtime_dir(&dir).connect().unwrap();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.stats().unwrap();
                if n % 50 == 0 {
                    let inspect = std::env::var_os("KVRING_INSPECT_BIN")
                        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvring-inspect").into());
                    let out = std::process::Command::new(inspect)
                        .args(["show", &name, "--json", "--sample-ms", "1"])
                        .output()
                        .unwrap();
                    assert!(out.status.success());
                }
                n += 1;
            }
            n
        })
    };
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 256, 128);
    let engines: Vec<_> = (0..3u32)
        .map(|e| {
            let (dir, name, l) = (s.dir.clone(), s.name.clone(), l.clone());
            std::thread::spawn(move || {
                let mut c = Client::builder(&name).runtime_dir(&dir).connect().unwrap();
                let cache = CudaKvCache::new(l, CHUNK, 0, Export::Ipc).unwrap();
                let inst = c.register_cuda(&spec("t"), &cache).unwrap();
                let bpc = inst.blocks_per_chunk();
                for round in 0..20u32 {
                    let hashes =
                        chunk_hashes(&prompt(e * 1000 + round, 16 * CHUNK as usize), CHUNK);
                    let b: Vec<u32> = (0..16 * bpc).map(|k| (k * 3 + round) % 256).collect();
                    let b: Vec<u32> = {
                        let mut seen = std::collections::HashSet::new();
                        b.into_iter().filter(|x| seen.insert(*x)).collect()
                    };
                    let n = b.len() / bpc as usize;
                    let r = done30(
                        c.store(Store::new(&inst, &hashes[..n], &b[..n * bpc as usize]))
                            .unwrap(),
                    );
                    assert_eq!(r.value, n as u64);
                    let lease = c
                        .lookup(Lookup::new(model_id("t"), 1, &hashes[..n]))
                        .unwrap();
                    done30(
                        c.retrieve(Retrieve::new(&inst, &lease, &b[..n * bpc as usize]))
                            .unwrap(),
                    );
                }
            })
        })
        .collect();
    for e in engines {
        e.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = telemetry.join().unwrap();
    eprintln!("{n} STATS requests alongside 60 store/retrieve rounds");
    assert!(n > 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn the_zero_copy_path_round_trips_every_layout_too() {
    require_gpu();
    let s = Fixture::new(
        "cuda-zero-copy",
        Duration::from_secs(300),
        &[
            "--backend",
            "cuda",
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "512MiB",
            "--cuda-zero-copy-ctas",
            "8",
        ],
    );
    let mut sched = s.client();
    let mut seed = 500;
    for preset in LayoutPreset::ALL {
        for elem in [1, 2] {
            seed += 1;
            round_trip_gpu(&s, &mut sched, layout(preset, elem, 40), Export::Ipc, seed);
        }
    }
    for preset in [LayoutPreset::Lbnhc, LayoutPreset::Bhlnc] {
        seed += 1;
        round_trip_gpu(
            &s,
            &mut sched,
            mla_layout(preset, 2, 40, 36),
            Export::Ipc,
            seed,
        );
    }
    let big = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    round_trip_gpu(&s, &mut sched, big, Export::VmmFd, 600);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn host_memory_engines_are_served_by_a_cuda_server_too() {
    require_gpu();
    let s = Fixture::new("cuda-host", Duration::from_secs(60), &CUDA_ARGS);
    let mut c = s.client();
    let l = layout(LayoutPreset::FlashInfer, 2, 40);
    let src = kvring::HostKvCache::new(l.clone(), CHUNK).unwrap();
    let inst = c.register_host(&spec("h"), &src).unwrap();
    let bpc = inst.blocks_per_chunk() as usize;
    let hashes = chunk_hashes(&prompt(9, 2 * CHUNK as usize), CHUNK);
    let sb = blocks(0, 2 * bpc as u32, 40);
    for (h, b) in hashes.iter().zip(sb.chunks(bpc)) {
        pattern::write_chunk(&src, 0, h, b);
    }
    done30(c.store(Store::new(&inst, &hashes, &sb)).unwrap());
    let lease = c.lookup(Lookup::new(model_id("h"), 1, &hashes)).unwrap();
    let dst = kvring::HostKvCache::new(l.clone(), CHUNK).unwrap();
    dst.fill(0xa5);
    let dinst = c.register_host(&spec("h"), &dst).unwrap();
    let db = blocks(11, 2 * bpc as u32, 40);
    done30(c.retrieve(Retrieve::new(&dinst, &lease, &db)).unwrap());
    verify(&dst, &hashes, &db, bpc, 0, 0xa5);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn the_engines_stream_waits_for_a_retrieve_through_its_job_word() {
    require_gpu();
    let s = Fixture::new("cuda-published", Duration::from_secs(120), &CUDA_ARGS);
    let mut c = s.client();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 1024, 128);
    let src = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    src.fill(0).unwrap();
    let inst = c.register_cuda(&spec("pub"), &src).unwrap();
    let bpc = inst.blocks_per_chunk();
    // 200 chunks: enough copying that the engine gets ahead of it.
    let n = 200u32;
    let hashes = chunk_hashes(&prompt(77, (n * CHUNK) as usize), CHUNK);
    let hashes = &hashes[..];
    let sb: Vec<u32> = (0..n * bpc).collect();
    for (h, b) in hashes.iter().zip(sb.chunks(bpc as usize)) {
        pattern::write_chunk(&src, 0, h, b);
    }
    done30(c.store(Store::new(&inst, hashes, &sb)).unwrap());
    let lease = c.lookup(Lookup::new(model_id("pub"), 1, hashes)).unwrap();

    let dst = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    dst.fill(0xa5).unwrap();
    let mirror = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    mirror.fill(0).unwrap();
    let dinst = c.register_cuda(&spec("pub"), &dst).unwrap();
    let stream = EngineStream::new(&dst).unwrap();
    // The engine does not wait for the job on the CPU: its stream waits for
    // the job's word on the device, and its own read of the blocks (into a
    // mirror) is queued behind.
    let job = c.retrieve(Retrieve::new(&dinst, &lease, &sb)).unwrap();
    stream.wait_job(&job).unwrap();
    let early = job.status().unwrap();
    stream.copy_cache_async(&dst, &mirror).unwrap();
    stream.synchronize().unwrap();
    eprintln!("the job read {early:?} when the engine queued its read");
    verify(&mirror, hashes, &sb, bpc as usize, 0, 0xa5);
    done30(job);
}

/// A tensor-parallel rank in its own process (`rank<R>@<ordinal>`): its KV
/// cache on GPU `ordinal`, registered with world size 2; per round it
/// stores 8 chunks, looks them up (all hit once both ranks stored),
/// retrieves them into a poisoned second cache on the same GPU and checks
/// every byte; prints "done" at the end.
fn rank_main(role: &str, name: &str, dir: &std::path::Path) {
    let (rank, ordinal) = role
        .strip_prefix("rank")
        .and_then(|r| r.split_once('@'))
        .map(|(r, o)| (r.parse::<u32>().unwrap(), o.parse::<i32>().unwrap()))
        .expect("role rank<R>@<ordinal>");
    let mut c = Client::builder(name).runtime_dir(dir).connect().unwrap();
    let l = kv_layout(LayoutPreset::Blnhc, 2, 64, 64);
    let src = CudaKvCache::new(l.clone(), CHUNK, ordinal, Export::Ipc).unwrap();
    let dst = CudaKvCache::new(l.clone(), CHUNK, ordinal, Export::Ipc).unwrap();
    let model = model_id("tp2-gpus");
    let spec = KvSpec::new(model, 2, rank);
    let inst = c.register_cuda(&spec, &src).unwrap();
    let finst = c.register_cuda(&spec, &dst).unwrap();
    let bpc = inst.blocks_per_chunk() as usize;
    for round in 0..10u32 {
        let hashes = chunk_hashes(&prompt(round, 8 * CHUNK as usize), CHUNK);
        let sb: Vec<u32> = (0..8 * bpc as u32).collect();
        for (h, b) in hashes.iter().zip(sb.chunks(bpc)) {
            pattern::write_chunk(&src, rank, h, b);
        }
        assert_eq!(
            done30(c.store(Store::new(&inst, &hashes, &sb)).unwrap()).value,
            8
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        let lease = loop {
            let lease = c.lookup(Lookup::new(model, 2, &hashes)).unwrap();
            if matches!(lease.result(), JobResult { value: 8, .. }) {
                break lease;
            }
            // (A lookup without a hit has no lease.)
            let id = lease.into_id();
            let _ = c.end_lease_id(id);
            c.release_job(id.job()).unwrap();
            assert!(Instant::now() < deadline, "the other rank never stored");
            std::thread::sleep(Duration::from_millis(1));
        };
        dst.fill(0x7e).unwrap();
        let db: Vec<u32> = (8 * bpc as u32..16 * bpc as u32).collect();
        done30(c.retrieve(Retrieve::new(&finst, &lease, &db)).unwrap());
        // This rank's lookup also held the other rank's chunks.
        let lease = lease.into_id();
        c.end_lease_id(lease).unwrap();
        c.release_job(lease.job()).unwrap();
        for (i, (h, b)) in hashes.iter().zip(db.chunks(bpc)).enumerate() {
            if let Err(e) = pattern::verify_chunk(&dst, rank, h, b, 0, 0x7e) {
                panic!("rank {rank} on GPU {ordinal}, round {round}, chunk {i}: {e}");
            }
        }
    }
    tell_parent("done");
}

/// Two engine processes of one tensor-parallel engine, one per GPU, store
/// and retrieve concurrently through one server. Needs two GPUs (it fails
/// on fewer); `KVRING_TEST_TP_ON_ONE_GPU=1` puts both ranks on GPU 0, to
/// check the test itself on a one-GPU machine.
#[test]
#[ignore = "needs two NVIDIA GPUs (run with --include-ignored on such a machine)"]
fn two_engine_processes_on_two_gpus_store_and_retrieve_concurrently() {
    if let Some((role, name, dir)) = child_role() {
        rank_main(&role, &name, &dir);
        return;
    }
    let n = match kvring::gpu::probe() {
        Ok(d) => d.len(),
        Err(e) => panic!("{NEEDS_GPU}: no usable GPU: {e}"),
    };
    let one_gpu = std::env::var_os("KVRING_TEST_TP_ON_ONE_GPU").is_some();
    // Run by name on a machine that cannot run it: fail, never pass.
    assert!(
        n >= 2 || one_gpu,
        "needs two GPUs, found {n} (KVRING_TEST_TP_ON_ONE_GPU=1 runs both ranks on GPU 0)"
    );
    let s = Fixture::new("cuda-tp2", Duration::from_secs(300), &CUDA_ARGS);
    let mut ranks: Vec<ChildProc> = (0..2)
        .map(|rank| {
            let ordinal = if n >= 2 { rank } else { 0 };
            s.child(
                "two_engine_processes_on_two_gpus_store_and_retrieve_concurrently",
                &format!("rank{rank}@{ordinal}"),
            )
        })
        .collect();
    for r in &mut ranks {
        r.expect_line("done");
    }
    let mut c = s.client();
    let st = c.stats().unwrap();
    assert_eq!(st.stored_chunks, 2 * 10 * 8, "{st:?}");
    assert_eq!(st.leases, 0, "{st:?}");
    eprintln!(
        "two ranks on {}: {} chunks stored, {} retrieved, every byte checked",
        if n >= 2 { "two GPUs" } else { "one GPU" },
        st.stored_chunks,
        st.retrieved_chunks
    );
}

/// Waits (at most `limit`) for the file `dir/name` another process of the
/// test creates.
fn await_file(dir: &std::path::Path, name: &str, limit: Duration) {
    let p = dir.join(name);
    let t = Instant::now();
    while !p.exists() {
        assert!(t.elapsed() < limit, "{} never appeared", p.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Latency figures of `kind` operations: "KIND n N p50 P p99 Q max M fail F".
fn latency_line(kind: &str, mut ms: Vec<f64>, failures: usize) -> String {
    ms.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q).round() as usize)
            .copied()
    };
    format!(
        "{kind} n {} p50 {:.3} p99 {:.3} max {:.3} fail {failures}",
        ms.len(),
        at(0.5).unwrap_or(f64::NAN),
        at(0.99).unwrap_or(f64::NAN),
        ms.last().copied().unwrap_or(f64::NAN),
    )
}

/// The engine that is not stuck: stores and retrieves 2-chunk prompts, each
/// job waited for at most 2 s, alone for 1.5 s ("alone ..."), then, once the
/// parent says so, for 2.5 s while other engines are stuck ("during ...").
fn steady_engine_main(name: &str, dir: &std::path::Path) {
    let mut c = Client::builder(name).runtime_dir(dir).connect().unwrap();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    cache.fill(0x11).unwrap();
    let inst = c.register_cuda(&spec("steady"), &cache).unwrap();
    let b: Vec<u32> = (0..2 * inst.blocks_per_chunk()).collect();
    let mut seed = 1000u32;
    let mut run = |secs: f64| {
        let (mut ms, mut failures) = (Vec::new(), 0usize);
        let t = Instant::now();
        while t.elapsed().as_secs_f64() < secs {
            seed += 1;
            let hashes = chunk_hashes(&prompt(seed, 2 * CHUNK as usize), CHUNK);
            let op = Instant::now();
            let deadline = op + Duration::from_secs(2);
            let ok = c
                .store(Store::new(&inst, &hashes, &b))
                .and_then(|j| j.wait(deadline))
                .is_ok_and(|st| matches!(st, JobStatus::Done(_)))
                && c.lookup(Lookup::new(model_id("steady"), 1, &hashes))
                    .and_then(|lease| c.retrieve(Retrieve::new(&inst, &lease, &b)))
                    .and_then(|j| j.wait(deadline))
                    .is_ok_and(|st| matches!(st, JobStatus::Done(_)));
            if ok {
                ms.push(op.elapsed().as_secs_f64() * 1e3);
            } else {
                failures += 1;
            }
        }
        (ms, failures)
    };
    let (ms, f) = run(1.5);
    tell_parent(&latency_line("alone", ms, f));
    await_file(dir, "go", Duration::from_secs(60));
    let (ms, f) = run(2.5);
    tell_parent(&latency_line("during", ms, f));
}

/// `n` engines (a client and a GPU cache each) whose streams wait on a word
/// before recording the event their 4-chunk store comes after. With
/// `release_after`, the words are set once that file appears and every job
/// must end Done; without, they are never set and every job must fail
/// `EngineEventTimeout`. Says "submitted", then how the jobs ended.
fn blocked_engines_main(name: &str, dir: &std::path::Path, n: usize, release_after: Option<&str>) {
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 64, 128);
    // Every cache is made and filled before any stream blocks: four blocked
    // streams stall all of a process's GPU work (measured on the H200).
    let mut ready = Vec::new();
    for _ in 0..n {
        let mut c = Client::builder(name).runtime_dir(dir).connect().unwrap();
        let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
        cache.fill(0x22).unwrap();
        let inst = c.register_cuda(&spec("blocked"), &cache).unwrap();
        ready.push((c, cache, inst));
    }
    let mut engines = Vec::new();
    for (i, (mut c, cache, inst)) in ready.into_iter().enumerate() {
        let stream = EngineStream::new(&cache).unwrap();
        let word = stream.host_word().unwrap();
        stream.wait_word(&word, 1).unwrap();
        let ev = IpcEvent::new(&cache).unwrap();
        ev.record(&stream).unwrap();
        let seed = 5000 + i as u32 + if release_after.is_some() { 100 } else { 0 };
        let hashes = chunk_hashes(&prompt(seed, 4 * CHUNK as usize), CHUNK);
        let b: Vec<u32> = (0..4 * inst.blocks_per_chunk()).collect();
        let job = c
            .store(Store::new(&inst, &hashes, &b).after(ev.handle()))
            .unwrap();
        engines.push((c, cache, inst, stream, word, ev, job));
    }
    let submitted = Instant::now();
    tell_parent("submitted");
    if let Some(file) = release_after {
        await_file(dir, file, Duration::from_secs(60));
        for e in &engines {
            e.4.set(1);
        }
    }
    let mut ends = Vec::new();
    for e in &engines {
        let st = e.6.wait(Instant::now() + Duration::from_secs(60)).unwrap();
        ends.push((st, submitted.elapsed().as_secs_f64()));
    }
    let all = |want: &dyn Fn(&JobStatus) -> bool| ends.iter().all(|(st, _)| want(st));
    let last = ends.iter().map(|e| e.1).fold(0.0, f64::max);
    let verdict = if release_after.is_some() {
        all(&|st| matches!(st, JobStatus::Done(_)))
    } else {
        all(&|st| {
            matches!(
                st,
                JobStatus::Failed(kvring::jobs::FailReason::EngineEventTimeout)
            )
        })
    };
    tell_parent(&format!(
        "ended {} last after {last:.2} s: {:?}",
        if verdict { "as expected" } else { "WRONG" },
        ends.iter().map(|e| &e.0).collect::<Vec<_>>()
    ));
}

/// Engines whose streams never reach the events their stores come after
/// hold up no other engine: the server polls engine events from the host
/// and queues a job's copies only once its event completed, so no copy
/// stream of the server waits on the device for another process. Seven
/// engines (one process) stay stuck: their jobs fail `EngineEventTimeout`
/// at the server's deadline (4 s here). One engine (another process) is
/// released after 1 s: its job completes. A third process stores and
/// retrieves meanwhile, every job within 2 s, its latencies printed next to
/// those it had alone.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn engines_stuck_before_their_events_stall_no_other_engine() {
    const T: &str = "engines_stuck_before_their_events_stall_no_other_engine";
    if let Some((role, name, dir)) = child_role() {
        match role.as_str() {
            "steady" => steady_engine_main(&name, &dir),
            "stuck" => blocked_engines_main(&name, &dir, 7, None),
            "released" => blocked_engines_main(&name, &dir, 1, Some("release")),
            other => panic!("unknown role {other}"),
        }
        return;
    }
    require_gpu();
    let mut args = CUDA_ARGS.to_vec();
    args.extend(["--engine-event-timeout", "4"]);
    let s = Fixture::new("cuda-stuck", Duration::from_secs(180), &args);
    let mut steady = s.child(T, "steady");
    let alone = steady.expect_line("alone");
    let mut stuck = s.child(T, "stuck");
    let mut released = s.child(T, "released");
    stuck.expect_line("submitted");
    released.expect_line("submitted");
    std::fs::write(s.dir.join("go"), b"").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(s.dir.join("release"), b"").unwrap();
    let during = steady.expect_line("during");
    let r = released.expect_line("ended");
    let k = stuck.expect_line("ended");
    eprintln!(
        "steady engine: {alone}\nsteady engine: {during}\nreleased engine: {r}\nstuck engines: {k}"
    );
    assert!(alone.ends_with("fail 0"), "{alone}");
    assert!(
        during.ends_with("fail 0"),
        "the steady engine was held up: {during}"
    );
    assert!(r.contains("as expected"), "the released engine's job: {r}");
    assert!(k.contains("as expected"), "the stuck engines' jobs: {k}");
    let mut c = s.client();
    assert_eq!(c.stats().unwrap().leases, 0);
}

/// An engine process that registers a 768 MiB cache, stores a chunk, says
/// "ready", then idles (`idle`) or stores and retrieves in a loop (`busy`)
/// until it is killed.
fn doomed_engine_main(role: &str, name: &str, dir: &std::path::Path) {
    let mut c = Client::builder(name).runtime_dir(dir).connect().unwrap();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 16384, 128);
    let cache = CudaKvCache::new(l, CHUNK, 0, Export::Ipc).unwrap();
    cache.fill(0x33).unwrap();
    let inst = c.register_cuda(&spec(role), &cache).unwrap();
    let b: Vec<u32> = (0..8 * inst.blocks_per_chunk()).collect();
    let mut seed = if role == "busy" { 7000 } else { 8000 };
    let mut round = |c: &mut Client| {
        seed += 1;
        let hashes = chunk_hashes(&prompt(seed, 8 * CHUNK as usize), CHUNK);
        done30(c.store(Store::new(&inst, &hashes, &b)).unwrap());
        let lease = c.lookup(Lookup::new(model_id(role), 1, &hashes)).unwrap();
        done30(c.retrieve(Retrieve::new(&inst, &lease, &b)).unwrap());
    };
    round(&mut c);
    tell_parent("ready");
    loop {
        if role == "busy" {
            round(&mut c);
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The server's imports keep an engine's GPU memory allocated after the
/// engine dies; reclaiming the client closes them. Two engines register a
/// 768 MiB cache each, one idle and one copying, and are SIGKILLed: within
/// a few seconds the device's free memory is back where it was before they
/// started, and the next engine is served.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn a_killed_engines_gpu_memory_is_given_back() {
    const T: &str = "a_killed_engines_gpu_memory_is_given_back";
    if let Some((role, name, dir)) = child_role() {
        doomed_engine_main(&role, &name, &dir);
        return;
    }
    require_gpu();
    let s = Fixture::new("cuda-give-back", Duration::from_secs(180), &CUDA_ARGS);
    let ctx = kvring::gpu::Context::by_ordinal(0).unwrap();
    // The server's own buffers exist after a first copy of this shape.
    let mut c = s.client();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 16384, 128);
    let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    cache.fill(0x44).unwrap();
    let inst = c.register_cuda(&spec("next"), &cache).unwrap();
    let b: Vec<u32> = (0..8 * inst.blocks_per_chunk()).collect();
    let hashes = chunk_hashes(&prompt(9000, 8 * CHUNK as usize), CHUNK);
    done30(c.store(Store::new(&inst, &hashes, &b)).unwrap());
    let (baseline, total) = ctx.memory_info().unwrap();
    let mut doomed: Vec<ChildProc> = ["idle", "busy"].iter().map(|r| s.child(T, r)).collect();
    for d in &mut doomed {
        d.expect_line("ready");
    }
    let (with_them, _) = ctx.memory_info().unwrap();
    let cache_bytes = cache.bytes();
    assert!(
        baseline.saturating_sub(with_them) >= 2 * cache_bytes,
        "two engines' caches are not on the device: free {with_them} of {total}, before {baseline}"
    );
    let killed = Instant::now();
    for d in &mut doomed {
        d.kill();
    }
    let back = eventually(Duration::from_secs(10), || {
        ctx.memory_info().unwrap().0 + (64 << 20) >= baseline
    });
    let (after, _) = ctx.memory_info().unwrap();
    eprintln!(
        "free before {} MiB, with two engines {} MiB, {:?} after the kill {} MiB",
        baseline >> 20,
        with_them >> 20,
        killed.elapsed(),
        after >> 20
    );
    assert!(
        back.is_some(),
        "the killed engines' memory was not given back: free {after}, before {baseline}"
    );
    // The next engine is served (a fresh store: the busy engine's stores
    // may have evicted the first).
    let hashes = chunk_hashes(&prompt(9001, 8 * CHUNK as usize), CHUNK);
    done30(c.store(Store::new(&inst, &hashes, &b)).unwrap());
    let lease = c.lookup(Lookup::new(model_id("next"), 1, &hashes)).unwrap();
    assert_eq!(lease.hits(), 8);
    done30(c.retrieve(Retrieve::new(&inst, &lease, &b)).unwrap());
}

/// An engine stream ordered after a retrieve (`EngineStream::wait_job`)
/// never waits for a server that stopped or died: the job is held Pending
/// by the server (its copies come after an engine event recorded behind a
/// gate), the server is SIGSTOPped, the job's deadline passes, and the
/// client's watcher releases the stream (the job reports `Timeout`); the
/// engine rewrites its blocks, the gate opens, the server continues: not
/// one byte changes, and the server fails the job `Cancelled`. Then the
/// server is SIGKILLed under a second such wait: the stream goes on within
/// the liveness bound (`ServerGone`), and later work on it runs.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn a_stopped_or_killed_server_never_holds_the_engines_stream() {
    require_gpu();
    let mut s = Fixture::new("cuda-release", Duration::from_secs(120), &CUDA_ARGS);
    let mut c = s.client();
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 1024, 128);
    let cache = CudaKvCache::new(l.clone(), CHUNK, 0, Export::Ipc).unwrap();
    let inst = c.register_cuda(&spec("release"), &cache).unwrap();
    let bpc = inst.blocks_per_chunk();
    let n = 32u32;
    let hashes = chunk_hashes(&prompt(91, (n * CHUNK) as usize), CHUNK);
    let b: Vec<u32> = (0..n * bpc).collect();
    for (h, blk) in hashes.iter().zip(b.chunks(bpc as usize)) {
        pattern::write_chunk(&cache, 0, h, blk);
    }
    done30(c.store(Store::new(&inst, &hashes, &b)).unwrap());
    let stream = EngineStream::new(&cache).unwrap();
    // The gate: a stream of its own that records the event the retrieve
    // comes after only once the test opens it.
    let gated = EngineStream::new(&cache).unwrap();
    let gate = gated.host_word().unwrap();
    let held = |c: &mut Client, timeout: Duration| {
        let lease = c
            .lookup(Lookup::new(model_id("release"), 1, &hashes))
            .unwrap();
        assert_eq!(lease.hits(), u64::from(n));
        gated.wait_word(&gate, gate.get() + 1).unwrap();
        let ev = IpcEvent::new(&cache).unwrap();
        ev.record(&gated).unwrap();
        let job = c
            .retrieve(
                Retrieve::new(&inst, &lease, &b)
                    .after(ev.handle())
                    .timeout(timeout),
            )
            .unwrap();
        (job, ev)
    };

    // Stopped.
    cache.fill(0xa5).unwrap();
    let timeout = Duration::from_millis(300);
    let (job, _ev) = held(&mut c, timeout);
    stream.wait_job(&job).unwrap();
    s.srv.pause();
    let stopped = Instant::now();
    stream.synchronize().unwrap();
    let released = stopped.elapsed();
    let r = job.wait(Instant::now() + Duration::from_secs(10));
    assert!(matches!(r, Err(kvring::Error::Timeout(_))), "{r:?}");
    assert!(released < timeout + Duration::from_secs(2), "{released:?}");
    // The engine has its blocks back and rewrites them; then the gate
    // opens and the server continues.
    stream.fill_async(&cache, 0x5a).unwrap();
    stream.synchronize().unwrap();
    gate.set(gate.get() + 1);
    s.srv.signal(libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(20);
    let st = loop {
        let st = job.status().unwrap();
        if st.is_terminal() || Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        st,
        JobStatus::Failed(kvring::jobs::FailReason::Cancelled),
        "the given-up retrieve"
    );
    let mut bytes = vec![0u8; cache.bytes() as usize];
    let all = [pattern::Run {
        alloc: 0,
        offset: 0,
        bytes: cache.bytes(),
        at: 0,
    }];
    cache.read_runs(&all, &mut bytes);
    let late = bytes.iter().filter(|&&x| x != 0x5a).count();
    eprintln!(
        "stopped server: stream released {released:?} after the stop ({timeout:?} job timeout); \
         {late} bytes changed after the give-up"
    );
    assert_eq!(late, 0, "a copy landed after the give-up");

    // Killed.
    let (job, _ev) = held(&mut c, Duration::from_secs(30));
    stream.wait_job(&job).unwrap();
    let killed = Instant::now();
    s.srv.kill();
    stream.synchronize().unwrap();
    let released = killed.elapsed();
    let r = job.wait(Instant::now() + Duration::from_secs(10));
    assert!(matches!(r, Err(kvring::Error::ServerGone)), "{r:?}");
    eprintln!("killed server: stream released {released:?} after the SIGKILL");
    assert!(released < Duration::from_secs(2), "{released:?}");
    // Later work on the same stream runs.
    stream.fill_async(&cache, 0x11).unwrap();
    stream.synchronize().unwrap();
    gate.set(gate.get() + 1);
    s.restart(&CUDA_ARGS);
}

/// `/readyz` answers 503 while the CUDA backend pins the pool (1 GiB at a
/// time, after the start; the server serves meanwhile) and 200 once all of
/// it is pinned; the ready bytes only grow.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]
fn readyz_waits_for_the_whole_pool_to_be_pinned() {
    require_gpu();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let s = Fixture::new(
        "cuda-readyz",
        Duration::from_secs(300),
        &[
            "--backend",
            "cuda",
            "--pool-bytes",
            "24GiB",
            "--http",
            &addr,
        ],
    );
    let pool = 24u64 << 30;
    let mut seen = Vec::new();
    let start = Instant::now();
    loop {
        let (code, body) = http_get(port, "/readyz");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["pool_bytes"].as_u64(), Some(pool), "{body}");
        let ready = v["pool_ready_bytes"].as_u64().unwrap();
        assert_eq!(code == 200, ready == pool, "{body}");
        seen.push((start.elapsed(), code, ready));
        if seen.len() == 1 {
            // Not ready, yet serving: a client connects and is answered.
            s.client().stats().unwrap();
        }
        if code == 200 || start.elapsed() > Duration::from_secs(120) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "readyz: {} answers, 503 for {:?}, then {:?}",
        seen.len(),
        seen.iter().rev().find(|x| x.1 == 503).map(|x| x.0),
        seen.last()
    );
    assert_eq!(seen.last().unwrap().1, 200, "the pool was pinned in 120 s");
    assert_eq!(
        seen[0].1, 503,
        "a 24 GiB pool was pinned before the first answer"
    );
    assert!(seen.windows(2).all(|w| w[0].2 <= w[1].2), "{seen:?}");
}
