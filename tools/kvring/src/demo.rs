//! `kvring demo`: the whole job end to end on one machine, with real
//! processes. A server, two tensor-parallel engine workers and a scheduler
//! client (this process):
//!
//! 1. each worker allocates a paged KV cache, registers it, "computes" KV for
//!    a set of prompts that share a system prompt (deterministic contents
//!    that depend on the whole prefix and the rank) and stores it;
//! 2. the scheduler looks up the stored prompts, prompts that share only the
//!    system prompt, and new prompts;
//! 3. each worker retrieves every hit into a fresh, poisoned cache and checks
//!    every byte.
//!
//! Workers are this binary again (`kvring demo-worker`), driven by lines on
//! stdin and answering on stdout.

use kvring::jobs::{JobId, JobStatus};
use kvring::kv::{
    chunk_hashes, model_id, pattern, ChunkHash, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::{Client, Error, HostKvCache, Job, KvSpec, LeaseId, Lookup, Registration, Result};
use kvring::{Retrieve, Store};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Wraps an I/O error with what was being done.
fn io_err(context: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io {
        context: context.into(),
        source,
    }
}

const MODEL: &str = "demo-llama-8l";
const WORLD: u32 = 2;
const CHUNK: u32 = 256;
const SYSTEM_TOKENS: usize = 1024;
const OWN_TOKENS: usize = 1024;
const PROMPTS: u32 = 8;
/// Blocks per prompt in a worker's cache (its chunks, 16-token blocks).
const PROMPT_BLOCKS: u32 = ((SYSTEM_TOKENS + OWN_TOKENS) / 16) as u32;
const POISON: u8 = 0xa5;
const WAIT: Duration = Duration::from_secs(60);

/// The per-rank KV cache of the demo model (a Llama-like slice: 8 layers,
/// 4 KV heads per rank, head dim 128, 2-byte elements, 16-token blocks), in
/// vLLM 0.33's default layout: one buffer for all layers, `[L, B, N, H,
/// K|V]`.
pub fn demo_layout(num_blocks: u32) -> KvLayout {
    let shape = KvShape {
        layers: 8,
        blocks: num_blocks,
        block_tokens: 16,
        heads: 4,
        head_dim: 128,
    };
    KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16))
        .expect("the demo's layout is valid")
}

/// A prompt: a system prompt (shared by all prompts of one `system`) and
/// the prompt's own text.
fn tokens(system: u32, own: u32) -> Vec<u32> {
    let gen = |seed: u32, n: usize| {
        (0..n as u32).map(move |i| {
            (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)).wrapping_add(seed) % 128_000
        })
    };
    gen(system, SYSTEM_TOKENS)
        .chain(gen(own.wrapping_add(1 << 20), OWN_TOKENS))
        .collect()
}

fn hashes(system: u32, own: u32) -> Vec<ChunkHash> {
    chunk_hashes(&tokens(system, own), CHUNK)
}

/// What `kvring demo` measured.
#[derive(Debug, Default)]
struct OpStats {
    count: usize,
    chunks: u64,
    hits: u64,
    bytes: u64,
    lat_ns: Vec<u64>,
    /// Time during which at least one job of this operation ran (ns).
    wall_ns: u64,
    spans: Vec<(u64, u64)>,
}

impl OpStats {
    fn pct(&self, p: f64) -> u64 {
        let mut v = self.lat_ns.clone();
        v.sort_unstable();
        v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0)
    }
    fn gbps(&self) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            self.bytes as f64 / self.wall_ns as f64
        }
    }

    /// Takes "start:end" job intervals (CLOCK_MONOTONIC ns, one clock for
    /// all processes): their lengths are the latencies, and the time any job
    /// was running (the union) is what GB/s divides by.
    fn add_intervals<'a>(&mut self, spans: impl Iterator<Item = &'a String>) {
        for s in spans {
            if let Some((a, b)) = s.split_once(':') {
                if let (Ok(a), Ok(b)) = (a.parse::<u64>(), b.parse::<u64>()) {
                    self.spans.push((a, b.max(a)));
                    self.lat_ns.push(b.saturating_sub(a));
                }
            }
        }
        let mut v = self.spans.clone();
        v.sort_unstable();
        let (mut total, mut end) = (0u64, 0u64);
        for (a, b) in v {
            let a = a.max(end);
            if b > a {
                total += b - a;
                end = b;
            }
        }
        self.wall_ns = total;
    }
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "chunks": self.chunks,
            "hit_chunks": self.hits,
            "bytes": self.bytes,
            "gbps": self.gbps(),
            "p50_us": self.pct(0.5) as f64 / 1e3,
            "p99_us": self.pct(0.99) as f64 / 1e3,
        })
    }
}

