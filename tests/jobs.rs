//! The job-slot contract across real processes: the `kvring` server binary,
//! this test binary as a client, and re-executed copies of it as child
//! clients that get killed. A status poll never reads a finished, released,
//! reused, foreign or never-issued job as pending or running.

mod common;

use common::*;
use kvring::jobs::{FailReason, JobId, JobResult, JobStatus};
use kvring::proto::Status;
use kvring::segment::ReadOnlySegment;
use kvring::{DelayJob, Error};
use std::time::{Duration, Instant};

fn delay(pending_ms: u64, running_ms: u64) -> DelayJob {
    DelayJob::new(
        Duration::from_millis(pending_ms),
        Duration::from_millis(running_ms),
    )
    .result(42, 7)
}

fn id_to_string(id: JobId) -> String {
    format!("{}:{}", id.epoch, id.key)
}

fn id_from_str(s: &str) -> JobId {
    let (e, k) = s.split_once(':').unwrap();
    JobId {
        epoch: e.parse().unwrap(),
        key: k.parse().unwrap(),
    }
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
    match role.as_str() {
        "long-jobs" => {
            // Two jobs that would take a minute, one pending, one running.
            let a = c.delay_job(delay(60_000, 1)).unwrap().into_id();
            let b = c.delay_job(delay(0, 60_000)).unwrap().into_id();
            tell_parent(&format!("ids {} {}", id_to_string(a), id_to_string(b)));
            std::thread::sleep(Duration::from_secs(60));
        }
        "reuse" => {
            // Once the parent polls, 1000 jobs through a one-slot table: each
            // reuses the same slot.
            let go = dir.join("go");
            let t = Instant::now();
            while !go.exists() {
                assert!(t.elapsed() < Duration::from_secs(10), "never told to go");
                std::thread::sleep(Duration::from_millis(1));
            }
            for _ in 0..1000 {
                let job = c.delay_job(delay(0, 0)).unwrap();
                let st = job.wait(Instant::now() + Duration::from_secs(5)).unwrap();
                assert!(matches!(st, JobStatus::Done(_)), "{st:?}");
                c.release_job(job).unwrap();
            }
            tell_parent("reused 1000");
        }
        other => panic!("unknown role {other}"),
    }
    true
}

