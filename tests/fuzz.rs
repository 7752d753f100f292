//! The fuzz targets' properties (`kvring::fuzz`) over a bounded number of
//! pseudo-random inputs, so every test run exercises them without
//! `cargo fuzz`. Inputs saved by the fuzzer under `fuzz/regressions/<target>/`
//! (crashes that were fixed) are replayed first.

mod common;

use std::time::{Duration, Instant};

/// Deterministic inputs: random lengths, mostly random bytes, with runs of
/// small values and 0xff (the shapes that reach index and length checks).
fn inputs(seed: u64, count: usize, max_len: usize) -> impl Iterator<Item = Vec<u8>> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..count).map(move |_| {
        let len = (next() as usize) % max_len;
        let mut v = Vec::with_capacity(len);
        while v.len() < len {
            let r = next();
            match r % 8 {
                0 => v.extend_from_slice(&[0; 8]),
                1 => v.extend_from_slice(&[0xff; 8]),
                2 => v.extend_from_slice(&((r >> 8) % 64).to_le_bytes()),
                _ => v.extend_from_slice(&r.to_le_bytes()),
            }
        }
        v.truncate(len);
        v
    })
}

fn replay(target: &str, f: fn(&[u8])) -> usize {
    // The repository's fuzz/ folder (this test belongs to tools/kvring).
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions")
        .join(target);
    let mut n = 0;
    // A target may have no saved inputs yet, but the folder of saved inputs
    // must be where this test looks, or a move would silently replay none.
    assert!(
        dir.parent().is_some_and(|p| p.is_dir()),
        "no fuzz/regressions folder at {}",
        dir.display()
    );
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            f(&std::fs::read(e.path()).unwrap());
            n += 1;
        }
    }
    n
}

fn run(target: &str, f: fn(&[u8]), count: usize, max_len: usize) {
    let t0 = Instant::now();
    let saved = replay(target, f);
    for input in inputs(0x5eed ^ target.len() as u64, count, max_len) {
        f(&input);
    }
    eprintln!(
        "{target}: {saved} saved inputs and {count} generated in {:?}",
        t0.elapsed()
    );
}

#[test]
fn ring_frames() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("ring_frames", kvring::fuzz::ring_frames, 20_000, 4096);
}

#[test]
fn registration() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("registration", kvring::fuzz::registration, 20_000, 1024);
}

#[test]
fn requests() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("requests", kvring::fuzz::requests, 2_000, 2048);
}

#[test]
fn l2_value() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("l2_value", kvring::fuzz::l2_value, 20_000, 4096);
}
