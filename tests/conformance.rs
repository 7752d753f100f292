//! What every copy backend of the cache server does the same way, written
//! once, generic over [`Backend`] (the server's backend and the engines'
//! caches), and run against each: the host backend (module `host`), the
//! host backend with two simulated devices (`simulated_devices`) and the
//! CUDA backend with GPU caches (`cuda`; ignored unless asked for with
//! `--include-ignored`, and failing, saying why, where there is no GPU).
//!
//! Every retrieve is checked byte for byte against the deterministic
//! contents the storing engine wrote, into caches poisoned beforehand.
//! What only one backend does (a client killed mid-store, fairness between
//! clients, malformed requests; the engine's CUDA events, the zero-copy
//! path) is tested in `kv.rs` and `cuda.rs`.

mod common;

use common::*;
use kvring::jobs::{JobId, JobResult, JobStatus};
use kvring::kv::pattern::{self, KvMemory};
use kvring::kv::{chunk_hashes, model_id, salt_id, KvLayout, LayoutPreset};
use kvring::proto::Status;
use kvring::{LeaseId, Lookup, Retrieve};
use std::time::{Duration, Instant};

/// A 3-layer layout `preset` with the backend's head size.
fn layout<B: Backend>(preset: LayoutPreset, elem_bytes: u32, num_blocks: u32) -> KvLayout {
    kv_layout(preset, elem_bytes, num_blocks, B::HEAD_DIM)
}

fn every_layout_and_element_size_round_trips_byte_for_byte<B: Backend>() {
    let s = B::fixture("layouts", Duration::from_secs(300), B::POOL);
    let mut sched = s.client();
    assert_eq!(sched.server_config().unwrap().backend, B::KIND.raw());
    // Every named layout (vLLM 0.21 to 0.34), fp8, 16- and 32-bit
    // elements; MLA in the one-buffer layouts of 0.33+ too.
    let mut cases: Vec<KvLayout> = Vec::new();
    for preset in LayoutPreset::ALL {
        for elem in [1, 2, 4] {
            cases.push(layout::<B>(preset, elem, 48));
        }
    }
    for preset in [
        LayoutPreset::Lbnhc,
        LayoutPreset::Blhnc,
        LayoutPreset::Bhlnc,
    ] {
        cases.push(mla_layout(preset, 1, 48, B::HEAD_DIM + 8));
    }
    for (i, l) in cases.into_iter().enumerate() {
        round_trip(
            &s,
            &mut sched,
            l.clone(),
            || B::new_cache(l.clone(), 0),
            i as u32 + 1,
        );
    }
    let st = sched.stats().unwrap();
    assert_eq!(st.instances, 0);
    assert_eq!(st.leases, 0, "every lease was used up by its retrieve");
}

fn layouts_of_one_geometry_share_objects_and_skip_tokens_leave_blocks_alone<B: Backend>() {
    let s = B::fixture("share", Duration::from_secs(120), B::POOL);
    // Stored from a cache in vLLM 0.33's default layout, retrieved into a
    // block-outermost one with a smaller block size and into vLLM 0.21's
    // per-layer tensors: the object format is layout-independent.
    let lbnhc = layout::<B>(LayoutPreset::Lbnhc, 2, 64);
    let g8 = lbnhc.geometry().with_blocks(128).with_block_tokens(8);
    let blhnc = KvLayout::preset(LayoutPreset::Blhnc, g8).unwrap();
    let fa = layout::<B>(LayoutPreset::FlashAttn, 2, 64);
    let mut a = B::engine(&s, lbnhc.clone(), 1, 0, 0);
    let hashes = chunk_hashes(&prompt(5, 3 * CHUNK as usize), CHUNK);
    let src = a.blocks(0, 3);
    a.write(&hashes, &src);
    a.store(0, &hashes, &src);
    // What the first engine holds, chunk by chunk, in object order.
    let bpc_a = a.bpc() as usize;
    let objects: Vec<Vec<u8>> = src
        .chunks(bpc_a)
        .map(|b| {
            let mut o = vec![0u8; lbnhc.object_bytes(CHUNK) as usize];
            a.cache.read_runs(&pattern::chunk_runs(&lbnhc, b), &mut o);
            o
        })
        .collect();
    for (other, skip) in [(blhnc, 40), (fa, 16)] {
        let mut b = B::engine(&s, other.clone(), 1, 0, 0);
        b.cache.poison(0x11);
        let lease = lookup(&mut b.c, 1, 0, &hashes);
        assert_eq!(lease.hits(), 3);
        let dst = b.blocks(5, 3);
        // Skip the first tokens (whole blocks): they stay as they were.
        done(
            b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst).skip_tokens(skip))
                .unwrap(),
        );
        let g = other.geometry();
        let row = g.row_bytes() as usize;
        for (c, blocks) in dst.chunks(b.bpc() as usize).enumerate() {
            let mut got = vec![0u8; other.object_bytes(CHUNK) as usize];
            b.cache
                .read_runs(&pattern::chunk_runs(&other, blocks), &mut got);
            for (i, (x, y)) in objects[c].chunks(row).zip(got.chunks(row)).enumerate() {
                let (layer_token, _head) = (i / g.heads as usize, i % g.heads as usize);
                let token = c * CHUNK as usize + layer_token % CHUNK as usize;
                if token < skip as usize {
                    assert!(
                        y.iter().all(|&v| v == 0x11),
                        "{other:?}: token {token} overwritten"
                    );
                } else {
                    assert_eq!(x, y, "{:?}: row {i} of chunk {c}", other.preset_name());
                }
            }
        }
    }
}

