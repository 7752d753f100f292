//! The cache server end to end with real processes: the `kvring` binary as
//! the server, engines as clients of this process (and of child processes
//! that get killed). What the host backend is tested for beyond the
//! conformance suite every backend passes (`conformance.rs`): clients that
//! die mid-job, malformed requests, fairness between clients, request
//! limits, dropped handles. Every retrieve is checked byte for byte against
//! the deterministic contents the storing engine wrote.

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, ChunkHash, KvGeometry, KvLayout, KvShape, LayoutPreset};
use kvring::proto::kv::{RetrieveRequest, StoreRequest};
use kvring::proto::{Opcode, Status};
use kvring::ring::FrameHeader;
use kvring::{Client, Error, HostKvCache, KvSpec, Lookup, Retrieve, Store};
use std::time::{Duration, Instant};

fn layout(preset: LayoutPreset, elem_bytes: u32, num_blocks: u32) -> KvLayout {
    kv_layout(preset, elem_bytes, num_blocks, 24)
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
            let l = layout(LayoutPreset::Lbnhc, 4, 4096);
            let cache = HostKvCache::new(l.clone(), CHUNK).unwrap();
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
    let mut e = Engine::new(&s, layout(LayoutPreset::Lbnhc, 4, 64), 1, 0);
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
    let mut f = Engine::new(&s, layout(LayoutPreset::Lbnhc, 4, 64), 1, 0);
    let dst = f.blocks(9, 4);
    done(f.c.retrieve(Retrieve::new(&f.inst, &lease, &dst)).unwrap());
    f.verify(&hashes, &dst, 0, 0);
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let s = Fixture::new("bad", Duration::from_secs(60), &KV_SERVER_ARGS);
    let mut e = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 16), 1, 0);
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
    // Block counts a STORE's chunks cannot have, sent raw (the client
    // library refuses them before sending): more than its chunks hold, and
    // a last chunk of no block.
    let two = chunk_hashes(&prompt(3, 2 * CHUNK as usize), CHUNK);
    let bpc = e.bpc() as usize;
    for n in [2 * bpc + 1, bpc] {
        expect_status(
            store_raw(&mut e.c, e.inst.id(), &two, &vec![0; n]),
            Status::BadLength,
        );
        assert!(matches!(
            e.c.store(Store::new(&e.inst, &two, &vec![0; n])),
            Err(Error::InvalidArgument(_))
        ));
    }
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
    // More layer groups than the layout has layers (the client library
    // refuses them before sending; sent raw, the server does).
    let mut h: RetrieveRequest = bytemuck::Zeroable::zeroed();
    h.lease = kvring::LeaseId::from(&lease).job();
    h.instance = e.inst.id();
    h.n_chunks = 1;
    h.layer_groups = e.inst.layout().geometry().layers + 1;
    let mut payload = bytemuck::bytes_of(&h).to_vec();
    payload.extend_from_slice(bytemuck::cast_slice(&blocks));
    expect_status(
        e.c.raw().call_large(Opcode::Retrieve, &payload, far()),
        Status::InvalidArgument,
    );
    let l16 = layout(LayoutPreset::Lbnhc, 2, 16);
    let bad = KvLayout::preset(LayoutPreset::Lbnhc, l16.geometry().with_block_tokens(48)).unwrap();
    match HostKvCache::new(bad.clone(), CHUNK) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("does not divide"), "{m}"),
        other => panic!("expected a chunk-size error, got {:?}", other.map(|_| ())),
    }
    let cache = HostKvCache::new(bad.clone(), 48).unwrap();
    let mut spec = KvSpec::new(model_id(MODEL), 1, 0);
    match e.c.register(&spec, &bad, &cache.memory(), &[cache.fd()]) {
        Err(Error::InvalidArgument(m)) => assert!(
            m.contains("does not divide the server's chunk size of 64"),
            "{m}"
        ),
        other => panic!("expected a chunk-size error, got {other:?}"),
    }
    let cache = HostKvCache::new(l16.clone(), CHUNK).unwrap();
    let l = cache.layout().clone();
    spec.rank = 3;
    match e.c.register(&spec, &l, &cache.memory(), &[cache.fd()]) {
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
        &l,
        &cache.memory(),
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
fn a_retrieve_writes_each_block_once_and_its_skipped_blocks_may_repeat() {
    let s = Fixture::new("once", Duration::from_secs(60), &KV_SERVER_ARGS);
    let mut a = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 64), 1, 0);
    let bpc = a.bpc() as usize;
    assert!(bpc >= 2, "the test needs chunks of several blocks");
    let hashes = chunk_hashes(&prompt(11, 2 * CHUNK as usize), CHUNK);
    let blocks = a.blocks(0, 2);
    a.write(&hashes, &blocks);
    assert_eq!(a.store(0, &hashes, &blocks).value, 2);
    let mut b = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 64), 1, 0);
    b.cache.poison(0x5a);
    // One block written twice: refused before anything is copied, and the
    // lease still holds its chunks.
    let mut sched = s.client();
    let lease = lookup(&mut sched, 1, 0, &hashes);
    let mut twice = b.blocks(20, 2);
    twice[bpc + 1] = twice[1];
    expect_status(
        b.c.retrieve(Retrieve::new(&b.inst, &lease, &twice)),
        Status::InvalidArgument,
    );
    // The first chunk and one block of the second skipped, all named as
    // block 0 (as a state group's null blocks are): only the rest lands,
    // and block 0 keeps its poison.
    let mut dst = b.blocks(20, 2);
    dst[..=bpc].fill(0);
    let bt = b.inst.layout().geometry().block_tokens;
    let r = done(
        b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst).skip_tokens((bpc as u32 + 1) * bt))
            .unwrap(),
    );
    assert_eq!(r.value, 2);
    b.verify(&hashes, &dst, bpc as u32 + 1, 0x5a);
    let _ = lease.into_id();
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
    let big_layout = KvLayout::preset(
        LayoutPreset::Lbnhc,
        KvGeometry::mha(
            KvShape {
                layers: 8,
                blocks: 4 * 100,
                block_tokens: 16,
                heads: 8,
                head_dim: 128,
            },
            dtype(2),
        ),
    )
    .unwrap();
    let mut big = Engine::of_model(&s, "big-model", big_layout, 1, 0);
    let mut small = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 16), 1, 0);
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

