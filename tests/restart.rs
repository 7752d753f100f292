//! The server dies or wedges under load.
//!
//! * SIGKILL while engines store, look up, retrieve and wait: every wait
//!   ends with `ServerGone` within 1 s; a new server of the same name
//!   replaces the stale segment; `Client::reconnect` registers the engines'
//!   caches again, old job ids read `Unknown`, and the engines go on with
//!   the `Registration` handles they had, bytes verified.
//! * SIGSTOP with requests, jobs and a synchronous store in flight: every
//!   wait ends with `Timeout` at its deadline; after SIGCONT every request
//!   is answered exactly once, in order, the abandoned store is carried out
//!   once, and nothing is lost.

mod common;

use common::*;
use kvring::jobs::{JobId, JobStatus};
use kvring::kv::{chunk_hashes, model_id, pattern};
use kvring::{Client, DelayJob, Error, HostKvCache, KvSpec, Lookup, Registration, Retrieve, Store};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

/// One engine worker: a cache it stores from and a fresh one it retrieves
/// into, both registered; its calls return the client's errors (the test is
/// about which ones).
struct TwoCacheEngine {
    inst: Registration,
    finst: Registration,
    c: Client,
    cache: HostKvCache,
    fresh: HostKvCache,
}

impl TwoCacheEngine {
    fn new(s: &Scope) -> TwoCacheEngine {
        let mut c = s.client();
        let cache = HostKvCache::new(small_layout(), CHUNK).unwrap();
        let fresh = HostKvCache::new(small_layout(), CHUNK).unwrap();
        let spec = KvSpec::new(model_id("restart"), 1, 0);
        let inst = c.register_host(&spec, &cache).unwrap();
        let finst = c.register_host(&spec, &fresh).unwrap();
        TwoCacheEngine {
            c,
            cache,
            inst,
            fresh,
            finst,
        }
    }

    fn hashes(seed: u64) -> Vec<kvring::kv::ChunkHash> {
        // The seed's two words open the prompt: distinct seeds never share
        // a chunk hash (equal hashes must mean equal contents).
        let tokens: Vec<u32> = [seed as u32, (seed >> 32) as u32]
            .into_iter()
            .chain((2..4 * CHUNK).map(|i| i.wrapping_mul(2_654_435_761)))
            .collect();
        chunk_hashes(&tokens, CHUNK)
    }

    /// Writes 4 chunks of content `seed` into blocks 0..16 and stores them.
    fn store(&mut self, seed: u64, last: &mut Option<JobId>) -> Result<(), Error> {
        let hashes = Self::hashes(seed);
        let blocks: Vec<u32> = (0..16).collect();
        for (h, b) in hashes.iter().zip(blocks.chunks(4)) {
            pattern::write_chunk(&self.cache, seed as u32, h, b);
        }
        let job = self.c.store(Store::new(&self.inst, &hashes, &blocks))?;
        *last = Some(job.id());
        let st = job.wait(far())?;
        assert!(matches!(st, JobStatus::Done(_)), "store ended {st:?}");
        self.c.release_job(job)
    }

    /// Looks up the 4 chunks of `seed` (all must hit), retrieves them into
    /// the fresh cache and checks every byte.
    fn fetch(&mut self, seed: u64, last: &mut Option<JobId>) -> Result<(), Error> {
        let hashes = Self::hashes(seed);
        let lease = self
            .c
            .lookup(Lookup::new(model_id("restart"), 1, &hashes))?;
        *last = Some(lease.id().job());
        assert_eq!(lease.hits(), 4, "lookup hits");
        let blocks: Vec<u32> = (16..32).collect();
        self.fresh.fill(0xcc);
        let job = self
            .c
            .retrieve(Retrieve::new(&self.finst, &lease, &blocks))?;
        *last = Some(job.id());
        let st = job.wait(far())?;
        assert!(matches!(st, JobStatus::Done(_)), "retrieve ended {st:?}");
        self.c.release_job(job)?;
        // The retrieve took the holds; the lookup job goes too.
        self.c.release_job(lease.into_id().job())?;
        for (h, b) in hashes.iter().zip(blocks.chunks(4)) {
            pattern::verify_chunk(&self.fresh, seed as u32, h, b, 0, 0xcc)
                .unwrap_or_else(|e| panic!("seed {seed:#x}: {e}"));
        }
        Ok(())
    }
}