/// A STORE whose last chunk has fewer blocks (a prompt's tail): its blocks
/// round-trip byte for byte, and the rest of its object reads as zeros, not
/// as the bytes an earlier object left in that pool space.
fn a_short_last_chunk_round_trips_and_the_rest_of_its_object_is_zeros<B: Backend>() {
    let s = B::fixture("short", Duration::from_secs(120), B::POOL);
    let l = layout::<B>(LayoutPreset::Lbnhc, 2, 64);
    let mut a = B::engine(&s, l.clone(), 1, 0, 0);
    let bpc = a.bpc() as usize;
    assert!(bpc >= 2, "the test needs chunks of several blocks");
    // The pool space first holds another prompt's objects, then is freed.
    let before = chunk_hashes(&prompt(41, 4 * CHUNK as usize), CHUNK);
    let blocks = a.blocks(0, 4);
    a.write(&before, &blocks);
    assert_eq!(a.store(0, &before, &blocks).value, 4);
    a.c.clear().unwrap();
    // Two chunks, the second of half its blocks.
    let m = bpc / 2;
    let hashes = chunk_hashes(&prompt(42, 2 * CHUNK as usize), CHUNK);
    let src = a.blocks(0, 2)[..bpc + m].to_vec();
    a.write(&hashes, &src);
    assert_eq!(a.store(0, &hashes, &src).value, 2);
    let mut b = B::engine(&s, l.clone(), 1, 0, 0);
    b.cache.poison(0x5a);
    let lease = lookup(&mut b.c, 1, 0, &hashes);
    assert_eq!(lease.hits(), 2);
    let dst = b.blocks(10, 2)[..bpc + m].to_vec();
    done(b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst)).unwrap());
    b.verify(&hashes, &dst, 0, 0x5a);
    // The second object whole: its first blocks as stored, then zeros.
    let lease = lookup(&mut b.c, 1, 0, &hashes);
    let whole = b.blocks(30, 2);
    done(
        b.c.retrieve(Retrieve::new(&b.inst, &lease, &whole))
            .unwrap(),
    );
    b.verify(&hashes[1..], &whole[bpc..bpc + m], 0, 0x5a);
    let rest = &whole[bpc + m..];
    let mut got =
        vec![
            0xffu8;
            rest.len() * l.geometry().page_bytes() as usize * l.geometry().layers as usize
        ];
    b.cache.read_runs(&pattern::chunk_runs(&l, rest), &mut got);
    assert!(
        got.iter().all(|&v| v == 0),
        "the rows past a short chunk's blocks are not zeros"
    );
}

