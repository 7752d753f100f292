//! Client crash matrix: engine processes SIGKILLed at many points (mid-
//! request in their ring, registering, storing, holding leases, parked in a
//! wait), over randomized iterations, while an honest engine keeps working.
//! After each kill the dead client's slot, jobs (`Failed(ClientGone)` or
//! tombstoned), leases and KV registrations are reclaimed within 1 s, and
//! nothing leaks over the run. While a killed client's slot is being
//! reclaimed the inspector raises no alarm; a slot never reclaimed (the
//! server stopped) is reported.

mod common;

use common::*;
use kvring::jobs::JobStatus;
use kvring::kv::{
    chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::proto::Opcode;
use kvring::shm::SlotState;
use kvring::{DelayJob, KvSpec, Lookup, Retrieve, Store};
use std::time::{Duration, Instant};

fn layout() -> KvLayout {
    let shape = KvShape {
        layers: 2,
        blocks: 256,
        block_tokens: 16,
        heads: 2,
        head_dim: 64,
    };
    KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16)).unwrap()
}

fn spec() -> KvSpec {
    KvSpec::new(model_id("crash"), 1, 0)
}

fn tokens(seed: u32, chunks: u32) -> Vec<u32> {
    (0..chunks * 64)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

/// Child roles, run when this binary is re-executed by `Scope::child`.
fn child_main() -> bool {
    let Some((role, name, dir)) = child_role() else {
        return false;
    };
    let mut c = kvring::Client::builder(&name)
        .runtime_dir(&dir)
        .connect()
        .expect("child connect");
    let cache = kvring::HostKvCache::new(layout(), 64).unwrap();
    match role.as_str() {
        // A frame written but not published, and garbage after it.
        "mid-message" => {
            c.raw().enqueue(Opcode::Ping, &[7; 500], 1).unwrap();
            tell_parent("ready");
        }
        // Killed around its registration.
        "registering" => {
            tell_parent("ready");
            let _ = c.register_host(&spec(), &cache);
        }
        // Stores of many chunks in flight.
        "storing" => {
            let inst = c.register_host(&spec(), &cache).unwrap();
            let h = chunk_hashes(&tokens(std::process::id(), 64), 64);
            let b: Vec<u32> = (0..256).collect();
            let _ = c.store(Store::new(&inst, &h, &b)).unwrap();
            tell_parent("ready");
        }
        // Leases on the honest engine's chunks.
        "leasing" => {
            let h = chunk_hashes(&tokens(1, 8), 64);
            // Held until this process is killed.
            let _ = c
                .lookup(Lookup::new(model_id("crash"), 1, &h))
                .unwrap()
                .into_id();
            tell_parent("ready");
        }
        // Parked in a wait for a long job.
        "waiting" => {
            let job = c
                .delay_job(DelayJob::new(Duration::ZERO, Duration::from_secs(60)))
                .unwrap();
            tell_parent("ready");
            let _ = job.wait(Instant::now() + Duration::from_secs(60));
        }
        // Connected, doing nothing.
        "idle" => tell_parent("ready"),
        other => panic!("unknown role {other}"),
    }
    std::thread::sleep(Duration::from_secs(60));
    true
}

#[test]
fn killed_clients_are_reclaimed_and_nothing_leaks() {
    if child_main() {
        return;
    }
    let s = Fixture::new(
        "crash",
        Duration::from_secs(120),
        &["--chunk-tokens", "64", "--pool-bytes", "256MiB"],
    );
    // The honest engine: 8 chunks stored, verified after every kill.
    let mut good = s.client();
    let cache = kvring::HostKvCache::new(layout(), 64).unwrap();
    let inst = good.register_host(&spec(), &cache).unwrap();
    let fresh = kvring::HostKvCache::new(layout(), 64).unwrap();
    let finst = good.register_host(&spec(), &fresh).unwrap();
    let hashes = chunk_hashes(&tokens(1, 8), 64);
    let blocks: Vec<u32> = (0..32).collect();
    for (h, b) in hashes.iter().zip(blocks.chunks(4)) {
        pattern::write_chunk(&cache, 0, h, b);
    }
    let far = || Instant::now() + Duration::from_secs(10);
    let job = good.store(Store::new(&inst, &hashes, &blocks)).unwrap();
    assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
    good.release_job(job).unwrap();

    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let h = || ro.view().header();
    let roles = [
        "mid-message",
        "registering",
        "storing",
        "leasing",
        "waiting",
    ];
    let mut seed = 0x2545f4914f6cdd1du64;
    let iterations = 25;
    let mut slowest = Duration::ZERO;
    for it in 0..iterations {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let role = roles[(seed % roles.len() as u64) as usize];
        let mut child = s.child("killed_clients_are_reclaimed_and_nothing_leaks", role);
        child.expect_line("ready");
        // Kill at a random moment shortly after it is ready.
        std::thread::sleep(Duration::from_micros(seed % 5000));
        let pid = child.child.id();
        let slot = (0..ro.view().info().geometry.max_clients)
            .find(|&sl| {
                let sb = || ro.view().server_client(sl);
                sb().pid == pid && sb().state != SlotState::Free as u32
            })
            .expect("the child's slot");
        child.kill();
        let sb = || ro.view().server_client(slot);
        let took = eventually(Duration::from_secs(1), || {
            sb().state == SlotState::Free as u32 && sb().kv_instances == 0
        })
        .unwrap_or_else(|| panic!("iteration {it} ({role}): slot {slot} not reclaimed within 1 s"));
        slowest = slowest.max(took);
        // Its leases are gone, and the honest engine still gets its bytes.
        let st = good.stats().unwrap();
        assert_eq!(st.leases, 0, "iteration {it} ({role})");
        assert_eq!(st.instances, 2, "iteration {it} ({role})");
        // The retrieve takes the lease's holds; its lookup job goes now.
        let lease = good
            .lookup(Lookup::new(model_id("crash"), 1, &hashes))
            .unwrap()
            .into_id();
        good.release_job(lease.job()).unwrap();
        fresh.fill(0xcc);
        let job = good
            .retrieve(Retrieve::new(&finst, lease, &blocks))
            .unwrap();
        assert!(matches!(job.wait(far()).unwrap(), JobStatus::Done(_)));
        good.release_job(job).unwrap();
        for (hh, b) in hashes.iter().zip(blocks.chunks(4)) {
            pattern::verify_chunk(&fresh, 0, hh, b, 0, 0xcc)
                .unwrap_or_else(|e| panic!("iteration {it} ({role}): {e}"));
        }
    }
    eprintln!("{iterations} kills, slowest reclaim {slowest:?}");
    // Nothing leaked: no job stuck unfinished, no lease, only the honest
    // engine's connection and registrations, and once cleared the pool is
    // empty (an object still being written could not be cleared).
    assert_no_unfinished_jobs(&ro);
    assert_eq!(h().clients_connected, 1);
    // The inspector sees the same: one client, every kill reclaimed, no
    // anomaly.
    let snap = kvring::inspect::snapshot(&ro, Default::default());
    assert_eq!(snap.clients.len(), 1, "{:?}", snap.clients);
    assert!(snap.server.clients_reclaimed >= iterations as u64);
    assert!(snap.anomalies.is_empty(), "{:?}", snap.anomalies);
    let st = good.stats().unwrap();
    assert_eq!((st.leases, st.instances), (0, 2));
    good.clear().unwrap();
    let st = good.stats().unwrap();
    assert_eq!((st.objects, st.pool_used_bytes), (0, 0), "{st:?}");
}

/// The slot of the client process `pid`.
fn slot_of(ro: &kvring::segment::ReadOnlySegment, pid: u32) -> u32 {
    (0..ro.view().info().geometry.max_clients)
        .find(|&sl| {
            let sb = ro.view().server_client(sl);
            sb.pid == pid && sb.state != SlotState::Free as u32
        })
        .expect("the child's slot")
}

/// The dead-client anomalies of a reading.
fn dead_clients(snap: &kvring::inspect::Snapshot) -> Vec<&kvring::inspect::Anomaly> {
    snap.anomalies
        .iter()
        .filter(|a| a.kind == kvring::inspect::AnomalyKind::DeadClientNotReclaimed)
        .collect()
}

#[test]
fn a_dead_client_is_no_alarm_while_reclaimed_and_one_until_it_is() {
    if child_main() {
        return;
    }
    const TEST: &str = "a_dead_client_is_no_alarm_while_reclaimed_and_one_until_it_is";
    let s = Fixture::new(
        "crash-grace",
        Duration::from_secs(120),
        &["--pool-bytes", "16MiB"],
    );
    let ro = kvring::segment::ReadOnlySegment::open(&s.name).unwrap();
    let mut readings = 0;
    for it in 0..20 {
        let mut child = s.child(TEST, "idle");
        child.expect_line("ready");
        let slot = slot_of(&ro, child.child.id());
        // Killed and reaped: from here its pid is gone.
        child.kill();
        // Read as an inspector does, again and again, until it is free.
        let t0 = Instant::now();
        loop {
            let snap = kvring::inspect::snapshot(&ro, Default::default());
            readings += 1;
            let dead = dead_clients(&snap);
            assert!(
                dead.is_empty(),
                "iteration {it}, reading {readings}: {dead:?}"
            );
            if !snap.clients.iter().any(|c| c.slot == slot) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "slot {slot} not freed"
            );
        }
    }
    eprintln!("20 kills, {readings} readings, no false alarm");

    // A slot never reclaimed (the server stopped before the client died)
    // is reported, and no more once the server goes on.
    let mut child = s.child(TEST, "idle");
    child.expect_line("ready");
    let slot = slot_of(&ro, child.child.id());
    s.srv.pause();
    child.kill();
    let snap = kvring::inspect::snapshot(&ro, Default::default());
    let dead = dead_clients(&snap);
    assert_eq!(dead.len(), 1, "{:?}", snap.anomalies);
    assert_eq!(dead[0].client_slot, Some(slot));
    s.srv.signal(libc::SIGCONT);
    eventually(Duration::from_secs(5), || {
        let snap = kvring::inspect::snapshot(&ro, Default::default());
        snap.clients.is_empty() && snap.anomalies.is_empty()
    })
    .expect("reclaimed once the server went on");
}
