//! The copy lanes as observers see them, against the real binary: a copy
//! worker stopped by the kernel (one thread of the server held in a
//! ptrace stop, as a thread wedged in a driver call or a page fault would
//! be) with a store queued on its lane makes `/healthz` answer 503
//! `lane_stalled`, the inspector flag it and `/metrics` show the queue
//! depth and the stall; once the thread runs again the store completes and
//! `/healthz` is 200 (and `kvring health`, a container's health check,
//! fails and then passes). Also: the lookups-by-model counters, in tokens.

mod common;

use common::*;
use kvring::kv::model_id;
use kvring::Store;
use nix::sys::ptrace;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde_json::Value;
use std::time::Duration;

/// The thread of process `pid` named `name`.
fn thread_named(pid: i32, name: &str) -> Pid {
    let dir = format!("/proc/{pid}/task");
    for e in std::fs::read_dir(&dir).expect("the server's threads") {
        let tid = e.unwrap().file_name().to_string_lossy().to_string();
        let comm = std::fs::read_to_string(format!("{dir}/{tid}/comm")).unwrap_or_default();
        if comm.trim_end() == name {
            return Pid::from_raw(tid.parse().unwrap());
        }
    }
    panic!("no thread {name} in {pid}")
}

/// One thread held in a ptrace stop (the rest of its process runs on);
/// let go on drop.
struct StoppedThread(Pid);

impl StoppedThread {
    fn stop(tid: Pid) -> StoppedThread {
        ptrace::seize(tid, ptrace::Options::empty()).expect("PTRACE_SEIZE");
        ptrace::interrupt(tid).expect("PTRACE_INTERRUPT");
        match waitpid(tid, Some(WaitPidFlag::__WALL)).expect("waitpid") {
            WaitStatus::PtraceEvent(..) | WaitStatus::Stopped(..) => {}
            other => panic!("the thread did not stop: {other:?}"),
        }
        StoppedThread(tid)
    }
}

impl Drop for StoppedThread {
    fn drop(&mut self) {
        let _ = ptrace::detach(self.0, None);
    }
}

/// The value of the sample of `name` whose labels include `labels`.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            ref v => panic!("{name}: {v:?}"),
        })
        .unwrap_or_else(|| panic!("no {name} {labels:?}"))
}

