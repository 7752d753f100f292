//! A hostile client: many clients in turn write random and adversarial
//! words into everything they can write (ring indices, frame words, their
//! heartbeat, their doorbell) while an honest engine keeps storing and
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
        for _ in 0..rng.next() % 4 {
            seg.doorbell().ring();
        }

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

/// Whether `fd` (of `len` bytes) can be mapped shared and writable; maps and
/// unmaps it to find out.
fn maps_writable(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> Result<(), nix::errno::Errno> {
    use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
    let len = std::num::NonZeroUsize::new(len).unwrap();
    // SAFETY: a fresh mapping, unmapped at once, never read or written.
    let p = unsafe {
        mmap(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            0,
        )
    }?;
    // SAFETY: the mapping just made.
    unsafe { munmap(p, len.get()) }.unwrap();
    Ok(())
}

/// What a connected client holds of the segment is read-only, and cannot be
/// made writable: every descriptor of it (`mmap(PROT_WRITE)` fails with
/// EACCES) and every mapping (`mprotect(PROT_WRITE)` fails with EACCES).
/// The only shared memory of this server the client maps writable is its
/// session's own memfd, which it cannot resize.
#[test]
fn a_client_holds_the_segment_read_only_and_maps_only_its_own_memory_writable() {
    use std::os::fd::BorrowedFd;
    let s = Fixture::new("ro-segment", Duration::from_secs(30), &[]);
    let mut c = s.client();
    let (slot, session) = (c.slot(), c.raw().session());
    assert_eq!(c.ping(b"x", far()).unwrap(), b"x");
    let seg_path = format!("/dev/shm{}", s.shm_name());
    let info = kvring::segment::ReadOnlySegment::open(&s.name)
        .unwrap()
        .view()
        .info()
        .clone();

    let mut descriptors = 0;
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        if target.to_str() != Some(seg_path.as_str()) {
            continue;
        }
        let fd: i32 = e.file_name().to_str().unwrap().parse().unwrap();
        // SAFETY: a descriptor of this process, open while the client lives.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert_eq!(
            flags & libc::O_ACCMODE,
            libc::O_RDONLY,
            "a descriptor of the segment is writable"
        );
        assert_eq!(
            maps_writable(fd, info.segment_bytes as usize),
            Err(nix::errno::Errno::EACCES)
        );
        descriptors += 1;
    }
    assert!(
        descriptors >= 1,
        "the client holds no descriptor of the segment"
    );

    // The session's memory: a memfd named after the segment, slot and
    // session (that it cannot be resized is checked by the next test, which
    // keeps the descriptors).
    let own_name = format!(
        "/memfd:{}.{slot}.{session}",
        s.shm_name().trim_start_matches('/')
    );
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let (mut mappings, mut own) = (0, 0);
    for line in maps.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (Some(range), Some(perms), Some(path)) = (cols.first(), cols.get(1), cols.get(5))
        else {
            continue;
        };
        if path.starts_with(&own_name) {
            own += u32::from(perms.contains('w'));
            continue;
        }
        if !path.starts_with(&seg_path) {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            usize::from_str_radix(a, 16).unwrap(),
            usize::from_str_radix(b, 16).unwrap(),
        );
        if *path == seg_path {
            assert!(!perms.contains('w'), "segment mapped writable: {line}");
            // SAFETY: asks the kernel to change a mapping of this process's
            // client library to writable; it must refuse, so nothing changes.
            let r = unsafe {
                nix::sys::mman::mprotect(
                    std::ptr::NonNull::new(a as *mut libc::c_void).unwrap(),
                    b - a,
                    nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                )
            };
            assert_eq!(r, Err(nix::errno::Errno::EACCES), "{line}");
            mappings += 1;
        } else {
            assert!(
                !perms.contains('w'),
                "a writable mapping of another object: {line}"
            );
        }
    }
    assert!(mappings >= 1, "the segment is not mapped");
    assert_eq!(
        own, 1,
        "the client's own memory is not mapped writable once"
    );
    drop(c);
}

