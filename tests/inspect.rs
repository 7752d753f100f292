//! `kvring-inspect` against real processes: its JSON reflects a known state,
//! it answers while the server is stopped (wedged) and after it was killed
//! (post-mortem), it refuses what is not a kvring segment, and its live view
//! renders in a terminal and quits on `q`.

mod common;

use common::*;
use kvring::jobs::{FailReason, JobStatus};
use kvring::kv::{model_id, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
use kvring::proto::Opcode;
use kvring::{DelayJob, KvSpec};
use serde_json::Value;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn inspect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvring-inspect"))
        .args(args)
        .output()
        .expect("run kvring-inspect")
}

fn inspect_json(args: &[&str]) -> Value {
    let out = inspect(args);
    assert!(
        out.status.success(),
        "kvring-inspect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().expect("output")).expect("JSON")
}

fn kinds(v: &Value) -> Vec<String> {
    v["anomalies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["kind"].as_str().unwrap().to_string())
        .collect()
}

fn delay(pending_ms: u64, running_ms: u64) -> DelayJob {
    DelayJob::new(
        Duration::from_millis(pending_ms),
        Duration::from_millis(running_ms),
    )
}

#[test]
fn json_reflects_the_state_live_wedged_and_post_mortem() {
    let mut s = Fixture::new(
        "inspect",
        Duration::from_secs(60),
        &["--job-slots", "16", "--pool-bytes", "16MiB"],
    );
    let mut a = s.client();
    let mut b = s.client();
    // Jobs in every state: pending, running, done, failed, tombstoned
    // (detached: the table keeps them as they are).
    let pending = a.delay_job(delay(60_000, 1)).unwrap().into_id();
    let running = a.delay_job(delay(0, 60_000)).unwrap().into_id();
    let done = a.delay_job(delay(0, 0)).unwrap().into_id();
    let failed = a
        .delay_job(delay(0, 0).fail(FailReason::Requested))
        .unwrap()
        .into_id();
    let tomb = a.delay_job(delay(0, 0)).unwrap().into_id();
    let far = Instant::now() + Duration::from_secs(5);
    for id in [done, failed, tomb] {
        assert!(a.wait_job(id, far).unwrap().is_terminal());
    }
    a.release_job(tomb).unwrap();
    eventually(Duration::from_secs(2), || {
        a.job_status(running).unwrap() == JobStatus::Running
    })
    .expect("running");
    assert_eq!(a.job_status(pending).unwrap(), JobStatus::Pending);
    // Client b registers a KV cache.
    let shape = KvShape {
        layers: 1,
        blocks: 16,
        block_tokens: 16,
        heads: 1,
        head_dim: 8,
    };
    let layout =
        KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16)).unwrap();
    let chunk = b.server_config().unwrap().chunk_tokens;
    let cache = kvring::HostKvCache::new(layout.clone(), chunk).unwrap();
    let _reg = b
        .register_host(&KvSpec::new(model_id("m"), 1, 0), &cache)
        .unwrap();

    let v = inspect_json(&["show", &s.name, "--json", "--sample-ms", "100"]);
    assert_eq!(v["name"], s.name.as_str());
    assert_eq!(v["server"]["alive"], true);
    assert_eq!(v["server"]["pid"], s.srv.pid());
    let clients = v["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 2);
    let cb = clients
        .iter()
        .find(|c| c["slot"] == b.slot())
        .expect("client b");
    assert_eq!(cb["kv_instances"], 1);
    assert_eq!(cb["pid"], std::process::id());
    assert_eq!(cb["alive"], true);
    assert_eq!(cb["request_ring"]["used"], 0);
    let by_state = &v["jobs"]["by_state"];
    for (state, n) in [
        ("pending", 1),
        ("running", 1),
        ("done", 1),
        ("failed", 1),
        ("tombstoned", 1),
        ("free", 11),
    ] {
        assert_eq!(by_state[state], n, "{state}: {by_state}");
    }
    assert_eq!(v["jobs"]["oldest_unfinished"]["state"], "pending");
    let delay_op = v["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["name"] == "delay_job")
        .unwrap();
    assert_eq!(delay_op["count"], 5);
    assert_eq!(delay_op["errors"], 1);
    assert!(delay_op["p50_us"].as_f64().is_some());
    assert!(kinds(&v).is_empty(), "{}", v["anomalies"]);

    // The job table, filtered.
    let j = inspect_json(&["jobs", &s.name, "--json", "--state", "running"]);
    let rows = j["jobs"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["index"], running.index());
    assert_eq!(rows[0]["kind"], "delay");
    let j = inspect_json(&["jobs", &s.name, "--json"]);
    assert_eq!(
        j["jobs"].as_array().unwrap().len(),
        4,
        "tombstones left out"
    );
    let j = inspect_json(&["jobs", &s.name, "--json", "--all"]);
    assert_eq!(j["jobs"].as_array().unwrap().len(), 5);
    let j = inspect_json(&["jobs", &s.name, "--json", "--client", &b.slot().to_string()]);
    assert!(j["jobs"].as_array().unwrap().is_empty());
    let text = inspect(&["show", &s.name]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("anomalies: none") && text.contains("delay_job"),
        "{text}"
    );

    // Wedged: requests wait in a's ring, the server's heartbeat stops.
    s.srv.pause();
    for i in 0..3 {
        a.raw().submit(Opcode::Ping, b"wedged", i).unwrap();
    }
    std::thread::sleep(Duration::from_millis(1100));
    let t = Instant::now();
    let v = inspect_json(&["show", &s.name, "--json", "--sample-ms", "200"]);
    assert!(t.elapsed() < Duration::from_secs(5), "slow while wedged");
    let ca = v["clients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["slot"] == a.slot())
        .unwrap()
        .clone();
    // Client-written words come from the client's own memory, read through
    // the (stopped) server's descriptor of it.
    assert_eq!(ca["client_memory"], true);
    assert_eq!(ca["request_ring"]["used"], 3 * 32);
    assert_eq!(ca["in_flight"], 3);
    let k = kinds(&v);
    assert!(k.contains(&"ring_stalled".to_string()), "{k:?}");
    assert!(k.contains(&"heartbeat_stopped".to_string()), "{k:?}");
    s.srv.signal(libc::SIGCONT);
    for _ in 0..3 {
        a.raw()
            .wait_completion(Instant::now() + Duration::from_secs(5))
            .unwrap();
    }

    // Post-mortem: the segment of a killed server is still readable.
    s.srv.kill();
    let v = inspect_json(&["show", &s.name, "--json", "--sample-ms", "10"]);
    assert_eq!(v["server"]["alive"], false);
    assert!(kinds(&v).contains(&"server_dead".to_string()));
    assert_eq!(v["jobs"]["by_state"]["running"], 1, "the table as it was");
    // The clients' own memory went with the server's descriptors of it.
    for c in v["clients"].as_array().unwrap() {
        assert_eq!(c["client_memory"], false, "{c}");
    }
    let l = inspect_json(&["list", "--json"]);
    let entry = l["segments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == s.name.as_str())
        .expect("listed")
        .clone();
    assert_eq!(entry["alive"], false);
    assert_eq!(entry["server_pid"], v["server"]["pid"]);
}

#[test]
fn what_is_not_a_kvring_segment_is_refused_clearly() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("bogus");
    let path = format!("/dev/shm{}", s.shm_name());
    std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
    let out = inspect(&["show", &s.name]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a kvring segment"), "{err}");
    let l = inspect_json(&["list", "--json"]);
    let e = l["segments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == s.name.as_str())
        .expect("listed")
        .clone();
    assert!(e["error"]
        .as_str()
        .unwrap()
        .contains("not a kvring segment"));
    // A kvring segment of a layout this build does not know.
    let mut bytes = vec![0u8; 8192];
    bytes[..8].copy_from_slice(&kvring::shm::MAGIC.to_le_bytes());
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let out = inspect(&["show", &s.name]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layout version 99"), "{err}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_watch_view_renders_in_a_terminal_and_quits_on_q() {
    use std::io::{Read, Write};
    let s = Fixture::new("watch", Duration::from_secs(30), &[]);
    let mut c = s.client();
    c.ping(b"x", Instant::now() + Duration::from_secs(5))
        .unwrap();
    let size = nix::pty::Winsize {
        ws_row: 50,
        ws_col: 160,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None).unwrap();
    let slave = std::fs::File::from(pty.slave);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvring-inspect"))
        .args(["watch", &s.name, "--interval-ms", "100"])
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave)
        .spawn()
        .unwrap();
    let mut master = std::fs::File::from(pty.master);
    // Read the screen until it shows the header and this client's row.
    nix::fcntl::fcntl(
        &master,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .unwrap();
    let mut screen = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let want = format!("kvring-inspect watch {}", s.name);
    while !(screen.contains(&want) && screen.contains("server pid") && screen.contains("rates:")) {
        assert!(
            Instant::now() < deadline,
            "the view never rendered: {screen:?}"
        );
        let mut buf = [0u8; 4096];
        match master.read(&mut buf) {
            Ok(n) => screen.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(screen.contains("active"), "the client's row: {screen:?}");
    master.write_all(b"q").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        // Keep the terminal drained so the program never blocks on output.
        let mut buf = [0u8; 4096];
        let _ = master.read(&mut buf);
        assert!(Instant::now() < deadline, "watch did not quit on q");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
}

/// The value of the sample `name` with `labels` in a parsed scrape.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let s = scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"));
    match s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        ref other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn metrics_count_what_was_done() {
    let s = Fixture::new("inspect-metrics", Duration::from_secs(60), &[]);
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    // A known workload: 3 stores of 2 chunks, 2 lookups, 1 retrieve of
    // 2 chunks, 1 failed delay job.
    let mut stored = Vec::new();
    for seed in 0..3 {
        let hashes = prompt_hashes(100 + seed, 2);
        let blocks = e.blocks(seed * 8, 2);
        e.write(&hashes, &blocks);
        assert_eq!(e.store(0, &hashes, &blocks).value, 2);
        stored.push(hashes);
    }
    let lease = lookup(&mut e.c, 1, 0, &stored[0]);
    drop(lookup(&mut e.c, 1, 0, &prompt_hashes(999, 3)));
    let blocks = e.blocks(40, 2);
    done(
        e.c.retrieve(kvring::Retrieve::new(&e.inst, lease.id(), &blocks))
            .unwrap(),
    );
    drop(lease);
    let failed =
        e.c.delay_job(delay(0, 0).fail(FailReason::Requested))
            .unwrap();
    assert!(failed.wait(far()).unwrap().is_terminal());
    drop(failed);

    let out = inspect(&["metrics", &s.name, "--sample-ms", "50"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    let scrape =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("parse");
    let chunk = e.c.server_config().unwrap().chunk_tokens;
    let obj = small_layout().object_bytes(chunk) as f64;
    for (name, labels, want) in [
        ("kvring_server_up", vec![], 1.0),
        ("kvring_clients_connected", vec![], 1.0),
        ("kvring_stores_total", vec![], 3.0),
        ("kvring_stored_chunks_total", vec![], 6.0),
        ("kvring_stored_bytes_total", vec![], 6.0 * obj),
        ("kvring_lookups_total", vec![], 2.0),
        ("kvring_lookup_chunks_total", vec![], 5.0),
        ("kvring_lookup_hit_chunks_total", vec![], 2.0),
        ("kvring_retrieves_total", vec![], 1.0),
        ("kvring_retrieved_chunks_total", vec![], 2.0),
        ("kvring_retrieved_bytes_total", vec![], 2.0 * obj),
        ("kvring_objects", vec![], 6.0),
        ("kvring_pool_used_bytes", vec![], 6.0 * obj),
        ("kvring_leases", vec![], 0.0),
        ("kvring_registrations", vec![], 1.0),
        ("kvring_requests_total", vec![("op", "store")], 3.0),
        ("kvring_requests_total", vec![("op", "lookup")], 2.0),
        ("kvring_requests_total", vec![("op", "retrieve")], 1.0),
        (
            "kvring_request_errors_total",
            vec![("op", "delay_job")],
            1.0,
        ),
        ("kvring_request_errors_total", vec![("op", "store")], 0.0),
        ("kvring_jobs_failed_total", vec![], 1.0),
        ("kvring_anomalies", vec![("kind", "job_stuck")], 0.0),
    ] {
        assert_eq!(sample(&scrape, name, &labels), want, "{name} {labels:?}");
    }
    // The store latency histogram: 3 jobs, a positive sum, cumulative
    // buckets ending at +Inf with the count.
    let store = [("op", "store")];
    assert_eq!(
        sample(&scrape, "kvring_request_latency_seconds_count", &store),
        3.0
    );
    assert!(sample(&scrape, "kvring_request_latency_seconds_sum", &store) > 0.0);
    let hist = scrape.samples.iter().find_map(|s| match &s.value {
        prometheus_parse::Value::Histogram(h)
            if s.metric == "kvring_request_latency_seconds"
                && s.labels.get("op") == Some("store") =>
        {
            Some(h.clone())
        }
        _ => None,
    });
    if let Some(h) = hist {
        assert!(h.windows(2).all(|w| w[0].count <= w[1].count));
        assert_eq!(h.last().unwrap().count, 3.0);
        assert!(h.last().unwrap().less_than.is_infinite());
    } else {
        let inf = sample(
            &scrape,
            "kvring_request_latency_seconds_bucket",
            &[("op", "store"), ("le", "+Inf")],
        );
        assert_eq!(inf, 3.0);
    }
}

#[test]
fn the_grafana_dashboard_queries_only_metrics_the_server_exposes() {
    // With a disk tier, so its series exist (the remote tier's counters
    // are there without one).
    let dir = std::env::temp_dir().join(format!("kvring-inspect-dashboard-{}", std::process::id()));
    let d = dir.display().to_string();
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _removed = Removed(dir.clone());
    let s = Fixture::new(
        "inspect-dashboard",
        Duration::from_secs(60),
        &["--disk", &d, "--disk-bytes", "16MiB"],
    );
    // A lookup, so the per-model series exist.
    let mut e = Engine::new(&s, small_layout(), 1, 0);
    let _lease = lookup(&mut e.c, 1, 0, &prompt_hashes(1, 2));
    let out = inspect(&["metrics", &s.name, "--sample-ms", "10"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let exposed: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .collect();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana-dashboard.json"
    );
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queried = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("kvring_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    exposed.contains(name.as_str()),
                    "panel {:?} queries {name}, which the server does not expose",
                    panel["title"]
                );
                queried += 1;
                rest = &rest[at + name.len()..];
            }
        }
    }
    assert!(queried >= 20, "{queried} metric references");
}
