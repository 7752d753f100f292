//! The disk tier when the disk fails, with the real `kvring` binary on
//! real file systems: a segment cut short under the server (a read that
//! fails), a full disk (a tmpfs smaller than the tier's budget), a disk
//! that fails every read and write with EIO (an ext4 image on a loop
//! device, shut down) and one that stops answering (the same, frozen). Each
//! ends in misses and dropped writes, counted; the tier is down and
//! `/healthz` says degraded (200), the rings keep answering, no lookup
//! waits past its bound, and the tier comes back when the disk does.
//!
//! The tests that mount file systems need root (mount, loop devices,
//! fsfreeze): they are ignored unless asked for (`cargo test --release
//! --test disk_faults -- --ignored`, which `.ci/run` does where it runs as
//! root).

mod common;

use common::disk::{DiskDir, Mounted};
use common::tier::{engine, fetch_and_check, stats, store, until};
use common::*;
use kvring::proto::kv::TierState;
use std::time::{Duration, Instant};

/// A server with 64-token chunks, HTTP on a free port, and a disk tier in
/// `dir` of `budget` bytes written through.
fn disk_server(tag: &str, dir: &str, budget: &str) -> (Fixture, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let args = [
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        "64MiB",
        "--http",
        &addr,
        "--disk",
        dir,
        "--disk-bytes",
        budget,
        "--disk-write",
        "through",
    ];
    (Fixture::new(tag, Duration::from_secs(120), &args), port)
}

/// `/healthz`'s code, status and reasons' kinds.
fn health(port: u16) -> (u16, String, Vec<String>) {
    let (code, kinds, v) = common::health(port);
    (code, v["status"].as_str().unwrap().to_string(), kinds)
}

/// The slowest of `n` STATS round trips.
fn slowest_round_trip(e: &mut Engine, n: usize) -> Duration {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            stats(e);
            t.elapsed()
        })
        .max()
        .unwrap()
}

#[test]
fn a_segment_cut_short_is_a_miss_and_the_tier_comes_back() {
    let dir = DiskDir::new("disk-cut");
    let (a, port) = disk_server("disk-cut", &dir.arg(), "16MiB");
    let mut e = engine(&a);
    let hashes = store(&mut e, 80, 8);
    until(&mut e, "written through", |s| s.disk_written_objects == 8);
    e.c.clear().unwrap();
    // The segment loses its records under the server (the file system
    // answers a read past its end with nothing).
    for seg in dir.segments() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(0)
            .unwrap();
    }
    assert_eq!(fetch_and_check(&mut e, &hashes), 0, "a miss, never KV");
    let s = stats(&mut e);
    assert!(s.disk_errors >= 1, "{s:?}");
    assert_eq!(s.disk_loaded_objects, 0, "{s:?}");
    assert_eq!(s.disk_tier_state(), Ok(TierState::Down), "{s:?}");
    // Down: degraded, not dead; stores go on (their writes dropped).
    let (code, status, kinds) = health(port);
    assert_eq!((code, status.as_str()), (200, "degraded"), "{kinds:?}");
    assert!(kinds.iter().any(|k| k == "tier_down"), "{kinds:?}");
    let dropped = s.disk_write_dropped_objects;
    store(&mut e, 81, 4);
    until(&mut e, "writes dropped while down", |s| {
        s.disk_write_dropped_objects >= dropped + 4
    });
    // A probe after the pause brings it back; new records are written and
    // read again.
    until(&mut e, "the tier up again", |s| {
        s.disk_tier_state() == Ok(TierState::Up)
    });
    let again = store(&mut e, 82, 4);
    until(&mut e, "written through", |s| s.disk_written_objects == 12);
    e.c.clear().unwrap();
    assert_eq!(fetch_and_check(&mut e, &again), 4);
    assert_eq!(health(port).1, "ok");
}

/// Fails the test unless this process may mount file systems.
fn need_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test mounts file systems: run it as root"
    );
}

#[test]
#[ignore = "needs root: mounts a tmpfs (cargo test --test disk_faults -- --ignored)"]
fn a_full_disk_drops_writes_and_the_pool_serves() {
    need_root();
    // 1 MiB of file system under a 64 MiB budget: the tier's first segment
    // (16 MiB, allocated whole) does not fit.
    let fs = Mounted::tmpfs("disk-full", "1m");
    let d = fs.dir.join("kv").display().to_string();
    let (a, port) = disk_server("disk-full", &d, "64MiB");
    let mut e = engine(&a);
    let hashes = store(&mut e, 84, 4);
    let s = until(&mut e, "the write failed", |s| s.disk_errors >= 1);
    assert_eq!(s.disk_written_objects, 0, "{s:?}");
    until(&mut e, "every write dropped", |s| {
        s.disk_write_dropped_objects == 4
    });
    assert_eq!(
        stats(&mut e).disk_tier_state(),
        Ok(TierState::Down),
        "down after the error"
    );
    let (code, status, _) = health(port);
    assert_eq!((code, status.as_str()), (200, "degraded"));
    // The pool still has the prompt: every byte from it.
    assert_eq!(fetch_and_check(&mut e, &hashes), 4);
    assert!(slowest_round_trip(&mut e, 50) < Duration::from_secs(1));
}

