//! The cache server end to end with real processes: the `kvring` binary as
//! the server, engines as clients of this process (and of child processes
//! that get killed). Every retrieve is checked byte for byte against the
//! deterministic contents the storing engine wrote.

mod common;

use common::*;
use kvring::jobs::{JobId, JobResult, JobStatus};
use kvring::kv::{chunk_hashes, model_id, salt_id, ChunkHash, KvLayout, KvLayoutKind, KvShape};
use kvring::proto::kv::StoreRequest;
use kvring::proto::{Opcode, Status};
use kvring::ring::FrameHeader;
use kvring::{Client, Error, HostKvCache, KvSpec, LeaseId, Lookup, Memory, Retrieve, Store};
use std::time::{Duration, Instant};

fn layout(kind: KvLayoutKind, elem_bytes: u32, num_blocks: u32) -> KvLayout {
    kv_layout(kind, elem_bytes, num_blocks, 24)
}

/// A STORE of raw fields, for instance ids no registration has.
fn store_raw(
    c: &mut Client,
    instance: u32,
    hashes: &[ChunkHash],
    blocks: &[u32],
) -> kvring::Result<Vec<u8>> {
    let mut h: StoreRequest = bytemuck::Zeroable::zeroed();
    h.instance = instance;
    h.n_chunks = hashes.len() as u32;
    let mut payload = bytemuck::bytes_of(&h).to_vec();
    payload.extend_from_slice(&hashes.concat());
    payload.extend_from_slice(bytemuck::cast_slice(blocks));
    c.raw().call_large(Opcode::Store, &payload, far())
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
    let mut c = Client::builder(&name)
        .runtime_dir(&dir)
        .connect()
        .expect("child connect");
    let hashes = chunk_hashes(&prompt(77, 4 * CHUNK as usize), CHUNK);
    match role.as_str() {
        "lease-holder" => {
            let lease = lookup(&mut c, 1, 0, &hashes);
            assert_eq!(lease.hits(), 4);
            // Held until this process is killed.
            let lease = lease.into_id();
            tell_parent(&format!("holding {}", lease.job().key));
        }
        "mid-store" => {
            // A store of many chunks, killed while it is copying.
            let l = layout(KvLayoutKind::FlashAttn, 4, 4096);
            let cache = HostKvCache::new(l, CHUNK).unwrap();
            let inst = c
                .register_host(&KvSpec::new(model_id(MODEL), 1, 0), &cache)
                .unwrap();
            let many = chunk_hashes(&prompt(78, 1000 * CHUNK as usize), CHUNK);
            let blocks: Vec<u32> = (0..1000 * inst.blocks_per_chunk())
                .map(|b| b % 4096)
                .collect();
            let job = c.store(Store::new(&inst, &many, &blocks)).unwrap();
            tell_parent(&format!("storing {}", job.id().key));
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
    let s = Fixture::new("death", Duration::from_secs(60), &KV_SERVER_ARGS);
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
    let lease = lookup(&mut c, 1, 0, &hashes);
    assert_eq!(lease.hits(), 4);
    let mut f = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 4, 64), 1, 0);
    let dst = f.blocks(9, 4);
    done(f.c.retrieve(Retrieve::new(&f.inst, &lease, &dst)).unwrap());
    f.verify(&hashes, &dst, 0, 0);
}

#[test]
fn every_layout_and_element_size_round_trips_byte_for_byte() {
    let s = Fixture::new("layouts", Duration::from_secs(120), &KV_SERVER_ARGS);
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
            let lease = lookup(&mut sched, 1, 0, &hashes);
            assert_eq!(lease.hits(), 4, "{kind:?}/{elem}");
            // A fresh, poisoned cache of another engine process of the same
            // model: the chunks land in other blocks, byte for byte.
            let mut b = Engine::new(&s, l, 1, 0);
            b.cache.fill(0xa5);
            let dst = b.blocks(11, 4);
            let r = done(b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst)).unwrap());
            assert_eq!(r.value, 4);
            assert_eq!(r.aux, 4 * l.object_bytes(CHUNK));
            b.verify(&hashes, &dst, 0, 0xa5);
            a.c.unregister(a.inst).unwrap();
            b.c.unregister(b.inst).unwrap();
            // Consumed by its retrieve: nothing left to end.
            let _ = lease.into_id();
        }
    }
    let st = sched.stats().unwrap();
    assert_eq!(st.instances, 0);
    assert_eq!(st.leases, 0, "every lease was used up by its retrieve");
}

