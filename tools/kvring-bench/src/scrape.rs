//! What scraping the HTTP endpoint costs a server at full rate: PING round
//! trips over the ring (the ring loop's hot path, one client spinning) in
//! phases without a scraper and with one (`GET /metrics` every interval),
//! alternating, against one server; and how long a scrape takes.

use crate::peers::{cpus, kvring_client, kvring_server_with, pin, stop_server};
use crate::stats::Summary;
use kvring::proto::Opcode;
use kvring::wait::WaitPolicy;
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One scrape: its duration (connect to the last byte), in ns.
fn scrape(port: u16) -> u64 {
    let t = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
        .unwrap();
    let mut body = Vec::new();
    s.read_to_end(&mut body).unwrap();
    assert!(body.starts_with(b"HTTP/1.1 200"), "a scrape failed");
    t.elapsed().as_nanos() as u64
}

/// PING round trips for `span`: their latencies (ns).
fn pings(c: &mut kvring::Client, span: Duration) -> Vec<u64> {
    let far = Instant::now() + Duration::from_secs(3600);
    let mut buf = Vec::new();
    let mut v = Vec::new();
    let end = Instant::now() + span;
    while Instant::now() < end {
        let t = Instant::now();
        c.raw().submit(Opcode::Ping, &[0u8; 16], 1).unwrap();
        c.raw().wait_into(far, &mut buf).unwrap();
        v.push(t.elapsed().as_nanos() as u64);
    }
    v
}

pub fn run(json_out: bool, rounds: usize, phase_ms: u64, interval_ms: &[u64]) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (child, name) = kvring_server_with(
        "scrape",
        WaitPolicy::SPIN,
        &["--http".into(), format!("127.0.0.1:{port}")],
        true,
    );
    pin(cpus().0);
    let mut c = kvring_client(&name);
    let span = Duration::from_millis(phase_ms);
    pings(&mut c, Duration::from_millis(200)); // warm-up
    let mut phases: Vec<(u64, Vec<u64>, Vec<u64>)> = Vec::new();
    for _ in 0..rounds {
        for &every in std::iter::once(&0).chain(interval_ms) {
            let stop = Arc::new(AtomicBool::new(false));
            let scraper = (every > 0).then(|| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut took = Vec::new();
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        took.push(scrape(port));
                        next += Duration::from_millis(every);
                        // Few wake-ups: on a small machine the scraper's own
                        // wake-ups would cost the spinning threads more than
                        // the scrapes.
                        while !stop.load(Ordering::Relaxed) {
                            let left = next.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                break;
                            }
                            std::thread::sleep(left.min(Duration::from_millis(50)));
                        }
                    }
                    took
                })
            });
            let v = pings(&mut c, span);
            stop.store(true, Ordering::Relaxed);
            let took = scraper.map(|t| t.join().unwrap()).unwrap_or_default();
            phases.push((every, v, took));
        }
    }
    drop(c);
    stop_server(child);
    let mut out = Vec::new();
    let base: Vec<&(u64, Vec<u64>, Vec<u64>)> = phases.iter().filter(|p| p.0 == 0).collect();
    let median = |mut x: Vec<f64>| {
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let summarize = |ps: &[&(u64, Vec<u64>, Vec<u64>)]| {
        let p50 = median(
            ps.iter()
                .map(|p| Summary::of(p.1.clone()).p50 as f64)
                .collect(),
        );
        let p99 = median(
            ps.iter()
                .map(|p| Summary::of(p.1.clone()).p99 as f64)
                .collect(),
        );
        let rate = median(
            ps.iter()
                .map(|p| p.1.len() as f64 / span.as_secs_f64())
                .collect(),
        );
        (p50, p99, rate)
    };
    let (b50, b99, brate) = summarize(&base);
    for &every in std::iter::once(&0).chain(interval_ms) {
        let ps: Vec<_> = phases.iter().filter(|p| p.0 == every).collect();
        let (p50, p99, rate) = summarize(&ps);
        let took: Vec<u64> = ps.iter().flat_map(|p| p.2.iter().copied()).collect();
        let scrape_ms = (!took.is_empty()).then(|| {
            let s = Summary::of(took);
            json!({"p50": s.p50 as f64 / 1e6, "p99": s.p99 as f64 / 1e6, "n": s.n})
        });
        eprintln!(
            "scrape every {}: ping p50 {p50:.0} ns p99 {p99:.0} ns, {rate:.0}/s ({:.3}x the rate without){}",
            if every == 0 { "never".to_string() } else { format!("{every} ms") },
            rate / brate,
            scrape_ms
                .as_ref()
                .map_or(String::new(), |s| format!("; a scrape takes p50 {:.2} ms", s["p50"])),
        );
        out.push(json!({
            "scrape_every_ms": every,
            "ping_p50_ns": p50,
            "ping_p99_ns": p99,
            "pings_per_s": rate,
            "rate_vs_no_scraper": rate / brate,
            "p50_vs_no_scraper": p50 / b50,
            "p99_vs_no_scraper": p99 / b99,
            "scrape_ms": scrape_ms,
        }));
    }
    let v = json!({
        "bench": "scrape",
        "rounds": rounds,
        "phase_ms": phase_ms,
        "phases": out,
    });
    if json_out {
        println!("{v}");
    }
}
