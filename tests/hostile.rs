//! A hostile client: many clients in turn write random and adversarial
//! words into everything they can write (ring indices, frame words, their
//! heartbeat, the doorbell) while an honest engine keeps storing and
//! retrieving. The server never dies, disconnects what breaks its ring
//! rules, and the honest engine's results stay bit-exact.

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern};
use kvring::shm::SlotState;
use kvring::{KvSpec, Lookup, Retrieve, Store};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn hostile_clients_never_hurt_the_server_or_an_honest_engine() {
    let mut s = Fixture::new(
        "hostile",
        Duration::from_secs(120),
        &["--chunk-tokens", "64", "--pool-bytes", "64MiB"],
    );
    // The honest engine.
    let mut good = s.client();
    let l = small_layout();
    let cache = kvring::HostKvCache::new(l.clone(), 64).unwrap();
    let spec = KvSpec::new(model_id("h"), 1, 0);
    let inst = good.register_host(&spec, &cache).unwrap();
    let fresh = kvring::HostKvCache::new(l.clone(), 64).unwrap();
    let finst = good.register_host(&spec, &fresh).unwrap();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let mut kicked = 0;
    // Kicked clients of this (live) process stay quarantined until it
    // exits, so at most the slots the server has: 50 of 64.
    let rounds = 50;
    for round in 0..rounds {
        let mut evil = s.client();
        let evil_session = evil.raw().session();
        let slot = evil.slot();
        let seg = evil.segment();
        let cb = seg.block_rw();
        let words = seg.view().info().geometry.req_ring_bytes as u64 / 8;
        // Garbage frames: random words, sometimes plausible headers.
        for i in 0..64 {
            let w = match rng.next() % 4 {
                0 => rng.next(),
                1 => (rng.next() % 40_000) | ((rng.next() % 20) << 32),
                2 => u64::MAX,
                _ => 0,
            };
            seg.scribble_request_ring(i, w);
        }
        // Indices and flags: random, huge, backwards, misaligned, or valid.
        let tail = match round % 5 {
            0 => rng.next(),
            1 => words * 8 * 3,
            2 => 8 * (rng.next() % words),
            3 => 13,
            _ => 8 * 64,
        };
        cb.req_tail.store(tail, Ordering::Release);
        cb.cq_head.store(rng.next() % 4096 * 8, Ordering::Release);
        cb.client_sleeping
            .store(rng.next() as u32, Ordering::Relaxed);
        cb.heartbeat_ns.store(rng.next(), Ordering::Relaxed);
        seg.doorbell_rw()
            .server_doorbell
            .fetch_add(rng.next() as u32, Ordering::Relaxed);
        kvring::wait::wake(&seg.doorbell_rw().server_doorbell);

        // Meanwhile the honest engine stores and retrieves one chunk and
        // checks every byte.
        let hashes = chunk_hashes(
            &(0..64u32).map(|t| t ^ (round * 7919)).collect::<Vec<_>>(),
            64,
        );
        let b: Vec<u32> = (0..4).map(|k| (round * 4 + k) % 64).collect();
        pattern::write_chunk(&cache, 0, &hashes[0], &b);
        let far = Instant::now() + Duration::from_secs(10);
        let job = good.store(Store::new(&inst, &hashes, &b)).unwrap();
        assert!(matches!(job.wait(far).unwrap(), JobStatus::Done(_)));
        good.release_job(job).unwrap();
        // The retrieve takes the lease's holds; its lookup job goes now.
        let lease = good
            .lookup(Lookup::new(model_id("h"), 1, &hashes))
            .unwrap()
            .into_id();
        good.release_job(lease.job()).unwrap();
        fresh.fill(0xee);
        let job = good.retrieve(Retrieve::new(&finst, lease, &b)).unwrap();
        assert!(matches!(job.wait(far).unwrap(), JobStatus::Done(_)));
        good.release_job(job).unwrap();
        pattern::verify_chunk(&fresh, 0, &hashes[0], &b, 0, 0xee)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(
            good.ping(b"still here", Instant::now() + Duration::from_secs(5))
                .unwrap(),
            b"still here"
        );
        // A hostile client whose ring broke the rules is disconnected.
        let sb = || ro.view().server_client(slot);
        let gone = eventually(Duration::from_millis(300), || {
            sb().state != SlotState::Active as u32 || sb().session != evil_session
        });
        kicked += gone.is_some() as u32;
        drop(evil);
    }
    // The server is alive and every round of the honest engine passed; most
    // hostile clients were thrown out (a few wrote a tail the ring accepts
    // and only produced error completions).
    assert!(
        s.srv.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "server died"
    );
    eprintln!("{kicked} of {rounds} hostile clients disconnected");
    assert!(kicked >= rounds / 2, "{kicked}");
    let h = || ro.view().header();
    let reclaimed = eventually(Duration::from_secs(2), || {
        h().clients_reclaimed >= u64::from(kicked)
    });
    assert!(
        reclaimed.is_some(),
        "kicked clients' slots were not reclaimed"
    );
}

