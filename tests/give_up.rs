//! Giving a job up while the server is stopped (SIGSTOP): the client's wait
//! ends at the job's deadline, and once it returned, nothing of the job
//! lands in the engine's blocks, even after the server is continued, and a
//! given-up store never commits. Runs against the real `kvring` binary
//! (host backend); the GPU versions are in `tests/cuda.rs`.

mod common;

use common::*;
use kvring::jobs::{FailReason, JobStatus};
use kvring::kv::{model_id, LayoutPreset};
use kvring::{Error, Job, Lookup, Retrieve, Store};
use std::time::{Duration, Instant};

/// 64 chunks of 1.5 MiB (3 layers, 2 heads of 1024 bf16 elements, 64-token
/// chunks): a job long enough (tens of milliseconds) to stop the server in.
const CHUNKS: u32 = 64;
const BLOCKS_PER_CHUNK: u32 = CHUNK / 16;
const ARGS: [&str; 8] = [
    "--backend",
    "host",
    "--chunk-tokens",
    "64",
    "--pool-bytes",
    "256MiB",
    "--copy-threads",
    "2",
];
/// How long each job may run before its client gives it up.
const TIMEOUT: Duration = Duration::from_millis(200);

/// Waits (up to 20 s) until the server says the job ended.
fn ended(job: &Job) -> JobStatus {
    let deadline = far();
    loop {
        let st = job.status().unwrap();
        if st.is_terminal() {
            return st;
        }
        assert!(Instant::now() < deadline, "the job never ended: {st:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Bytes of the cache that are not `byte`.
fn changed(cache: &kvring::HostKvCache, byte: u8) -> usize {
    let n = cache.bytes() as usize;
    // SAFETY: the cache's one allocation is `bytes()` long and mapped while
    // `cache` lives; the server writes it only through copies, and none
    // runs while this reads (the test waits for the job's end first).
    let all = unsafe { std::slice::from_raw_parts(cache.at(0, 0, n as u64), n) };
    all.iter().filter(|&&b| b != byte).count()
}

#[test]
fn a_job_given_up_while_the_server_is_stopped_never_lands_afterwards() {
    let s = Fixture::new("give-up", Duration::from_secs(120), &ARGS);
    let l = kv_layout(LayoutPreset::Lbnhc, 2, CHUNKS * BLOCKS_PER_CHUNK, 1024);
    let chunk_bytes = l.object_bytes(CHUNK) as usize;
    let mut e = Engine::new(&s, l, 1, 0);
    let blocks: Vec<u32> = (0..CHUNKS * BLOCKS_PER_CHUNK).collect();
    let hashes = prompt_hashes(41, CHUNKS as usize);
    for (h, b) in hashes.iter().zip(blocks.chunks(BLOCKS_PER_CHUNK as usize)) {
        kvring::kv::pattern::write_chunk(&e.cache, 0, h, b);
    }
    let job = e.c.store(Store::new(&e.inst, &hashes, &blocks)).unwrap();
    assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));

    // A retrieve, the server stopped under it.
    let mut tested = false;
    for attempt in 0..8 {
        let lease =
            e.c.lookup(Lookup::new(model_id(MODEL), 1, &hashes))
                .unwrap();
        assert_eq!(lease.hits(), u64::from(CHUNKS));
        e.cache.fill(0xa5);
        let job =
            e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks).timeout(TIMEOUT))
                .unwrap();
        s.srv.pause();
        let stopped = Instant::now();
        let r = job.wait(far());
        let waited = stopped.elapsed();
        let quiet = match r {
            // It ended before the stop: nothing to give up; again.
            Ok(st) => {
                s.srv.signal(libc::SIGCONT);
                eprintln!("attempt {attempt}: the retrieve ended first ({st:?})");
                continue;
            }
            Err(Error::Timeout(_)) => true,
            // The server stopped in the middle of a chunk's copy.
            Err(Error::CopiesInFlight(_)) => false,
            Err(other) => panic!("the wait ended {other:?}"),
        };
        // The engine has its blocks back: it writes them.
        e.cache.fill(0x5a);
        s.srv.signal(libc::SIGCONT);
        let st = ended(&job);
        let late = changed(&e.cache, 0x5a);
        eprintln!(
            "attempt {attempt}: wait returned {waited:?} after the stop (no copy under way: {quiet}); \
             the server ended the job {st:?}; {late} bytes changed after the give-up"
        );
        assert_eq!(st, JobStatus::Failed(FailReason::Cancelled));
        if quiet {
            assert_eq!(late, 0, "a copy landed after the give-up");
            assert!(waited < TIMEOUT + Duration::from_secs(2));
        } else {
            // Only the chunk each worker was copying when the server
            // stopped may finish; no other starts.
            assert!(
                late <= 2 * chunk_bytes,
                "{late} bytes landed after the give-up"
            );
        }
        tested = true;
        break;
    }
    assert!(tested, "every retrieve ended before the server stopped");

    // A store queued behind retrieves of the same client (its chunks wait
    // behind theirs in the client's queue), the server stopped: the store
    // is given up, most likely before any of its copies started (else as
    // above), and never commits.
    let fresh = prompt_hashes(42, CHUNKS as usize);
    let mut tested = false;
    for attempt in 0..8 {
        let fresh = &fresh[..];
        // Three retrieves ahead (about 300 MiB of copies), so the store is
        // most likely still queued when the server stops.
        let ahead: Vec<Job> = (0..3)
            .map(|_| {
                let lease =
                    e.c.lookup(Lookup::new(model_id(MODEL), 1, &hashes))
                        .unwrap();
                e.c.retrieve(Retrieve::new(&e.inst, &lease, &blocks))
                    .unwrap()
            })
            .collect();
        let job =
            e.c.store(Store::new(&e.inst, fresh, &blocks).timeout(TIMEOUT))
                .unwrap();
        s.srv.pause();
        let stopped = Instant::now();
        let r = job.wait(far());
        let waited = stopped.elapsed();
        s.srv.signal(libc::SIGCONT);
        let st = ended(&job);
        for a in &ahead {
            assert!(matches!(ended(a), JobStatus::Done(_)));
        }
        if r.is_ok() {
            eprintln!("attempt {attempt}: the store ended first");
            // Stored: drop it so the next attempt writes again.
            e.c.clear().unwrap();
            continue;
        }
        eprintln!(
            "attempt {attempt}: the queued store's wait returned {r:?} {waited:?} after the stop"
        );
        assert!(
            matches!(r, Err(Error::Timeout(_) | Error::CopiesInFlight(_))),
            "{r:?}"
        );
        assert_eq!(st, JobStatus::Failed(FailReason::Cancelled));
        let lease = e.c.lookup(Lookup::new(model_id(MODEL), 1, fresh)).unwrap();
        assert_eq!(lease.hits(), 0, "a given-up store committed");
        tested = true;
        break;
    }
    assert!(tested, "every store ended before the server stopped");
}