fn lookups_find_the_longest_stored_prefix_per_salt<B: Backend>() {
    let s = B::fixture("prefix", Duration::from_secs(60), B::POOL);
    let mut e = B::engine(&s, layout::<B>(LayoutPreset::Lbnhc, 2, 64), 1, 0, 0);
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

fn retrieve_needs_a_lease_and_uses_it_once<B: Backend>() {
    let s = B::fixture("lease", Duration::from_secs(60), B::POOL);
    let mut e = B::engine(&s, layout::<B>(LayoutPreset::Lbnhc, 2, 64), 1, 0, 0);
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

fn a_retrieve_in_layer_groups_lands_group_after_group_byte_for_byte<B: Backend>() {
    let s = B::fixture("groups", Duration::from_secs(120), B::POOL);
    let l = layout::<B>(LayoutPreset::Lbnhc, 2, 64);
    let layers = l.geometry().layers;
    assert_eq!(layers, 3);
    let mut a = B::engine(&s, l.clone(), 1, 0, 0);
    let hashes = chunk_hashes(&prompt(9, 3 * CHUNK as usize), CHUNK);
    let src = a.blocks(0, 3);
    a.write(&hashes, &src);
    a.store(0, &hashes, &src);
    let mut b = B::engine(&s, l.clone(), 1, 0, 0);
    let dst = b.blocks(7, 3);
    // No groups, or more groups than layers: refused before anything is
    // sent (the server refuses them too: `kv.rs`).
    let lease = lookup(&mut b.c, 1, 0, &hashes);
    for bad in [0, layers + 1] {
        let r =
            b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst).layer_groups(bad));
        assert!(
            matches!(r, Err(kvring::Error::InvalidArgument(_))),
            "{bad}: {r:?}"
        );
    }
    b.c.end_lease(lease).unwrap();
    let skip = 16;
    for groups in [layers, 2, 1] {
        b.cache.poison(0x5a);
        let lease = lookup(&mut b.c, 1, 0, &hashes);
        let job =
            b.c.retrieve(
                Retrieve::new(&b.inst, &lease, &dst)
                    .layer_groups(groups)
                    .skip_tokens(skip),
            )
            .unwrap();
        assert_eq!(job.layer_groups(), groups);
        for k in 0..groups {
            job.wait_layer_group(k, far()).unwrap();
            assert!(
                (0..=k).all(|j| job.layer_group_landed(j)),
                "{groups} groups: {k}"
            );
        }
        let r = done(job);
        assert_eq!(r.value, 3);
        let skipped = u64::from(skip / l.geometry().block_tokens) * u64::from(layers);
        let pages = 3 * u64::from(b.bpc()) * u64::from(layers) - skipped;
        assert_eq!(r.aux, pages * l.geometry().page_bytes(), "{groups} groups");
        b.verify(&hashes, &dst, skip / l.geometry().block_tokens, 0x5a);
        let _ = lease.into_id();
    }
}