/// The bootstrap done by hand, as a client that does not use the library
/// would: the connection (kept open: it is the session), the welcome and
/// the three descriptors it carried.
fn hello_by_hand(
    s: &Fixture,
) -> (
    kvring::bootstrap::Conn,
    kvring::proto::Welcome,
    Vec<std::os::fd::OwnedFd>,
) {
    let conn = kvring::bootstrap::Conn::connect(&s.dir.join(format!("{}.sock", s.name))).unwrap();
    let hello = kvring::proto::Hello::new([0; 32]);
    conn.send(bytemuck::bytes_of(&hello), &[]).unwrap();
    let mut buf = [0u8; 64];
    let (n, fds) = conn.recv(&mut buf, Duration::from_secs(5)).unwrap();
    let w: kvring::proto::Welcome = bytemuck::pod_read_unaligned(&buf[..n]);
    assert_eq!((w.status, fds.len()), (0, 3));
    (conn, w, fds)
}

/// A client does the bootstrap by hand, maps writable everything it was
/// handed that can be, says goodbye, and goes on writing garbage there
/// while the slot's next occupant works: the next occupant never notices
/// (its session has memory of its own), and the server serves on.
#[test]
fn writes_of_a_slots_previous_occupant_after_its_goodbye_reach_nobody() {
    use kvring::proto::Goodbye;
    use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
    use std::os::fd::AsFd;
    let s = Fixture::new("late-writer", Duration::from_secs(60), &KV_SERVER_ARGS);
    let (conn, w, fds) = hello_by_hand(&s);
    // Everything that maps writable, whole.
    let mut writable = Vec::new();
    for fd in &fds {
        let len = nix::sys::stat::fstat(fd.as_fd()).unwrap().st_size as usize;
        let Some(nz) = std::num::NonZeroUsize::new(len) else {
            continue;
        };
        // SAFETY: a fresh shared mapping, unmapped at the end of the test.
        let p = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        };
        if let Ok(p) = p {
            writable.push((p.as_ptr() as usize, len));
            // What a client can write it cannot resize: a truncation would
            // fault the server's next load from it.
            assert_eq!(
                nix::unistd::ftruncate(fd, 0),
                Err(nix::errno::Errno::EPERM),
                "a client can shrink memory the server maps"
            );
        }
    }
    assert!(
        !writable.is_empty(),
        "not even the client's own memory maps writable"
    );
    conn.send(bytemuck::bytes_of(&Goodbye::default()), &[])
        .unwrap();
    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || {
            ro.view().server_client(w.slot).state == SlotState::Free as u32
        })
        .is_some(),
        "the slot was not freed after the goodbye"
    );

    // The next occupant of the same slot.
    let mut next = s.client();
    assert_eq!(next.slot(), w.slot);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            let mut rng = Rng(0x2545f4914f6cdd1d);
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for &(base, len) in &writable {
                    for k in 0..len / 8 {
                        // SAFETY: inside a writable shared mapping of this
                        // test, 8-aligned.
                        unsafe {
                            (*((base + k * 8) as *const std::sync::atomic::AtomicU64))
                                .store(rng.next(), Ordering::Relaxed)
                        };
                    }
                }
                rounds += 1;
            }
            rounds
        });
        for i in 0..200u32 {
            let msg = i.to_le_bytes();
            let deadline = Instant::now() + Duration::from_secs(2);
            assert_eq!(next.ping(&msg, deadline).unwrap(), msg);
        }
        round_trip(
            &s,
            &mut next,
            small_layout(),
            || kvring::HostKvCache::new(small_layout(), 64).unwrap(),
            7,
        );
        stop.store(true, Ordering::Relaxed);
        assert!(writer.join().unwrap() > 0);
    });
    let sb = ro.view().server_client(w.slot);
    assert_eq!(sb.state, SlotState::Active as u32);
    assert_eq!(sb.session, next.raw().session());
    assert_eq!(sb.requests_rejected, 0);
    for (base, len) in writable {
        // SAFETY: the mappings made above, not used after this.
        unsafe {
            munmap(
                std::ptr::NonNull::new(base as *mut libc::c_void).unwrap(),
                len,
            )
        }
        .unwrap();
    }
}

