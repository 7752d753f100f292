//! Job-path benchmarks: what a status poll costs (a read of the job slot in
//! shared memory) next to what a status query costs as a round trip (kvring's
//! own ring, and ZeroMQ as LMCache's multi-process mode does it), and the
//! client-observed time from submitting a job to reading it done.

use crate::peers::{self, cpus, kvring_client, kvring_server, pin, sample, stop_server};
use crate::stats::Summary;
use kvring::jobs::{JobId, JobStatus};
use kvring::proto::Opcode;
use kvring::wait::WaitPolicy;
use kvring::DelayJob;
use serde_json::json;
use std::time::{Duration, Instant};

/// Writes the server made to a job slot (its seqlock advances by 2 each).
fn slot_writes(c: &kvring::Client, id: JobId) -> u64 {
    c.segment().view().job_slot(id.index()).seq / 2
}

pub fn run(json_out: bool, iters: usize) {
    let (client_cpu, server_cpu) = cpus();
    eprintln!(
        "pinning: client cpu {client_cpu:?}, server cpu {server_cpu:?}; {iters} samples each"
    );
    let timer = Summary::of(peers::timer_overhead(iters));

    let (child, name) = kvring_server("jobs", WaitPolicy::SPIN);
    pin(cpus().0);
    let mut c = kvring_client(&name);
    let far = Instant::now() + Duration::from_secs(3600);

    // 1. A status query as a round trip over kvring's ring (16-byte id).
    let id_bytes = [0x5au8; 16];
    let mut buf = Vec::new();
    let ring_rtt = Summary::of(sample(iters, || {
        c.raw().submit(Opcode::Ping, &id_bytes, 1).unwrap();
        c.raw().wait_into(far, &mut buf).unwrap();
    }));
    eprintln!(
        "ring round trip (16 B): p50 {} ns p99 {} ns",
        ring_rtt.p50, ring_rtt.p99
    );
    // 2. A finished, released job (a tombstone): nobody writes the slot.
    let job = c
        .delay_job(DelayJob::new(Duration::ZERO, Duration::ZERO))
        .unwrap();
    job.wait(far).unwrap();
    let done = job.id();
    c.release_job(job).unwrap();
    let idle = Summary::of(sample(iters, || {
        assert!(c.job_status(done).unwrap().is_terminal());
    }));
    eprintln!(
        "status poll, tombstone: p50 {} ns p99 {} ns",
        idle.p50, idle.p99
    );

    // 3. Submit a zero-delay job and wait until it reads done (spinning).
    let n = (iters / 20).max(1000);
    let mut tags = 0u64;
    let submit_done = Summary::of(sample(n, || {
        tags += 1;
        let job = c
            .delay_job(DelayJob::new(Duration::ZERO, Duration::ZERO).result(tags, 0))
            .unwrap();
        let st = job.wait(far).unwrap();
        assert!(matches!(st, JobStatus::Done(r) if r.value == tags));
        c.release_job(job).unwrap();
    }));
    eprintln!(
        "submit + wait done + release: p50 {} ns p99 {} ns",
        submit_done.p50, submit_done.p99
    );

    // 4. A running job whose progress the server rewrites every microsecond
    //    (as fast as its loop turns) while the client polls it.
    let busy = c
        .delay_job(
            DelayJob::new(Duration::ZERO, Duration::from_secs(3600))
                .progress_every(Duration::from_micros(1)),
        )
        .unwrap()
        .into_id();
    let t = Instant::now();
    while c.job_status(busy).unwrap() != JobStatus::Running {
        assert!(t.elapsed() < Duration::from_secs(5), "job never started");
    }
    let (w0, t0) = (slot_writes(&c, busy), Instant::now());
    let mut running = 0u64;
    let contended = sample(iters, || {
        running += (c.job_status(busy).unwrap() == JobStatus::Running) as u64;
    });
    let writes_per_s = (slot_writes(&c, busy) - w0) as f64 / t0.elapsed().as_secs_f64();
    assert_eq!(
        running as usize,
        iters + peers::WARMUP,
        "the job stayed running"
    );
    let contended = Summary::of(contended);
    eprintln!(
        "status poll, slot written {:.1} M/s by the server: p50 {} ns p99 {} ns",
        writes_per_s / 1e6,
        contended.p50,
        contended.p99
    );
    // The busy job ends Failed(ServerShutdown) when the server stops.
    drop(c);
    stop_server(child);

    // 5. The same query as a ZeroMQ DEALER/ROUTER round trip over ipc://.
    let zmq = Summary::of(peers::zmq((iters / 4).max(1000)));
    eprintln!("ZeroMQ round trip: p50 {} ns p99 {} ns", zmq.p50, zmq.p99);

    let ratios = json!({
        "status_poll_over_ring_rtt": contended.p50 as f64 / ring_rtt.p50 as f64,
        "status_poll_over_zmq_rtt": contended.p50 as f64 / zmq.p50 as f64,
    });
    eprintln!("ratios (p50): {ratios}");
    let out = json!({
        "bench": "jobs",
        "iterations": iters,
        "pinned_cpus": { "client": client_cpu, "server": server_cpu },
        "timer_overhead_ns": timer.to_json(),
        "status_poll_ns": contended.to_json(),
        "server_slot_writes_per_s": writes_per_s,
        "status_poll_tombstone_ns": idle.to_json(),
        "submit_wait_release_ns": submit_done.to_json(),
        "ring_rtt_ns": ring_rtt.to_json(),
        "zmq_rtt_ns": zmq.to_json(),
        "ratios": ratios,
    });
    if json_out {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
}
