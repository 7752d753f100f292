//! The server's HTTP endpoint against the real binary: a scrape parsed by a
//! Prometheus text parser counts what was done, `/healthz` is 200 under
//! load and 503 (naming the stuck job) while a job stays unfinished past
//! the bound, then 200 again, `/readyz` and `/status` answer, the admin
//! calls evict and clear what no lease holds and no pin covers, pins taken
//! and dropped over HTTP keep a prompt prefix's chunks (with the counters
//! saying so), admin calls from a non-loopback peer are refused, malformed
//! requests and silent clients are refused without holding up the rings,
//! and an address asked for that is taken fails the start.

mod common;

use common::*;
use kvring::kv::{model_id, ChunkHash};
use kvring::DelayJob;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A `POST` of `body` (JSON) with its `Content-Length`.
fn post_json(port: u16, path: &str, body: &str) -> (u16, String) {
    http_exchange(
        port,
        format!(
            "POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
}

fn hex(h: &ChunkHash) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// An address of this host that is not loopback (the one a route to the
/// outside leaves from; a UDP connect sends nothing), if it has one.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    ["192.0.2.1:9", "198.51.100.1:9", "10.255.255.1:9"]
        .iter()
        .find_map(|to| {
            let u = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
            u.connect(to).ok()?;
            let ip = u.local_addr().ok()?.ip();
            (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
        })
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
    let (code, body) = http_get(port, "/metrics");
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
    let (code, om) = http_exchange(
        port,
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0\r\n\r\n",
    );
    assert_eq!(code, 200);
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("kvring_stores_total 4\n"), "{om}");

    // Ready once the whole pool is (a CUDA server pins it after the
    // start, serving meanwhile: the stores above waited for their range).
    assert!(
        eventually(Duration::from_secs(30), || http_get(port, "/readyz").0
            == 200)
        .is_some(),
        "{:?}",
        http_get(port, "/readyz")
    );
    let (code, body) = http_get(port, "/readyz");
    assert_eq!(code, 200, "{body}");
    let ready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ready["ready"], true);
    assert_eq!(ready["state"], "running");
    assert_eq!(ready["pool_ready_bytes"], ready["pool_bytes"]);
    let (code, body) = http_get(port, "/status");
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
        let (code, body) = http_get(port, "/healthz");
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
    let (code, body) = http_get(port, "/healthz");
    assert_eq!(code, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "unhealthy");
    assert_eq!(v["reasons"][0]["kind"], "job_stuck", "{body}");
    assert!(job.wait(far()).unwrap().is_terminal());
    drop(job);
    let (code, body) = http_get(port, "/healthz");
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
    let status = |port| -> Value { serde_json::from_str(&http_get(port, "/status").1).unwrap() };
    assert_eq!(status(port)["cache"]["objects"], 4);
    let post = |path: &str| http_exchange(port, format!("POST {path} HTTP/1.1\r\n\r\n").as_bytes());
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
    assert_eq!(http_get(port, "/clear").0, 405);
}