/// A retrieve in layer groups whose server stops under it: a wait for its
/// last group ends at the job's own deadline (the job given up), and the
/// give-up lands every group, so a stream waiting on any of them goes on.
#[test]
fn a_wait_for_a_layer_group_of_a_stopped_server_ends_at_the_deadline() {
    let s = Fixture::new("give-up-groups", Duration::from_secs(120), &ARGS);
    let l = kv_layout(LayoutPreset::Lbnhc, 2, CHUNKS * BLOCKS_PER_CHUNK, 1024);
    let layers = l.geometry().layers;
    let mut e = Engine::new(&s, l, 1, 0);
    let blocks: Vec<u32> = (0..CHUNKS * BLOCKS_PER_CHUNK).collect();
    let hashes = prompt_hashes(43, CHUNKS as usize);
    let job = e.c.store(Store::new(&e.inst, &hashes, &blocks)).unwrap();
    assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
    let mut tested = false;
    for attempt in 0..8 {
        let lease =
            e.c.lookup(Lookup::new(model_id(MODEL), 1, &hashes))
                .unwrap();
        let job =
            e.c.retrieve(
                Retrieve::new(&e.inst, &lease, &blocks)
                    .layer_groups(layers)
                    .timeout(TIMEOUT),
            )
            .unwrap();
        s.srv.pause();
        let stopped = Instant::now();
        let last_landed_before = job.layer_group_landed(layers - 1);
        let r = job.wait_layer_group(layers - 1, far());
        let waited = stopped.elapsed();
        s.srv.signal(libc::SIGCONT);
        if last_landed_before || r.is_ok() {
            eprintln!("attempt {attempt}: the last group landed before the stop ({r:?})");
            ended(&job);
            continue;
        }
        eprintln!("attempt {attempt}: the wait for the last group returned {r:?} {waited:?} after the stop");
        assert!(
            matches!(r, Err(Error::Timeout(_) | Error::CopiesInFlight(_))),
            "{r:?}"
        );
        // A copy under way when the server stopped is waited for up to the
        // give-up's bound (5 s) before the words are released anyway.
        let bound = match r {
            Err(Error::CopiesInFlight(_)) => TIMEOUT + Duration::from_secs(7),
            _ => TIMEOUT + Duration::from_secs(2),
        };
        assert!(waited < bound, "{waited:?}");
        assert!((0..layers).all(|k| job.layer_group_landed(k)));
        assert!(job.released());
        assert_eq!(ended(&job), JobStatus::Failed(FailReason::Cancelled));
        tested = true;
        break;
    }
    assert!(tested, "every retrieve landed before the server stopped");
}

/// A server that shuts down with jobs queued releases every one of them
/// (a stream ordered after any would otherwise wait forever): the jobs
/// whose tasks it dropped are released when their last task goes.
#[test]
fn a_server_shutting_down_releases_every_job() {
    let mut s = Fixture::new("give-up-stop", Duration::from_secs(60), &ARGS);
    let l = kv_layout(LayoutPreset::Lbnhc, 2, CHUNKS * BLOCKS_PER_CHUNK, 1024);
    let mut e = Engine::new(&s, l, 1, 0);
    let blocks: Vec<u32> = (0..CHUNKS * BLOCKS_PER_CHUNK).collect();
    // Stores of fresh chunks, queued behind each other on two workers.
    let jobs: Vec<Job> = (0..6)
        .map(|i| {
            let hashes = prompt_hashes(100 + i, CHUNKS as usize);
            e.c.store(Store::new(&e.inst, &hashes, &blocks)).unwrap()
        })
        .collect();
    let status = s.srv.terminate();
    assert!(status.success(), "{status:?}");
    let ended: Vec<bool> = jobs.iter().map(Job::released).collect();
    eprintln!("released after the shutdown: {ended:?}");
    assert!(ended.iter().all(|&r| r), "a job left unreleased: {ended:?}");
}
