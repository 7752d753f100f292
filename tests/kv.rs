//! The cache server end to end with real processes: the `kvring` binary as
//! the server, engines as clients of this process (and of child processes
//! that get killed). Every retrieve is checked byte for byte against the
//! deterministic contents the storing engine wrote.

mod common;

use common::*;
use kvring::jobs::{JobId, JobResult, JobStatus};
use kvring::kv::{chunk_hashes, model_id, pattern, salt_id, ChunkHash, KvLayout, KvLayoutKind};
use kvring::proto::{Opcode, Status};
use kvring::ring::FrameHeader;
use kvring::{Client, Error, HostKvCache, Instance};
use std::time::{Duration, Instant};

const CHUNK: u32 = 64;
const MODEL: &str = "test-model";

fn layout(kind: KvLayoutKind, elem_bytes: u32, num_blocks: u32) -> KvLayout {
    KvLayout {
        kind: kind as u32,
        num_layers: 3,
        num_blocks,
        block_tokens: 16,
        num_heads: if kind == KvLayoutKind::Mla { 1 } else { 2 },
        head_dim: 24,
        elem_bytes,
        _reserved: 0,
    }
}

fn server_args() -> Vec<&'static str> {
    vec![
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        "64MiB",
        "--copy-threads",
        "2",
    ]
}

/// One engine worker: a client, a host cache, its registration.
struct Engine {
    c: Client,
    cache: HostKvCache,
    inst: Instance,
    rank: u32,
}

impl Engine {
    fn new(s: &Scope, l: KvLayout, world: u32, rank: u32) -> Engine {
        Self::of_model(s, MODEL, l, world, rank)
    }

    fn of_model(s: &Scope, model: &str, l: KvLayout, world: u32, rank: u32) -> Engine {
        let mut c = s.client();
        let cache = HostKvCache::new(l, CHUNK).unwrap();
        let inst = c
            .register_host_cache(model_id(model), world, rank, &cache)
            .unwrap();
        Engine {
            c,
            cache,
            inst,
            rank,
        }
    }

    /// The content id of this rank's objects (MLA ranks share one).
    fn content(&self) -> u32 {
        if self.cache.layout().parts() == 1 {
            u32::MAX
        } else {
            self.rank
        }
    }

    fn bpc(&self) -> u32 {
        self.inst.blocks_per_chunk()
    }

    /// Blocks for chunk `i`, spread over the cache in a scrambled order.
    fn blocks(&self, first_block: u32, n_chunks: usize) -> Vec<u32> {
        let nb = self.cache.layout().num_blocks;
        (0..n_chunks as u32 * self.bpc())
            .map(|k| (first_block + k * 7) % nb)
            .collect()
    }

    fn write(&self, hashes: &[ChunkHash], blocks: &[u32]) {
        let bpc = self.bpc() as usize;
        for (h, b) in hashes.iter().zip(blocks.chunks(bpc)) {
            pattern::write_chunk(&self.cache, self.content(), h, b);
        }
    }

    fn store(&mut self, salt: u64, hashes: &[ChunkHash], blocks: &[u32]) -> JobResult {
        let id = self.c.store(&self.inst, salt, hashes, blocks).unwrap();
        done(&mut self.c, id)
    }

    fn verify(&self, hashes: &[ChunkHash], blocks: &[u32], skip_blocks: u32, poison: u8) {
        let bpc = self.bpc() as usize;
        let mut skip = skip_blocks;
        for (i, (h, b)) in hashes.iter().zip(blocks.chunks(bpc)).enumerate() {
            let s = skip.min(bpc as u32);
            skip -= s;
            if let Err(e) = pattern::verify_chunk(&self.cache, self.content(), h, b, s, poison) {
                panic!("chunk {i}: {e}");
            }
        }
    }
}

fn done(c: &mut Client, id: JobId) -> JobResult {
    match c
        .wait_job(id, Instant::now() + Duration::from_secs(20))
        .unwrap()
    {
        JobStatus::Done(r) => {
            c.release_job(id).unwrap();
            r
        }
        other => panic!("{id}: {other:?}"),
    }
}

fn prompt(seed: u32, tokens: usize) -> Vec<u32> {
    (0..tokens as u32)
        .map(|i| i.wrapping_mul(2654435761) ^ seed)
        .collect()
}