#[test]
fn killed_server_ends_every_wait_and_clients_reconnect_to_its_successor() {
    let mut s = Fixture::new("restart", Duration::from_secs(150), &KV_SERVER_ARGS);
    // Killed and restarted below while the engines hold the fixture.
    let mut srv = ServerProc {
        child: s.srv.child.take(),
    };
    const CLIENTS: usize = 8;
    const KILLS: usize = 10;
    let sync = Barrier::new(CLIENTS + 1);
    let killed_at: Mutex<Option<Instant>> = Mutex::new(None);
    let slowest = Mutex::new(Duration::ZERO);
    let units = Mutex::new(0u64);
    std::thread::scope(|sc| {
        for t in 0..CLIENTS {
            let (s, sync, killed_at, slowest, units) = (&s, &sync, &killed_at, &slowest, &units);
            sc.spawn(move || {
                let mut e = TwoCacheEngine::new(s);
                let epoch0 = e.c.epoch();
                let mut seed = (t as u64 + 1) << 40;
                sync.wait();
                for round in 0..=KILLS {
                    let mut last = None;
                    // Work until the server is gone (the last round: a few
                    // units on the final server).
                    let mut done = 0u64;
                    let gone = loop {
                        if round == KILLS && done == 20 {
                            break None;
                        }
                        seed += 1;
                        let r = e
                            .store(seed, &mut last)
                            .and_then(|()| e.fetch(seed, &mut last));
                        match r {
                            Ok(()) => done += 1,
                            Err(Error::ServerGone) => break Some(Instant::now()),
                            Err(other) => {
                                panic!("client {t} round {round}: {other} (not ServerGone)")
                            }
                        }
                    };
                    *units.lock().unwrap() += done;
                    let Some(gone) = gone else {
                        sync.wait(); // the last server's books are checked
                        sync.wait();
                        break;
                    };
                    let k = killed_at.lock().unwrap().expect("the server was killed");
                    let took = gone.saturating_duration_since(k);
                    assert!(
                        took < Duration::from_secs(1),
                        "client {t}: server gone noticed after {took:?}"
                    );
                    {
                        let mut m = slowest.lock().unwrap();
                        *m = (*m).max(took);
                    }
                    sync.wait(); // everyone saw the server go
                    sync.wait(); // a new server is up
                    let registered =
                        e.c.reconnect(Instant::now() + Duration::from_secs(10))
                            .unwrap();
                    assert_eq!(registered, 2, "both caches registered again");
                    assert_ne!(e.c.epoch(), epoch0);
                    if let Some(id) = last {
                        assert_eq!(
                            e.c.job_status(id).unwrap(),
                            JobStatus::Unknown,
                            "client {t}: an old job id on the new server"
                        );
                    }
                }
            });
        }
        sync.wait(); // all engines registered
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..KILLS {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::thread::sleep(Duration::from_millis(100 + rng % 300));
            *killed_at.lock().unwrap() = Some(Instant::now());
            srv.kill();
            sync.wait();
            // The stale segment and socket are replaced by the new server.
            srv = s.server(&KV_SERVER_ARGS);
            sync.wait();
        }
        sync.wait();
        let mut c = s.client();
        let st = c.stats().unwrap();
        // Every engine's two caches are registered with the last server,
        // and nothing was left held.
        assert_eq!((st.instances, st.leases), (2 * CLIENTS as u64, 0), "{st:?}");
        sync.wait();
    });
    eprintln!(
        "{KILLS} server kills under {CLIENTS} engines, {} verified store+retrieve units, slowest ServerGone {:?}",
        units.lock().unwrap(),
        slowest.lock().unwrap()
    );
}