/// `kvring health --http 127.0.0.1:PORT`: whether it exited 0, and what it
/// printed.
fn kvring_health(port: u16) -> (bool, String) {
    let out = std::process::Command::new(kvring_bin())
        .args(["health", "--http", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
    )
}

fn scrape(port: u16) -> prometheus_parse::Scrape {
    let (code, body) = http_get(port, "/metrics");
    assert_eq!(code, 200);
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("parse")
}

#[test]
fn a_stopped_copy_worker_with_work_is_a_stall_until_it_runs_again() {
    let (s, port) = server_with_http(
        "lanes-wedge",
        &[
            "--copy-threads",
            "1",
            "--stalled-lane-s",
            "1",
            "--chunk-tokens",
            "64",
        ],
    );
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    // One store first: the worker has run, and the lane is healthy.
    let hashes = prompt_hashes(1, 2);
    let blocks = e.blocks(0, 2);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, 2);
    assert_eq!(health(port).0, 200);

    let worker = thread_named(s.srv.pid(), "kvring-copy-0.0");
    let stopped = StoppedThread::stop(worker);
    // A store of three chunks now waits on the stopped worker's lane.
    let hashes = prompt_hashes(2, 3);
    let blocks = e.blocks(8, 3);
    e.write(&hashes, &blocks);
    let job =
        e.c.store(Store::new(&e.inst, &hashes, &blocks))
            .expect("submitted");
    let (code, kinds, body) = (0..40)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(250));
            health(port)
        })
        .find(|(code, _, _)| *code == 503)
        .expect("/healthz turned 503 within 10 s");
    assert_eq!(code, 503);
    assert_eq!(kinds, ["lane_stalled"], "{body}");
    let why = body["reasons"][0]["message"].as_str().unwrap();
    assert!(
        why.contains("copy lane 0 (device host, 3 tasks queued)"),
        "{why}"
    );
    assert!(why.contains("worker 0 (0 in flight, 0 held"), "{why}");

    let m = scrape(port);
    let host = [("device", "host")];
    assert_eq!(sample(&m, "kvring_copy_queued_tasks", &host), 3.0);
    assert_eq!(sample(&m, "kvring_copy_workers", &host), 1.0);
    assert!(sample(&m, "kvring_copy_stalled_seconds", &host) > 1.0);
    assert_eq!(
        sample(&m, "kvring_anomalies", &[("kind", "lane_stalled")]),
        1.0
    );

    // `kvring health` (a container's health check) fails, saying why.
    let (ok, out) = kvring_health(port);
    assert!(!ok && out.contains("lane_stalled"), "{out}");

    // The inspector flags it too, with its own bound.
    let out = std::process::Command::new(
        std::env::var_os("KVRING_INSPECT_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvring-inspect").into()),
    )
    .args(["show", &s.name, "--json", "--lane-stall-s", "0.5"])
    .output()
    .unwrap();
    assert!(out.status.success());
    let show: Value = serde_json::from_slice(&out.stdout).unwrap();
    let lane = &show["lanes"][0];
    assert_eq!(
        (lane["device"].as_str(), lane["queued"].as_u64()),
        (Some("host"), Some(3))
    );
    assert!(show["anomalies"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["kind"] == "lane_stalled"));

    // Let it run: the store completes, the lane drains, health returns.
    drop(stopped);
    assert_eq!(done(job).value, 3);
    assert!(
        eventually(Duration::from_secs(10), || health(port).0 == 200).is_some(),
        "{:?}",
        health(port)
    );
    assert!(kvring_health(port).0);
    let m = scrape(port);
    assert_eq!(sample(&m, "kvring_copy_queued_tasks", &host), 0.0);
    assert_eq!(sample(&m, "kvring_copy_stalled_seconds", &host), 0.0);
    assert_eq!(sample(&m, "kvring_copy_chunks_total", &host), 5.0);
}

#[test]
fn lookups_are_counted_per_model_and_salt_in_tokens() {
    let (s, port) = server_with_http("lanes-models", &["--chunk-tokens", "64"]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    let hashes = prompt_hashes(3, 4);
    let blocks = e.blocks(0, 4);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(9, &hashes, &blocks).value, 4);
    // Salt 9: 4 of 4 chunks, then 2 of 6 (a different continuation after
    // two chunks); salt 0: none of 4.
    let mut other = prompt_hashes(4, 6);
    other[..2].copy_from_slice(&hashes[..2]);
    assert_eq!(lookup(&mut e.c, 1, 9, &hashes).hits(), 4);
    assert_eq!(lookup(&mut e.c, 1, 9, &other).hits(), 2);
    assert_eq!(lookup(&mut e.c, 1, 0, &hashes).hits(), 0);

    let m = scrape(port);
    let model = format!("{:#018x}", model_id(MODEL));
    let salted = [("model", model.as_str()), ("salt", "0x0000000000000009")];
    let unsalted = [("model", model.as_str()), ("salt", "0x0000000000000000")];
    assert_eq!(sample(&m, "kvring_model_lookups_total", &salted), 2.0);
    assert_eq!(
        sample(&m, "kvring_lookup_tokens_total", &salted),
        10.0 * 64.0
    );
    assert_eq!(
        sample(&m, "kvring_lookup_hit_tokens_total", &salted),
        6.0 * 64.0
    );
    assert_eq!(
        sample(&m, "kvring_model_lookup_hit_chunks_total", &salted),
        6.0
    );
    assert_eq!(
        sample(&m, "kvring_lookup_tokens_total", &unsalted),
        4.0 * 64.0
    );
    assert_eq!(sample(&m, "kvring_lookup_hit_tokens_total", &unsalted), 0.0);
    // The rows add up to the cache's own counters.
    assert_eq!(sample(&m, "kvring_lookup_chunks_total", &[]), 14.0);
}