fn fmt_us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.1} us", ns as f64 / 1e3)
    }
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn send(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}").map_err(io_err("write to a worker"))?;
        self.stdin.flush().map_err(io_err("write to a worker"))
    }

    fn recv(&mut self) -> Result<Vec<String>> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(io_err("read from a worker"))?;
        if n == 0 {
            return Err(Error::Protocol("a demo worker exited".into()));
        }
        let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        if words.first().map(String::as_str) == Some("error") {
            return Err(Error::Protocol(format!("worker: {}", words[1..].join(" "))));
        }
        Ok(words)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.send("quit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The demo's server process; stopped (SIGTERM) on drop.
struct ServerChild(Child);

impl Drop for ServerChild {
    fn drop(&mut self) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for a job and returns its result; the job is released when the
/// handle drops here.
fn wait_done(job: Job) -> Result<kvring::jobs::JobResult> {
    match job.wait(Instant::now() + WAIT)? {
        JobStatus::Done(r) => Ok(r),
        other => Err(Error::Protocol(format!("{} ended {other:?}", job.id()))),
    }
}

/// Starts the {WORLD} workers; whether their caches are on the GPU.
fn start_workers(
    exe: &std::ffi::OsString,
    exe_args: &[std::ffi::OsString],
    name: &str,
    dir: &std::path::Path,
) -> Result<(Vec<Worker>, bool)> {
    let mut workers = Vec::new();
    let mut on_gpu = false;
    for rank in 0..WORLD {
        let mut child = Command::new(exe)
            .args(exe_args)
            .args([
                "demo-worker",
                "--name",
                name,
                "--rank",
                &rank.to_string(),
                "--runtime-dir",
            ])
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(io_err("start a worker"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut w = Worker {
            child,
            stdin,
            stdout,
        };
        let ready = w.recv()?; // "ready <instance> gpu|host"
        on_gpu = ready.get(2).map(String::as_str) == Some("gpu");
        workers.push(w);
    }
    Ok((workers, on_gpu))
}

/// Step 1, store: both ranks at once, one job per prompt. GB/s: all bytes
/// over the time during which any store job ran (the union of the jobs'
/// intervals; producing the KV is not counted).
fn store_all(workers: &mut [Worker]) -> Result<OpStats> {
    let mut store = OpStats::default();
    for w in workers.iter_mut() {
        w.send("compute")?;
    }
    for w in workers.iter_mut() {
        w.recv()?;
    }
    for w in workers.iter_mut() {
        w.send("store")?;
    }
    for w in workers.iter_mut() {
        let words = w.recv()?; // stored <jobs> <chunks> <bytes> <start:end...>
        let num = |i: usize| {
            words
                .get(i)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
        };
        store.count += num(1) as usize;
        store.chunks += num(2);
        store.bytes += num(3);
        store.add_intervals(words[4..].iter());
    }
    store.hits = store.chunks;
    Ok(store)
}

/// A lease the workers retrieve: its job, the prompt (system, own) and
/// its hits.
type Held = (kvring::jobs::JobId, u32, u32, u64);

/// Step 2, lookup from the scheduler: stored prompts (all chunks hit),
/// prompts sharing only the system prompt (its chunks hit), new prompts
/// (none). Fails on a lookup that hits other than expected.
fn look_up(sched: &mut Client) -> Result<(OpStats, Vec<Held>, u64)> {
    let mut lookup = OpStats::default();
    let mut leases = Vec::new();
    let mid = model_id(MODEL);
    let sys_chunks = (SYSTEM_TOKENS / CHUNK as usize) as u64;
    let all_chunks = ((SYSTEM_TOKENS + OWN_TOKENS) / CHUNK as usize) as u64;
    let mut expected_hits = 0;
    for (system, own, expect) in (0..PROMPTS)
        .map(|p| (1, p, all_chunks))
        .chain((0..PROMPTS).map(|p| (1, 1000 + p, sys_chunks)))
        .chain((0..PROMPTS).map(|p| (2, 2000 + p, 0)))
    {
        let hs = hashes(system, own);
        let t = Instant::now();
        let lease = sched.lookup(Lookup::new(mid, WORLD, &hs))?;
        let r = lease.result();
        lookup.lat_ns.push(t.elapsed().as_nanos() as u64);
        // The workers' retrieves take the holds: the lease goes to them by
        // id, and the scheduler's lookup job is done with.
        let id = lease.into_id().job();
        sched.release_job(id)?;
        lookup.count += 1;
        lookup.chunks += hs.len() as u64;
        lookup.hits += r.value;
        expected_hits += expect;
        if r.value != expect {
            return Err(Error::Protocol(format!(
                "lookup of prompt ({system}, {own}) hit {} chunks, expected {expect}",
                r.value
            )));
        }
        if r.value > 0 {
            leases.push((id, system, own, r.value));
        }
    }
    Ok((lookup, leases, expected_hits))
}

/// Step 3, retrieve every hit into fresh caches on both ranks at once, and
/// check every byte; the bytes verified.
fn retrieve_all(workers: &mut [Worker], leases: &[Held]) -> Result<(OpStats, u64)> {
    let mut retrieve = OpStats::default();
    let mut verified = 0u64;
    for w in workers.iter_mut() {
        let list: Vec<String> = leases
            .iter()
            .map(|(id, s, o, hits)| format!("{}:{}:{s}:{o}:{hits}", id.epoch, id.key))
            .collect();
        w.send(&format!("retrieve {}", list.join(" ")))?;
    }
    for w in workers.iter_mut() {
        // retrieved <jobs> <chunks> <bytes> <verified> <start:end...>
        let words = w.recv()?;
        let num = |i: usize| {
            words
                .get(i)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
        };
        retrieve.count += num(1) as usize;
        retrieve.chunks += num(2);
        retrieve.bytes += num(3);
        verified += num(4);
        retrieve.add_intervals(words[5..].iter());
    }
    retrieve.hits = retrieve.chunks;
    Ok((retrieve, verified))
}

/// The table of the three steps.
fn print_table(store: &OpStats, lookup: &OpStats, retrieve: &OpStats) {
    println!(
        "{:<9} {:>5} {:>7} {:>7} {:>10} {:>8} {:>10} {:>10}",
        "op", "jobs", "chunks", "hits", "MiB", "GB/s", "p50", "p99"
    );
    for (name, s) in [("store", store), ("lookup", lookup), ("retrieve", retrieve)] {
        println!(
            "{:<9} {:>5} {:>7} {:>7} {:>10.1} {:>8} {:>10} {:>10}",
            name,
            s.count,
            s.chunks,
            s.hits,
            s.bytes as f64 / (1 << 20) as f64,
            if s.wall_ns > 0 && s.bytes > 0 {
                format!("{:.2}", s.gbps())
            } else {
                "-".into()
            },
            fmt_us(s.pct(0.5)),
            fmt_us(s.pct(0.99))
        );
    }
}

/// Runs the demo; prints the table (and with `json`, one JSON object as the
/// last line). Fails unless every retrieved byte matched.
pub fn run(json: bool, this: &[std::ffi::OsString]) -> Result<()> {
    let Some((exe, exe_args)) = this.split_first() else {
        return Err(kvring::Error::Config(
            "no command to start the demo's processes with".into(),
        ));
    };
    let name = format!("demo-{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("kvring-demo-{}", std::process::id()));
    kvring::rundir::ensure_runtime_dir(&dir)?;
    let _cleanup = DirGuard(dir.clone());
    let server = Command::new(exe)
        .args(exe_args)
        .args([
            "serve",
            "--name",
            &name,
            "--pool-bytes",
            "1GiB",
            "--prefault",
            "--runtime-dir",
        ])
        .arg(&dir)
        .stdout(Stdio::null())
        .spawn()
        .map_err(io_err("start the server"))?;
    let server = ServerChild(server);
    let mut sched = Client::builder(&name)
        .runtime_dir(&dir)
        .connect_timeout(Duration::from_secs(20))
        .connect()?;
    let cfg = sched.server_config()?;
    let (mut workers, on_gpu) = start_workers(exe, exe_args, &name, &dir)?;
    let layout = demo_layout(PROMPT_BLOCKS * PROMPTS);
    let l = layout.geometry();
    println!(
        "kvring demo: server pid {}, {WORLD} tensor-parallel workers and a scheduler; model {MODEL}: \
         {} layers, {} KV heads per rank, head dim {}, {}-byte elements, {}-token blocks, layout {}; \
         chunk {} tokens = {} MiB per rank; {} copy threads; KV caches in {}",
        server.0.id(),
        l.layers,
        l.heads,
        l.k_dim,
        l.elem_bytes,
        l.block_tokens,
        layout.preset_name().unwrap_or("custom"),
        cfg.chunk_tokens,
        l.object_bytes(CHUNK) >> 20,
        cfg.copy_threads,
        if on_gpu {
            "GPU memory (CUDA backend)"
        } else {
            "host memory (host backend)"
        }
    );

    let store = store_all(&mut workers)?;
    let (lookup, leases, expected_hits) = look_up(&mut sched)?;
    let (retrieve, verified) = retrieve_all(&mut workers, &leases)?;
    let stats = sched.stats()?;
    let ok = lookup.hits == expected_hits
        && verified == retrieve.bytes
        && retrieve.chunks == lookup.hits * u64::from(WORLD)
        && stats.leases == 0;

    print_table(&store, &lookup, &retrieve);
    println!(
        "verified: {} ({} MiB retrieved into fresh caches, {} MiB compared byte for byte)",
        ok,
        retrieve.bytes >> 20,
        verified >> 20
    );
    if json {
        let out = serde_json::json!({
            "demo": "kvring",
            "model": MODEL,
            "world_size": WORLD,
            "chunk_tokens": CHUNK,
            "backend": if on_gpu { "cuda" } else { "host" },
            "store": store.json(),
            "lookup": lookup.json(),
            "retrieve": retrieve.json(),
            "verified_bytes": verified,
            "verified": ok,
        });
        println!("{out}");
    }
    drop(workers);
    drop(sched);
    drop(server);
    if ok {
        Ok(())
    } else {
        Err(Error::Protocol("the demo's results did not verify".into()))
    }
}

struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `kvring demo-worker`: one tensor-parallel rank of the demo engine.
pub fn worker(name: &str, dir: &Path, rank: u32) -> Result<()> {
    let r = worker_loop(name, dir, rank);
    if let Err(e) = &r {
        println!("error {e}");
    }
    r
}

/// A worker's KV cache: in GPU memory when the machine has one, else host.
enum EngineCache {
    Host(HostKvCache),
    #[cfg(feature = "cuda")]
    Cuda(kvring::client::cuda_cache::CudaKvCache),
}

impl EngineCache {
    fn new(layout: KvLayout, gpu: bool) -> Result<EngineCache> {
        #[cfg(not(feature = "cuda"))]
        if gpu {
            return Err(Error::Cuda("this build has no CUDA support".into()));
        }
        #[cfg(feature = "cuda")]
        if gpu {
            return Ok(EngineCache::Cuda(
                kvring::client::cuda_cache::CudaKvCache::new(
                    layout,
                    CHUNK,
                    0,
                    kvring::client::cuda_cache::Export::Ipc,
                )?,
            ));
        }
        Ok(EngineCache::Host(HostKvCache::new(layout, CHUNK)?))
    }

    fn register(&self, c: &mut Client, rank: u32) -> Result<Registration> {
        let spec = KvSpec::new(model_id(MODEL), WORLD, rank);
        match self {
            EngineCache::Host(h) => c.register_host(&spec, h),
            #[cfg(feature = "cuda")]
            EngineCache::Cuda(d) => c.register_cuda(&spec, d),
        }
    }

    fn fill(&self, byte: u8) -> Result<()> {
        match self {
            EngineCache::Host(h) => {
                h.fill(byte);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            EngineCache::Cuda(d) => d.fill(byte),
        }
    }

    fn memory(&self) -> &dyn pattern::KvMemory {
        match self {
            EngineCache::Host(h) => h,
            #[cfg(feature = "cuda")]
            EngineCache::Cuda(d) => d,
        }
    }
}

fn worker_loop(name: &str, dir: &Path, rank: u32) -> Result<()> {
    let mut c = Client::builder(name).runtime_dir(dir).connect()?;
    let layout = demo_layout(PROMPT_BLOCKS * PROMPTS);
    // Engines on the GPU when the server copies with CUDA.
    let gpu = c.server_config()?.backend == kvring::proto::kv::BackendKind::Cuda.raw();
    let cache = EngineCache::new(layout.clone(), gpu)?;
    let inst = cache.register(&mut c, rank)?;
    let bpc = inst.blocks_per_chunk();
    println!("ready {} {}", inst.id(), if gpu { "gpu" } else { "host" });
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.map_err(io_err("read a command"))?;
        let mut words = line.split_whitespace();
        match words.next() {
            Some("compute") => {
                // The engine's forward passes, as far as the cache sees
                // them: every prompt's KV in its own blocks.
                for p in 0..PROMPTS {
                    let hs = hashes(1, p);
                    let blocks: Vec<u32> = (p * PROMPT_BLOCKS..(p + 1) * PROMPT_BLOCKS).collect();
                    for (h, b) in hs.iter().zip(blocks.chunks(bpc as usize)) {
                        pattern::write_chunk(cache.memory(), rank, h, b);
                    }
                }
                println!("computed");
            }
            Some("store") => {
                let (mut chunks, mut bytes, mut lat) = (0u64, 0u64, Vec::new());
                for p in 0..PROMPTS {
                    let hs = hashes(1, p);
                    let blocks: Vec<u32> = (p * PROMPT_BLOCKS..(p + 1) * PROMPT_BLOCKS).collect();
                    let t = kvring::liveness::monotonic_ns();
                    let r = wait_done(c.store(Store::new(&inst, &hs, &blocks))?)?;
                    lat.push(format!("{t}:{}", kvring::liveness::monotonic_ns()));
                    chunks += r.value;
                    bytes += r.value * layout.object_bytes(CHUNK);
                }
                println!("stored {PROMPTS} {chunks} {bytes} {}", lat.join(" "));
            }
            Some("retrieve") => {
                // A fresh cache, poisoned, registered for the retrieves.
                let fresh = EngineCache::new(demo_layout(2 * PROMPT_BLOCKS * PROMPTS), gpu)?;
                fresh.fill(POISON)?;
                let mut cursor = 0u32;
                let finst = fresh.register(&mut c, rank)?;
                let (mut jobs, mut chunks, mut bytes, mut checked, mut lat) =
                    (0, 0u64, 0u64, 0u64, Vec::new());
                for spec in words {
                    let f: Vec<u64> = spec.split(':').filter_map(|x| x.parse().ok()).collect();
                    let [epoch, key, system, own, hits] = f[..] else {
                        return Err(Error::Protocol(format!("bad lease spec {spec}")));
                    };
                    let lease = LeaseId::from_job(JobId { epoch, key });
                    let hs = hashes(system as u32, own as u32);
                    let n = hits as u32;
                    // Each prompt lands in its own blocks of the fresh cache.
                    let blocks: Vec<u32> = (cursor..cursor + n * bpc).collect();
                    cursor += n * bpc;
                    let t = kvring::liveness::monotonic_ns();
                    let r = wait_done(c.retrieve(Retrieve::new(&finst, lease, &blocks))?)?;
                    lat.push(format!("{t}:{}", kvring::liveness::monotonic_ns()));
                    jobs += 1;
                    chunks += r.value;
                    bytes += r.aux;
                    for (h, b) in hs[..n as usize].iter().zip(blocks.chunks(bpc as usize)) {
                        checked += pattern::verify_chunk(fresh.memory(), rank, h, b, 0, POISON)
                            .map_err(|e| Error::Protocol(format!("rank {rank}: {e}")))?;
                    }
                }
                c.unregister(finst)?;
                println!(
                    "retrieved {jobs} {chunks} {bytes} {checked} {}",
                    lat.join(" ")
                );
            }
            Some("quit") | None => break,
            Some(other) => return Err(Error::Protocol(format!("unknown command {other}"))),
        }
    }
    Ok(())
}