#[test]
fn a_job_goes_pending_running_done_tombstoned_as_seen_from_shared_memory() {
    if child_main() {
        return;
    }
    let s = Fixture::new("states", Duration::from_secs(30), &[]);
    let mut c = s.client();
    let job = c
        .delay_job(delay(150, 150).progress_every(Duration::from_millis(5)))
        .unwrap();
    assert_eq!(job.status().unwrap(), JobStatus::Pending);
    let mut seen = Vec::new();
    let mut progress = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = job.status().unwrap();
        if seen.last() != Some(&st.name()) {
            seen.push(st.name());
        }
        if st == JobStatus::Running {
            progress.push(job.progress().unwrap());
        }
        if st.is_terminal() {
            assert_eq!(st, JobStatus::Done(JobResult { value: 42, aux: 7 }));
            break;
        }
        assert!(Instant::now() < deadline, "job never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(seen, ["pending", "running", "done"]);
    assert!(progress.windows(2).all(|w| w[0] <= w[1]), "{progress:?}");
    assert!(
        progress.last().copied().unwrap_or(0) >= 50_000,
        "{progress:?}"
    );
    let info = job.info().unwrap().unwrap();
    assert_eq!(info.owner_slot, c.slot());
    assert!(info.submitted_ns < info.started_ns && info.started_ns < info.finished_ns);
    let pending_for = Duration::from_nanos(info.started_ns - info.submitted_ns);
    assert!(pending_for >= Duration::from_millis(150), "{pending_for:?}");

    let id = job.id();
    c.release_job(job).unwrap();
    let tomb = JobStatus::Tombstoned(Ok(JobResult { value: 42, aux: 7 }));
    assert_eq!(c.job_status(id).unwrap(), tomb);
    c.release_job(id).unwrap(); // twice is harmless
    assert_eq!(c.job_status(id).unwrap(), tomb);

    // A requested failure, awaited through the futex path. The job runs for
    // 50 ms from its submission, so the clock starts before the submission
    // (started after it, the reply's own latency could be counted twice).
    let t = Instant::now();
    let f = c
        .delay_job(delay(0, 50).fail(FailReason::Requested))
        .unwrap();
    let st = f.wait(Instant::now() + Duration::from_secs(5)).unwrap();
    assert_eq!(st, JobStatus::Failed(FailReason::Requested));
    assert!(t.elapsed() >= Duration::from_millis(50));
    let h = ReadOnlySegment::open(&s.name).unwrap();
    let hdr = || h.view().header();
    assert_eq!(hdr().jobs_submitted, 2);
    assert_eq!(hdr().jobs_done, 1);
    assert_eq!(hdr().jobs_failed, 1);
    assert_eq!(hdr().jobs_released, 1);
}

#[test]
fn a_released_job_reads_terminal_10000_times_and_through_1000_reuses_of_its_slot() {
    if child_main() {
        return;
    }
    let s = Fixture::new("seed", Duration::from_secs(60), &["--job-slots", "1"]);
    let mut c = s.client();
    let job = c.delay_job(delay(0, 20)).unwrap();
    let done = job.wait(Instant::now() + Duration::from_secs(5)).unwrap();
    assert_eq!(done, JobStatus::Done(JobResult { value: 42, aux: 7 }));
    let id = job.id();
    c.release_job(job).unwrap();
    for _ in 0..10_000 {
        assert_eq!(
            c.job_status(id).unwrap(),
            JobStatus::Tombstoned(Ok(JobResult { value: 42, aux: 7 }))
        );
    }
    // Another process reuses the only slot 1000 times while this one polls
    // the old id: tombstoned, then expired, never pending or running.
    let mut child = s.child(
        "a_released_job_reads_terminal_10000_times_and_through_1000_reuses_of_its_slot",
        "reuse",
    );
    let ro = ReadOnlySegment::open(&s.name).unwrap();
    let reader = ro.view().job_reader();
    let mut polls = 0u64;
    let mut expired = 0u64;
    let hdr = || ro.view().header();
    std::fs::write(s.dir.join("go"), b"").unwrap();
    while hdr().jobs_released < 1001 {
        let st = c.job_status(id).unwrap();
        assert!(st.is_terminal(), "released job read {st:?}");
        let seen = reader.status(id).unwrap();
        assert!(seen.is_terminal(), "an observer read {seen:?}");
        expired += (st == JobStatus::Expired) as u64;
        polls += 1;
    }
    child.expect_line("reused 1000");
    assert_eq!(c.job_status(id).unwrap(), JobStatus::Expired);
    assert_eq!(
        ro.view()
            .job_reader()
            .current_id(0)
            .unwrap()
            .unwrap()
            .generation(),
        1001
    );
    // How the polls interleaved depends on scheduling; every one of them was
    // terminal, which is the contract.
    eprintln!("{polls} polls during the reuse, {expired} of them expired");
}

#[test]
fn a_dead_clients_jobs_end_failed_client_gone_within_a_second() {
    if child_main() {
        return;
    }
    let s = Fixture::new("gone", Duration::from_secs(30), &[]);
    let observer = s.client();
    let mut victim = s.child(
        "a_dead_clients_jobs_end_failed_client_gone_within_a_second",
        "long-jobs",
    );
    let line = victim.expect_line("ids");
    let ids: Vec<JobId> = line.split_whitespace().skip(1).map(id_from_str).collect();
    assert_eq!(observer.job_status(ids[0]).unwrap(), JobStatus::Pending);
    let running = eventually(Duration::from_secs(2), || {
        observer.job_status(ids[1]).unwrap() == JobStatus::Running
    });
    assert!(running.is_some());
    let killed = Instant::now();
    victim.kill();
    let gone = JobStatus::Tombstoned(Err(FailReason::ClientGone));
    let took = eventually(Duration::from_secs(1), || {
        ids.iter()
            .all(|&id| observer.job_status(id).unwrap() == gone)
    });
    assert!(took.is_some(), "jobs not reclaimed within 1 s of the kill");
    eprintln!("jobs reclaimed {:?} after the kill", killed.elapsed());
    let ro = ReadOnlySegment::open(&s.name).unwrap();
    assert_eq!(ro.view().header().jobs_failed, 2);
    // A non-owner waits through the polling path and gets the same answer.
    let o = observer;
    assert_eq!(
        o.wait_job(ids[0], Instant::now() + Duration::from_secs(1))
            .unwrap(),
        gone
    );
}

#[test]
fn capacity_ownership_and_bad_ids_are_clear_errors() {
    if child_main() {
        return;
    }
    let s = Fixture::new("cap", Duration::from_secs(30), &["--job-slots", "2"]);
    let mut a = s.client();
    let mut b = s.client();
    let j1 = a.delay_job(delay(0, 0)).unwrap().into_id();
    let j2 = a.delay_job(delay(10_000, 0)).unwrap().into_id();
    match b.delay_job(delay(0, 0)).map(kvring::Job::into_id) {
        Err(Error::Status(Status::NoFreeJobSlot)) => {}
        other => panic!("expected NoFreeJobSlot, got {other:?}"),
    }
    // Finished but not released: still never overwritten.
    assert!(a
        .wait_job(j1, Instant::now() + Duration::from_secs(5))
        .unwrap()
        .is_terminal());
    assert!(matches!(
        b.delay_job(delay(0, 0)).map(kvring::Job::into_id),
        Err(Error::Status(Status::NoFreeJobSlot))
    ));
    let expect = |r: kvring::Result<()>, st: Status| match r {
        Err(Error::Status(s)) if s == st => {}
        other => panic!("expected {st:?}, got {other:?}"),
    };
    expect(b.release_job(j1), Status::NotJobOwner);
    expect(a.release_job(j2), Status::JobNotFinished);
    let forged = JobId::new(j1.epoch, j1.index(), j1.generation() + 5);
    expect(a.release_job(forged), Status::UnknownJob);
    assert_eq!(a.job_status(forged).unwrap(), JobStatus::Unknown);
    let foreign = JobId::new(j1.epoch + 1, j1.index(), j1.generation());
    assert_eq!(a.job_status(foreign).unwrap(), JobStatus::Unknown);
    expect(a.release_job(foreign), Status::UnknownJob);
    assert_eq!(
        a.job_status(JobId::new(j1.epoch, 1 << 20, 1)).unwrap(),
        JobStatus::Unknown
    );
    // Out-of-bounds requests are refused before anything is allocated.
    match a.delay_job(DelayJob::new(
        Duration::from_micros(u64::MAX),
        Duration::ZERO,
    )) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("exceeds"), "{msg}"),
        other => panic!("expected a bounds error, got {other:?}"),
    }
    a.release_job(j1).unwrap();
    let j3 = b.delay_job(delay(0, 0)).unwrap().into_id();
    assert_eq!(j3.index(), j1.index());
    assert_eq!(a.job_status(j1).unwrap(), JobStatus::Expired);
    expect(a.release_job(j1), Status::JobExpired);
}