#[test]
fn layouts_of_one_geometry_share_objects_and_skip_tokens_leave_blocks_alone() {
    let s = Fixture::new("share", Duration::from_secs(60), &KV_SERVER_ARGS);
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
    let lease = lookup(&mut b.c, 1, 0, &hashes);
    assert_eq!(lease.hits(), 3);
    let dst = b.blocks(5, 3);
    // Skip the first 40 tokens (5 blocks of 8): they stay as they were.
    done(
        b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst).skip_tokens(40))
            .unwrap(),
    );
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
    let s = Fixture::new("prefix", Duration::from_secs(60), &KV_SERVER_ARGS);
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
    assert_eq!(
        lookup(&mut sched, 1, tenant, &hashes).hits(),
        3,
        "partial hit"
    );
    let mut other = tokens.clone();
    other[2 * CHUNK as usize + 5] ^= 1;
    assert_eq!(
        lookup(&mut sched, 1, tenant, &chunk_hashes(&other, CHUNK)).hits(),
        2,
        "a prompt that diverges in chunk 2"
    );
    assert_eq!(
        lookup(&mut sched, 1, salt_id(Some("tenant-b")), &hashes).hits(),
        0,
        "other salt"
    );
    assert_eq!(lookup(&mut sched, 1, 0, &hashes).hits(), 0, "no salt");
    assert_eq!(
        lookup(&mut sched, 2, tenant, &hashes).hits(),
        0,
        "other world size"
    );
    let lease = sched
        .lookup(Lookup::new(model_id("other-model"), 1, &hashes).salt(tenant))
        .unwrap();
    assert!(matches!(
        sched
            .wait_job(lease.id().job(), Instant::now() + Duration::from_secs(5))
            .unwrap(),
        JobStatus::Done(JobResult { value: 0, .. })
    ));
    // A long prompt's lookup spans many frames and is answered once.
    let long = chunk_hashes(&prompt(9, 5000 * CHUNK as usize), CHUNK);
    assert!(long.len() * 16 > sched.raw().max_payload());
    assert_eq!(lookup(&mut sched, 1, tenant, &long).hits(), 0);
}

#[test]
fn retrieve_needs_a_lease_and_uses_it_once() {
    let s = Fixture::new("lease", Duration::from_secs(60), &KV_SERVER_ARGS);
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 64), 1, 0);
    let hashes = chunk_hashes(&prompt(2, 2 * CHUNK as usize), CHUNK);
    let blocks = e.blocks(0, 2);
    e.write(&hashes, &blocks);
    e.store(0, &hashes, &blocks);
    let never = LeaseId::from_job(JobId::new(e.c.epoch(), 7, 3));
    expect_status(
        e.c.retrieve(Retrieve::new(&e.inst, never, &blocks)),
        Status::NoLease,
    );
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    assert_eq!(lease.hits(), 2);
    // Beyond the hits: not leased.
    let beyond = e.blocks(0, 2);
    expect_status(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &beyond).first_chunk(1)),
        Status::NoLease,
    );
    done(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks[..4]))
            .unwrap(),
    );
    expect_status(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks[..4])),
        Status::NoLease,
    );
    done(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks[4..]).first_chunk(1))
            .unwrap(),
    );
    assert_eq!(e.c.stats().unwrap().leases, 0);
    // Freed leases cannot be retrieved either; END_SESSION ends the rest.
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    e.c.release_lease_chunks(&lease, 0, 1).unwrap();
    expect_status(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks[..4])),
        Status::NoLease,
    );
    assert_eq!(e.c.stats().unwrap().leases, 1);
    let id = lease.into_id();
    e.c.end_lease_id(id).unwrap();
    assert_eq!(e.c.stats().unwrap().leases, 0);
    expect_status(e.c.end_lease_id(id), Status::NoLease);
}

#[test]
fn eviction_under_pressure_never_takes_leased_objects() {
    // Each object is 3 layers * 2 parts * 64 tokens * 96 B = 36 KiB: a 1 MiB
    // pool holds 28.
    let s = Fixture::new(
        "evict",
        Duration::from_secs(60),
        &["--chunk-tokens", "64", "--pool-bytes", "1MiB"],
    );
    let l = layout(KvLayoutKind::FlashAttn, 2, 256);
    let mut e = Engine::new(&s, l, 1, 0);
    let per = l.object_bytes(CHUNK).div_ceil(4096) * 4096;
    let capacity = (1u64 << 20) / per;
    let a = chunk_hashes(&prompt(10, 20 * CHUNK as usize), CHUNK);
    let blocks_a = e.blocks(0, 20);
    e.write(&a, &blocks_a);
    assert_eq!(e.store(0, &a, &blocks_a).value, 20);
    let lease = lookup(&mut e.c, 1, 0, &a);
    assert_eq!(lease.hits(), 20);
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
    done(f.c.retrieve(Retrieve::new(&f.inst, &lease, &dst)).unwrap());
    f.verify(&a, &dst, 0, 0);
    // Lease gone: now the old prompt gives way.
    let r = e.store(0, &b, &blocks_b);
    assert_eq!((r.value, r.aux), (20, 0));
    let st = e.c.stats().unwrap();
    assert!(st.evicted_objects > 0 && st.pool_used_bytes <= st.pool_bytes);
    assert!(lookup(&mut e.c, 1, 0, &a).hits() < 20);
}

