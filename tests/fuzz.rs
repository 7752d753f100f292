//! The fuzz targets' properties (`kvring_server::fuzz`) over a bounded number of
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
    run(
        "ring_frames",
        kvring_server::fuzz::ring_frames,
        20_000,
        4096,
    );
}

#[test]
fn registration() {
    let _w = common::watchdog(Duration::from_secs(120));
    run(
        "registration",
        kvring_server::fuzz::registration,
        20_000,
        1024,
    );
}

#[test]
fn requests() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("requests", kvring_server::fuzz::requests, 2_000, 2048);
}

#[test]
fn l2_value() {
    let _w = common::watchdog(Duration::from_secs(120));
    run("l2_value", kvring_server::fuzz::l2_value, 20_000, 4096);
}

#[test]
fn http_request() {
    let _w = common::watchdog(Duration::from_secs(120));
    run(
        "http_request",
        kvring_server::fuzz::http_request,
        20_000,
        2048,
    );
    // Random bytes rarely make a request: well-formed ones, cut short,
    // with a byte changed, or padded past the bound, each split by a
    // seed of its own.
    let requests: [&[u8]; 6] = [
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\n\r\n",
        b"POST /pin HTTP/1.1\r\nAuthorization: Bearer abc\r\nContent-Length: 5\r\n\r\n{\"a\"}tail",
        b"POST /unpin HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc",
        b"POST /x HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc",
        b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"GET /healthz HTTP/1.1\nHost: x\n\n",
    ];
    let t0 = Instant::now();
    let mut n = 0;
    for (i, seed) in inputs(0x4717, 2_000, 16).enumerate() {
        let r = requests[i % requests.len()];
        let mut seed = seed;
        seed.resize(8, 0);
        let mut variants = vec![r.to_vec(), r[..i % r.len()].to_vec()];
        let mut changed = r.to_vec();
        changed[i % r.len()] = seed[0];
        variants.push(changed);
        // A header that brings the request to about the bound.
        let mut padded = r.to_vec();
        let line = r.iter().position(|&c| c == b'\n').unwrap() + 1;
        let mut header = b"X: ".to_vec();
        header.extend(std::iter::repeat_n(b'a', 16 * 1024 - 40 - r.len() + i % 80));
        header.extend_from_slice(b"\r\n");
        padded.splice(line..line, header);
        variants.push(padded);
        for v in variants {
            let mut input = seed.clone();
            input.extend_from_slice(&v);
            kvring_server::fuzz::http_request(&input);
            n += 1;
        }
    }
    eprintln!("http_request: {n} requests in {:?}", t0.elapsed());
}
