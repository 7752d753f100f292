//! The second tier against real Valkey: two `kvring` servers under
//! different names stand for two hosts sharing one L2 (store on A, look up
//! and retrieve on B, every byte checked), write-through and write-back on
//! eviction (also of an object the store dropped after the pool read it),
//! a restarted server serving from L2, a corrupted value (or a well-formed one of another size) read as
//! a miss, a three-node cluster, and Valkey stopped (SIGSTOP) and killed
//! under load: no lookup waits past its deadline, no byte is wrong, the
//! pool keeps serving, and the tier comes back when Valkey does. A lookup
//! waiting on the tier is polled without waiting, and one given up (or
//! never taken by a stopped server) leaves no lease behind.

mod common;

use common::tier::*;
use common::valkey::{Valkey, ValkeyCluster};
use common::*;
use kvring::kv::{chunk_hashes, ChunkHash};
use kvring::proto::kv::TierState;
use kvring::{Lookup, LookupPoll};
use kvring_server::l2::value;
use std::time::{Duration, Instant};

#[test]
fn objects_stored_on_one_server_are_retrieved_on_another_through_valkey() {
    let vk = Valkey::start("l2-share");
    let a = server("l2-share-a", &[vk.url()], &["--l2-write", "through"]);
    let b = server("l2-share-b", &[vk.url()], &[]);
    let mut ea = engine(&a);
    let mut eb = engine(&b);
    let hashes = store(&mut ea, 1, 12);
    until(&mut ea, "written through", |s| s.l2_written_objects == 12);
    assert_eq!(vk.keys("kvring:*").len(), 12);
    // B never saw them: its lookup waits for the tier, then every byte
    // comes from A's stores.
    assert_eq!(fetch_and_check(&mut eb, &hashes), 12);
    let s = stats(&mut eb);
    assert_eq!(
        (s.lookup_l2_hit_chunks, s.l2_loaded_objects, s.tier_state()),
        (12, 12, Ok(TierState::Up))
    );
    // Now in B's pool: a second lookup needs no tier.
    assert_eq!(fetch_and_check(&mut eb, &hashes), 12);
    assert_eq!(stats(&mut eb).lookup_l2_hit_chunks, 12);
    // A longer prompt: the tier has its first 12 chunks only.
    let mut longer = hashes.clone();
    longer.extend(chunk_hashes(&prompt(99, 3 * CHUNK as usize), CHUNK));
    assert_eq!(lookup(&mut eb.c, 1, 0, &longer).hits(), 12);
}

#[test]
fn evicted_objects_are_written_back_and_served_again() {
    let vk = Valkey::start("l2-back");
    // A 1 MiB pool holds about 30 of the 32 KiB objects.
    let a = server("l2-back-a", &[vk.url()], &["--pool-bytes", "1MiB"]);
    let mut e = engine(&a);
    // Four chunks at a time, each batch written before the next: the
    // objects waiting stay within a quarter of the pool.
    let first: Vec<ChunkHash> = (0..16)
        .step_by(4)
        .flat_map(|i| {
            let h = store(&mut e, 10 + i, 4);
            until(&mut e, "queue drained", |s| s.l2_queue == 0);
            h
        })
        .collect();
    for seed in 30..42 {
        store(&mut e, seed, 4);
        until(&mut e, "queue drained", |s| s.l2_queue == 0);
    }
    let s = until(&mut e, "written back", |s| {
        s.l2_written_objects + s.l2_write_dropped_objects == s.evicted_objects
    });
    assert!(s.evicted_objects >= 30, "{s:?}");
    assert_eq!(s.l2_write_dropped_objects, 0, "{s:?}");
    // A burst evicts more than may wait at once: the rest are dropped, and
    // counted.
    store(&mut e, 50, 16);
    let s = until(&mut e, "burst accounted", |s| {
        s.l2_queue == 0 && s.l2_written_objects + s.l2_write_dropped_objects == s.evicted_objects
    });
    assert!(s.l2_write_dropped_objects > 0, "{s:?}");
    // The first prompt left the pool long ago; the tier has it.
    assert_eq!(fetch_and_check(&mut e, &first), 16);
    assert!(stats(&mut e).lookup_l2_hit_chunks >= 16);
}

