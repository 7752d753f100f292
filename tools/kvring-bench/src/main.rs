//! `kvring-bench`: measures kvring side by side with the physical floor and
//! real peers, in one run, and prints one JSON object as the last line.
//!
//! Every figure is a round trip (or a rate) between two processes, each
//! pinned to its own CPU where the machine has two. Each peer runs in a
//! forked child; the parent is single-threaded at every fork.

mod disk;
mod disk_rings;
mod iceoryx;
mod jobs;
mod kv;
mod kv_cuda;
mod l2;
mod peers;
mod ring;
mod scrape;
mod stats;

use clap::{Parser, Subcommand};

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
    /// pipelined throughput: floor, kvring (spin / futex), UDS, ZeroMQ,
    /// iceoryx2 (publish-subscribe and request-response), in interleaved
    /// rounds bracketed by the floor.
    Ring {
        /// Print the JSON object (always the last line of stdout).
        #[arg(long)]
        json: bool,
        /// Timed round trips per transport over all rounds (after warm-up;
        /// a quarter of it for the blocking transports).
        #[arg(long, default_value_t = 200_000)]
        iters: usize,
        /// Requests for the pipelined throughput run, over all rounds.
        #[arg(long, default_value_t = 5_000_000)]
        pipelined: u64,
        /// Rounds; each runs a block of every transport.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Leave out blocks during which other processes used more than
        /// this share of all CPUs (unless that leaves none).
        #[arg(long, default_value_t = 0.25)]
        max_other_load: f64,
    },
    /// The disk tier's store against the same disk's raw direct I/O:
    /// sequential writes and reads of the same records at queue depth one,
    /// GB/s and per-record latency, in alternating rounds.
    Disk(disk::Opts),
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
    /// What scraping the HTTP endpoint costs the ring loop at full rate:
    /// PING round trips without a scraper and with GET /metrics every
    /// interval, alternating phases against one server.
    Scrape {
        /// Print the JSON object (always the last line of stdout).
        #[arg(long)]
        json: bool,
        /// Rounds of phases (one without a scraper, one per interval).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Length of each phase (ms).
        #[arg(long, default_value_t = 3000)]
        phase_ms: u64,
        /// Scrape intervals (ms), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1000,100")]
        every_ms: Vec<u64>,
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
        #[arg(long, default_value_t = kvring::kv::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: u32,
        /// The HTTP endpoint's address (none without it).
        #[arg(long)]
        http: Option<String>,
        /// A write-through disk tier in this directory (the `disk`
        /// benchmark's rings under load).
        #[arg(long)]
        disk: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 1 << 30)]
        disk_bytes: u64,
        /// A write-through second tier at this URL (the `l2` benchmark).
        #[arg(long)]
        l2: Option<String>,
        #[arg(long, default_value = "kvring:")]
        l2_prefix: String,
        #[arg(long, default_value_t = 1.0)]
        l2_timeout_s: f64,
        #[arg(long, default_value_t = 2.0)]
        l2_lookup_wait_s: f64,
        #[arg(long, default_value_t = 4)]
        l2_connections: usize,
        #[arg(long)]
        l2_secret_file: Option<std::path::PathBuf>,
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
        /// The engine cache's layout, a preset name: lbnhc (vLLM 0.33+
        /// default), lbhnc, blnhc, blhnc, lhbnc, bhlnc, flash-attn,
        /// flash-attn-hnd, flashinfer, flashinfer-hnd, packed, packed-hnd,
        /// mla (measured with DeepSeek-V3's latent geometry), cross-layer.
        #[arg(long, default_value = "lbnhc")]
        layout: String,
        /// Host backend: how the engine's cache is registered: `memfd` (the
        /// server maps it) or `process` (by address in the engine process,
        /// copied by cross-memory attach, as vLLM's CPU cache is).
        #[arg(long, default_value = "memfd")]
        memory: String,
        /// CUDA: tokens per chunk (the server's and the engine caches'),
        /// dividing the 16,384 tokens of a job.
        #[arg(long, default_value_t = kvring::kv::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: u32,
    },
    /// The second tier (Valkey/Redis): STORE with write-through until the
    /// tier has the object, and LOOKUP of objects only the tier has (on a
    /// second server, fresh pool) then RETRIEVE, against SET and GET of
    /// the same 32 MiB values with redis-rs directly; GB/s and per-chunk
    /// latency.
    L2(l2::Opts),
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Ring {
            json,
            iters,
            pipelined,
            rounds,
            max_other_load,
        } => ring::run(json, iters, pipelined, rounds, max_other_load),
        Cmd::Jobs { json, iters } => jobs::run(json, iters),
        Cmd::Disk(o) => disk::run(&o),
        Cmd::Scrape {
            json,
            rounds,
            phase_ms,
            every_ms,
        } => scrape::run(json, rounds, phase_ms, &every_ms),
        Cmd::Kv {
            json,
            passes,
            lookups,
            copy_threads,
            backend,
            devices,
            layout,
            memory,
            chunk_tokens,
        } => {
            let preset = kv::parse_layout(&layout);
            let process = match memory.as_str() {
                "memfd" => false,
                "process" => true,
                other => {
                    eprintln!("unknown memory {other} (memfd or process)");
                    std::process::exit(2);
                }
            };
            match backend.as_str() {
                "host" => kv::run(json, passes, lookups, copy_threads, preset, process),
                "cuda" => kv_cuda::run(json, passes, copy_threads, devices, preset, chunk_tokens),
                other => {
                    eprintln!("unknown backend {other} (host or cuda)");
                    std::process::exit(2);
                }
            }
        }
        Cmd::L2(opts) => l2::run(&opts),
        Cmd::ServeChild {
            name,
            dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            l2: Some(url),
            l2_prefix,
            l2_timeout_s,
            l2_lookup_wait_s,
            l2_connections,
            l2_secret_file,
            ..
        } => l2::serve_child(
            &name,
            &dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            &url,
            &l2_prefix,
            l2_timeout_s,
            l2_lookup_wait_s,
            l2_connections,
            l2_secret_file.as_deref(),
        ),
        Cmd::ServeChild {
            name,
            dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            backend,
            cuda_zero_copy_ctas,
            chunk_tokens,
            http,
            disk,
            disk_bytes,
            ..
        } => peers::serve_child(
            &name,
            &dir,
            spin_us,
            pool_mib,
            copy_threads,
            prefault,
            &backend,
            cuda_zero_copy_ctas,
            chunk_tokens,
            http.as_deref(),
            disk.map(|d| (d, disk_bytes)),
        ),
    }
}