fn lookup(c: &mut Client, world: u32, salt: u64, hashes: &[ChunkHash]) -> (JobId, u64) {
    let id = c.lookup(model_id(MODEL), world, salt, hashes).unwrap();
    let r = match c
        .wait_job(id, Instant::now() + Duration::from_secs(5))
        .unwrap()
    {
        JobStatus::Done(r) => r,
        other => panic!("lookup {other:?}"),
    };
    assert_eq!(r.aux, hashes.len() as u64);
    (id, r.value)
}

fn expect_status<T: std::fmt::Debug>(r: kvring::Result<T>, st: Status) {
    match r {
        Err(Error::Status(s)) if s == st => {}
        other => panic!("expected {st:?}, got {other:?}"),
    }
}

/// Child roles, run when this binary is re-executed by `Scope::child`.
fn child_main() -> bool {
    let Some((role, name, dir)) = child_role() else {
        return false;
    };
    let mut c = Client::connect_in(&dir, &name).expect("child connect");
    let hashes = chunk_hashes(&prompt(77, 4 * CHUNK as usize), CHUNK);
    match role.as_str() {
        "lease-holder" => {
            let (lease, hits) = lookup(&mut c, 1, 0, &hashes);
            assert_eq!(hits, 4);
            tell_parent(&format!("holding {}", lease.key));
        }
        "mid-store" => {
            // A store of many chunks, killed while it is copying.
            let l = layout(KvLayoutKind::FlashAttn, 4, 4096);
            let cache = HostKvCache::new(l, CHUNK).unwrap();
            let inst = c
                .register_host_cache(model_id(MODEL), 1, 0, &cache)
                .unwrap();
            let many = chunk_hashes(&prompt(78, 1000 * CHUNK as usize), CHUNK);
            let blocks: Vec<u32> = (0..1000 * inst.blocks_per_chunk())
                .map(|b| b % 4096)
                .collect();
            let id = c.store(&inst, 0, &many, &blocks).unwrap();
            tell_parent(&format!("storing {}", id.key));
        }
        other => panic!("unknown role {other}"),
    }
    std::thread::sleep(Duration::from_secs(60));
    true
}

#[test]
fn a_client_that_dies_holding_leases_or_mid_store_is_reclaimed() {
    if child_main() {
        return;
    }
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("death");
    let _srv = s.server(&server_args());
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 4, 64), 1, 0);
    let hashes = chunk_hashes(&prompt(77, 4 * CHUNK as usize), CHUNK);
    let blocks = e.blocks(0, 4);
    e.write(&hashes, &blocks);
    e.store(0, &hashes, &blocks);
    let test = "a_client_that_dies_holding_leases_or_mid_store_is_reclaimed";
    let mut holder = s.child(test, "lease-holder");
    holder.expect_line("holding");
    assert_eq!(e.c.stats().unwrap().leases, 1);
    assert_eq!(e.c.clear().unwrap().objects, 0, "leased objects stay");
    let killed = Instant::now();
    holder.kill();
    let mut c = s.client();
    let gone = eventually(Duration::from_secs(1), || c.stats().unwrap().leases == 0);
    assert!(
        gone.is_some(),
        "leases of a dead client not dropped within 1 s"
    );
    eprintln!("leases dropped {:?} after the kill", killed.elapsed());
    assert_eq!(c.clear().unwrap().objects, 4, "then they can go");

    let mut writer = s.child(test, "mid-store");
    writer.expect_line("storing");
    assert_eq!(c.stats().unwrap().instances, 2);
    writer.kill();
    let gone = eventually(Duration::from_secs(2), || c.stats().unwrap().instances == 1);
    assert!(gone.is_some(), "the dead writer's instance was not dropped");
    // Nothing it was writing is left behind: once its copies stop, clearing
    // empties the pool (an object still being written could not be cleared).
    let empty = eventually(Duration::from_secs(5), || {
        c.clear().unwrap();
        let st = c.stats().unwrap();
        st.objects == 0 && st.pool_used_bytes == 0
    });
    assert!(empty.is_some(), "{:?}", c.stats().unwrap());
    // The survivor is served as before.
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, 4);
    let (lease, hits) = lookup(&mut c, 1, 0, &hashes);
    assert_eq!(hits, 4);
    let mut f = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 4, 64), 1, 0);
    let dst = f.blocks(9, 4);
    let id = f.c.retrieve(&f.inst, lease, 0, &dst, 0).unwrap();
    done(&mut f.c, id);
    f.verify(&hashes, &dst, 0, 0);
}