#[test]
fn bad_requests_and_silent_clients_never_hold_up_the_rings() {
    let (s, port) = server_with_http("http-bad", &[]);
    assert_eq!(http_exchange(port, b"GARBAGE\r\n\r\n").0, 400);
    assert_eq!(
        http_exchange(port, b"GET /metrics HTTP/1.1\r\nBad Header\r\n\r\n").0,
        400
    );
    assert_eq!(
        http_exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n").0,
        405
    );
    assert_eq!(http_get(port, "/nothing").0, 404);
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    assert_eq!(http_exchange(port, huge.as_bytes()).0, 413);
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
    let (code, _) = http_get(port, "/healthz");
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

#[test]
fn pinned_chunks_outlive_evict_and_clear_until_unpinned() {
    const N: usize = 6;
    const K: usize = 2;
    let (s, port) = server_with_http("http-pin", &[]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    let hashes = prompt_hashes(11, N);
    let blocks = e.blocks(0, N);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, N as u64);
    let obj_bytes = e.c.stats().unwrap().stored_bytes / N as u64;
    assert!(obj_bytes > 0);
    let model = model_id(MODEL);
    let pinned: Vec<String> = hashes[..K].iter().map(hex).collect();
    let post = |path: &str| http_exchange(port, format!("POST {path} HTTP/1.1\r\n\r\n").as_bytes());
    let status = || -> Value { serde_json::from_str(&http_get(port, "/status").1).unwrap() };

    // The first K chunks, the model as a hex string, the salt left out.
    let body = serde_json::json!({ "model_id": format!("{model:#x}"), "hashes": pinned });
    let (code, out) = post_json(port, "/pin", &body.to_string());
    assert_eq!(code, 200, "{out}");
    let k = K as u64;
    let want = serde_json::json!({ "pins": k, "objects": k, "bytes": k * obj_bytes, "matched": k });
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), want);
    // Again, the model as a number and the salt given: the same pins.
    let body = serde_json::json!({ "model_id": model, "salt": 0, "hashes": pinned });
    let (code, out) = post_json(port, "/pin", &body.to_string());
    assert_eq!(
        (code, serde_json::from_str::<Value>(&out).unwrap()),
        (200, want)
    );
    let (code, out) = http_get(port, "/pins");
    assert_eq!(code, 200, "{out}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    let listed = listed["pins"].as_array().unwrap();
    assert_eq!(listed.len(), K);
    for p in listed {
        assert_eq!(p["model_id"], format!("{model:#018x}"));
        assert_eq!(p["salt"], "0x0000000000000000");
        assert!(pinned.iter().any(|h| p["hash"] == h.as_str()), "{p}");
    }

    // Evicting everything and clearing leave exactly the pinned chunks.
    let (code, out) = post("/evict?bytes=1GiB");
    assert_eq!(code, 200, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["objects"], (N - K) as u64);
    // Stored again, the rest goes with a clear.
    assert_eq!(e.store(0, &hashes, &blocks).value, N as u64);
    let (code, out) = post("/clear");
    assert_eq!(code, 200, "{out}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["objects"],
        (N - K) as u64
    );
    let lease = lookup(&mut e.c, 1, 0, &hashes);
    assert_eq!(lease.result().value, K as u64, "the pinned prefix hits");
    drop(lease);
    let rest = lookup(&mut e.c, 1, 0, &hashes[K..]);
    assert_eq!(rest.result().value, 0, "nothing past it");
    drop(rest);
    let st = e.c.stats().unwrap();
    assert_eq!((st.objects, st.pinned_objects), (k, k));
    assert_eq!(st.pinned_bytes, k * obj_bytes);
    let cache = &status()["cache"];
    assert_eq!(cache["pinned_objects"], k);
    assert_eq!(cache["pinned_bytes"], k * obj_bytes);

    // Refused bodies: 400 saying what is expected, nothing changed.
    let bad = |body: &str, says: &str| {
        let (code, out) = post_json(port, "/pin", body);
        assert_eq!(code, 400, "{body}: {out}");
        assert!(out.contains(says), "{body}: {out}");
        assert!(out.contains("expected a JSON body"), "{out}");
    };
    bad("{not json", "not JSON");
    bad("[1, 2]", "not a JSON object");
    let short = "ab".repeat(15);
    bad(
        &format!(r#"{{"model_id": 1, "hashes": ["{short}"]}}"#),
        "exactly 32 hex digits",
    );
    bad(
        &format!(r#"{{"model_id": 1, "hashes": ["{short}abcd"]}}"#),
        "exactly 32 hex digits",
    );
    bad(
        &format!(r#"{{"model_id": 1, "hashes": ["{}"]}}"#, "zz".repeat(16)),
        "exactly 32 hex digits",
    );
    bad(r#"{"model_id": 1, "hashes": [7]}"#, "hashes[0]");
    bad(r#"{"model_id": 1, "hashes": []}"#, "at least one");
    bad(
        r#"{"hashes": ["00000000000000000000000000000000"]}"#,
        "model_id is missing",
    );
    bad(
        r#"{"model_id": -1, "hashes": ["00000000000000000000000000000000"]}"#,
        "model_id",
    );
    bad(
        r#"{"model_id": "12", "hashes": ["00000000000000000000000000000000"]}"#,
        "model_id",
    );
    bad(
        r#"{"model_id": 1, "salt": "0xnope", "hashes": ["00000000000000000000000000000000"]}"#,
        "salt",
    );
    bad(
        r#"{"model_id": 1, "hash": ["00000000000000000000000000000000"]}"#,
        "unknown field",
    );
    let (code, out) = post("/pin");
    assert_eq!(code, 400, "{out}");
    assert!(out.contains("Content-Length"), "{out}");
    assert_eq!(post_json(port, "/unpin", "").0, 400);
    // Too large for the request bound: 413 before any body is read.
    let (code, _) = http_exchange(
        port,
        b"POST /pin HTTP/1.1\r\nContent-Length: 20000\r\n\r\n{",
    );
    assert_eq!(code, 413);
    assert_eq!(
        http_exchange(port, b"POST /pin HTTP/1.1\r\nContent-Length: x\r\n\r\n").0,
        400
    );
    // A body shorter than said: answered 408 at the deadline.
    let t0 = Instant::now();
    let (code, _) = http_exchange(
        port,
        b"POST /pin HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"model",
    );
    assert_eq!(code, 408);
    assert!(t0.elapsed() >= kvring::server::HTTP_CLIENT_DEADLINE - Duration::from_millis(100));
    assert_eq!(http_get(port, "/pin").0, 405);
    assert_eq!(post("/pins").0, 405);
    assert_eq!(e.c.stats().unwrap().pinned_objects, k);

    // A client that waits for "100 Continue" before its body gets it.
    let body = serde_json::json!({ "model_id": model, "hashes": [hex(&hashes[K])] }).to_string();
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        c,
        "POST /unpin HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let mut interim = [0u8; 25];
    c.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    c.write_all(body.as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    // (Unpinning a chunk no pin covers changes nothing.)
    assert!(out.contains(r#""pins":2"#), "{out}");

    // Unpinned, a clear drops them.
    let body = serde_json::json!({ "model_id": model, "hashes": pinned });
    let (code, out) = post_json(port, "/unpin", &body.to_string());
    assert_eq!(code, 200, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        serde_json::json!({ "pins": 0, "objects": 0, "bytes": 0, "matched": k })
    );
    let (code, out) = post("/clear");
    assert_eq!(code, 200, "{out}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["objects"], k);
    let st = e.c.stats().unwrap();
    assert_eq!((st.objects, st.pinned_objects, st.pinned_bytes), (0, 0, 0));
    assert_eq!(lookup(&mut e.c, 1, 0, &hashes).result().value, 0);
    assert_eq!(http_get(port, "/pins").1, r#"{"pins":[]}"#);
}

#[test]
fn admin_calls_from_a_non_loopback_peer_are_refused() {
    let Some(ip) = non_loopback_ip() else {
        eprintln!("skipped: this host has no address but loopback");
        return;
    };
    let body = r#"{"model_id": 1, "hashes": ["00000000000000000000000000000000"]}"#;
    let request = |port: u16, head: &str| {
        let mut s = TcpStream::connect((ip, port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "{head}\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    for (remote, tag) in [(false, "http-remote"), (true, "http-remote-ok")] {
        let port = free_port();
        let addr = format!("0.0.0.0:{port}");
        let mut args = vec!["--http", addr.as_str(), "--pool-bytes", "16MiB"];
        if remote {
            args.push("--http-admin-remote");
        }
        let _s = Fixture::new(tag, Duration::from_secs(60), &args);
        for head in [
            "POST /pin HTTP/1.1",
            "POST /unpin HTTP/1.1",
            "GET /pins HTTP/1.1",
            "POST /clear HTTP/1.1",
            "POST /evict?bytes=1 HTTP/1.1",
        ] {
            let out = request(port, head);
            let want = if remote {
                "HTTP/1.1 200"
            } else {
                "HTTP/1.1 403"
            };
            assert!(out.starts_with(want), "{head} (remote {remote}): {out}");
        }
        // The read-only calls answer any peer.
        assert!(request(port, "GET /status HTTP/1.1").starts_with("HTTP/1.1 200"));
        // Loopback peers may always.
        assert_eq!(post_json(port, "/pin", body).0, 200);
    }
}
