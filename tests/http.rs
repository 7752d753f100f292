//! The server's HTTP endpoint against the real binary: a scrape parsed by a
//! Prometheus text parser counts what was done, `/healthz` is 200 under
//! load and 503 (naming the stuck job) while a job stays unfinished past
//! the bound, then 200 again, `/readyz` and `/status` answer, the admin
//! calls evict and clear what no lease holds and no pin covers, pins taken
//! and dropped over HTTP keep a prompt prefix's chunks (with the counters
//! saying so), admin calls from a non-loopback peer are refused, malformed
//! requests and silent clients are refused without holding up the rings,
//! and an address asked for that is taken fails the start. Under abuse:
//! the probes answer within a second with a thousand idle, slow and
//! half-open connections open (PINGs going on meanwhile), each of those is
//! answered at its deadline, a connection past the bound or out of
//! descriptors closes the oldest idle one, and the endpoint never spins.
//! The admin token: 0600 in the runtime directory, needed by every admin
//! call (401 without it, with another, or with two headers; never from
//! another local user, who cannot read it), removed at a clean stop,
//! another at each start. Pins are bounded in count (100,000 attempts
//! stop at the default bound, refused whole with 409, the server's memory
//! and an engine's lookups measured meanwhile) and in bytes, a call names
//! at most 256 chunks (413), and they are listed by pages of 1,000.

mod common;

use common::*;
use kvring::kv::{model_id, ChunkHash};
use kvring::DelayJob;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A `POST` of `body` (JSON) with its `Content-Length`, with the admin
/// token of the server on `port`.
fn post_json(port: u16, path: &str, body: &str) -> (u16, String) {
    http_exchange(
        port,
        format!(
            "POST {path} HTTP/1.1\r\n{}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            admin_header(port),
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
    let post = |path: &str| admin_post(port, path);
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
    while t0.elapsed() < kvring_server::HTTP_CLIENT_DEADLINE {
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
    let post = |path: &str| admin_post(port, path);
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
    let (code, out) = admin_get(port, "/pins");
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
    assert!(t0.elapsed() >= kvring_server::HTTP_CLIENT_DEADLINE - Duration::from_millis(100));
    assert_eq!(http_get(port, "/pin").0, 405);
    assert_eq!(post("/pins").0, 405);
    assert_eq!(e.c.stats().unwrap().pinned_objects, k);

    // A client that waits for "100 Continue" before its body gets it.
    let body = serde_json::json!({ "model_id": model, "hashes": [hex(&hashes[K])] }).to_string();
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        c,
        "POST /unpin HTTP/1.1\r\n{}Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        admin_header(port),
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
    let listed: Value = serde_json::from_str(&admin_get(port, "/pins").1).unwrap();
    assert_eq!(listed["pins"], serde_json::json!([]));
    assert_eq!(
        (&listed["held"], &listed["next"]),
        (&0.into(), &Value::Null)
    );
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib << 10
}

/// `n` distinct chunk hashes from `seed`.
fn random_hashes(seed: u64, n: usize) -> Vec<String> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            (0..2)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    format!("{x:016x}")
                })
                .collect()
        })
        .collect()
}