#[test]
fn every_layout_and_element_size_round_trips_byte_for_byte() {
    let _w = watchdog(Duration::from_secs(120));
    let s = Scope::new("layouts");
    let _srv = s.server(&server_args());
    let mut sched = s.client();
    for kind in KvLayoutKind::ALL {
        for elem in [1, 2, 4] {
            let l = layout(kind, elem, 48);
            let mut a = Engine::new(&s, l, 1, 0);
            let tokens = prompt(kind as u32 * 10 + elem, 4 * CHUNK as usize + 10);
            let hashes = chunk_hashes(&tokens, CHUNK);
            assert_eq!(hashes.len(), 4);
            let blocks = a.blocks(3, 4);
            a.write(&hashes, &blocks);
            let r = a.store(0, &hashes, &blocks);
            assert_eq!((r.value, r.aux), (4, 0), "{kind:?}/{elem}");
            let (lease, hits) = lookup(&mut sched, 1, 0, &hashes);
            assert_eq!(hits, 4, "{kind:?}/{elem}");
            // A fresh, poisoned cache of another engine process of the same
            // model: the chunks land in other blocks, byte for byte.
            let mut b = Engine::new(&s, l, 1, 0);
            b.cache.fill(0xa5);
            let dst = b.blocks(11, 4);
            let id = b.c.retrieve(&b.inst, lease, 0, &dst, 0).unwrap();
            let r = done(&mut b.c, id);
            assert_eq!(r.value, 4);
            assert_eq!(r.aux, 4 * l.object_bytes(CHUNK));
            b.verify(&hashes, &dst, 0, 0xa5);
            a.c.unregister_kv(&a.inst).unwrap();
            b.c.unregister_kv(&b.inst).unwrap();
        }
    }
    let st = sched.stats().unwrap();
    assert_eq!(st.instances, 0);
    assert_eq!(st.leases, 0, "every lease was used up by its retrieve");
}

#[test]
fn layouts_of_one_geometry_share_objects_and_skip_tokens_leave_blocks_alone() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("share");
    let _srv = s.server(&server_args());
    // Stored from a flash-attention cache, retrieved into a FlashInfer one
    // with a smaller block size: the object format is layout-independent.
    let fa = layout(KvLayoutKind::FlashAttn, 2, 64);
    let mut fi = layout(KvLayoutKind::FlashInfer, 2, 128);
    fi.block_tokens = 8;
    let mut a = Engine::new(&s, fa, 1, 0);
    let hashes = chunk_hashes(&prompt(5, 3 * CHUNK as usize), CHUNK);
    let src = a.blocks(0, 3);
    a.write(&hashes, &src);
    a.store(0, &hashes, &src);
    let mut b = Engine::new(&s, fi, 1, 0);
    b.cache.fill(0x11);
    let (lease, hits) = lookup(&mut b.c, 1, 0, &hashes);
    assert_eq!(hits, 3);
    let dst = b.blocks(5, 3);
    // Skip the first 40 tokens (5 blocks of 8): they stay as they were.
    let id = b.c.retrieve(&b.inst, lease, 0, &dst, 40).unwrap();
    done(&mut b.c, id);
    // Compare token rows: row t of layer l, part p is at the same object
    // offset in both; read both caches through their layouts.
    let tb = fa.token_bytes() as usize;
    let bpc_a = (CHUNK / fa.block_tokens) as usize;
    let bpc_b = (CHUNK / fi.block_tokens) as usize;
    for (c, _) in hashes.iter().enumerate() {
        for layer in 0..3 {
            for part in 0..2 {
                for t in 0..CHUNK as usize {
                    let token = c * CHUNK as usize + t;
                    let (ba, ia) = (src[c * bpc_a + t / 16], t % 16);
                    let (bb, ib) = (dst[c * bpc_b + t / 8], t % 8);
                    let mut x = vec![0u8; fa.slab_bytes() as usize];
                    a.cache.read_slab(layer, part, ba, &mut x);
                    let mut y = vec![0u8; fi.slab_bytes() as usize];
                    b.cache.read_slab(layer, part, bb, &mut y);
                    let row_b = &y[ib * tb..(ib + 1) * tb];
                    if token < 40 {
                        assert!(
                            row_b.iter().all(|&v| v == 0x11),
                            "token {token} overwritten"
                        );
                    } else {
                        assert_eq!(&x[ia * tb..(ia + 1) * tb], row_b, "token {token}");
                    }
                }
            }
        }
    }
}