fn eviction_under_pressure_never_takes_leased_objects<B: Backend>() {
    // Each object is 3 layers * 2 parts * 64 tokens * 96 B = 36 KiB (the
    // same rows on every backend): a 1 MiB pool holds 28.
    let s = B::fixture("evict", Duration::from_secs(60), "1MiB");
    let l = kv_layout(LayoutPreset::Lbnhc, 2, 256, 24);
    let mut e = B::engine(&s, l.clone(), 1, 0, 0);
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
    let mut f = B::engine(&s, l.clone(), 1, 0, 0);
    f.cache.poison(0);
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

fn tensor_parallel_ranks_store_and_retrieve_concurrently_and_mla_shares<B: Backend>() {
    let s = B::fixture("tp", Duration::from_secs(120), B::POOL);
    let mut total_objects = 0;
    for (seed, l) in [
        layout::<B>(LayoutPreset::Lbnhc, 2, 64),
        mla_layout(LayoutPreset::Lbnhc, 2, 64, B::HEAD_DIM),
    ]
    .into_iter()
    .enumerate()
    {
        let shared = l.geometry().shared();
        let hashes = chunk_hashes(&prompt(seed as u32, 8 * CHUNK as usize), CHUNK);
        let world = 2;
        // Two ranks, each its own connection and thread, storing at once.
        let mut ranks: Vec<_> = (0..world)
            .map(|r| B::engine(&s, l.clone(), world, r, 0))
            .collect();
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
        total_objects += if shared { 8 } else { 16 };
        assert_eq!(ranks[0].c.stats().unwrap().objects, total_objects, "{l:?}");
        let mut sched = s.client();
        let lease = lookup(&mut sched, world, 0, &hashes);
        assert_eq!(lease.hits(), 8);
        let lease = lease.id();
        // Fresh caches, both ranks retrieving at once from one lease.
        let mut fresh: Vec<_> = (0..world)
            .map(|r| B::engine(&s, l.clone(), world, r, 0))
            .collect();
        std::thread::scope(|sc| {
            for e in fresh.iter_mut() {
                let hashes = &hashes;
                sc.spawn(move || {
                    e.cache.poison(0x5a);
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

/// Rounds of the two-device scenario.
const DEVICE_ROUNDS: u32 = 20;

fn tensor_parallel_ranks_on_two_devices_store_and_retrieve_concurrently<B: Backend>() {
    let s = B::fixture("tp-devices", Duration::from_secs(120), B::POOL);
    let l = small_layout();
    std::thread::scope(|sc| {
        let ranks: Vec<_> = (0..2u32)
            .map(|rank| {
                let (s, l) = (&s, &l);
                sc.spawn(move || {
                    // Rank r runs on device r: its cache, and a fresh one
                    // to retrieve into, registered with world size 2.
                    let mut e = B::engine(s, l.clone(), 2, rank, rank);
                    let mut fresh = B::engine(s, l.clone(), 2, rank, rank);
                    let bpc = e.bpc();
                    for round in 0..DEVICE_ROUNDS {
                        let hs = prompt_hashes(round, 8);
                        let blocks: Vec<u32> = (0..8 * bpc).collect();
                        e.write(&hs, &blocks);
                        assert_eq!(e.store(0, &hs, &blocks).value, 8);
                        // A lookup hits only once both ranks stored: poll.
                        let deadline = far();
                        let lease = loop {
                            let lease = e.c.lookup(Lookup::new(model_id(MODEL), 2, &hs)).unwrap();
                            if lease.hits() == 8 {
                                break lease;
                            }
                            // (A lookup without a hit has no lease.)
                            let id = lease.into_id();
                            let _ = e.c.end_lease_id(id);
                            e.c.release_job(id.job()).unwrap();
                            assert!(Instant::now() < deadline, "the other rank never stored");
                            std::thread::sleep(Duration::from_millis(1));
                        };
                        fresh.cache.poison(0xc3);
                        let db: Vec<u32> = (8 * bpc..16 * bpc).collect();
                        let r = done(
                            fresh
                                .c
                                .retrieve(Retrieve::new(&fresh.inst, lease.id(), &db))
                                .unwrap(),
                        );
                        assert_eq!(r.value, 8);
                        // This rank's own lookup also held the other rank's
                        // chunks: end it.
                        let lease = lease.into_id();
                        e.c.end_lease_id(lease).unwrap();
                        e.c.release_job(lease.job()).unwrap();
                        for (h, b) in hs.iter().zip(db.chunks(bpc as usize)) {
                            kvring::kv::pattern::verify_chunk(&fresh.cache, rank, h, b, 0, 0xc3)
                                .unwrap_or_else(|e| panic!("rank {rank} round {round}: {e}"));
                        }
                    }
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    });
    let mut c = s.client();
    let st = c.stats().unwrap();
    assert_eq!(st.stored_chunks, 2 * 8 * u64::from(DEVICE_ROUNDS), "{st:?}");
    assert_eq!(st.leases, 0);
}

/// One test per scenario for `$backend`, in module `$module`, each with
/// the attributes in brackets; the scenarios after `devices:` run only on
/// backends with more than one device.
macro_rules! conformance {
    ($module:ident, $backend:ty, [$(#[$attr:meta])*] $(, devices: $($device_test:ident),*)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            conformance!(@tests $backend, [$(#[$attr])*],
                every_layout_and_element_size_round_trips_byte_for_byte,
                layouts_of_one_geometry_share_objects_and_skip_tokens_leave_blocks_alone,
                lookups_find_the_longest_stored_prefix_per_salt,
                a_short_last_chunk_round_trips_and_the_rest_of_its_object_is_zeros,
                retrieve_needs_a_lease_and_uses_it_once,
                eviction_under_pressure_never_takes_leased_objects,
                a_retrieve_in_layer_groups_lands_group_after_group_byte_for_byte,
                tensor_parallel_ranks_store_and_retrieve_concurrently_and_mla_shares
                $($(, $device_test)*)?
            );
        }
    };
    (@tests $backend:ty, $attrs:tt, $($scenario:ident),*) => {
        $(conformance!(@test $backend, $attrs, $scenario);)*
    };
    (@test $backend:ty, [$(#[$attr:meta])*], $scenario:ident) => {
        #[test]
        $(#[$attr])*
        fn $scenario() {
            super::$scenario::<$backend>();
        }
    };
}

conformance!(host, Host, []);
conformance!(
    simulated_devices,
    SimulatedDevices,
    [],
    devices: tensor_parallel_ranks_on_two_devices_store_and_retrieve_concurrently
);
#[cfg(feature = "cuda")]
conformance!(
    cuda,
    Cuda,
    [#[ignore = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)"]],
    devices: tensor_parallel_ranks_on_two_devices_store_and_retrieve_concurrently
);