#[test]
fn tensor_parallel_ranks_store_and_retrieve_concurrently_and_mla_shares() {
    let s = Fixture::new("tp", Duration::from_secs(90), &KV_SERVER_ARGS);
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
        let lease = lookup(&mut sched, world, 0, &hashes);
        assert_eq!(lease.hits(), 8);
        let lease = lease.id();
        // Fresh caches, both ranks retrieving at once from one lease.
        let mut fresh: Vec<Engine> = (0..world).map(|r| Engine::new(&s, l, world, r)).collect();
        std::thread::scope(|sc| {
            for e in fresh.iter_mut() {
                let hashes = &hashes;
                sc.spawn(move || {
                    e.cache.fill(0x5a);
                    let dst = e.blocks(e.rank + 20, 8);
                    done(e.c.retrieve(Retrieve::new(&e.inst, lease, &dst)).unwrap());
                    e.verify(hashes, &dst, 0, 0x5a);
                });
            }
        });
        assert_eq!(sched.stats().unwrap().leases, 0);
        // The next layout is another geometry under the same model name:
        // the server refuses that while ranks of the old one are registered.
        for e in ranks.into_iter().chain(fresh) {
            let mut c = e.c;
            c.unregister(e.inst).unwrap();
        }
    }
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let s = Fixture::new("bad", Duration::from_secs(60), &KV_SERVER_ARGS);
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 16), 1, 0);
    let hashes = chunk_hashes(&prompt(3, CHUNK as usize), CHUNK);
    // Unknown instance, and another client's instance.
    let fake = e.inst.id() + 1000;
    expect_status(
        store_raw(&mut e.c, fake, &hashes, &[0; 4]),
        Status::UnknownInstance,
    );
    let mut other = s.client();
    expect_status(
        other.store(Store::new(&e.inst, &hashes, &[0; 4])),
        Status::UnknownInstance,
    );
    // Out-of-range block ids.
    expect_status(
        e.c.store(Store::new(&e.inst, &hashes, &[0, 1, 2, 16])),
        Status::InvalidArgument,
    );
    // Wrong lengths, sent raw: a truncated store, a lookup whose count lies.
    let send = |c: &mut Client, op: Opcode, payload: &[u8]| {
        let mut raw = c.raw();
        let h = FrameHeader {
            opcode: op as u16,
            session: raw.session(),
            user_data: 1,
            ..Default::default()
        };
        raw.submit_raw(h, payload, true).unwrap();
        raw.wait_completion(Instant::now() + Duration::from_secs(5))
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
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    expect_status(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks).skip_tokens(5)),
        Status::InvalidArgument,
    );
    let mut bad = layout(KvLayoutKind::FlashAttn, 2, 16);
    bad.block_tokens = 48;
    match HostKvCache::new(bad, CHUNK) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("does not divide"), "{m}"),
        other => panic!("expected a chunk-size error, got {:?}", other.map(|_| ())),
    }
    let cache = HostKvCache::new(layout(KvLayoutKind::FlashAttn, 2, 16), 32).unwrap();
    let mut spec = KvSpec::new(model_id(MODEL), 1, 0);
    let mut l = *cache.layout();
    l.block_tokens = 48;
    let regions = cache.regions();
    match e
        .c
        .register(&spec, l, Memory::Host(&regions), &[cache.fd()])
    {
        Err(Error::InvalidArgument(m)) => assert!(
            m.contains("does not divide the server's chunk size of 64"),
            "{m}"
        ),
        other => panic!("expected a chunk-size error, got {other:?}"),
    }
    l.block_tokens = 16;
    spec.rank = 3;
    match e
        .c
        .register(&spec, l, Memory::Host(&regions), &[cache.fd()])
    {
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
    match e.c.register(
        &spec,
        l,
        Memory::Host(&regions),
        &[std::os::fd::AsFd::as_fd(&unsealed)],
    ) {
        Err(Error::Registration { reason, .. }) => assert!(reason.contains("sealed"), "{reason}"),
        other => panic!("expected a seal error, got {other:?}"),
    }
    // Still serving, the same connection and others.
    assert_eq!(e.c.ping(b"alive", far()).unwrap(), b"alive");
    done(
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks))
            .unwrap(),
    );
    let id = e.inst.id();
    e.c.unregister(e.inst).unwrap();
    expect_status(
        store_raw(&mut e.c, id, &hashes, &blocks),
        Status::UnknownInstance,
    );
    assert!(matches!(
        e.c.raw().unregister(id),
        Err(Error::Registration {
            status: Status::UnknownInstance,
            ..
        })
    ));
}

