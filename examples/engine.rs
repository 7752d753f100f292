//! An inference engine's side of kvring, end to end in one process: a cache
//! server started in-process (the `kvring-server` package; an engine runs
//! `kvring serve` instead and links only `kvring`), two tensor-parallel workers that register
//! their paged KV caches in host memory, and a scheduler.
//!
//! 1. Each worker writes the KV of a prompt into its cache and STOREs it
//!    (a `Job`, waited on with a deadline).
//! 2. The scheduler LOOKs the prompt up: a `Lease` holding the chunks it
//!    found for both ranks.
//! 3. Each worker RETRIEVEs the lease's chunks into other, poisoned blocks
//!    (the lease goes to it by id, as it would to another process) and
//!    checks every byte.
//!
//! Run it with `cargo run --release --example engine`; it exits 0 only when
//! every retrieved byte matched what was stored.

use kvring::jobs::{JobResult, JobStatus};
use kvring::kv::{
    chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::{Client, HostKvCache, Job, KvSpec, LeaseId, Lookup, Registration, Retrieve, Store};
use kvring_server::{BackendChoice, ServerConfig};
use std::time::{Duration, Instant};

const WORLD: u32 = 2;
const CHUNK: u32 = 256;
const PROMPT_TOKENS: usize = 4 * CHUNK as usize + 100;
const POISON: u8 = 0xa5;

/// One tensor-parallel worker: its connection, its KV cache, and the cache's
/// registration (dropping the registration unregisters the cache).
struct Worker {
    rank: u32,
    reg: Registration,
    cache: HostKvCache,
    client: Client,
}

/// Waits for a job that must end `Done`; the job is released when its handle
/// drops at the end of this function.
fn finish(job: Job, what: &str) -> kvring::Result<JobResult> {
    match job.wait(Instant::now() + Duration::from_secs(30))? {
        JobStatus::Done(r) => Ok(r),
        other => Err(kvring::Error::Protocol(format!("{what} ended {other:?}"))),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A server in this process, in a private runtime directory.
    let pid = std::process::id();
    let name = format!("example-engine-{pid}");
    let dir = std::env::temp_dir().join(format!("kvring-example-{pid}"));
    let mut cfg = ServerConfig::new(&name);
    cfg.runtime_dir = dir.clone();
    cfg.cache.chunk_tokens = CHUNK;
    cfg.cache.pool_bytes = 64 << 20;
    cfg.copy.backend = BackendChoice::Host;
    let server = kvring_server::start(cfg)?;
    let connect = || {
        Client::builder(&name)
            .runtime_dir(&dir)
            .call_timeout(Duration::from_secs(10))
            .connect()
    };

    // Each rank's slice of the model: 4 layers, 2 KV heads of 64, bf16,
    // 16-token blocks, 128 blocks (flash-attention layout).
    let shape = KvShape {
        layers: 4,
        blocks: 128,
        block_tokens: 16,
        heads: 2,
        head_dim: 64,
    };
    let layout =
        KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16)).unwrap();
    let model = model_id("example-model");
    let mut workers = Vec::new();
    for rank in 0..WORLD {
        let mut client = connect()?;
        let cache = HostKvCache::new(layout.clone(), CHUNK)?;
        let reg = client.register_host(&KvSpec::new(model, WORLD, rank), &cache)?;
        workers.push(Worker {
            rank,
            reg,
            cache,
            client,
        });
    }

    // The prompt: only its whole chunks are stored (4 of them).
    let tokens: Vec<u32> = (0..PROMPT_TOKENS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let hashes = chunk_hashes(&tokens, CHUNK);
    let bpc = workers[0].reg.blocks_per_chunk();
    let stored_blocks: Vec<u32> = (0..hashes.len() as u32 * bpc).collect();
    let fresh_blocks: Vec<u32> = (64..64 + hashes.len() as u32 * bpc).collect();

    // 1. Every rank computes (here: writes) its KV and stores it.
    for w in &mut workers {
        for (h, b) in hashes.iter().zip(stored_blocks.chunks(bpc as usize)) {
            pattern::write_chunk(&w.cache, w.rank, h, b);
        }
        let job = w
            .client
            .store(Store::new(&w.reg, &hashes, &stored_blocks))?;
        let r = finish(job, "store")?;
        println!(
            "rank {}: stored {} chunks ({} without space)",
            w.rank, r.value, r.aux
        );
    }

    // 2. The scheduler looks the prompt up. The lease holds the chunks for
    //    both ranks until their retrieves take them (or it is dropped).
    let mut scheduler = connect()?;
    let lease = scheduler.lookup(Lookup::new(model, WORLD, &hashes))?;
    println!("lookup: {} of {} chunks hit", lease.hits(), hashes.len());
    let lease_id: LeaseId = lease.id();

    // 3. Each rank retrieves into poisoned blocks and checks every byte.
    let mut checked = 0u64;
    for w in &mut workers {
        w.cache.fill(POISON);
        let req = Retrieve::new(&w.reg, lease_id, &fresh_blocks);
        let r = finish(w.client.retrieve(req)?, "retrieve")?;
        println!(
            "rank {}: retrieved {} chunks, {} bytes",
            w.rank, r.value, r.aux
        );
        for (h, b) in hashes.iter().zip(fresh_blocks.chunks(bpc as usize)) {
            checked += pattern::verify_chunk(&w.cache, w.rank, h, b, 0, POISON)
                .map_err(|e| format!("rank {}: {e}", w.rank))?;
        }
    }
    let stats = scheduler.stats()?;
    let want = u64::from(WORLD) * hashes.len() as u64 * layout.object_bytes(CHUNK);
    println!(
        "verified: {checked} of {want} bytes; server: {} objects, {} leases",
        stats.objects, stats.leases
    );
    let all_hit = lease.hits() == hashes.len() as u64;

    // End the lease now (the retrieves took its holds; this also releases
    // the lookup job). Dropping it would queue the same.
    scheduler.end_lease(lease)?;
    for w in workers {
        // Unregister now (dropping the registration would queue it), then
        // say goodbye; the cache's memory goes last.
        let Worker {
            reg,
            mut client,
            cache,
            ..
        } = w;
        client.unregister(reg)?;
        client.close();
        drop(cache);
    }
    scheduler.close();
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
    if all_hit && checked == want {
        println!("ok: every byte matched");
        Ok(())
    } else {
        Err(format!("{checked} of {want} bytes checked, all hit: {all_hit}").into())
    }
}