#[test]
fn an_object_the_store_dropped_is_written_again_when_the_pool_evicts_it() {
    let vk = Valkey::start("l2-rewrite");
    let (_a, _ea, hashes) = stored_through(&vk, "l2-rewrite-a", 60, 8);
    // B (write-back, a 1 MiB pool) reads the prompt from the tier.
    let b = server("l2-rewrite-b", &[vk.url()], &["--pool-bytes", "1MiB"]);
    let mut eb = engine(&b);
    assert_eq!(fetch_and_check(&mut eb, &hashes), 8);
    // The store lets three of them go (as its maxmemory policy would).
    let keys: Vec<String> = hashes.iter().map(|h| key_of(&vk, h)).collect();
    let mut c = vk.client();
    let gone: u64 = redis::cmd("DEL").arg(&keys[2..5]).query(&mut c).unwrap();
    assert_eq!(gone, 3);
    // Other prompts push the eight out of B's pool, four chunks at a time.
    for seed in 70..82 {
        store(&mut eb, seed, 4);
        until(&mut eb, "queue drained", |s| s.l2_queue == 0);
    }
    let s = stats(&mut eb);
    assert!(s.evicted_objects >= 8 + 12, "{s:?}");
    // Every eviction ended written, dropped, or (five of the eight) found
    // in the tier: B wrote back its own objects and the three the store
    // had dropped, and not the five it still had.
    assert_eq!(s.l2_write_dropped_objects, 0, "{s:?}");
    assert_eq!(s.l2_written_objects + 5, s.evicted_objects, "{s:?}");
    for k in &keys {
        assert!(vk.get_raw(k).is_some(), "{k} back in the tier");
    }
    // And they are the right bytes: a fresh server reads all eight.
    let c2 = server("l2-rewrite-c", &[vk.url()], &[]);
    let mut ec = engine(&c2);
    assert_eq!(fetch_and_check(&mut ec, &hashes), 8);
}

#[test]
fn a_restarted_server_serves_from_valkey() {
    let vk = Valkey::start("l2-restart");
    let mut a = server("l2-restart", &[vk.url()], &["--l2-write", "through"]);
    let hashes = {
        let mut e = engine(&a);
        let h = store(&mut e, 20, 8);
        until(&mut e, "written through", |s| s.l2_written_objects == 8);
        h
    };
    a.srv.kill();
    let url = vk.url();
    a.restart(&[KV_SERVER_ARGS.as_slice(), &["--l2", &url, "--http", "off"]].concat());
    let mut e = engine(&a);
    assert_eq!(stats(&mut e).objects, 0);
    assert_eq!(fetch_and_check(&mut e, &hashes), 8);
}