#[test]
fn lookups_find_the_longest_stored_prefix_per_salt() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("prefix");
    let _srv = s.server(&server_args());
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 64), 1, 0);
    let tokens = prompt(1, 6 * CHUNK as usize);
    let hashes = chunk_hashes(&tokens, CHUNK);
    let blocks = e.blocks(0, 3);
    e.write(&hashes[..3], &blocks);
    let tenant = salt_id(Some("tenant-a"));
    assert_eq!(e.store(tenant, &hashes[..3], &blocks).value, 3);
    // Storing the same chunks again finds them present (nothing copied).
    let before = e.c.stats().unwrap().stored_chunks;
    assert_eq!(e.store(tenant, &hashes[..3], &blocks).value, 3);
    assert_eq!(e.c.stats().unwrap().stored_chunks, before);
    let mut sched = s.client();
    assert_eq!(lookup(&mut sched, 1, tenant, &hashes).1, 3, "partial hit");
    let mut other = tokens.clone();
    other[2 * CHUNK as usize + 5] ^= 1;
    assert_eq!(
        lookup(&mut sched, 1, tenant, &chunk_hashes(&other, CHUNK)).1,
        2,
        "a prompt that diverges in chunk 2"
    );
    assert_eq!(
        lookup(&mut sched, 1, salt_id(Some("tenant-b")), &hashes).1,
        0,
        "other salt"
    );
    assert_eq!(lookup(&mut sched, 1, 0, &hashes).1, 0, "no salt");
    assert_eq!(
        lookup(&mut sched, 2, tenant, &hashes).1,
        0,
        "other world size"
    );
    let id = sched
        .lookup(model_id("other-model"), 1, tenant, &hashes)
        .unwrap();
    assert!(matches!(
        sched
            .wait_job(id, Instant::now() + Duration::from_secs(5))
            .unwrap(),
        JobStatus::Done(JobResult { value: 0, .. })
    ));
    // A long prompt's lookup spans many frames and is answered once.
    let long = chunk_hashes(&prompt(9, 5000 * CHUNK as usize), CHUNK);
    assert!(long.len() * 16 > sched.max_payload());
    assert_eq!(lookup(&mut sched, 1, tenant, &long).1, 0);
}

#[test]
fn retrieve_needs_a_lease_and_uses_it_once() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("lease");
    let _srv = s.server(&server_args());
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 64), 1, 0);
    let hashes = chunk_hashes(&prompt(2, 2 * CHUNK as usize), CHUNK);
    let blocks = e.blocks(0, 2);
    e.write(&hashes, &blocks);
    e.store(0, &hashes, &blocks);
    let never = JobId::new(e.c.epoch(), 7, 3);
    expect_status(e.c.retrieve(&e.inst, never, 0, &blocks, 0), Status::NoLease);
    let (lease, hits) = lookup(&mut e.c, 1, 0, &hashes);
    assert_eq!(hits, 2);
    // Beyond the hits: not leased.
    expect_status(
        e.c.retrieve(&e.inst, lease, 1, &e.blocks(0, 2), 0),
        Status::NoLease,
    );
    let id = e.c.retrieve(&e.inst, lease, 0, &blocks[..4], 0).unwrap();
    done(&mut e.c, id);
    expect_status(
        e.c.retrieve(&e.inst, lease, 0, &blocks[..4], 0),
        Status::NoLease,
    );
    let id = e.c.retrieve(&e.inst, lease, 1, &blocks[4..], 0).unwrap();
    done(&mut e.c, id);
    assert_eq!(e.c.stats().unwrap().leases, 0);
    // Freed leases cannot be retrieved either; END_SESSION ends the rest.
    let (lease, _) = lookup(&mut e.c, 1, 0, &hashes);
    e.c.free_lookup_locks(lease, 0, 1).unwrap();
    expect_status(
        e.c.retrieve(&e.inst, lease, 0, &blocks[..4], 0),
        Status::NoLease,
    );
    assert_eq!(e.c.stats().unwrap().leases, 1);
    e.c.end_session(lease).unwrap();
    assert_eq!(e.c.stats().unwrap().leases, 0);
    expect_status(e.c.end_session(lease), Status::NoLease);
}

