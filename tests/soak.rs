//! Load soak and deadlock regression: many engine clients (32 by default)
//! at full rate — pipelined requests, jobs, stores, lookups and retrieves
//! with every byte checked — while a telemetry client polls STATS and
//! GET_CONFIG, this process takes inspector snapshots of the segment and
//! the `kvring-inspect` binary reads it too. Every wait has a deadline
//! (a missed one fails as a hang), a watchdog bounds the whole run.
//!
//! At the end: no completion lost or repeated, no job left non-terminal, no
//! lease left, the inspector reports no anomaly; medians and p99 of each
//! operation are printed.
//!
//! Short by default (CI). Longer or larger:
//! `KVRING_SOAK_SECS=600 KVRING_SOAK_CLIENTS=64 cargo test --release --test soak -- --nocapture`;
//! `KVRING_SOAK_BACKEND=cuda` runs it against a CUDA server with the
//! engines' caches in GPU memory (skipped without a GPU).

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::pattern::{self, KvMemory};
use kvring::kv::{chunk_hashes, model_id, ChunkHash};
use kvring::proto::Opcode;
use kvring::{Client, DelayJob, Error, Job, KvSpec, Lookup, Registration, Retrieve, Store};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        })
        .unwrap_or(default)
}

/// An engine's two caches (store from one, retrieve into the other), in
/// host or GPU memory.
trait Caches: Send {
    fn src(&self) -> &dyn KvMemory;
    fn dst(&self) -> &dyn KvMemory;
    fn poison_dst(&self, byte: u8);
    fn register(&self, c: &mut Client) -> (Registration, Registration);
}

struct HostCaches(kvring::HostKvCache, kvring::HostKvCache);

impl Caches for HostCaches {
    fn src(&self) -> &dyn KvMemory {
        &self.0
    }
    fn dst(&self) -> &dyn KvMemory {
        &self.1
    }
    fn poison_dst(&self, byte: u8) {
        self.1.fill(byte);
    }
    fn register(&self, c: &mut Client) -> (Registration, Registration) {
        let spec = KvSpec::new(model_id("soak"), 1, 0);
        (
            c.register_host(&spec, &self.0).unwrap(),
            c.register_host(&spec, &self.1).unwrap(),
        )
    }
}

#[cfg(feature = "cuda")]
struct GpuCaches(
    kvring::client::cuda_cache::CudaKvCache,
    kvring::client::cuda_cache::CudaKvCache,
);

#[cfg(feature = "cuda")]
impl Caches for GpuCaches {
    fn src(&self) -> &dyn KvMemory {
        &self.0
    }
    fn dst(&self) -> &dyn KvMemory {
        &self.1
    }
    fn poison_dst(&self, byte: u8) {
        self.1.fill(byte).unwrap();
    }
    fn register(&self, c: &mut Client) -> (Registration, Registration) {
        let spec = KvSpec::new(model_id("soak"), 1, 0);
        (
            c.register_cuda(&spec, &self.0).unwrap(),
            c.register_cuda(&spec, &self.1).unwrap(),
        )
    }
}

/// Latencies per operation, in nanoseconds.
#[derive(Default)]
struct Lat {
    ping_batch: Vec<u64>,
    delay_job: Vec<u64>,
    store: Vec<u64>,
    lookup: Vec<u64>,
    retrieve: Vec<u64>,
}

impl Lat {
    fn merge(&mut self, o: Lat) {
        self.ping_batch.extend(o.ping_batch);
        self.delay_job.extend(o.delay_job);
        self.store.extend(o.store);
        self.lookup.extend(o.lookup);
        self.retrieve.extend(o.retrieve);
    }
}