/// CPU time (user + system) process `pid` has used, in seconds.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the line; `rest` starts at field 3.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// A client's doorbell is the writing end of a pipe whose reading end only
/// the server holds: the client cannot drain it nor make the server's reads
/// block (it can change only its own end's flags), and a client that closes
/// its end (while keeping its connection) does not make the ring loop spin
/// on the hung-up pipe. An honest client is served throughout.
#[test]
fn a_client_cannot_stall_or_spin_the_ring_loop_through_its_doorbell() {
    use std::os::fd::{AsFd, AsRawFd};
    let s = Fixture::new("doorbell", Duration::from_secs(60), &[]);
    let (conn, _, mut fds) = hello_by_hand(&s);
    let bell = fds.pop().unwrap();
    // Blocking, as far as this end goes; it reads nothing (a write end).
    nix::fcntl::fcntl(
        bell.as_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
    )
    .unwrap();
    let mut one = [0u8; 1];
    assert!(
        nix::unistd::read(&bell, &mut one).is_err(),
        "the client can drain its doorbell"
    );
    for _ in 0..100 {
        nix::unistd::write(&bell, &[7u8]).unwrap();
    }
    let mut honest = s.client();
    assert_eq!(honest.ping(b"a", far()).unwrap(), b"a");
    // A flood of rings (64 KiB writes into a 1 MiB pipe, as fast as they
    // go): the ring loop drains a bounded amount per wake and serves on.
    let flooding = std::sync::atomic::AtomicBool::new(true);
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            // SAFETY: F_SETPIPE_SZ on this test's own pipe end.
            unsafe { libc::fcntl(bell.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
            let block = vec![9u8; 64 << 10];
            let mut bytes = 0u64;
            // Relaxed: a stop flag only; the join below orders the rest.
            while flooding.load(Ordering::Relaxed) {
                bytes += nix::unistd::write(&bell, &block).unwrap_or(0) as u64;
            }
            bytes
        });
        let t = Instant::now();
        let mut worst = Duration::ZERO;
        for i in 0..20u8 {
            let p = Instant::now();
            let deadline = p + Duration::from_secs(2);
            assert_eq!(honest.ping(&[i], deadline).unwrap(), [i]);
            worst = worst.max(p.elapsed());
            std::thread::sleep(Duration::from_millis(20));
        }
        // Relaxed: pairs with the writer's load of the stop flag (a hint).
        flooding.store(false, Ordering::Relaxed);
        let bytes = writer.join().unwrap();
        eprintln!(
            "{} MiB of rings in {:?}: 20 pings of an honest client, the slowest {worst:?}",
            bytes >> 20,
            t.elapsed()
        );
    });
    // Hang up the doorbell, keep the connection: the loop must not spin.
    drop(bell);
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_seconds(s.srv.pid());
    let t = Instant::now();
    for i in 0..10u8 {
        let deadline = Instant::now() + Duration::from_secs(2);
        assert_eq!(honest.ping(&[i], deadline).unwrap(), [i]);
        std::thread::sleep(Duration::from_millis(100));
    }
    let used = cpu_seconds(s.srv.pid()) - before;
    let wall = t.elapsed().as_secs_f64();
    eprintln!("server CPU {used:.3} s in {wall:.3} s with a hung-up doorbell");
    assert!(
        used < 0.5 * wall,
        "the server spun: {used:.3} s of CPU in {wall:.3} s"
    );
    drop(conn);
}
