//! End-to-end tests of the foundation with real processes: the `kvring`
//! server binary, this test binary as client (and re-executed as child
//! client processes that get killed).

mod common;

use common::*;
use kvring::proto::Opcode;
use kvring::ring::{FrameHeader, RingError};
use kvring::segment::ReadOnlySegment;
use kvring::shm::SlotState;
use kvring::Error;
use std::time::{Duration, Instant};

/// Child roles, run when this binary is re-executed by `Scope::child`.
fn child_main() -> bool {
    let Some((role, name, dir)) = child_role() else {
        return false;
    };
    let mut c = kvring::Client::builder(&name)
        .runtime_dir(&dir)
        .connect()
        .expect("child connect");
    match role.as_str() {
        "mid-message" => {
            // Serve one ping so the ring has moved, then leave a frame written
            // but unpublished, and garbage past it, and wait to be killed.
            c.ping(b"warm-up", Instant::now() + Duration::from_secs(5))
                .unwrap();
            c.raw().enqueue(Opcode::Ping, &[0xee; 200], 99).unwrap();
            tell_parent(&format!("ready slot={}", c.slot()));
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown role {other}"),
    }
    true
}

#[test]
fn ping_round_trips_between_processes() {
    if child_main() {
        return;
    }
    let s = Fixture::new("ping", Duration::from_secs(60), &[]);
    let mut c = s.client();
    for size in [0usize, 1, 7, 8, 64, 1000, c.raw().max_payload()] {
        let payload: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        assert_eq!(
            c.ping(&payload, Instant::now() + Duration::from_secs(5))
                .unwrap(),
            payload,
            "size {size}"
        );
    }
    // Pipelined: many requests in flight, completions in order.
    for i in 0..100u64 {
        c.raw().enqueue(Opcode::Ping, &i.to_le_bytes(), i).unwrap();
    }
    c.raw().flush();
    for i in 0..100u64 {
        let done = c
            .raw()
            .wait_completion(Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(done.user_data, i);
        assert_eq!(done.payload, i.to_le_bytes());
    }
    // The CLI's ping command works against the same server.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvring"))
        .args(["ping", "--count", "50", "--name", &s.name, "--runtime-dir"])
        .arg(&s.dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("50 pings of 64 bytes"));
}

#[test]
fn oversized_request_is_refused_with_the_bound() {
    if child_main() {
        return;
    }
    let s = Fixture::new(
        "big",
        Duration::from_secs(30),
        &["--max-frame-bytes", "4096"],
    );
    let mut c = s.client();
    assert_eq!(c.raw().max_payload(), 4096 - 24);
    match c.ping(&vec![1u8; 4096], Instant::now() + Duration::from_secs(1)) {
        Err(Error::Ring(RingError::TooLarge {
            len: 4096,
            max: 4072,
        })) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // Still usable.
    assert_eq!(
        c.ping(&[3u8; 4072], Instant::now() + Duration::from_secs(5))
            .unwrap(),
        vec![3u8; 4072]
    );
}

#[test]
fn credits_bound_requests_in_flight_to_the_completion_ring() {
    if child_main() {
        return;
    }
    let s = Fixture::new(
        "credit",
        Duration::from_secs(30),
        &[
            "--cq-ring-bytes",
            "16384",
            "--req-ring-bytes",
            "65536",
            "--max-frame-bytes",
            "4096",
        ],
    );
    let mut c = s.client();
    let payload = [5u8; 1000];
    let per = kvring::ring::frame_bytes(1000);
    let mut n = 0u64;
    let err = loop {
        match c.raw().enqueue(Opcode::Ping, &payload, n) {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
    };
    // The request ring (64 KiB) had room; the completion credit (16 KiB) ran out.
    assert_eq!(n as usize, 16384 / per);
    assert!(matches!(err, Error::Ring(RingError::Full { .. })), "{err}");
    c.raw().flush();
    for i in 0..n {
        assert_eq!(
            c.raw()
                .wait_completion(Instant::now() + Duration::from_secs(5))
                .unwrap()
                .user_data,
            i
        );
    }
    assert_eq!(c.raw().credits(), 16384);
}

#[test]
fn stale_session_frames_are_never_served() {
    if child_main() {
        return;
    }
    let s = Fixture::new("session", Duration::from_secs(30), &[]);
    let mut c = s.client();
    let stale = FrameHeader {
        opcode: Opcode::Ping as u16,
        session: c.raw().session().wrapping_sub(1),
        user_data: 0xdead,
        ..Default::default()
    };
    c.raw()
        .submit_raw(stale, b"from a previous occupant", false)
        .unwrap();
    // The next completion is the real ping's, not the stale frame's.
    assert_eq!(
        c.ping(b"mine", Instant::now() + Duration::from_secs(5))
            .unwrap(),
        b"mine"
    );
    let ro = ReadOnlySegment::open(&s.name).unwrap();
    let sb = ro.view().server_client(c.slot());
    assert_eq!(sb.requests_rejected, 1);
    // An unknown opcode gets an error completion, and the ring goes on.
    let bad = FrameHeader {
        opcode: 999,
        session: c.raw().session(),
        user_data: 7,
        ..Default::default()
    };
    c.raw().submit_raw(bad, &[], true).unwrap();
    let done = c
        .raw()
        .wait_completion(Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(done.status, kvring::proto::Status::UnknownOpcode as i32);
    assert_eq!(
        c.ping(b"again", Instant::now() + Duration::from_secs(5))
            .unwrap(),
        b"again"
    );
}

#[test]
fn killed_client_is_reclaimed_within_a_second_and_others_are_unaffected() {
    if child_main() {
        return;
    }
    let s = Fixture::new("kill", Duration::from_secs(60), &[]);
    let mut other = s.client();
    let mut victim = s.child(
        "killed_client_is_reclaimed_within_a_second_and_others_are_unaffected",
        "mid-message",
    );
    let line = victim.expect_line("ready");
    let slot: u32 = line.trim_start_matches("ready slot=").parse().unwrap();
    let ro = ReadOnlySegment::open(&s.name).unwrap();
    let h = || ro.view().header();
    assert_eq!(h().clients_connected, 2);
    let reclaimed_before = h().clients_reclaimed;
    let sb = || ro.view().server_client(slot);
    assert_eq!(sb().state, SlotState::Active as u32);

    // Keep the other client busy across the kill.
    let killed_at = Instant::now();
    victim.kill();
    let took = eventually(Duration::from_secs(1), || {
        sb().state == SlotState::Free as u32 && h().clients_reclaimed == reclaimed_before + 1
    });
    assert!(
        took.is_some(),
        "slot {slot} not reclaimed within 1 s of the kill"
    );
    eprintln!("reclaimed {:?} after the kill", killed_at.elapsed());
    assert_eq!(h().clients_connected, 1);
    for i in 0..1000u32 {
        assert_eq!(
            other
                .ping(&i.to_le_bytes(), Instant::now() + Duration::from_secs(5))
                .unwrap(),
            i.to_le_bytes()
        );
    }
    // The slot is reused with a new session and a clean ring.
    let old_session = sb().session;
    let mut fresh = s.client();
    assert_eq!(fresh.slot(), slot);
    assert_ne!(fresh.raw().session(), old_session);
    assert_eq!(
        fresh
            .ping(b"new occupant", Instant::now() + Duration::from_secs(5))
            .unwrap(),
        b"new occupant"
    );
}

#[test]
fn killed_server_ends_a_waiting_client_with_server_gone_and_restarts() {
    if child_main() {
        return;
    }
    let mut s = Fixture::new("srvkill", Duration::from_secs(60), &[]);
    let mut c = s.client();
    let epoch = c.epoch();
    c.ping(b"x", Instant::now() + Duration::from_secs(5))
        .unwrap();
    // Stop the server so the next request stays unanswered, then kill it
    // while the client is parked waiting.
    s.srv.pause();
    c.raw().submit(Opcode::Ping, b"never answered", 1).unwrap();
    let mut srv = ServerProc {
        child: s.srv.child.take(),
    };
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        srv.kill();
        t
    });
    let r = c
        .raw()
        .wait_completion(Instant::now() + Duration::from_secs(30));
    let ended = Instant::now();
    let killed_at = killer.join().unwrap();
    assert!(matches!(r, Err(Error::ServerGone)), "{r:?}");
    let lag = ended.saturating_duration_since(killed_at);
    assert!(
        lag < Duration::from_secs(1),
        "wait ended {lag:?} after the kill"
    );
    eprintln!("wait ended {lag:?} after the kill");
    assert!(c.server_gone());

    // The stale segment is detected (its lock is free) and replaced.
    let stale = ReadOnlySegment::open(&s.name).unwrap();
    assert!(!stale.server_alive().unwrap());
    let _srv2 = s.server(&[]);
    let mut c2 = s.client();
    assert!(c2.epoch() > epoch);
    assert_eq!(
        c2.ping(b"after restart", Instant::now() + Duration::from_secs(5))
            .unwrap(),
        b"after restart"
    );
}

#[test]
fn wedged_server_ends_a_wait_at_its_deadline() {
    if child_main() {
        return;
    }
    let s = Fixture::new("wedge", Duration::from_secs(30), &[]);
    let mut c = s.client();
    s.srv.pause();
    c.raw().submit(Opcode::Ping, b"late", 5).unwrap();
    let t = Instant::now();
    let r = c
        .raw()
        .wait_completion(Instant::now() + Duration::from_millis(300));
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(2));
    // Resumed, the server answers the request that was waiting.
    s.srv.signal(libc::SIGCONT);
    let done = c
        .raw()
        .wait_completion(Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!((done.user_data, done.payload.as_slice()), (5, &b"late"[..]));
}

#[test]
fn a_live_server_is_never_taken_over_and_sigterm_cleans_up() {
    if child_main() {
        return;
    }
    let mut s = Fixture::new("twice", Duration::from_secs(30), &[]);
    let out = s.serve_output();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already running") && err.contains(&format!("pid {}", s.srv.pid())),
        "{err}"
    );
    let mut c = s.client();
    assert_eq!(
        c.ping(b"still mine", Instant::now() + Duration::from_secs(5))
            .unwrap(),
        b"still mine"
    );
    drop(c);
    assert!(s.srv.terminate().success());
    assert!(
        !s.dir.join(format!("{}.sock", s.name)).exists(),
        "socket left behind"
    );
    assert!(
        !std::path::Path::new(&format!("/dev/shm{}", s.shm_name())).exists(),
        "segment left behind"
    );
}

#[test]
fn a_full_server_refuses_with_no_free_slot() {
    if child_main() {
        return;
    }
    let s = Fixture::new("full", Duration::from_secs(30), &["--max-clients", "1"]);
    let mut a = s.client();
    match kvring::Client::builder(&s.name)
        .runtime_dir(&s.dir)
        .connect()
    {
        Err(Error::Refused(kvring::proto::Status::NoFreeSlot)) => {}
        other => panic!("expected NoFreeSlot, got {:?}", other.map(|c| c.slot())),
    }
    a.ping(b"ok", Instant::now() + Duration::from_secs(5))
        .unwrap();
    drop(a);
    // A clean goodbye frees the slot at once.
    let ok = eventually(Duration::from_secs(2), || {
        kvring::Client::builder(&s.name)
            .runtime_dir(&s.dir)
            .connect()
            .is_ok()
    });
    assert!(ok.is_some());
}

#[test]
fn no_server_is_a_clear_error() {
    if child_main() {
        return;
    }
    let s = Scope::new("none");
    match s
        .client_builder()
        .connect_timeout(Duration::from_millis(50))
        .connect()
    {
        Err(e @ Error::NoServer { .. }) => assert!(e.to_string().contains(&s.name)),
        other => panic!("expected NoServer, got {:?}", other.map(|c| c.slot())),
    }
}