fn ns(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Waits for a job to end, failing the test on a hang or a failure.
fn finish(c: &mut Client, job: Job, what: &str) -> kvring::jobs::JobResult {
    let id = job.id();
    match job.wait(deadline()) {
        Ok(JobStatus::Done(r)) => {
            c.release_job(job).unwrap();
            r
        }
        Err(Error::Timeout(_)) => panic!("{what} {id}: no answer within 10 s (hang)"),
        other => panic!("{what} {id}: {other:?}"),
    }
}

fn hashes(seed: u64, n: u32) -> Vec<ChunkHash> {
    // The seed's two words open the prompt: distinct seeds never share a
    // chunk hash (equal hashes must mean equal contents).
    let tokens: Vec<u32> = [seed as u32, (seed >> 32) as u32]
        .into_iter()
        .chain((2..n * CHUNK).map(|i| i.wrapping_mul(2_654_435_761)))
        .collect();
    chunk_hashes(&tokens, CHUNK)
}

/// One engine at full rate until `until`. Returns its latencies and how
/// many requests it had answered.
fn engine(s: &Scope, t: u64, caches: &dyn Caches, until: Instant) -> (Lat, u64) {
    let mut c = s.client();
    let (src, dst) = caches.register(&mut c);
    let bpc = src.blocks_per_chunk();
    let mut lat = Lat::default();
    let mut answered = 0u64;
    let mut iter = 0u64;
    while Instant::now() < until {
        iter += 1;
        // Eight pipelined PINGs, answered in order with their payloads.
        let t0 = Instant::now();
        for k in 0..8u64 {
            c.raw()
                .submit(Opcode::Ping, &(iter * 8 + k).to_le_bytes(), k)
                .unwrap();
        }
        for k in 0..8u64 {
            let done = c
                .raw()
                .wait_completion(deadline())
                .unwrap_or_else(|e| panic!("engine {t}: ping {k}: {e}"));
            assert_eq!((done.status, done.user_data), (0, k));
            assert_eq!(done.payload, (iter * 8 + k).to_le_bytes());
        }
        answered += 8;
        lat.ping_batch.push(ns(t0));
        // A job through the whole job path.
        let t0 = Instant::now();
        let job = c
            .delay_job(DelayJob::new(Duration::ZERO, Duration::ZERO).result(iter, 0))
            .unwrap();
        assert_eq!(finish(&mut c, job, "delay job").value, iter);
        lat.delay_job.push(ns(t0));
        answered += 2;
        // Store two chunks, look them up, retrieve them into poisoned
        // blocks, check every byte.
        let seed = (t << 40) | iter;
        let hs = hashes(seed, 2);
        let sb: Vec<u32> = (0..2 * bpc)
            .map(|k| (k + (iter as u32 % 4) * 8) % 64)
            .collect();
        for (h, b) in hs.iter().zip(sb.chunks(bpc as usize)) {
            pattern::write_chunk(caches.src(), seed as u32, h, b);
        }
        let t0 = Instant::now();
        let job = c.store(Store::new(&src, &hs, &sb)).unwrap();
        assert_eq!(finish(&mut c, job, "store").value, 2);
        lat.store.push(ns(t0));
        let t0 = Instant::now();
        let lease = c
            .lookup(Lookup::new(model_id("soak"), 1, &hs))
            .unwrap_or_else(|e| panic!("engine {t}: lookup {e}"));
        let hits = lease.hits();
        lat.lookup.push(ns(t0));
        assert_eq!(hits, 2, "engine {t}: a chunk stored a moment ago is gone");
        let db: Vec<u32> = (32..32 + 2 * bpc).collect();
        caches.poison_dst(0xa5);
        let t0 = Instant::now();
        let job = c.retrieve(Retrieve::new(&dst, &lease, &db)).unwrap();
        finish(&mut c, job, "retrieve");
        lat.retrieve.push(ns(t0));
        // The retrieve took the holds; the lookup job goes too.
        c.release_job(lease.into_id().job()).unwrap();
        for (h, b) in hs.iter().zip(db.chunks(bpc as usize)) {
            pattern::verify_chunk(caches.dst(), seed as u32, h, b, 0, 0xa5)
                .unwrap_or_else(|e| panic!("engine {t}: {e}"));
        }
        answered += 9;
    }
    (lat, answered)
}

fn pct(v: &mut [u64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i] as f64 / 1000.0
}

#[test]
fn many_engines_at_full_rate_with_telemetry() {
    let secs = env_u64("KVRING_SOAK_SECS", 5);
    let clients = env_u64("KVRING_SOAK_CLIENTS", 32);
    let cuda = match std::env::var("KVRING_SOAK_BACKEND").as_deref() {
        // Asked for by name: without a GPU (or CUDA support) the run fails
        // rather than pass having soaked nothing.
        #[cfg(feature = "cuda")]
        Ok("cuda") => match kvring::gpu::probe() {
            Ok(_) => true,
            Err(e) => panic!("KVRING_SOAK_BACKEND=cuda: no usable GPU: {e}"),
        },
        #[cfg(not(feature = "cuda"))]
        Ok("cuda") => panic!("KVRING_SOAK_BACKEND=cuda: this build has no CUDA support"),
        Ok("host") | Err(_) => false,
        Ok(other) => panic!("KVRING_SOAK_BACKEND={other}: host or cuda"),
    };
    let backend = if cuda { "cuda" } else { "host" };
    let s = Fixture::new(
        "soak",
        Duration::from_secs(secs + 90),
        &[
            "--backend",
            backend,
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "256MiB",
            "--max-clients",
            &(clients + 8).to_string(),
        ],
    );
    let caches: Vec<Box<dyn Caches>> = (0..clients)
        .map(|_| -> Box<dyn Caches> {
            if cuda {
                #[cfg(feature = "cuda")]
                {
                    use kvring::client::cuda_cache::{CudaKvCache, Export};
                    Box::new(GpuCaches(
                        CudaKvCache::new(small_layout(), CHUNK, 0, Export::Ipc).unwrap(),
                        CudaKvCache::new(small_layout(), CHUNK, 0, Export::Ipc).unwrap(),
                    ))
                }
                #[cfg(not(feature = "cuda"))]
                unreachable!("the cuda backend was refused above")
            } else {
                Box::new(HostCaches(
                    kvring::HostKvCache::new(small_layout(), CHUNK).unwrap(),
                    kvring::HostKvCache::new(small_layout(), CHUNK).unwrap(),
                ))
            }
        })
        .collect();
    let stop = AtomicBool::new(false);
    let all = Mutex::new((Lat::default(), 0u64));
    let t_start = Instant::now();
    let until = t_start + Duration::from_secs(secs);
    /// Stops the observers however the engines end (a failed engine must
    /// not leave them running until the watchdog).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let (telemetry, snapshots, inspector_runs) = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let tel = sc.spawn(|| {
            let mut c = s.client();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let st = c.stats().unwrap();
                assert!(st.pool_used_bytes <= st.pool_bytes);
                c.server_config().unwrap();
                n += 2;
            }
            n
        });
        let obs = sc.spawn(|| {
            let mut snaps = 0u64;
            let mut runs = 0u64;
            let inspect = std::env::var_os("KVRING_INSPECT_BIN")
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvring-inspect").into());
            while !stop.load(Ordering::Relaxed) {
                let seg = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
                let snap = kvring::inspect::snapshot(&seg, Default::default());
                assert!(snap.server.alive);
                snaps += 1;
                if snaps % 20 == 0 {
                    let out = std::process::Command::new(&inspect)
                        .args(["show", &s.name, "--json", "--sample-ms", "1"])
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "kvring-inspect show failed");
                    runs += 1;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (snaps, runs)
        });
        let engines: Vec<_> = caches
            .into_iter()
            .enumerate()
            .map(|(t, caches)| {
                let (s, all) = (&s, &all);
                sc.spawn(move || {
                    let (lat, n) = engine(s, t as u64, caches.as_ref(), until);
                    let mut a = all.lock().unwrap();
                    a.0.merge(lat);
                    a.1 += n;
                })
            })
            .collect();
        for e in engines {
            e.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let (snaps, runs) = obs.join().unwrap();
        (tel.join().unwrap(), snaps, runs)
    });
    let elapsed = t_start.elapsed();
    // Nothing left behind: no lease, no job unfinished, no anomaly.
    let mut c = s.client();
    let st = c.stats().unwrap();
    assert_eq!(st.leases, 0, "{st:?}");
    let seg = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let snap = kvring::inspect::snapshot(&seg, Default::default());
    for state in ["pending", "running"] {
        assert_eq!(
            snap.jobs.by_state.get(state).copied().unwrap_or(0),
            0,
            "jobs left {state}: {:?}",
            snap.jobs
        );
    }
    assert_eq!(
        snap.jobs.submitted,
        snap.jobs.done + snap.jobs.failed,
        "{:?}",
        snap.jobs
    );
    assert!(snap.anomalies.is_empty(), "{:?}", snap.anomalies);
    let (mut lat, answered) = std::mem::take(&mut *all.lock().unwrap());
    let rate = answered as f64 / elapsed.as_secs_f64();
    eprintln!(
        "soak ({backend}): {clients} engines, {:.1} s, {answered} requests answered ({rate:.0}/s), \
         {telemetry} telemetry requests, {snapshots} snapshots, {inspector_runs} inspector runs",
        elapsed.as_secs_f64()
    );
    for (name, v) in [
        ("8 pipelined pings", &mut lat.ping_batch),
        ("delay job", &mut lat.delay_job),
        ("store 2 chunks", &mut lat.store),
        ("lookup", &mut lat.lookup),
        ("retrieve 2 chunks", &mut lat.retrieve),
    ] {
        let n = v.len();
        eprintln!(
            "  {name:18} n={n:7} p50 {:9.1} us  p99 {:9.1} us  max {:9.1} us",
            pct(v, 0.5),
            pct(v, 0.99),
            pct(v, 1.0)
        );
    }
}
