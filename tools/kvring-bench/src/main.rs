//! `kvring-bench`: measures kvring side by side with the physical floor and
//! real peers, in one run, and prints one JSON object as the last line.
//!
//! Every figure is a round trip (or a rate) between two processes, each
//! pinned to its own CPU where the machine has two. Each peer runs in a
//! forked child; the parent is single-threaded at every fork.

mod jobs;
mod kv;
mod kv_cuda;
mod peers;
mod stats;

use clap::{Parser, Subcommand};
use serde_json::json;
use stats::Summary;

#[derive(Parser)]
#[command(
    name = "kvring-bench",
    about = "kvring benchmarks (measure, never assert)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Round-trip latency of a 64-byte request and its response, and
    /// pipelined throughput: floor, kvring (spin / futex), UDS, ZeroMQ, iceoryx2.
    Ring {
        /// Print the JSON object (always the last line of stdout).
        #[arg(long)]
        json: bool,
        /// Timed round trips per transport (after warm-up).
        #[arg(long, default_value_t = 200_000)]
        iters: usize,
        /// Requests for the pipelined throughput run.
        #[arg(long, default_value_t = 5_000_000)]
        pipelined: u64,
    },
    /// Job status polls (a shared-memory read) while the server writes the
    /// slot, next to a status query as a kvring ring or ZeroMQ round trip;
    /// and submit-to-done latency.
    Jobs {
        /// Print the JSON object (always the last line of stdout).
        #[arg(long)]
        json: bool,
        /// Timed samples per measurement (after warm-up).
        #[arg(long, default_value_t = 200_000)]
        iters: usize,
    },
    /// (internal) Run a kvring server for the benchmark until stdin closes.
    #[command(hide = true)]
    ServeChild {
        #[arg(long)]
        name: String,
        #[arg(long)]
        dir: std::path::PathBuf,
        #[arg(long)]
        spin_us: u64,
        /// Pool size in MiB.
        #[arg(long, default_value_t = 64)]
        pool_mib: u64,
        #[arg(long, default_value_t = 1)]
        copy_threads: u32,
        #[arg(long)]
        prefault: bool,
        #[arg(long, default_value = "host")]
        backend: String,
        #[arg(long, default_value_t = 0)]
        cuda_zero_copy_ctas: u32,
    },
    /// KV data path on the host backend: store and retrieve GB/s against
    /// memcpy with the same threads, and lookup latency.
    Kv {
        /// Print the JSON object (always the last line of stdout).
        #[arg(long)]
        json: bool,
        /// Timed store and retrieve passes.
        #[arg(long, default_value_t = 7)]
        passes: usize,
        /// Timed lookups.
        #[arg(long, default_value_t = 20_000)]
        lookups: usize,
        /// Copy threads of the server (and of the memcpy ceiling); default:
        /// all CPUs but the one the client runs on.
        #[arg(long)]
        copy_threads: Option<u32>,
        /// `host` (engine caches in host memory) or `cuda` (in GPU memory;
        /// the ceiling is then one large pinned cuMemcpy each way).
        #[arg(long, default_value = "host")]
        backend: String,
        /// CUDA: how many GPUs, one tensor-parallel rank each (default:
        /// all); aggregate and per-GPU GB/s against the pinned-memcpy
        /// ceiling measured on all of them at once.
        #[arg(long)]
        devices: Option<usize>,
    },
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Ring {
            json,
            iters,
            pipelined,
        } => ring(json, iters, pipelined),
        Cmd::Jobs { json, iters } => jobs::run(json, iters),
        Cmd::Kv {
            json,
            passes,
            lookups,
            copy_threads,
            backend,
            devices,
        } => match backend.as_str() {
            "host" => kv::run(json, passes, lookups, copy_threads),
            "cuda" => kv_cuda::run(json, passes, copy_threads, devices),
            other => {
                eprintln!("unknown backend {other} (host or cuda)");
                std::process::exit(2);
            }
        },
        Cmd::ServeChild {
            name,
            dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            backend,
            cuda_zero_copy_ctas,
        } => peers::serve_child(
            &name,
            &dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            &backend,
            cuda_zero_copy_ctas,
        ),
    }
}

/// Takes `n` round-trip samples (ns) of one transport.
type Sampler = Box<dyn Fn(usize) -> Vec<u64>>;

fn ring(json_out: bool, iters: usize, pipelined: u64) {
    let (client_cpu, server_cpu) = peers::cpus();
    eprintln!(
        "pinning: client cpu {client_cpu:?}, server cpu {server_cpu:?}; {iters} round trips each"
    );
    let timer = Summary::of(peers::timer_overhead(iters));
    let mut rtt = serde_json::Map::new();
    let runs: Vec<(&str, Sampler)> = vec![
        ("floor", Box::new(peers::floor)),
        ("kvring_spin", Box::new(|n| peers::kvring_rtt(n, true))),
        ("kvring_futex", Box::new(|n| peers::kvring_rtt(n, false))),
        ("uds", Box::new(peers::uds)),
        ("zmq", Box::new(peers::zmq)),
        ("iceoryx2", Box::new(peers::iceoryx2)),
    ];
    let mut summaries = Vec::new();
    for (name, run) in &runs {
        // Blocking transports are ~100x slower per round trip: fewer iterations.
        let n = if matches!(*name, "uds" | "zmq" | "kvring_futex") {
            (iters / 4).max(1000)
        } else {
            iters
        };
        let s = Summary::of(run(n));
        eprintln!(
            "{name:>13}: p50 {:>7} ns  p99 {:>7} ns  ({} samples)",
            s.p50, s.p99, s.n
        );
        rtt.insert(name.to_string(), s.to_json());
        summaries.push((*name, s));
    }
    let mps = peers::kvring_pipelined(pipelined);
    eprintln!("kvring_pipelined: {mps:.2} M requests/s");
    let p50 = |n: &str| {
        summaries
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, s)| s.p50 as f64)
            .unwrap_or(f64::NAN)
    };
    let ratios = json!({
        "kvring_spin_over_floor": p50("kvring_spin") / p50("floor"),
        "kvring_futex_over_uds": p50("kvring_futex") / p50("uds"),
        "kvring_spin_over_iceoryx2": p50("kvring_spin") / p50("iceoryx2"),
        "kvring_spin_over_zmq": p50("kvring_spin") / p50("zmq"),
    });
    eprintln!("ratios (p50): {ratios}");
    let out = json!({
        "bench": "ring",
        "payload_bytes": 64,
        "iterations": iters,
        "pinned_cpus": { "client": client_cpu, "server": server_cpu },
        "timer_overhead_ns": timer.to_json(),
        "rtt_ns": rtt,
        "throughput_mps": { "kvring_pipelined": mps },
        "ratios": ratios,
    });
    if json_out {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
}
