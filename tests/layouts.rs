//! Every KV-cache layout engines use, through one strided descriptor, with
//! the real `kvring` binary (host backend; the CUDA backend runs the same
//! layouts in `conformance.rs` and `cuda.rs` on a GPU machine). Caches are
//! allocated as each vLLM version does: one buffer for every layer (0.33,
//! 0.34), a tensor per layer (0.21, 0.24, 0.26). What is checked: a store,
//! the engine's blocks scribbled over, a retrieve into other blocks, byte
//! for byte; engines of different layouts and block sizes sharing stored
//! chunks; a hand-written descriptor with padding; and hostile descriptors
//! refused by the server with their reason, the server serving on.

mod common;

use common::*;
use kvring::kv::pattern::{self, KvMemory};
use kvring::kv::{model_id, KvGeometry, KvLayout, KvShape, LayerPlacement, LayoutPreset};
use kvring::proto::kv::MemoryPiece;
use kvring::proto::Status;
use kvring::{Client, Error, HostKvCache, KvSpec, Retrieve};
use std::time::Duration;

fn host_server(tag: &str) -> Fixture {
    Fixture::new(
        tag,
        Duration::from_secs(120),
        &[
            "--backend",
            "host",
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            "128MiB",
            "--copy-threads",
            "2",
        ],
    )
}

/// Every preset, fp8 / bf16 / fp32, and MLA in the one-buffer layouts: a
/// store, then the source blocks scribbled over, then a retrieve into other
/// blocks of the same cache, byte for byte (and the scribbles elsewhere
/// untouched).
#[test]
fn every_layout_survives_a_scribble_between_store_and_retrieve() {
    let s = host_server("scribble");
    let mut cases = Vec::new();
    for preset in LayoutPreset::ALL {
        for elem in [1, 2, 4] {
            cases.push(kv_layout(preset, elem, 40, 20));
        }
    }
    for preset in [
        LayoutPreset::Lbhnc,
        LayoutPreset::Blnhc,
        LayoutPreset::Lhbnc,
    ] {
        cases.push(mla_layout(preset, 1, 40, 72));
    }
    for (i, l) in cases.into_iter().enumerate() {
        let model = format!("scribble-{i}");
        let mut e = Engine::of_model(&s, &model, l.clone(), 1, 0);
        let hashes = prompt_hashes(i as u32, 3);
        let bpc = e.bpc();
        let src: Vec<u32> = (0..3 * bpc).collect();
        e.write(&hashes, &src);
        assert_eq!(e.store(0, &hashes, &src).value, 3, "{l:?}");
        e.cache.fill(0x5a);
        let lease =
            e.c.lookup(kvring::Lookup::new(model_id(&model), 1, &hashes))
                .unwrap();
        assert_eq!(lease.hits(), 3);
        let dst: Vec<u32> = (0..3 * bpc).map(|b| 39 - b).collect();
        assert!(dst.iter().all(|b| !src.contains(b)));
        done(e.c.retrieve(Retrieve::new(&e.inst, &lease, &dst)).unwrap());
        e.verify(&hashes, &dst, 0, 0);
        // The source blocks still hold the scribble.
        for b in src.chunks(e.bpc() as usize) {
            let want = vec![0x5a; l.object_bytes(CHUNK) as usize];
            let mut got = vec![0; want.len()];
            e.cache.read_runs(&pattern::chunk_runs(&l, b), &mut got);
            assert!(
                got == want,
                "{:?}: a source block was written",
                l.preset_name()
            );
        }
    }
}