#[test]
fn eviction_under_pressure_never_takes_leased_objects() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("evict");
    // Each object is 3 layers * 2 parts * 64 tokens * 96 B = 36 KiB: a 1 MiB
    // pool holds 28.
    let _srv = s.server(&["--chunk-tokens", "64", "--pool-bytes", "1MiB"]);
    let l = layout(KvLayoutKind::FlashAttn, 2, 256);
    let mut e = Engine::new(&s, l, 1, 0);
    let per = l.object_bytes(CHUNK).div_ceil(4096) * 4096;
    let capacity = (1u64 << 20) / per;
    let a = chunk_hashes(&prompt(10, 20 * CHUNK as usize), CHUNK);
    let blocks_a = e.blocks(0, 20);
    e.write(&a, &blocks_a);
    assert_eq!(e.store(0, &a, &blocks_a).value, 20);
    let (lease, hits) = lookup(&mut e.c, 1, 0, &a);
    assert_eq!(hits, 20);
    // Fill the pool with other prompts: only unleased space can be used.
    let b = chunk_hashes(&prompt(11, 20 * CHUNK as usize), CHUNK);
    let blocks_b = e.blocks(100, 20);
    e.write(&b, &blocks_b);
    let r = e.store(0, &b, &blocks_b);
    assert_eq!(r.value + r.aux, 20);
    assert!(
        r.aux > 0 && r.value <= capacity - 20,
        "{r:?} with room for {capacity}"
    );
    // The leased prompt is whole and retrievable.
    let mut f = Engine::new(&s, l, 1, 0);
    f.cache.fill(0);
    let dst = f.blocks(1, 20);
    let id = f.c.retrieve(&f.inst, lease, 0, &dst, 0).unwrap();
    done(&mut f.c, id);
    f.verify(&a, &dst, 0, 0);
    // Lease gone: now the old prompt gives way.
    let r = e.store(0, &b, &blocks_b);
    assert_eq!((r.value, r.aux), (20, 0));
    let st = e.c.stats().unwrap();
    assert!(st.evicted_objects > 0 && st.pool_used_bytes <= st.pool_bytes);
    assert!(lookup(&mut e.c, 1, 0, &a).1 < 20);
}