/// Another process of the same user (one trust domain: it can open the
/// segment by name) sets a running job's lock word odd. The server retires
/// that slot the moment it comes to write it, instead of spinning on it
/// with the job table locked: every other client keeps being served, new
/// jobs take other slots, and the header and the inspector count it.
#[test]
fn an_odd_lock_word_retires_its_job_slot_instead_of_stalling_the_server() {
    use kvring::DelayJob;
    let s = Fixture::new("odd-seqlock", Duration::from_secs(60), &[]);
    let mut c = s.client();
    let job = c
        .delay_job(DelayJob::new(Duration::ZERO, Duration::from_millis(300)))
        .unwrap();
    let index = job.id().index();
    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let info = ro.view().info().clone();
    let fd = nix::sys::mman::shm_open(
        kvring::rundir::shm_name(&s.name).as_str(),
        nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    let len = std::num::NonZeroUsize::new(info.segment_bytes as usize).unwrap();
    // SAFETY: a fresh shared mapping of the whole segment, unmapped below;
    // only one atomic word of it is touched.
    let base = unsafe {
        nix::sys::mman::mmap(
            None,
            len,
            nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
            nix::sys::mman::MapFlags::MAP_SHARED,
            &fd,
            0,
        )
    }
    .unwrap();
    let at = info.offsets.jobs_off as usize
        + index as usize * std::mem::size_of::<kvring::jobs::JobSlot>();
    // SAFETY: `seq`, the slot's first word, inside the mapping, 8-aligned.
    let seq =
        unsafe { &*(base.as_ptr().cast::<u8>().add(at) as *const std::sync::atomic::AtomicU64) };
    seq.store(seq.load(Ordering::Relaxed) | 1, Ordering::Release);
    // The job's end comes (300 ms) and finds the word odd. The server
    // answers on, well within deadlines.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(800) {
        assert_eq!(
            c.ping(b"x", Instant::now() + Duration::from_secs(2))
                .unwrap(),
            b"x"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut other = s.client();
    let j = other
        .delay_job(DelayJob::new(Duration::ZERO, Duration::from_millis(5)).result(7, 8))
        .unwrap();
    assert_ne!(j.id().index(), index);
    assert!(matches!(
        j.wait(Instant::now() + Duration::from_secs(5)).unwrap(),
        JobStatus::Done(_)
    ));
    // Counted in the header (published every tick) and flagged.
    let deadline = Instant::now() + Duration::from_secs(5);
    while ro.view().header().jobs_retired != 1 {
        assert!(
            Instant::now() < deadline,
            "the retired slot was not counted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let inspect = std::env::var_os("KVRING_INSPECT_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvring-inspect").into());
    let out = std::process::Command::new(inspect)
        .args(["show", &s.name, "--json"])
        .env("KVRING_RUNTIME_DIR", &s.dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("job slots retired"), "{text}");
    drop(job);
    // SAFETY: the mapping made above, not used after this.
    unsafe { nix::sys::mman::munmap(base, len.get()) }.unwrap();
}