/// An engine that stores a prompt of 100 chunks of 2 MiB (one copy
/// worker: 200 MiB to copy, tens of milliseconds at least).
fn big_store_engine(s: &Scope) -> Engine {
    let l = KvLayout::preset(
        LayoutPreset::Lbnhc,
        KvGeometry::mha(
            KvShape {
                layers: 8,
                blocks: 4 * 100,
                block_tokens: 16,
                heads: 8,
                head_dim: 128,
            },
            dtype(2),
        ),
    )
    .unwrap();
    Engine::of_model(s, MODEL, l, 1, 0)
}

#[test]
fn a_lookup_waits_for_a_prefix_being_stored() {
    // (--inflight-wait-s, whether a lookup submitted while the store
    // copies finds the whole prefix): it waits for it; it never waits (the
    // negative control: it misses what is being written).
    for (wait, whole) in [("5", true), ("0", false)] {
        let s = Fixture::new(
            "inflight",
            Duration::from_secs(60),
            &[
                "--chunk-tokens",
                "64",
                "--pool-bytes",
                "256MiB",
                "--copy-threads",
                "1",
                "--inflight-wait-s",
                wait,
            ],
        );
        let mut writer = big_store_engine(&s);
        // Another engine of the model (the lease is its own), its cache
        // poisoned: what it retrieves must be the writer's bytes.
        let mut reader = big_store_engine(&s);
        reader.cache.poison(0x5a);
        let hashes = chunk_hashes(&prompt(42, 100 * CHUNK as usize), CHUNK);
        let blocks = writer.blocks(0, 100);
        writer.write(&hashes, &blocks);
        let store = writer
            .c
            .store(Store::new(&writer.inst, &hashes, &blocks))
            .unwrap();
        let copying_before = !store.status().unwrap().is_terminal();
        let t0 = Instant::now();
        let lease = lookup(&mut reader.c, 1, 0, &hashes);
        let answered = t0.elapsed();
        let copying_after = !store.status().unwrap().is_terminal();
        let st = store
            .wait(Instant::now() + Duration::from_secs(30))
            .unwrap();
        assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
        eprintln!(
            "--inflight-wait-s {wait}: {} of 100 chunks, answered in {answered:?} \
             (store copying before: {copying_before}, after: {copying_after})",
            lease.hits()
        );
        if whole {
            // Submitted while the store was under way (else nothing to wait for).
            if !copying_before {
                eprintln!("the store ended before the lookup: not measured");
                continue;
            }
            assert_eq!(lease.hits(), 100, "the lookup did not wait for the prefix");
            // The reader's retrieve gets the bytes the writer stored.
            let dst = reader.blocks(5, 100);
            done(
                reader
                    .c
                    .retrieve(Retrieve::new(&reader.inst, &lease, &dst))
                    .unwrap(),
            );
            reader.verify(&hashes, &dst, 0, 0);
        } else if copying_after {
            assert!(
                lease.hits() < 100,
                "the lookup found every chunk of a store still under way"
            );
        } else {
            eprintln!("the store ended before the answer: not measured");
        }
    }
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
    let mut e = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 64), 1, 0);
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