#[test]
fn tensor_parallel_ranks_store_and_retrieve_concurrently_and_mla_shares() {
    let _w = watchdog(Duration::from_secs(90));
    let s = Scope::new("tp");
    let _srv = s.server(&server_args());
    let mut total_objects = 0;
    for kind in [KvLayoutKind::FlashAttn, KvLayoutKind::Mla] {
        let l = layout(kind, 2, 64);
        let hashes = chunk_hashes(&prompt(kind as u32, 8 * CHUNK as usize), CHUNK);
        let world = 2;
        // Two ranks, each its own connection and thread, storing at once.
        let mut ranks: Vec<Engine> = (0..world).map(|r| Engine::new(&s, l, world, r)).collect();
        std::thread::scope(|sc| {
            for e in ranks.iter_mut() {
                let hashes = &hashes;
                sc.spawn(move || {
                    let blocks = e.blocks(e.rank * 3, 8);
                    e.write(hashes, &blocks);
                    assert_eq!(e.store(0, hashes, &blocks).value, 8);
                });
            }
        });
        // One object per chunk and rank; MLA ranks share one per chunk.
        total_objects += if kind == KvLayoutKind::Mla { 8 } else { 16 };
        assert_eq!(
            ranks[0].c.stats().unwrap().objects,
            total_objects,
            "{kind:?}"
        );
        let mut sched = s.client();
        let (lease, hits) = lookup(&mut sched, world, 0, &hashes);
        assert_eq!(hits, 8);
        // Fresh caches, both ranks retrieving at once from one lease.
        let mut fresh: Vec<Engine> = (0..world).map(|r| Engine::new(&s, l, world, r)).collect();
        std::thread::scope(|sc| {
            for e in fresh.iter_mut() {
                let hashes = &hashes;
                sc.spawn(move || {
                    e.cache.fill(0x5a);
                    let dst = e.blocks(e.rank + 20, 8);
                    let id = e.c.retrieve(&e.inst, lease, 0, &dst, 0).unwrap();
                    done(&mut e.c, id);
                    e.verify(hashes, &dst, 0, 0x5a);
                });
            }
        });
        assert_eq!(sched.stats().unwrap().leases, 0);
        // The next layout is another geometry under the same model name:
        // the server refuses that while ranks of the old one are registered.
        for e in ranks.iter_mut().chain(fresh.iter_mut()) {
            e.c.unregister_kv(&e.inst).unwrap();
        }
    }
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("bad");
    let _srv = s.server(&server_args());
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 16), 1, 0);
    let hashes = chunk_hashes(&prompt(3, CHUNK as usize), CHUNK);
    // Unknown instance, and another client's instance.
    let mut fake = e.inst;
    fake.id += 1000;
    expect_status(
        e.c.store(&fake, 0, &hashes, &[0; 4]),
        Status::UnknownInstance,
    );
    let mut other = s.client();
    expect_status(
        other.store(&e.inst, 0, &hashes, &[0; 4]),
        Status::UnknownInstance,
    );
    // Out-of-range block ids.
    expect_status(
        e.c.store(&e.inst, 0, &hashes, &[0, 1, 2, 16]),
        Status::InvalidArgument,
    );
    // Wrong lengths, sent raw: a truncated store, a lookup whose count lies.
    let send = |c: &mut Client, op: Opcode, payload: &[u8]| {
        let h = FrameHeader {
            opcode: op as u16,
            session: c.session(),
            user_data: 1,
            ..Default::default()
        };
        c.submit_raw(h, payload, true).unwrap();
        c.wait_completion(Instant::now() + Duration::from_secs(5))
            .unwrap()
            .status
    };
    assert_eq!(
        send(&mut e.c, Opcode::Store, &[1, 2, 3]),
        Status::BadLength as i32
    );
    let mut lie = vec![0u8; 24];
    lie[16..20].copy_from_slice(&1u32.to_le_bytes()); // world size 1
    lie[20..24].copy_from_slice(&100u32.to_le_bytes()); // 100 chunks, none sent
    assert_eq!(
        send(&mut e.c, Opcode::Lookup, &lie),
        Status::BadLength as i32
    );
    assert_eq!(
        send(&mut e.c, Opcode::Stats, &[0]),
        Status::BadLength as i32
    );
    // A misaligned skip, and a layout the server cannot serve.
    let blocks = e.blocks(0, 1);
    e.write(&hashes, &blocks);
    e.store(0, &hashes, &blocks);
    let (lease, _) = lookup(&mut e.c, 1, 0, &hashes);
    expect_status(
        e.c.retrieve(&e.inst, lease, 0, &blocks, 5),
        Status::InvalidArgument,
    );
    let mut bad = layout(KvLayoutKind::FlashAttn, 2, 16);
    bad.block_tokens = 48;
    match HostKvCache::new(bad, CHUNK) {
        Err(Error::Config(m)) => assert!(m.contains("does not divide"), "{m}"),
        other => panic!("expected a chunk-size error, got {:?}", other.map(|_| ())),
    }
    let cache = HostKvCache::new(layout(KvLayoutKind::FlashAttn, 2, 16), 32).unwrap();
    let mut spec = kvring::KvSpec {
        model_id: model_id(MODEL),
        world_size: 1,
        rank: 0,
        layout: *cache.layout(),
    };
    spec.layout.block_tokens = 48;
    match e.c.register_kv(&spec, &cache.regions(), &[cache.fd()]) {
        Err(Error::Config(m)) => assert!(
            m.contains("does not divide the server's chunk size of 64"),
            "{m}"
        ),
        other => panic!("expected a chunk-size error, got {other:?}"),
    }
    spec.layout.block_tokens = 16;
    spec.rank = 3;
    match e.c.register_kv(&spec, &cache.regions(), &[cache.fd()]) {
        Err(Error::Registration {
            status: Status::InvalidArgument,
            reason,
        }) => {
            assert!(reason.contains("rank 3"), "{reason}")
        }
        other => panic!("expected a rank error, got {other:?}"),
    }
    // Memory that is not sealed is refused (the server could be made to fault).
    let unsealed =
        nix::sys::memfd::memfd_create(c"unsealed", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    nix::unistd::ftruncate(&unsealed, 1 << 20).unwrap();
    spec.rank = 0;
    match e.c.register_kv(
        &spec,
        &cache.regions(),
        &[std::os::fd::AsFd::as_fd(&unsealed)],
    ) {
        Err(Error::Registration { reason, .. }) => assert!(reason.contains("sealed"), "{reason}"),
        other => panic!("expected a seal error, got {other:?}"),
    }
    // Still serving, the same connection and others.
    assert_eq!(
        e.c.ping(b"alive", Duration::from_secs(5)).unwrap(),
        b"alive"
    );
    let id = e.c.retrieve(&e.inst, lease, 0, &blocks, 0).unwrap();
    done(&mut e.c, id);
    e.c.unregister_kv(&e.inst).unwrap();
    expect_status(
        e.c.store(&e.inst, 0, &hashes, &blocks),
        Status::UnknownInstance,
    );
    assert!(matches!(
        e.c.unregister_kv(&e.inst),
        Err(Error::Registration {
            status: Status::UnknownInstance,
            ..
        })
    ));
}

