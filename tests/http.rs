//! The server's HTTP endpoint against the real binary: a scrape parsed by a
//! Prometheus text parser counts what was done, `/healthz` is 200 under
//! load and 503 (naming the stuck job) while a job stays unfinished past
//! the bound, then 200 again, `/readyz` and `/status` answer, the admin
//! calls evict and clear what no lease holds, malformed
//! requests and silent clients are refused without holding up the rings,
//! and an address asked for that is taken fails the start.

mod common;

use common::*;
use kvring::DelayJob;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A port free now on loopback.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends `raw` and returns the status code and the body.
fn exchange(port: u16, raw: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(raw).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

fn get(port: u16, path: &str) -> (u16, String) {
    exchange(
        port,
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
    )
}

fn server_with_http(tag: &str, extra: &[&str]) -> (Fixture, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec!["--http", addr.as_str(), "--pool-bytes", "64MiB"];
    args.extend_from_slice(extra);
    (Fixture::new(tag, Duration::from_secs(90), &args), port)
}

#[test]
fn a_scrape_counts_what_was_done_and_health_sees_a_stuck_job() {
    let (s, port) = server_with_http("http-metrics", &["--stuck-job-s", "1"]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    for seed in 0..4 {
        let hashes = prompt_hashes(seed, 1);
        let blocks = e.blocks(seed * 4, 1);
        e.write(&hashes, &blocks);
        assert_eq!(e.store(0, &hashes, &blocks).value, 1);
    }
    let (code, body) = get(port, "/metrics");
    assert_eq!(code, 200);
    let scrape =
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("parse");
    let value = |name: &str, op: Option<&str>| {
        scrape
            .samples
            .iter()
            .find(|x| x.metric == name && op.is_none_or(|o| x.labels.get("op") == Some(o)))
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
                // (A typed text format: counters are typed as such.)
                ref v => panic!("{name}: {v:?}"),
            })
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert_eq!(value("kvring_stores_total", None), 4.0);
    assert_eq!(value("kvring_stored_chunks_total", None), 4.0);
    assert_eq!(value("kvring_requests_total", Some("store")), 4.0);
    assert_eq!(value("kvring_clients_connected", None), 1.0);

    // Prometheus asks for OpenMetrics and gets it.
    let (code, om) = exchange(
        port,
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0\r\n\r\n",
    );
    assert_eq!(code, 200);
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("kvring_stores_total 4\n"), "{om}");

    let (code, body) = get(port, "/readyz");
    assert_eq!(
        (code, body.as_str()),
        (200, r#"{"ready":true,"state":"running"}"#)
    );
    let (code, body) = get(port, "/status");
    assert_eq!(code, 200);
    let status: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["name"], s.name.as_str());
    assert_eq!(status["cache"]["objects"], 4);

    // Healthy under load: another client stores in a loop meanwhile.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        let mut c = s.client();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.ping(b"x", far()).unwrap();
                n += 1;
            }
            n
        })
    };
    for _ in 0..3 {
        let (code, body) = get(port, "/healthz");
        assert_eq!(code, 200, "{body}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(load.join().unwrap() > 0);

    // A job unfinished past the bound (1 s): 503 naming it, then 200 once
    // it ended.
    let job =
        e.c.delay_job(DelayJob::new(Duration::ZERO, Duration::from_millis(2500)))
            .unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    let (code, body) = get(port, "/healthz");
    assert_eq!(code, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "unhealthy");
    assert_eq!(v["reasons"][0]["kind"], "job_stuck", "{body}");
    assert!(job.wait(far()).unwrap().is_terminal());
    drop(job);
    let (code, body) = get(port, "/healthz");
    assert_eq!(code, 200, "{body}");
}

#[test]
fn admin_calls_change_what_the_inspector_shows() {
    let (s, port) = server_with_http("http-admin", &[]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    for seed in 0..4 {
        let hashes = prompt_hashes(seed, 1);
        let blocks = e.blocks(seed * 4, 1);
        e.write(&hashes, &blocks);
        e.store(0, &hashes, &blocks);
    }
    // A lease holds the last object: neither call may drop it.
    let held = lookup(&mut e.c, 1, 0, &prompt_hashes(3, 1));
    let status = |port| -> Value { serde_json::from_str(&get(port, "/status").1).unwrap() };
    assert_eq!(status(port)["cache"]["objects"], 4);
    let post = |path: &str| exchange(port, format!("POST {path} HTTP/1.1\r\n\r\n").as_bytes());
    // One byte evicts the least recently used object, whole.
    let (code, body) = post("/evict?bytes=1");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["objects"], 1);
    let after = status(port);
    assert_eq!(after["cache"]["objects"], 3);
    assert_eq!(after["cache"]["evicted_objects"], 1);
    // The oldest went: the first prompt misses, the second hits.
    assert_eq!(
        lookup(&mut e.c, 1, 0, &prompt_hashes(0, 1)).result().value,
        0
    );
    assert_eq!(
        lookup(&mut e.c, 1, 0, &prompt_hashes(1, 1)).result().value,
        1
    );
    // (A dropped lease's end goes with the client's next synchronous call.)
    assert_eq!(e.c.stats().unwrap().leases, 1);
    let (code, body) = post("/clear");
    assert_eq!(code, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["objects"], 2);
    assert_eq!(status(port)["cache"]["objects"], 1, "the held object stays");
    drop(held);
    assert_eq!(post("/evict").0, 400);
    assert_eq!(post("/evict?bytes=lots").0, 400);
    assert_eq!(get(port, "/clear").0, 405);
}

#[test]
fn bad_requests_and_silent_clients_never_hold_up_the_rings() {
    let (s, port) = server_with_http("http-bad", &[]);
    assert_eq!(exchange(port, b"GARBAGE\r\n\r\n").0, 400);
    assert_eq!(
        exchange(port, b"GET /metrics HTTP/1.1\r\nBad Header\r\n\r\n").0,
        400
    );
    assert_eq!(exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n").0, 405);
    assert_eq!(get(port, "/nothing").0, 404);
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    assert_eq!(exchange(port, huge.as_bytes()).0, 413);
    // A client that connects and says nothing holds the endpoint until its
    // deadline; the rings are served all along.
    let silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let t0 = Instant::now();
    let mut c = s.client();
    let mut slowest = Duration::ZERO;
    while t0.elapsed() < kvring::server::HTTP_CLIENT_DEADLINE {
        let p = Instant::now();
        c.ping(b"ring", far()).unwrap();
        slowest = slowest.max(p.elapsed());
    }
    assert!(
        slowest < Duration::from_millis(500),
        "a ping took {slowest:?}"
    );
    let (code, _) = get(port, "/healthz");
    assert_eq!(code, 200);
    // It was answered 408 and closed at the deadline.
    let mut rest = String::new();
    let mut silent = silent;
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    silent.read_to_string(&mut rest).unwrap();
    assert!(rest.starts_with("HTTP/1.1 408"), "{rest:?}");
}

#[test]
fn an_address_asked_for_that_is_taken_fails_the_start() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let s = Scope::new("http-taken");
    let out = std::process::Command::new(kvring_bin())
        .args(["serve", "--name", &s.name, "--runtime-dir"])
        .arg(&s.dir)
        .args(["--pool-bytes", "16MiB", "--http", &addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen on"), "{err}");
    // Nothing of the failed start is left: a server of that name starts.
    let _srv = s.server(&["--pool-bytes", "16MiB", "--http", "off"]);
    let mut c = s.client();
    assert_eq!(c.ping(b"up", far()).unwrap(), b"up");
}