/// A chunk stored from an engine of each layout is retrieved by an engine
/// of every layout (and of another block size), byte for byte: one object
/// format for all.
#[test]
fn engines_of_every_layout_share_each_others_chunks() {
    let s = host_server("mixed");
    let shape = KvShape {
        layers: 2,
        blocks: 20,
        block_tokens: 16,
        heads: 2,
        head_dim: 16,
    };
    let g = KvGeometry::mha(shape, kvring::kv::Dtype::Bf16);
    let mut mha: Vec<KvLayout> = LayoutPreset::ALL
        .into_iter()
        .filter_map(|p| KvLayout::preset(p, g).ok())
        .collect();
    assert_eq!(mha.len(), LayoutPreset::ALL.len() - 1, "all but MLA's");
    let mla = KvGeometry::mla(2, 20, 16, 40, kvring::kv::Dtype::Bf16);
    let mut mla_layouts: Vec<KvLayout> =
        [LayoutPreset::Mla, LayoutPreset::Lbnhc, LayoutPreset::Bhlnc]
            .into_iter()
            .map(|p| KvLayout::preset(p, mla).unwrap())
            .collect();
    // Another block size reads every family's chunks too.
    for family in [&mut mha, &mut mla_layouts] {
        let other = family[0].geometry().with_blocks(40).with_block_tokens(8);
        family.push(KvLayout::preset(LayoutPreset::Lbhnc, other).unwrap());
    }
    let mut sched = s.client();
    let mut seed = 0;
    for (f, family) in [mha, mla_layouts].into_iter().enumerate() {
        let model = format!("mixed-{f}");
        let mut engines: Vec<Engine> = family
            .iter()
            .map(|l| Engine::of_model(&s, &model, l.clone(), 1, 0))
            .collect();
        for i in 0..engines.len() {
            seed += 1;
            let hashes = prompt_hashes(1000 + seed, 1);
            let src = engines[i].blocks(seed % 7, 1);
            engines[i].write(&hashes, &src);
            assert_eq!(engines[i].store(0, &hashes, &src).value, 1);
            for to in engines.iter_mut() {
                let lease = sched
                    .lookup(kvring::Lookup::new(model_id(&model), 1, &hashes))
                    .unwrap();
                assert_eq!(lease.hits(), 1);
                to.cache.fill(0xee);
                let dst = to.blocks(3 + seed % 5, 1);
                done(
                    to.c.retrieve(Retrieve::new(&to.inst, &lease, &dst))
                        .unwrap(),
                );
                let _ = lease.into_id();
                if let Err(e) =
                    pattern::verify_chunk(&to.cache, to.content(), &hashes[0], &dst, 0, 0xee)
                {
                    panic!(
                        "stored from {:?}, retrieved into {:?}: {e}",
                        family[i].preset_name(),
                        to.cache.layout().preset_name()
                    );
                }
            }
        }
    }
}

/// vLLM places each layer at `offset + l * layer_stride` of one buffer,
/// pages padded to an alignment: a descriptor written by hand from such
/// strides (here K and V pages apart, 4 KiB of padding after each layer,
/// the cache 64 KiB into its allocation) registers and round-trips.
#[test]
fn a_hand_written_descriptor_with_padding_round_trips() {
    let s = host_server("padded");
    let shape = KvShape {
        layers: 3,
        blocks: 24,
        block_tokens: 16,
        heads: 2,
        head_dim: 32,
    };
    let g = KvGeometry::mha(shape, kvring::kv::Dtype::Bf16);
    let (kb, n, h) = (g.k_bytes(), 16u64, 2u64);
    // Per block: a K page [N][H][D], then a V page: `[B][2][N][H][D]`.
    let block = 2 * n * h * kb;
    let layer = 24 * block + 4096;
    let start = 64 << 10;
    let layers = (0..3)
        .map(|l| {
            let k = start + l * layer;
            LayerPlacement::new(0, k, k + n * h * kb, block, kb, h * kb)
        })
        .collect();
    let l = KvLayout::new(g, vec![start + 3 * layer], layers);
    l.validate(CHUNK).unwrap();
    round_trip(
        &s,
        &mut s.client(),
        l.clone(),
        || HostKvCache::new(l.clone(), CHUNK).unwrap(),
        9,
    );
}

/// What a registration of `layout` in a cache of `real`'s memory gets from
/// the server when the client does not check it first.
fn register_raw(c: &mut Client, layout: &KvLayout, real: &HostKvCache) -> kvring::Result<u32> {
    c.raw().register(
        &KvSpec::new(model_id(MODEL), 1, 0),
        layout,
        &real.memory(),
        &[real.fd()],
    )
}

/// A change to a descriptor's placements, allocation sizes and geometry.
type Edit<'a> = dyn Fn(&mut Vec<LayerPlacement>, &mut Vec<u64>, &mut KvGeometry) + 'a;

