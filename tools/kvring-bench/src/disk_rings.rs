//! The rings' round trip while the disk tier works, against idle, in one
//! run: PING round trips of one engine, one after another for a few
//! seconds (p50, p99), on a server whose disk tier is written through,
//!
//! * `idle`: nothing else running;
//! * `disk_busy`: while a second engine stores fresh 32 MiB chunks (256
//!   tokens of Llama-3-8B) without a pause (each written to the disk as it
//!   is stored; the 256 MiB pool evicts all the time) and looks up chunks
//!   the pool evicted, which only the disk holds (so the tier reads too);
//! * `load_no_disk`: the same engine's load on a server without a disk
//!   tier: what that load costs the rings on these CPUs by itself.
//!
//! The ratios: `disk_busy` over `idle`, and over `load_no_disk` (the
//! disk's own share).

use crate::kv::llama_geometry;
use crate::peers::{kvring_client, kvring_server_with, stop_server};
use crate::stats::Summary;
use kvring::kv::{chunk_hashes, model_id, pattern, ChunkHash, KvLayout, LayoutPreset};
use kvring::wait::WaitPolicy;
use kvring::{HostKvCache, KvSpec, Lookup, Store};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens of a chunk (the server's default): 16 blocks of Llama-3-8B,
/// 32 MiB.
const CHUNK: u32 = kvring::kv::DEFAULT_CHUNK_TOKENS;
/// Blocks of a chunk.
const BLOCKS: u32 = CHUNK / 16;

/// Round trips of one PING after another for `secs` seconds, in ns.
fn pings(c: &mut kvring::Client, secs: f64) -> Vec<u64> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut v = Vec::new();
    while Instant::now() < end {
        let t = Instant::now();
        c.ping(b"", Instant::now() + Duration::from_secs(10))
            .expect("ping");
        v.push(t.elapsed().as_nanos() as u64);
    }
    v
}

fn us(ns: &[u64]) -> Value {
    let s = Summary::of(ns.to_vec());
    let u = |v: u64| v as f64 / 1e3;
    json!({ "p50": u(s.p50), "p99": u(s.p99), "max": u(s.max), "samples": s.n })
}

fn p99(ns: &[u64]) -> f64 {
    Summary::of(ns.to_vec()).p99 as f64
}

/// What the loading engine did.
#[derive(Default)]
struct Load {
    stores: AtomicU64,
    lookups: AtomicU64,
    hit_chunks: AtomicU64,
}

/// A second engine on `name` storing fresh prompts and looking up old
/// ones until `stop`.
fn load(name: &str, stop: &AtomicBool, done: &Load) {
    let layout = KvLayout::preset(LayoutPreset::Lbnhc, llama_geometry(BLOCKS)).unwrap();
    let cache = HostKvCache::new(layout, CHUNK).unwrap();
    let mut c = kvring_client(name);
    let inst = c
        .register_host(&KvSpec::new(model_id("bench-disk-rings"), 1, 0), &cache)
        .unwrap();
    let blocks: Vec<u32> = (0..BLOCKS).collect();
    let prompt = |seed: u64| -> Vec<ChunkHash> {
        let tokens: Vec<u32> = (0..CHUNK)
            .map(|i| ((u64::from(i) * 2_654_435_761) ^ seed) as u32)
            .collect();
        chunk_hashes(&tokens, CHUNK)
    };
    let mut seed = 0u64;
    // Acquire pairs with the Release store that ends the load.
    while !stop.load(Ordering::Acquire) {
        seed += 1;
        let hashes = prompt(seed);
        pattern::write_chunk(&cache, 0, &hashes[0], &blocks);
        let job = c.store(Store::new(&inst, &hashes, &blocks)).unwrap();
        job.wait(Instant::now() + Duration::from_secs(60)).unwrap();
        // Relaxed (all): counters read after the thread is joined.
        done.stores.fetch_add(1, Ordering::Relaxed);
        // A chunk stored 16 stores (512 MiB) ago: gone from the pool.
        if seed > 16 && seed % 2 == 0 {
            let old = prompt(seed - 16);
            let lease = c
                .lookup(Lookup::new(model_id("bench-disk-rings"), 1, &old))
                .unwrap();
            done.lookups.fetch_add(1, Ordering::Relaxed);
            done.hit_chunks.fetch_add(lease.hits(), Ordering::Relaxed);
        }
    }
}

/// One server (`disk`: with a disk tier in that directory): PING round
/// trips idle (if `idle`) and under the second engine's load.
fn side(
    tag: &str,
    disk: Option<&Path>,
    secs: f64,
    idle: bool,
) -> (Option<Vec<u64>>, Vec<u64>, Value) {
    let mut extra: Vec<String> = ["--pool-mib", "256"].map(String::from).to_vec();
    if let Some(d) = disk {
        extra.extend([
            "--disk".to_string(),
            d.display().to_string(),
            "--disk-bytes".into(),
            (4u64 << 30).to_string(),
        ]);
    }
    let (child, name) = kvring_server_with(tag, WaitPolicy::default(), &extra, false);
    let mut c = kvring_client(&name);
    pings(&mut c, 0.2); // warm-up
    let quiet = idle.then(|| pings(&mut c, secs));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(Load::default());
    let loader = {
        let (name, stop, done) = (name.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || load(&name, &stop, &done))
    };
    // Let the load reach the disk (the first prompts fill the pool).
    std::thread::sleep(Duration::from_secs(2));
    let busy = pings(&mut c, secs);
    // Release pairs with the loader's Acquire load.
    stop.store(true, Ordering::Release);
    loader.join().expect("the loading engine");
    let s = c.stats().unwrap();
    let r = Ordering::Relaxed;
    let what = json!({
        "stores": done.stores.load(r),
        "lookups": done.lookups.load(r),
        "lookup_hit_chunks": done.hit_chunks.load(r),
        "disk_written_objects": s.disk_written_objects,
        "disk_loaded_objects": s.disk_loaded_objects,
        "disk_write_dropped_objects": s.disk_write_dropped_objects,
        "evicted_objects": s.evicted_objects,
        "store_no_space_chunks": s.store_no_space_chunks,
        "stored_chunks": s.stored_chunks,
    });
    drop(c);
    stop_server(child);
    (quiet, busy, what)
}

/// The measurement, with the disk tier in a folder of `dir`: round trips
/// one after another for `secs` seconds in each state.
pub fn measure(dir: &Path, secs: f64) -> Value {
    let (idle, busy, with_disk) = side("disk-rings", Some(dir), secs, true);
    let idle = idle.expect("measured");
    let (_, no_disk, without) = side("disk-rings-nodisk", None, secs, false);
    json!({
        "seconds_each": secs,
        "chunk_bytes": 32u64 << 20,
        "idle_us": us(&idle),
        "disk_busy_us": us(&busy),
        "load_no_disk_us": us(&no_disk),
        "load_with_disk": with_disk,
        "load_without_disk": without,
        "ratios": {
            "disk_busy_p99_over_idle": p99(&busy) / p99(&idle),
            "disk_busy_p99_over_load_no_disk": p99(&busy) / p99(&no_disk),
        },
    })
}