#[test]
#[ignore = "needs root: a loop-device ext4, frozen (cargo test --test disk_faults -- --ignored)"]
fn a_disk_that_stops_answering_never_stalls_the_rings_or_a_lookup() {
    need_root();
    let mut fs = Mounted::ext4("disk-hang", 96);
    let d = fs.dir.join("kv").display().to_string();
    let (a, port) = disk_server("disk-hang", &d, "32MiB");
    let mut e = engine(&a);
    let on_disk = store(&mut e, 86, 4);
    until(&mut e, "written through", |s| s.disk_written_objects == 4);
    e.c.clear().unwrap();
    // Every write to the file system waits from now on: the tier's thread
    // is stuck in the next one.
    fs.freeze();
    store(&mut e, 87, 4);
    // A lookup of what the disk holds waits behind it, and is answered
    // without the disk once the tier's bound (2 s) and the owner's grace
    // are over.
    let t = Instant::now();
    assert_eq!(fetch_and_check(&mut e, &on_disk), 0);
    let waited = t.elapsed();
    assert!(waited < Duration::from_secs(6), "{waited:?}");
    // The rings never wait on the disk.
    let rtt = slowest_round_trip(&mut e, 50);
    eprintln!(
        "lookup answered without the stuck disk after {waited:?}; slowest of 50 STATS {rtt:?}"
    );
    assert!(rtt < Duration::from_secs(1));
    // Stuck past the stall bound: down, degraded.
    until(&mut e, "down while stuck", |s| {
        s.disk_tier_state() == Ok(TierState::Down)
    });
    let (code, status, kinds) = health(port);
    assert_eq!((code, status.as_str()), (200, "degraded"), "{kinds:?}");
    // The disk answers again: the stuck write ends, the tier is up, and
    // what it held is served, byte for byte.
    fs.thaw();
    until(&mut e, "up again", |s| {
        s.disk_tier_state() == Ok(TierState::Up) && s.disk_queue == 0
    });
    assert_eq!(fetch_and_check(&mut e, &on_disk), 4);
    assert_eq!(health(port).1, "ok");
}

/// Shuts the file system mounted at `dir` down as a failing disk would
/// leave it: every read and write on it fails with EIO from now on
/// (ext4's `EXT4_IOC_SHUTDOWN`, without flushing its journal).
fn shut_down(dir: &std::path::Path) {
    // _IOR('X', 125, __u32), as the kernel's ext4 (and XFS) define it.
    const EXT4_IOC_SHUTDOWN: libc::c_ulong =
        (2 << 30) | (4 << 16) | ((b'X' as libc::c_ulong) << 8) | 125;
    const NOLOGFLUSH: u32 = 2;
    let f = std::fs::File::open(dir).unwrap();
    let flags = NOLOGFLUSH;
    // SAFETY: the ioctl reads one u32 from the pointer, which lives
    // through the call; the descriptor is open.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            EXT4_IOC_SHUTDOWN as _,
            &flags,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
}

#[test]
#[ignore = "needs root: a loop-device ext4, shut down (cargo test --test disk_faults -- --ignored)"]
fn a_disk_that_fails_with_eio_is_down_until_it_answers() {
    need_root();
    let fs = Mounted::ext4("disk-eio", 96);
    let d = fs.dir.join("kv").display().to_string();
    let (a, port) = disk_server("disk-eio", &d, "32MiB");
    let mut e = engine(&a);
    let on_disk = store(&mut e, 89, 4);
    until(&mut e, "written through", |s| s.disk_written_objects == 4);
    e.c.clear().unwrap();
    shut_down(&fs.dir);
    // Reads fail: a miss, counted, the tier down (the tier answers the
    // lookup within its batch and goes down once the batch is over, so a
    // moment after the miss).
    assert_eq!(fetch_and_check(&mut e, &on_disk), 0);
    let s = until(&mut e, "down after the failed reads", |s| {
        s.disk_tier_state() == Ok(TierState::Down)
    });
    assert!(s.disk_errors >= 1, "{s:?}");
    // Writes are dropped while down; the probes fail too, so it stays
    // down past the first pause (2 s) and the pool keeps serving.
    let again = store(&mut e, 90, 4);
    std::thread::sleep(Duration::from_secs(3));
    let s = stats(&mut e);
    assert_eq!(s.disk_tier_state(), Ok(TierState::Down), "{s:?}");
    assert!(s.disk_write_dropped_objects >= 4, "{s:?}");
    assert_eq!(s.disk_loaded_objects, 0, "{s:?}");
    assert_eq!(fetch_and_check(&mut e, &again), 4, "from the pool");
    let (code, status, kinds) = health(port);
    assert_eq!((code, status.as_str()), (200, "degraded"), "{kinds:?}");
    assert!(slowest_round_trip(&mut e, 50) < Duration::from_secs(1));
}