#[test]
fn registrations_keep_working_after_a_reconnect_to_the_same_server() {
    let s = Fixture::new("recon-same", Duration::from_secs(30), &KV_SERVER_ARGS);
    let mut e = Engine::new(&s, layout(LayoutPreset::Lbnhc, 2, 64), 1, 0);
    let hashes = prompt_hashes(21, 2);
    let blocks = e.blocks(0, 2);
    e.write(&hashes, &blocks);
    // The server is alive: the reconnect re-registers with it (same epoch,
    // a new id), and the handle from before must map to that new id.
    assert_eq!(e.c.reconnect(far()).unwrap(), 1);
    assert_eq!(e.store(0, &hashes, &blocks).value, 2);
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    assert_eq!(lease.hits(), 2);
    e.cache.poison(0x3c);
    let fresh = e.blocks(8, 2);
    let job =
        e.c.retrieve(Retrieve::new(&e.inst, &lease, &fresh))
            .unwrap();
    assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
    e.verify(&hashes, &fresh, 0, 0x3c);
    // One registration on the server: the old connection's went with it.
    assert_eq!(e.c.stats().unwrap().instances, 1);
}

/// A lease belongs to the engine whose client took it: that engine's other
/// processes (its workers, each its own connection) retrieve, free and end
/// it; another engine, or an anonymous client, gets `ForeignLease` for
/// each and changes nothing.
#[test]
fn leases_belong_to_the_engine_that_took_them() {
    let s = Fixture::new(
        "engines",
        Duration::from_secs(60),
        &["--chunk-tokens", "64", "--pool-bytes", "64MiB"],
    );
    let engine = |id: Option<&str>| {
        let b = s.client_builder();
        match id {
            Some(id) => b.engine(id).connect().unwrap(),
            None => b.connect().unwrap(),
        }
    };
    let l = layout(LayoutPreset::Lbnhc, 2, 64);
    let spec = KvSpec::new(model_id(MODEL), 1, 0);
    // Engine A: a scheduler and a worker in separate connections.
    let mut sched = engine(Some("engine-a"));
    let mut worker = engine(Some("engine-a"));
    let cache = HostKvCache::new(l.clone(), CHUNK).unwrap();
    let reg = worker.register_host(&spec, &cache).unwrap();
    let hashes = prompt_hashes(77, 3);
    let blocks: Vec<u32> = (0..3 * reg.blocks_per_chunk()).collect();
    for (h, b) in hashes
        .iter()
        .zip(blocks.chunks(reg.blocks_per_chunk() as usize))
    {
        kvring::kv::pattern::write_chunk(&cache, 0, h, b);
    }
    done(worker.store(Store::new(&reg, &hashes, &blocks)).unwrap());
    let lease = sched
        .lookup(Lookup::new(model_id(MODEL), 1, &hashes))
        .unwrap();
    assert_eq!(lease.hits(), 3);
    let id = lease.id();
    // Engine B (another vLLM instance of the same user) and an anonymous
    // client, each with a cache of its own registered.
    for (who, mut c) in [
        ("engine B", engine(Some("engine-b"))),
        ("anonymous", engine(None)),
    ] {
        let other = HostKvCache::new(l.clone(), CHUNK).unwrap();
        let oreg = c.register_host(&spec, &other).unwrap();
        let dst: Vec<u32> = (0..reg.blocks_per_chunk()).collect();
        match c.retrieve(Retrieve::new(&oreg, id, &dst)) {
            Err(Error::Status(Status::ForeignLease)) => {}
            other => panic!("{who}: retrieve {other:?}"),
        }
        expect_status(
            c.release_lease_chunks(id, 0, u32::MAX),
            Status::ForeignLease,
        );
        expect_status(c.end_lease_id(id), Status::ForeignLease);
        c.unregister(oreg).unwrap();
    }
    // Nothing changed: the lease still holds every chunk, and engine A's
    // worker retrieves all three, byte for byte.
    assert_eq!(sched.stats().unwrap().leases, 1);
    let fresh = HostKvCache::new(l.clone(), CHUNK).unwrap();
    fresh.fill(0x5a);
    let freg = worker.register_host(&spec, &fresh).unwrap();
    let dst: Vec<u32> = (10..10 + 3 * reg.blocks_per_chunk()).collect();
    done(worker.retrieve(Retrieve::new(&freg, id, &dst)).unwrap());
    for (h, b) in hashes
        .iter()
        .zip(dst.chunks(reg.blocks_per_chunk() as usize))
    {
        kvring::kv::pattern::verify_chunk(&fresh, 0, h, b, 0, 0x5a).unwrap();
    }
    // The engine's scheduler ends it (a second end: no lease left).
    drop(lease);
    assert_eq!(sched.stats().unwrap().leases, 0);
}
