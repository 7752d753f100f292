//! The second tier's test helpers: a `kvring` server with a tier on real
//! Valkey, an engine on it, stores, and lookups whose retrieved bytes are
//! checked, byte for byte.

use super::valkey::Valkey;
use super::*;
use kvring::kv::{chunk_hashes, ChunkHash};
use kvring::proto::kv::{StatsReply, TierState};
use kvring::Retrieve;
use std::time::{Duration, Instant};

/// A server with 64-token chunks (a 64 MiB pool unless `extra` sizes it)
/// and a second tier at `urls`.
pub fn server(tag: &str, urls: &[String], extra: &[&str]) -> Fixture {
    let mut args: Vec<String> = vec!["--chunk-tokens".into(), CHUNK.to_string()];
    if !extra.contains(&"--pool-bytes") {
        args.extend(["--pool-bytes", "64MiB"].map(String::from));
    }
    for u in urls {
        args.push("--l2".into());
        args.push(u.clone());
    }
    args.extend(["--http", "off", "--l2-timeout-s", "0.5"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Fixture::new(tag, Duration::from_secs(120), &args)
}

/// An engine on `s`, once the server's tiers are up (before, their
/// writes are dropped and its lookups answered from the pool).
pub fn engine(s: &Fixture) -> Engine {
    let mut e = Engine::new(s, small_layout(), 1, 0);
    let up_or_none = |t| matches!(t, Ok(TierState::Up | TierState::None));
    until(&mut e, "the tiers up", |s| {
        up_or_none(s.tier_state()) && up_or_none(s.disk_tier_state())
    });
    e
}

pub fn stats(e: &mut Engine) -> StatsReply {
    e.c.stats().unwrap()
}

/// Waits (10 s at most) until `f` holds of the server's counters.
pub fn until(e: &mut Engine, what: &str, f: impl Fn(&StatsReply) -> bool) -> StatsReply {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let s = stats(e);
        if f(&s) {
            return s;
        }
        assert!(Instant::now() < end, "{what}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` chunks of prompt `seed`, written into `e`'s cache and stored (at
/// most 16 chunks: the test cache's 64 blocks).
pub fn store(e: &mut Engine, seed: u32, n: usize) -> Vec<ChunkHash> {
    let hashes = chunk_hashes(&prompt(seed, n * CHUNK as usize), CHUNK);
    let blocks = e.blocks(0, n);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, n as u64);
    hashes
}

/// Looks `hashes` up on `e`'s server, retrieves the hits into fresh
/// (poisoned) blocks and checks every byte; the hits.
pub fn fetch_and_check(e: &mut Engine, hashes: &[ChunkHash]) -> u64 {
    let lease = lookup(&mut e.c, 1, 0, hashes);
    let hits = lease.hits();
    if hits == 0 {
        return 0;
    }
    e.cache.poison(0x5a);
    let dst = e.blocks(1, hits as usize);
    let r = done(e.c.retrieve(Retrieve::new(&e.inst, &lease, &dst)).unwrap());
    assert_eq!(r.value, hits);
    e.verify(&hashes[..hits as usize], &dst, 0, 0x5a);
    let _ = lease.into_id();
    hits
}

/// A server `tag` writing through to `vk`, and `n` chunks of prompt `seed`
/// stored on it and written to the tier.
pub fn stored_through(
    vk: &Valkey,
    tag: &str,
    seed: u32,
    n: usize,
) -> (Fixture, Engine, Vec<ChunkHash>) {
    let a = server(tag, &[vk.url()], &["--l2-write", "through"]);
    let mut e = engine(&a);
    let hashes = store(&mut e, seed, n);
    until(&mut e, "written through", |s| {
        s.l2_written_objects == n as u64
    });
    (a, e, hashes)
}

/// The one key in `vk` of chunk `h`.
pub fn key_of(vk: &Valkey, h: &ChunkHash) -> String {
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    let keys = vk.keys(&format!("kvring:*:{hex}"));
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys[0].clone()
}