/// Descriptors that would make a copy read or write outside the registered
/// memory, or two rows share bytes, are refused by the server itself (the
/// client's own check bypassed), each with its reason; the server serves on.
#[test]
fn hostile_descriptors_are_refused_by_the_server_with_their_reason() {
    let s = host_server("hostile-layouts");
    let mut c = s.client();
    let good = small_layout();
    let cache = HostKvCache::new(good.clone(), CHUNK).unwrap();
    let g = *good.geometry();
    let edit = |f: &Edit<'_>| {
        let (mut p, mut a, mut g) = (good.layers().to_vec(), good.allocations().to_vec(), g);
        f(&mut p, &mut a, &mut g);
        KvLayout::new(g, a, p)
    };
    let size = good.allocations()[0];
    let cases: Vec<(&str, KvLayout, &str)> = vec![
        (
            "overflowing strides",
            edit(&|p, _, _| p[1].block_stride = u64::MAX / 3),
            "overflow",
        ),
        (
            "a view past the allocation",
            edit(&|p, _, _| {
                p[1].k_offset += 1 << 20;
                p[1].v_offset += 1 << 20;
            }),
            "past the",
        ),
        (
            "a window larger than the memory",
            edit(&|_, a, _| a[0] = size + (1 << 20)),
            "exceeds the memory object",
        ),
        (
            "K and V overlapping",
            edit(&|p, _, _| p[0].v_offset = p[0].k_offset + 8),
            "layer 0 K and layer 0 V share bytes",
        ),
        (
            "two layers on the same bytes",
            edit(&|p, _, _| p[1] = p[0]),
            "share bytes",
        ),
        (
            "a zero stride",
            edit(&|p, _, _| p[0].token_stride = 0),
            "same bytes",
        ),
        ("zero blocks", edit(&|_, _, g| g.blocks = 0), "0 blocks"),
        ("zero heads", edit(&|_, _, g| g.heads = 0), "0 heads"),
        ("an empty allocation", edit(&|_, a, _| a[0] = 0), "0 bytes"),
        (
            "a layer in an allocation not given",
            edit(&|p, _, _| p[1].alloc = 1),
            "allocation 1 named",
        ),
        (
            "a geometry with more layers than placements",
            edit(&|_, _, g| g.layers = 1),
            "length differs",
        ),
    ];
    for (what, l, reason) in &cases {
        match register_raw(&mut c, l, &cache) {
            Err(Error::Registration { status, reason: r }) => {
                assert!(
                    matches!(status, Status::InvalidArgument | Status::Malformed),
                    "{what}: {status:?}"
                );
                assert!(r.contains(reason), "{what}: {r}");
            }
            other => panic!("{what}: accepted ({other:?})"),
        }
    }
    // Device memory on a host server, and VMM chunks that were not sent.
    let chunks = [MemoryPiece {
        first_fd: 0,
        n_fds: 4,
        fd_offset: 0,
        fd_bytes: 20 << 20,
    }];
    let vmm = kvring::client::Memory::cuda_vmm([(0, &chunks[..])]);
    match c.raw().register(
        &KvSpec::new(model_id(MODEL), 1, 0),
        &good,
        &vmm,
        &[cache.fd()],
    ) {
        Err(Error::Registration { reason, .. }) => {
            assert!(reason.contains("descriptors 0..+4 of 1 sent"), "{reason}")
        }
        other => panic!("VMM chunks not sent: {other:?}"),
    }
    // The client refuses the same descriptors before sending them.
    match c.register(
        &KvSpec::new(model_id(MODEL), 1, 0),
        &cases[1].1,
        &cache.memory(),
        &[cache.fd()],
    ) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("past the"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Still serving: the good descriptor registers and round-trips.
    assert_eq!(c.stats().unwrap().instances, 0);
    round_trip(
        &s,
        &mut c,
        good.clone(),
        || HostKvCache::new(good.clone(), CHUNK).unwrap(),
        3,
    );
}

/// The largest registration message: 1024 layers, each its own tensor
/// (1024 allocations), goes through the bootstrap socket, is accepted and
/// round-trips.
#[test]
fn a_registration_of_1024_per_layer_tensors_round_trips() {
    let s = host_server("max-registration");
    let g = KvGeometry::mha(
        KvShape {
            layers: kvring::kv::geometry::MAX_LAYERS,
            blocks: 20,
            block_tokens: 16,
            heads: 1,
            head_dim: 4,
        },
        kvring::kv::Dtype::Bf16,
    );
    let l = KvLayout::preset(LayoutPreset::FlashAttn, g).unwrap();
    assert_eq!(l.allocations().len(), kvring::kv::layout::MAX_ALLOCATIONS);
    round_trip(
        &s,
        &mut s.client(),
        l.clone(),
        || HostKvCache::new(l.clone(), CHUNK).unwrap(),
        4,
    );
}