#[test]
fn a_large_job_of_one_client_does_not_hold_up_another_clients_small_one() {
    let _w = watchdog(Duration::from_secs(60));
    let s = Scope::new("fair");
    // One copy worker: both clients' chunks queue for it.
    let _srv = s.server(&[
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        "256MiB",
        "--copy-threads",
        "1",
    ]);
    // 2 MiB chunk objects, 100 of them: 200 MiB to copy.
    let big_layout = KvLayout {
        num_layers: 8,
        num_heads: 8,
        head_dim: 128,
        ..layout(KvLayoutKind::FlashAttn, 2, 4 * 100)
    };
    let mut big = Engine::of_model(&s, "big-model", big_layout, 1, 0);
    let mut small = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 16), 1, 0);
    let many = chunk_hashes(&prompt(40, 100 * CHUNK as usize), CHUNK);
    let big_blocks: Vec<u32> = (0..100 * 4).collect();
    let one = chunk_hashes(&prompt(41, CHUNK as usize), CHUNK);
    let small_blocks = small.blocks(0, 1);
    small.write(&one, &small_blocks);
    // 100 chunks queued first, then one small chunk.
    let big_job = big.c.store(&big.inst, 0, &many, &big_blocks).unwrap();
    let small_job = small.c.store(&small.inst, 0, &one, &small_blocks).unwrap();
    let st = small
        .c
        .wait_job(small_job, Instant::now() + Duration::from_secs(30))
        .unwrap();
    assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
    // The small job finished while the big one was still copying.
    let big_now = big.c.job_status(big_job).unwrap();
    assert!(
        !big_now.is_terminal(),
        "the big job ended first: {big_now:?}"
    );
    let st = big
        .c
        .wait_job(big_job, Instant::now() + Duration::from_secs(50))
        .unwrap();
    assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
}

#[test]
fn a_request_over_the_servers_limit_is_refused_and_the_ring_goes_on() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("limit");
    let _srv = s.server(&[
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        "16MiB",
        "--max-request-bytes",
        "64KiB",
    ]);
    let mut c = s.client();
    // 5000 hashes: 80 KB in six frames, over the 64 KiB limit.
    let long = chunk_hashes(&prompt(9, 5000 * CHUNK as usize), CHUNK);
    expect_status(c.lookup(model_id(MODEL), 1, 0, &long), Status::BadLength);
    // Just under it works, and so does everything after.
    let fits = &long[..4000];
    let (_, hits) = lookup(&mut c, 1, 0, fits);
    assert_eq!(hits, 0);
    assert_eq!(c.ping(b"after", Duration::from_secs(5)).unwrap(), b"after");
}