#[test]
fn a_corrupted_or_truncated_value_is_a_miss() {
    let vk = Valkey::start("l2-corrupt");
    let (_a, _ea, hashes) = stored_through(&vk, "l2-corrupt-a", 30, 6);
    // Chunk 4: one bit flipped in the object; chunk 2: cut short.
    let k4 = key_of(&vk, &hashes[4]);
    let mut v = vk.get_raw(&k4).unwrap();
    let at = v.len() / 2;
    v[at] ^= 0x10;
    vk.set_raw(&k4, &v);
    let k2 = key_of(&vk, &hashes[2]);
    let v = vk.get_raw(&k2).unwrap();
    vk.set_raw(&k2, &v[..v.len() - 100]);
    let b = server("l2-corrupt-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    assert_eq!(fetch_and_check(&mut eb, &hashes), 2);
    // The truncated value, and the flipped one when the fetch read that far
    // ahead before the truncated one ended it.
    let first = stats(&mut eb).l2_corrupt_objects;
    assert!(first == 1 || first == 2, "{first} corrupt values");
    // Past the truncated chunk: the flipped one is a miss too.
    assert_eq!(fetch_and_check(&mut eb, &hashes[3..]), 1);
    assert_eq!(stats(&mut eb).l2_corrupt_objects, first + 1);
}

#[test]
fn a_well_formed_value_of_another_size_is_a_miss() {
    let vk = Valkey::start("l2-size");
    let (_a, _ea, hashes) = stored_through(&vk, "l2-size-a", 35, 3);
    // Chunk 1: a value sealed under its key whose header, length and seal
    // agree with each other, holding half an object.
    let k1 = key_of(&vk, &hashes[1]);
    let whole = vk.get_raw(&k1).unwrap();
    let half = &whole[value::HEADER..value::HEADER + (whole.len() - value::HEADER) / 2];
    let v = value::Value::seal(&k1, half, &value::Seal::Checksum).to_vec();
    vk.set_raw(&k1, &v);
    let b = server("l2-size-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    assert_eq!(fetch_and_check(&mut eb, &hashes), 1);
    let s = stats(&mut eb);
    assert_eq!((s.l2_corrupt_objects, s.l2_loaded_objects), (1, 1), "{s:?}");
}

#[test]
fn a_three_node_cluster_spreads_objects_over_its_slots() {
    let cl = ValkeyCluster::start("l2-cluster");
    let a = server("l2-cluster-a", &cl.urls(), &["--l2-write", "through"]);
    let cluster_url = format!(
        "redis+cluster://{}",
        cl.urls()[1].trim_start_matches("redis://")
    );
    let b = server("l2-cluster-b", &[cluster_url], &[]);
    let mut ea = engine(&a);
    let mut eb = engine(&b);
    let hashes = store(&mut ea, 40, 15);
    until(&mut ea, "written through", |s| s.l2_written_objects == 15);
    let per_node = cl.keys_per_node();
    assert_eq!(per_node.iter().sum::<usize>(), 15);
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    assert_eq!(fetch_and_check(&mut eb, &hashes), 15);
}

#[test]
fn valkey_stopped_or_killed_under_load_never_holds_up_the_pool() {
    let mut vk = Valkey::start("l2-down");
    let a = server(
        "l2-down",
        &[vk.url()],
        &["--l2-write", "through", "--l2-lookup-wait-s", "1"],
    );
    let mut e = engine(&a);
    let cached = store(&mut e, 50, 8);
    until(&mut e, "up", |s| s.l2_written_objects == 8);
    // Lookups that miss the pool ask the tier: bounded however it fails.
    let absent = chunk_hashes(&prompt(51, 4 * CHUNK as usize), CHUNK);
    let mut worst = Duration::ZERO;
    let mut round = |e: &mut Engine, seed: u32| {
        let t = Instant::now();
        assert_eq!(lookup(&mut e.c, 1, 0, &absent).hits(), 0);
        worst = worst.max(t.elapsed());
        assert_eq!(fetch_and_check(e, &cached), 8);
        store(e, seed, 2);
    };
    vk.pause();
    for seed in 100..110 {
        round(&mut e, seed);
    }
    let s = until(&mut e, "down while stopped", |s| {
        s.tier_state() == Ok(TierState::Down)
    });
    assert!(s.l2_errors > 0, "{s:?}");
    vk.resume();
    let before = until(&mut e, "up after SIGCONT", |s| {
        s.tier_state() == Ok(TierState::Up)
    })
    .l2_written_objects;
    store(&mut e, 120, 2);
    until(&mut e, "writing again", |s| {
        s.l2_written_objects >= before + 2
    });
    vk.kill();
    for seed in 130..140 {
        round(&mut e, seed);
    }
    until(&mut e, "down while killed", |s| {
        s.tier_state() == Ok(TierState::Down)
    });
    vk.restart();
    let before = until(&mut e, "up after restart", |s| {
        s.tier_state() == Ok(TierState::Up)
    })
    .l2_written_objects;
    store(&mut e, 150, 2);
    until(&mut e, "writing after restart", |s| {
        s.l2_written_objects >= before + 2
    });
    // Each lookup took at most the wait bound (1 s) plus scheduling.
    assert!(
        worst < Duration::from_millis(1800),
        "a lookup took {worst:?}"
    );
    // And the pool served every round, byte for byte (checked above).
}

#[test]
fn a_lookup_is_polled_without_waiting_and_one_given_up_leaves_no_lease() {
    let vk = Valkey::start("l2-poll");
    let (_a, _ea, hashes) = stored_through(&vk, "l2-poll-a", 41, 4);
    let b = server("l2-poll-b", &[vk.url()], &["--l2-lookup-wait-s", "5"]);
    let mut eb = engine(&b);
    let model = kvring::kv::model_id(MODEL);
    let soon = || Instant::now() + Duration::from_millis(200);

    // Valkey stopped: B's lookup waits on the tier. Submitting and
    // polling it return at once; the lookup stays pending.
    vk.pause();
    let t0 = Instant::now();
    let pending =
        eb.c.submit_lookup(Lookup::new(model, 1, &hashes), soon())
            .unwrap();
    let pending = match eb.c.poll_lookup(pending, Instant::now()).unwrap() {
        LookupPoll::Pending(p) => p,
        LookupPoll::Ready(l) => panic!("answered with Valkey stopped: {l:?}"),
    };
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(100),
        "submit and poll took {took:?}"
    );
    // Given up while pending: once Valkey answers and the lookup ends,
    // its lease is ended (with the client's next calls).
    drop(pending);
    vk.resume();
    eventually(Duration::from_secs(10), || {
        let s = stats(&mut eb);
        s.lookup_l2_hit_chunks == 4 && s.leases == 0
    })
    .unwrap_or_else(|| panic!("a lease left behind: {:?}", stats(&mut eb)));

    // Now in B's pool: answered at the first poll.
    let pending =
        eb.c.submit_lookup(Lookup::new(model, 1, &hashes), soon())
            .unwrap();
    match eb.c.poll_lookup(pending, Instant::now()).unwrap() {
        LookupPoll::Ready(l) => assert_eq!(l.hits(), 4),
        LookupPoll::Pending(_) => panic!("a pool hit not answered inline"),
    }
    eventually(Duration::from_secs(2), || stats(&mut eb).leases == 0).expect("the lease ended");

    // The server stopped: the submission fails at its deadline, and the
    // lookup the server takes once it goes on leaves no lease.
    b.srv.pause();
    let t0 = Instant::now();
    let r = eb.c.submit_lookup(
        Lookup::new(model, 1, &hashes),
        Instant::now() + Duration::from_millis(50),
    );
    let took = t0.elapsed();
    assert!(matches!(r, Err(kvring::Error::Timeout(_))), "{r:?}");
    assert!(
        took < Duration::from_millis(150),
        "a stopped server held the call {took:?}"
    );
    b.srv.signal(libc::SIGCONT);
    eventually(Duration::from_secs(5), || {
        let s = stats(&mut eb);
        s.lookups >= 3 && s.leases == 0
    })
    .unwrap_or_else(|| panic!("a lease left behind: {:?}", stats(&mut eb)));
}