#[test]
fn a_large_job_of_one_client_does_not_hold_up_another_clients_small_one() {
    // One copy worker: both clients' chunks queue for it.
    let s = Fixture::new(
        "fair",
        Duration::from_secs(60),
        &[
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "256MiB",
            "--copy-threads",
            "1",
        ],
    );
    // 2 MiB chunk objects, 100 of them: 200 MiB to copy.
    let big_layout = KvLayout::new(
        KvLayoutKind::FlashAttn,
        KvShape {
            layers: 8,
            heads: 8,
            head_dim: 128,
            ..layout(KvLayoutKind::FlashAttn, 2, 4 * 100).shape()
        },
        dtype(2),
    );
    let mut big = Engine::of_model(&s, "big-model", big_layout, 1, 0);
    let mut small = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 16), 1, 0);
    let many = chunk_hashes(&prompt(40, 100 * CHUNK as usize), CHUNK);
    let big_blocks: Vec<u32> = (0..100 * 4).collect();
    let one = chunk_hashes(&prompt(41, CHUNK as usize), CHUNK);
    let small_blocks = small.blocks(0, 1);
    small.write(&one, &small_blocks);
    // 100 chunks queued first, then one small chunk.
    let big_job = big
        .c
        .store(Store::new(&big.inst, &many, &big_blocks))
        .unwrap();
    let small_job = small
        .c
        .store(Store::new(&small.inst, &one, &small_blocks))
        .unwrap();
    let st = small_job
        .wait(Instant::now() + Duration::from_secs(30))
        .unwrap();
    assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
    // The small job finished while the big one was still copying.
    let big_now = big_job.status().unwrap();
    assert!(
        !big_now.is_terminal(),
        "the big job ended first: {big_now:?}"
    );
    let st = big_job
        .wait(Instant::now() + Duration::from_secs(50))
        .unwrap();
    assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
}

#[test]
fn a_request_over_the_servers_limit_is_refused_and_the_ring_goes_on() {
    let s = Fixture::new(
        "limit",
        Duration::from_secs(30),
        &[
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "16MiB",
            "--max-request-bytes",
            "64KiB",
        ],
    );
    let mut c = s.client();
    // 5000 hashes: 80 KB in six frames, over the 64 KiB limit.
    let long = chunk_hashes(&prompt(9, 5000 * CHUNK as usize), CHUNK);
    expect_status(
        c.lookup(Lookup::new(model_id(MODEL), 1, &long)),
        Status::BadLength,
    );
    // Just under it works, and so does everything after.
    let fits = &long[..4000];
    assert_eq!(lookup(&mut c, 1, 0, fits).hits(), 0);
    assert_eq!(c.ping(b"after", far()).unwrap(), b"after");
}

#[test]
fn dropped_handles_release_what_they_hold_with_the_next_request() {
    let s = Fixture::new("drop", Duration::from_secs(30), &KV_SERVER_ARGS);
    let mut e = Engine::new(&s, layout(KvLayoutKind::FlashAttn, 2, 64), 1, 0);
    let hashes = prompt_hashes(12, 2);
    let blocks = e.blocks(0, 2);
    e.write(&hashes, &blocks);
    // A finished store: released with the next request.
    let job = e.c.store(Store::new(&e.inst, &hashes, &blocks)).unwrap();
    let id = job.id();
    assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
    drop(job);
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    assert!(matches!(
        e.c.job_status(id).unwrap(),
        JobStatus::Tombstoned(Ok(_))
    ));
    // A lease with its holds: ended (and its lookup job released) with the
    // next request.
    let lookup_job = lease.id().job();
    assert_eq!(e.c.stats().unwrap().leases, 1);
    drop(lease);
    assert_eq!(e.c.stats().unwrap().leases, 0);
    assert!(matches!(
        e.c.job_status(lookup_job).unwrap(),
        JobStatus::Tombstoned(Ok(_))
    ));
    // A registration: unregistered with the next request.
    assert_eq!(e.c.stats().unwrap().instances, 1);
    let Engine { inst, mut c, .. } = e;
    drop(inst);
    assert_eq!(c.stats().unwrap().instances, 0);
}