#[test]
fn server_death_ends_waits_and_old_ids_read_unknown_after_a_restart() {
    if child_main() {
        return;
    }
    let mut s = Fixture::new("restart", Duration::from_secs(60), &[]);
    let mut c = s.client();
    let long = c.delay_job(delay(0, 60_000)).unwrap().into_id();
    // Wedged: the wait ends at its deadline.
    s.srv.pause();
    let t = Instant::now();
    match c.wait_job(long, Instant::now() + Duration::from_millis(300)) {
        Err(Error::Timeout(_)) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(2));
    // Killed while the client waits: "server gone" within a second.
    let mut srv = ServerProc {
        child: s.srv.child.take(),
    };
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        srv.kill();
        t
    });
    let r = c.wait_job(long, Instant::now() + Duration::from_secs(30));
    let ended = Instant::now();
    let killed_at = killer.join().unwrap();
    assert!(matches!(r, Err(Error::ServerGone)), "{r:?}");
    assert!(ended.saturating_duration_since(killed_at) < Duration::from_secs(1));
    // A poll of the unfinished job now says the server is gone, not "running".
    std::thread::sleep(Duration::from_millis(5));
    assert!(matches!(c.job_status(long), Err(Error::ServerGone)));

    let _srv2 = s.server(&[]);
    let mut c2 = s.client();
    assert_eq!(c2.job_status(long).unwrap(), JobStatus::Unknown);
    let fresh = c2.delay_job(delay(0, 0)).unwrap().into_id();
    assert_ne!(fresh.epoch, long.epoch);
    assert_eq!(
        (fresh.index(), fresh.generation()),
        (long.index(), long.generation())
    );
    assert_eq!(c2.job_status(long).unwrap(), JobStatus::Unknown);
}

#[test]
fn shutdown_fails_unfinished_jobs_and_wakes_their_waiting_owner() {
    if child_main() {
        return;
    }
    let mut s = Fixture::new("shutdown", Duration::from_secs(30), &[]);
    let mut c = s.client();
    let long = c.delay_job(delay(0, 60_000)).unwrap().into_id();
    let pid = s.srv.pid();
    let term = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    });
    let st = c
        .wait_job(long, Instant::now() + Duration::from_secs(10))
        .unwrap();
    assert_eq!(st, JobStatus::Failed(FailReason::ServerShutdown));
    term.join().unwrap();
    assert!(s.srv.terminate().success());
}

#[test]
fn a_dropped_job_is_released_once_finished_and_a_handle_never_outlives_its_client() {
    if child_main() {
        return;
    }
    let s = Fixture::new("drop", Duration::from_secs(30), &[]);
    let mut c = s.client();
    // Dropped while running: it runs to its end, then the next request
    // releases it.
    let job = c.delay_job(delay(0, 100)).unwrap();
    let id = job.id();
    drop(job);
    c.ping(b"", Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert!(!c.job_status(id).unwrap().is_terminal());
    let done = JobStatus::Done(JobResult { value: 42, aux: 7 });
    assert_eq!(
        c.wait_job(id, Instant::now() + Duration::from_secs(5))
            .unwrap(),
        done
    );
    c.ping(b"", Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        c.job_status(id).unwrap(),
        JobStatus::Tombstoned(Ok(JobResult { value: 42, aux: 7 }))
    );
    // A handle kept past its client's goodbye: the server has reclaimed the
    // job, and the handle does not wait on a slot that is no longer its.
    let job = c.delay_job(delay(0, 10_000)).unwrap();
    drop(c);
    assert!(matches!(
        job.wait(Instant::now() + Duration::from_secs(5)),
        Err(Error::ClientClosed)
    ));
}