#[test]
fn wedged_server_times_waits_out_and_resumes_with_nothing_lost_or_repeated() {
    let s = Fixture::new("wedge", Duration::from_secs(120), &KV_SERVER_ARGS);
    const CLIENTS: usize = 6;
    const PINGS: u64 = 32;
    let wait = Duration::from_millis(300);
    let sync = Barrier::new(CLIENTS + 1);
    let late = Mutex::new(Duration::ZERO);
    std::thread::scope(|sc| {
        for t in 0..CLIENTS {
            let (s, sync, late) = (&s, &sync, &late);
            sc.spawn(move || {
                let mut e = TwoCacheEngine::new(s);
                let a = (t as u64 + 1) << 32;
                let b = a | 0xb;
                let mut last = None;
                e.store(a, &mut last).unwrap();
                let delay =
                    e.c.delay_job(
                        DelayJob::new(Duration::from_millis(100), Duration::from_millis(100))
                            .result(7, 0),
                    )
                    .unwrap();
                sync.wait();
                sync.wait(); // the server is stopped
                let check = |what: &str, r: Result<(), Error>, t0: Instant| {
                    let took = t0.elapsed();
                    assert!(
                        matches!(r, Err(Error::Timeout(_))),
                        "client {t}: {what} ended {r:?}, not Timeout"
                    );
                    assert!(
                        took >= wait,
                        "client {t}: {what} timed out early ({took:?})"
                    );
                    let mut m = late.lock().unwrap();
                    *m = (*m).max(took - wait);
                };
                // A synchronous store: its submission times out, abandoned.
                e.c.set_call_timeout(wait);
                let hashes = TwoCacheEngine::hashes(b);
                let blocks: Vec<u32> = (32..48).collect();
                for (h, bl) in hashes.iter().zip(blocks.chunks(4)) {
                    pattern::write_chunk(&e.cache, b as u32, h, bl);
                }
                let t0 = Instant::now();
                let r = e.c.store(Store::new(&e.inst, &hashes, &blocks)).map(|_| ());
                check("store", r, t0);
                // Pipelined requests, then waits.
                for seq in 0..PINGS {
                    e.c.raw()
                        .submit(kvring::proto::Opcode::Ping, &seq.to_le_bytes(), seq)
                        .unwrap();
                }
                let t0 = Instant::now();
                let r = e.c.raw().wait_completion(t0 + wait).map(|_| ());
                check("completion wait", r, t0);
                let t0 = Instant::now();
                let r = delay.wait(t0 + wait).map(|_| ());
                check("job wait", r, t0);
                sync.wait();
                sync.wait(); // the server runs again
                e.c.set_call_timeout(Duration::from_secs(10));
                // Every request answered once, in order (the abandoned
                // store's answer is dropped by the client).
                for seq in 0..PINGS {
                    let c = e.c.raw().wait_completion(far()).unwrap();
                    assert_eq!((c.status, c.user_data), (0, seq));
                    assert_eq!(c.payload, seq.to_le_bytes());
                }
                assert!(matches!(
                    e.c.raw()
                        .wait_completion(Instant::now() + Duration::from_millis(50)),
                    Err(Error::Protocol(_))
                ));
                match delay.wait(far()).unwrap() {
                    JobStatus::Done(r) => assert_eq!(r.value, 7),
                    st => panic!("delay job ended {st:?}"),
                }
                e.c.release_job(delay).unwrap();
                // The first store's bytes come back; the abandoned one was
                // given up (checked below, once the server has seen it).
                e.fetch(a, &mut last).unwrap();
            });
        }
        sync.wait();
        s.srv.pause();
        sync.wait();
        sync.wait(); // every wait timed out
        s.srv.signal(libc::SIGCONT);
        sync.wait();
    });
    let mut c = s.client();
    // Exactly two stores per engine reached the server (none repeated),
    // but the abandoned one was given up by its client when its call timed
    // out (its blocks are the engine's again: a late store would have read
    // whatever the engine wrote there since), so it never committed.
    let deadline = far();
    let st = loop {
        let st = c.stats().unwrap();
        if st.stores == 2 * CLIENTS as u64 || Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(st.stores, 2 * CLIENTS as u64, "{st:?}");
    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let deadline = far();
    while !unfinished_jobs(&ro).is_empty() {
        assert!(Instant::now() < deadline, "jobs left unfinished");
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = c.stats().unwrap();
    assert_eq!(st.stored_chunks, 4 * CLIENTS as u64, "{st:?}");
    for t in 0..CLIENTS {
        let b = ((t as u64 + 1) << 32) | 0xb;
        let lease = c
            .lookup(Lookup::new(
                model_id("restart"),
                1,
                &TwoCacheEngine::hashes(b),
            ))
            .unwrap();
        assert_eq!(lease.hits(), 0, "client {t}: the abandoned store committed");
    }
    let st = c.stats().unwrap();
    assert_eq!(st.leases, 0);
    // No job left unfinished.
    assert_no_unfinished_jobs(&ro);
    eprintln!(
        "{CLIENTS} engines wedged: latest timeout {:?} past its deadline",
        late.lock().unwrap()
    );
}