#[test]
fn a_hundred_thousand_pins_stop_at_the_bound_and_list_by_page() {
    let (s, port) = server_with_http("http-pin-storm", &[]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    let hashes = prompt_hashes(21, 4);
    let blocks = e.blocks(0, 4);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, 4);
    let before = rss(s.srv.pid());

    // An engine looks its prompt up throughout.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looker = {
        let (stop, hashes) = (stop.clone(), hashes.clone());
        let mut c = s.client();
        std::thread::spawn(move || {
            let mut took = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = Instant::now();
                let lease = lookup(&mut c, 1, 0, &hashes);
                assert_eq!(lease.result().value, 4);
                took.push(t0.elapsed());
                drop(lease);
            }
            took
        })
    };

    // 100,000 pin attempts, 256 a call: those past the bound are refused
    // whole, saying why.
    let max = kvring_server::DEFAULT_MAX_PINS as usize;
    let per = kvring_server::MAX_PINS_PER_CALL;
    let all = random_hashes(7, 100_000);
    let (mut taken, mut refused) = (0, 0);
    let t0 = Instant::now();
    for call in all.chunks(per) {
        let body = serde_json::json!({ "model_id": 3, "hashes": call }).to_string();
        let (code, out) = post_json(port, "/pin", &body);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|_| panic!("{code}: {out}"));
        if taken + call.len() <= max {
            assert_eq!(code, 200, "{out}");
            taken += call.len();
            assert_eq!(v["pins"], taken as u64);
        } else {
            assert_eq!(code, 409, "{out}");
            refused += call.len();
            assert_eq!(v["max_pins"], max as u64, "{out}");
            assert_eq!(v["pins"], taken as u64, "{out}");
            assert!(v["error"].as_str().unwrap().contains("--max-pins"), "{out}");
        }
    }
    let pinning = t0.elapsed();
    assert_eq!((taken, taken + refused), (max, all.len()));
    // One more than a call may name: 413, nothing taken.
    let body = serde_json::json!({ "model_id": 4, "hashes": random_hashes(8, per + 1) });
    let (code, out) = post_json(port, "/pin", &body.to_string());
    assert_eq!(code, 413, "{out}");
    assert!(out.contains(&format!("at most {per} per call")), "{out}");

    // Listed by pages of at most 1,000, each pin once, in order.
    let page_max = kvring_server::MAX_PINS_PER_PAGE;
    let (mut seen, mut next, mut pages) = (Vec::new(), None::<String>, 0);
    loop {
        let path = match &next {
            Some(c) => format!("/pins?after={c}"),
            None => "/pins".to_string(),
        };
        let (code, out) = admin_get(port, &path);
        assert_eq!(code, 200, "{out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let page = v["pins"].as_array().unwrap();
        assert!(page.len() <= page_max);
        assert_eq!(v["held"], max as u64);
        seen.extend(page.iter().map(|p| p["hash"].as_str().unwrap().to_string()));
        pages += 1;
        match v["next"].as_str() {
            Some(c) => next = Some(c.to_string()),
            None => break,
        }
    }
    let mut want = all[..max].to_vec();
    want.sort();
    assert_eq!(seen, want);
    assert_eq!(pages, max.div_ceil(page_max));
    let (code, out) = admin_get(port, "/pins?limit=3");
    assert_eq!(code, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["pins"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    for bad in ["limit=0", "limit=1001", "after=zz", "after=1.2.3", "page=2"] {
        let (code, out) = admin_get(port, &format!("/pins?{bad}"));
        assert_eq!(code, 400, "{bad}: {out}");
        assert!(out.contains("expected GET /pins"), "{out}");
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut took = looker.join().unwrap();
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
    let grew = rss(s.srv.pid()).saturating_sub(before);
    eprintln!(
        "{} pins in {pinning:?} ({refused} refused), listed in {pages} pages; server RSS +{} KiB; \
         engine lookups meanwhile: {} (p50 {:?}, p99 {:?}, max {:?})",
        max,
        grew >> 10,
        took.len(),
        at(0.5),
        at(0.99),
        took.last().unwrap()
    );
    // 65,536 pins take a few MiB (docs/operations.md: "Pins").
    assert!(grew < 32 << 20, "the server grew by {} MiB", grew >> 20);
    // Unpinned, they are gone.
    for call in all[..max].chunks(per) {
        let body = serde_json::json!({ "model_id": 3, "hashes": call }).to_string();
        assert_eq!(post_json(port, "/unpin", &body).0, 200);
    }
    let v: Value = serde_json::from_str(&admin_get(port, "/pins").1).unwrap();
    assert_eq!(v["held"], 0);
}

#[test]
fn pinned_bytes_stop_at_their_bound() {
    // Objects of 32 KiB; pins may keep three of them, four pins in all.
    let (s, port) = server_with_http(
        "http-pin-bytes",
        &[
            "--chunk-tokens",
            "64",
            "--max-pinned-bytes",
            "96KiB",
            "--max-pins",
            "4",
        ],
    );
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    let hashes = prompt_hashes(31, 6);
    let blocks = e.blocks(0, 6);
    e.write(&hashes, &blocks);
    assert_eq!(e.store(0, &hashes, &blocks).value, 6);
    assert_eq!(e.c.stats().unwrap().stored_bytes, 6 << 15);
    let model = model_id(MODEL);
    let pin = |hs: &[ChunkHash]| {
        let hs: Vec<String> = hs.iter().map(hex).collect();
        post_json(
            port,
            "/pin",
            &serde_json::json!({ "model_id": model, "hashes": hs }).to_string(),
        )
    };
    let (code, out) = pin(&hashes[..2]);
    assert_eq!(code, 200, "{out}");
    // Two more objects would make four: refused whole, saying why.
    let (code, out) = pin(&hashes[2..4]);
    assert_eq!(code, 409, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["max_pinned_bytes"], 96 << 10);
    assert_eq!(v["pinned_bytes"], 64 << 10);
    assert!(
        v["error"].as_str().unwrap().contains("--max-pinned-bytes"),
        "{out}"
    );
    let v: Value = serde_json::from_str(&admin_get(port, "/pins").1).unwrap();
    assert_eq!((&v["held"], &v["pinned_objects"]), (&2.into(), &2.into()));
    // One fits.
    assert_eq!(pin(&hashes[2..3]).0, 200);
    // A pin of what is not stored yet takes no bytes; stored past the
    // bound, its object is cached unpinned and counted.
    let later = prompt_hashes(32, 1);
    assert_eq!(pin(&later).0, 200);
    let lb = e.blocks(40, 1);
    e.write(&later, &lb);
    assert_eq!(e.store(0, &later, &lb).value, 1);
    let v: Value = serde_json::from_str(&admin_get(port, "/pins").1).unwrap();
    assert_eq!(v["pinned_objects"], 3);
    assert_eq!(v["stored_over_bound"], 1);
    // The fifth pin is past --max-pins.
    let (code, out) = pin(&hashes[5..6]);
    assert_eq!(code, 409, "{out}");
    assert!(out.contains("--max-pins"), "{out}");
    // Everything unpinned goes with a clear: the three pinned stay.
    let (code, out) = admin_post(port, "/clear");
    assert_eq!(code, 200, "{out}");
    assert_eq!(e.c.stats().unwrap().objects, 3);
}

#[test]
fn admin_calls_from_a_non_loopback_peer_are_refused() {
    let Some(ip) = non_loopback_ip() else {
        eprintln!("skipped: this host has no address but loopback");
        return;
    };
    let body = r#"{"model_id": 1, "hashes": ["00000000000000000000000000000000"]}"#;
    let request = |port: u16, head: &str, auth: &str| {
        let mut s = TcpStream::connect((ip, port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "{head}\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
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
        let s = Fixture::new(tag, Duration::from_secs(60), &args);
        remember_token(port, &s);
        let auth = admin_header(port);
        for head in [
            "POST /pin HTTP/1.1",
            "POST /unpin HTTP/1.1",
            "GET /pins HTTP/1.1",
            "POST /clear HTTP/1.1",
            "POST /evict?bytes=1 HTTP/1.1",
        ] {
            // Even with the token, only with --http-admin-remote.
            let out = request(port, head, &auth);
            let want = if remote {
                "HTTP/1.1 200"
            } else {
                "HTTP/1.1 403"
            };
            assert!(out.starts_with(want), "{head} (remote {remote}): {out}");
            // Never without the token.
            let out = request(port, head, "");
            let want = if remote {
                "HTTP/1.1 401"
            } else {
                "HTTP/1.1 403"
            };
            assert!(out.starts_with(want), "{head} (remote {remote}): {out}");
        }
        // The read-only calls answer any peer.
        assert!(request(port, "GET /status HTTP/1.1", "").starts_with("HTTP/1.1 200"));
        // Loopback peers may always, with the token.
        assert_eq!(post_json(port, "/pin", body).0, 200);
    }
}

/// A connection to loopback `port`, made within `limit`.
fn connect_within(port: u16, limit: Duration) -> std::io::Result<TcpStream> {
    TcpStream::connect_timeout(&std::net::SocketAddr::from(([127, 0, 0, 1], port)), limit)
}

/// `GET path` from loopback `port`, given `limit` to connect and answer:
/// the status code, the body and the time the whole exchange took.
fn timed_get(port: u16, path: &str, limit: Duration) -> Result<(u16, String, Duration), String> {
    let t0 = Instant::now();
    let mut s = connect_within(port, limit).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(limit)).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .map_err(|e| format!("no answer after {:?}: {e}", t0.elapsed()))?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((code, body, t0.elapsed()))
}

/// Whether `c` is still open with nothing to read (the server has neither
/// answered nor closed it).
fn still_waiting(c: &TcpStream) -> bool {
    c.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let waiting = matches!(c.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    c.set_nonblocking(false).unwrap();
    waiting
}

/// What the server sent on `c` before closing it (within `limit`).
fn answer_of(c: &mut TcpStream, limit: Duration) -> String {
    c.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    // A reset after the answer (the server closed with bytes unread) still
    // leaves the answer read.
    let _ = c.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn health_answers_within_a_second_under_a_thousand_idle_slow_and_half_open_connections() {
    const IDLE: usize = 1000;
    const SLOW: usize = 20;
    const HALF_OPEN: usize = 20;
    let limit = raise_open_files(4096);
    assert!(limit >= 2 * IDLE as u64, "open-descriptor limit {limit}");
    let (s, port) = server_with_http("http-abuse", &[]);
    assert!(
        eventually(Duration::from_secs(30), || http_get(port, "/readyz").0
            == 200)
        .is_some(),
        "never ready"
    );
    // A client's PING round trips all along.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pinger = {
        let stop = stop.clone();
        let mut c = s.client();
        std::thread::spawn(move || {
            let (mut n, mut slowest) = (0u64, Duration::ZERO);
            // Relaxed: a plain flag; the join below orders what it saw.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                c.ping(b"abuse", far()).unwrap();
                slowest = slowest.max(t.elapsed());
                n += 1;
            }
            (n, slowest)
        })
    };

    let t0 = Instant::now();
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|i| {
            connect_within(port, Duration::from_secs(1))
                .unwrap_or_else(|e| panic!("idle connection {i}: {e} after {:?}", t0.elapsed()))
        })
        .collect();
    // Half-open: part of a request, then the write side shut.
    let mut half: Vec<TcpStream> = (0..HALF_OPEN)
        .map(|_| {
            let mut c = connect_within(port, Duration::from_secs(1)).unwrap();
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            c.shutdown(std::net::Shutdown::Write).unwrap();
            c
        })
        .collect();
    // Slow: a byte of a request every 500 ms, for 3 s (past the deadline).
    let slow: Vec<TcpStream> = (0..SLOW)
        .map(|_| connect_within(port, Duration::from_secs(1)).unwrap())
        .collect();
    let slow_started = Instant::now();
    let trickle = std::thread::spawn(move || {
        let mut slow = slow;
        for b in b"GET /metrics HTTP/1.1\r\n".iter().take(6) {
            for c in &mut slow {
                // (Refused once the server closed it at its deadline.)
                let _ = c.write_all(&[*b]);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        slow
    });
    let opened = t0.elapsed();

    for path in ["/healthz", "/readyz", "/metrics", "/healthz"] {
        let (code, body, took) = timed_get(port, path, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{path} with {IDLE} idle connections open: {e}"));
        eprintln!(
            "{path}: {code} in {took:?} with {} connections open",
            IDLE + SLOW + HALF_OPEN
        );
        assert_eq!(code, 200, "{path}: {body}");
        assert!(took < Duration::from_secs(1), "{path} took {took:?}");
    }
    // All of them were open and unanswered while the probes ran.
    let waiting = idle.iter().filter(|c| still_waiting(c)).count();
    assert_eq!(
        waiting,
        IDLE,
        "idle connections still waiting after the probes ({:?} after the first; {opened:?} to open them)",
        t0.elapsed()
    );

    // Each connection's time is bounded: a half-open one is answered at
    // once, an idle one at its deadline, a slow one too (trickling does
    // not extend it).
    for c in &mut half {
        let a = answer_of(c, Duration::from_secs(5));
        assert!(a.starts_with("HTTP/1.1 400"), "half-open: {a:?}");
    }
    for mut c in idle {
        let a = answer_of(&mut c, Duration::from_secs(10));
        assert!(a.starts_with("HTTP/1.1 408"), "idle: {a:?}");
    }
    let deadline = kvring_server::HTTP_CLIENT_DEADLINE;
    assert!(t0.elapsed() >= deadline);
    let slow = trickle.join().unwrap();
    assert!(slow_started.elapsed() >= deadline + Duration::from_millis(500));
    for mut c in slow {
        // Already answered and closed: nothing more to wait for.
        let a = answer_of(&mut c, Duration::from_millis(500));
        assert!(a.starts_with("HTTP/1.1 408"), "slow: {a:?}");
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (pings, slowest) = pinger.join().unwrap();
    eprintln!("{pings} PINGs meanwhile, the slowest {slowest:?}");
    assert!(pings > 0);
    assert!(
        slowest < Duration::from_millis(500),
        "a ping took {slowest:?}"
    );
    let (code, _) = http_get(port, "/healthz");
    assert_eq!(code, 200);
}

#[test]
fn past_the_connection_bound_the_oldest_idle_connection_makes_room() {
    const IDLE: usize = 100;
    let (_s, port) = server_with_http("http-bound", &["--http-max-connections", "32"]);
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| connect_within(port, Duration::from_secs(1)).unwrap())
        .collect();
    let t0 = Instant::now();
    let (code, body, took) = timed_get(port, "/healthz", Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("/healthz past the bound: {e}"));
    assert_eq!(code, 200, "{body}");
    assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
    // The newest stay (31 of them fit besides the probe) ...
    for (i, c) in idle.iter().enumerate().skip(IDLE - 20) {
        assert!(still_waiting(c), "connection {i} was closed");
    }
    assert!(t0.elapsed() < kvring_server::HTTP_CLIENT_DEADLINE);
    // ... the oldest went at once, told why.
    for (i, mut c) in idle.into_iter().enumerate().take(60) {
        let a = answer_of(&mut c, Duration::from_millis(500));
        assert!(a.starts_with("HTTP/1.1 503"), "connection {i}: {a:?}");
        assert!(a.contains("too many connections"), "{a}");
    }
}

/// The lowest descriptor number process `pid` has free.
fn lowest_free_fd(pid: i32) -> u64 {
    let used: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !used.contains(n)).unwrap()
}

/// Sets the soft limit on open descriptors of process `pid` (its hard
/// limit unchanged).
fn set_open_files_of(pid: i32, soft: u64) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads the limit of `pid` into `old`, a valid rlimit.
    let r = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: `new` is a valid rlimit; no old value is asked for.
    let r = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
}

/// The CPU time process `pid` used so far, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after the
    // name.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn out_of_descriptors_the_endpoint_makes_room_and_never_spins() {
    let (s, port) = server_with_http("http-emfile", &[]);
    let pid = s.srv.pid();
    // Room for about 16 more descriptors: 100 idle connections exhaust it.
    set_open_files_of(pid, lowest_free_fd(pid) + 16);
    let mut idle: Vec<TcpStream> = (0..100)
        .map(|_| connect_within(port, Duration::from_secs(1)).unwrap())
        .collect();
    let (code, body, took) = timed_get(port, "/healthz", Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("/healthz out of descriptors: {e}"));
    assert_eq!(code, 200, "{body}");
    assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
    // The oldest made room.
    let a = answer_of(&mut idle[0], Duration::from_secs(1));
    assert!(a.starts_with("HTTP/1.1 503"), "{a:?}");
    drop(idle);

    // No descriptor at all, and no connection to close: connections wait
    // in the listen queue, and the endpoint does not spin on accept.
    std::thread::sleep(Duration::from_millis(300));
    set_open_files_of(pid, lowest_free_fd(pid));
    let waiting: Vec<TcpStream> = (0..3)
        .map(|_| connect_within(port, Duration::from_secs(1)).unwrap())
        .collect();
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_ticks(pid) - before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(
        used * 5 < hz,
        "the server used {used} of {hz} ticks in a second out of descriptors"
    );
    // With descriptors again, it serves.
    set_open_files_of(pid, 4096);
    let (code, _, _) = timed_get(port, "/healthz", Duration::from_secs(10)).unwrap();
    assert_eq!(code, 200);
    drop(waiting);
}

#[test]
fn admin_calls_need_the_token_from_the_runtime_directory() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let args = ["--http", addr.as_str(), "--pool-bytes", "64MiB"];
    let mut s = Fixture::new("http-token", Duration::from_secs(90), &args);
    let path = admin_token_path(&s);
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.mode() & 0o777, 0o600, "{}", path.display());
    assert_eq!(md.uid(), nix::unistd::geteuid().as_raw());
    let token = admin_token(&s);
    assert_eq!(token.len(), 64, "{token:?}");
    assert!(token.bytes().all(|c| c.is_ascii_hexdigit()), "{token:?}");

    let mut e = Engine::new(&s, small_layout(), 1, 0);
    for seed in 0..2 {
        let hashes = prompt_hashes(seed, 1);
        let blocks = e.blocks(seed * 4, 1);
        e.write(&hashes, &blocks);
        e.store(0, &hashes, &blocks);
    }
    let objects = || -> Value {
        serde_json::from_str::<Value>(&http_get(port, "/status").1).unwrap()["cache"]["objects"]
            .clone()
    };
    let evict = |auth: &str| {
        http_exchange(
            port,
            format!("POST /evict?bytes=1GiB HTTP/1.1\r\n{auth}\r\n").as_bytes(),
        )
    };
    let mut near = token.clone().into_bytes();
    near[63] = if near[63] == b'0' { b'1' } else { b'0' };
    let near = String::from_utf8(near).unwrap();
    for auth in [
        String::new(),
        "Authorization: Bearer\r\n".into(),
        "Authorization: Bearer nope\r\n".into(),
        format!("Authorization: Bearer {near}\r\n"),
        format!("Authorization: Bearer {token}0\r\n"),
        format!("Authorization: Bearer {}\r\n", &token[..63]),
        format!("Authorization: Basic {token}\r\n"),
        format!("Authorization: {token}\r\n"),
        format!("X-Token: {token}\r\n"),
    ] {
        let (code, body) = evict(&auth);
        assert_eq!(code, 401, "{auth:?}: {body}");
        assert!(body.contains(&path.display().to_string()), "{body}");
    }
    // Two headers, one of them right: refused as ambiguous.
    let (code, body) = evict(&format!(
        "Authorization: Bearer nope\r\nAuthorization: Bearer {token}\r\n"
    ));
    assert_eq!(code, 400, "{body}");
    assert_eq!(objects(), 2, "nothing was evicted");
    // The read-only calls need none.
    for p in ["/metrics", "/healthz", "/readyz", "/status"] {
        assert_eq!(http_get(port, p).0, 200, "{p}");
    }
    // The token (the scheme in any case) is taken.
    let (code, body) = evict(&format!("authorization: bearer {token}\r\n"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(objects(), 0);

    // A clean stop removes it; the next server has another.
    assert!(s.srv.terminate().success());
    assert!(!path.exists(), "{} left after a clean stop", path.display());
    s.restart(&args);
    let again = admin_token(&s);
    assert_ne!(again, token);
    assert_eq!(evict(&format!("Authorization: Bearer {token}\r\n")).0, 401);
    assert_eq!(evict(&format!("Authorization: Bearer {again}\r\n")).0, 200);
    // A killed server leaves its file; the next start replaces it.
    s.srv.kill();
    assert!(path.exists());
    s.restart(&args);
    let third = admin_token(&s);
    assert_ne!(third, again);
    assert_eq!(evict(&format!("Authorization: Bearer {again}\r\n")).0, 401);
    assert_eq!(evict(&format!("Authorization: Bearer {third}\r\n")).0, 200);
}

/// The uid another local user runs as here: `nobody`.
const OTHER_UID: u32 = 65534;

#[test]
fn another_local_users_admin_call_is_refused() {
    if let Some((role, _name, _dir)) = child_role() {
        // The other user: it cannot read the token, and without it the
        // endpoint refuses its admin call.
        let port: u16 = role.strip_prefix("evict:").unwrap().parse().unwrap();
        let token = std::env::var("KVRING_CHILD_TOKEN").unwrap();
        tell_parent(&format!("uid: {}", nix::unistd::geteuid()));
        match std::fs::read(&token) {
            Ok(_) => tell_parent("token: read"),
            Err(e) => tell_parent(&format!("token: {:?}", e.kind())),
        }
        let (code, _) = http_exchange(port, b"POST /evict?bytes=1GiB HTTP/1.1\r\n\r\n");
        tell_parent(&format!("evict: {code}"));
        let guess = "0".repeat(64);
        let (code, _) = http_exchange(
            port,
            format!("POST /clear HTTP/1.1\r\nAuthorization: Bearer {guess}\r\n\r\n").as_bytes(),
        );
        tell_parent(&format!("clear: {code}"));
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED (not a pass): starting a process of another uid ({OTHER_UID}) needs root; \
             run this test as root to check that another local user's admin call is refused"
        );
        return;
    }
    let (s, port) = server_with_http("http-other-uid", &[]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    for seed in 0..2 {
        let hashes = prompt_hashes(seed, 1);
        let blocks = e.blocks(seed * 4, 1);
        e.write(&hashes, &blocks);
        e.store(0, &hashes, &blocks);
    }
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "another_local_users_admin_call_is_refused",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVRING_CHILD_ROLE", format!("evict:{port}"))
        .env("KVRING_CHILD_NAME", &s.name)
        .env("KVRING_CHILD_DIR", &s.dir)
        .env("KVRING_CHILD_TOKEN", admin_token_path(&s))
        .uid(OTHER_UID)
        .gid(OTHER_UID)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |prefix: &str| {
        said.lines()
            .find_map(|l| {
                l.find(prefix)
                    .map(|at| l[at + prefix.len()..].trim().to_string())
            })
            .unwrap_or_else(|| panic!("the child did not say {prefix:?}: {said}"))
    };
    assert_eq!(line("uid: "), OTHER_UID.to_string());
    assert_eq!(line("token: "), "PermissionDenied");
    assert_eq!(line("evict: "), "401");
    assert_eq!(line("clear: "), "401");
    let status: Value = serde_json::from_str(&http_get(port, "/status").1).unwrap();
    assert_eq!(status["cache"]["objects"], 2, "nothing was evicted");
    // The owner, with the token, may.
    assert_eq!(admin_post(port, "/evict?bytes=1GiB").0, 200);
}
