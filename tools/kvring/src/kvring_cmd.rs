//! `kvring`: the cache server and a few client commands.

use crate::target::Target;
use clap::{Parser, Subcommand};
use kvring::Client;
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "kvring",
    version,
    about = "Node-local KV-cache server and shared-memory IPC runtime"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process: the size of the server's options does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the cache server until SIGINT or SIGTERM.
    Serve(crate::serve::ServeArgs),
    /// Asks a server's HTTP endpoint whether it is healthy (GET /healthz)
    /// or, with --ready, ready (GET /readyz); prints the answer and exits 0
    /// on 200, 1 otherwise (a container's health check, an exec probe).
    Health {
        /// The endpoint's ADDR:PORT.
        #[arg(long, default_value = kvring_server::DEFAULT_HTTP_ADDR)]
        http: String,
        /// Ask for readiness instead.
        #[arg(long)]
        ready: bool,
        /// Connect and answer within this (seconds).
        #[arg(long, default_value = "5", value_parser = kvring_server::config::flags::seconds)]
        timeout_s: Duration,
    },
    /// Round-trip PING requests to a running server and print latency.
    Ping {
        #[command(flatten)]
        target: Target,
        /// Number of pings.
        #[arg(long, default_value_t = 1000)]
        count: u32,
        /// Payload bytes per ping.
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Per-ping timeout in milliseconds.
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
    },
    /// The whole job end to end: start a server, two tensor-parallel engine
    /// workers and a scheduler; store KV for prompts with shared prefixes,
    /// look them up, retrieve them into fresh caches and verify every byte.
    Demo {
        /// Also print the results as one JSON object (the last line).
        #[arg(long)]
        json: bool,
    },
    /// The ring inspector: `kvring inspect ARGS` is `kvring-inspect ARGS`
    /// (list, show NAME [--json], jobs NAME, watch NAME; see its --help).
    #[command(disable_help_flag = true)]
    Inspect {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// (internal) One engine worker of `kvring demo`.
    #[command(hide = true)]
    DemoWorker {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        rank: u32,
    },
    /// Run a delay job through the job table and print every state it is
    /// seen in (a health check of the job path): pending for --pending-ms,
    /// running for --running-ms, then done, or failed with --fail.
    DelayJob {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 100)]
        pending_ms: u64,
        #[arg(long, default_value_t = 100)]
        running_ms: u64,
        /// End the job failed (reason "requested") instead of done.
        #[arg(long)]
        fail: bool,
        /// Leave the job unreleased (it stays readable as done or failed).
        #[arg(long)]
        keep: bool,
    },
}

/// Prints a status the way the CLI shows it.
fn show(st: &kvring::jobs::JobStatus) -> String {
    use kvring::jobs::JobStatus::*;
    match st {
        Done(r) => format!("done (value {}, aux {})", r.value, r.aux),
        Failed(f) => format!("failed ({f})"),
        Tombstoned(Ok(r)) => format!("tombstoned (done: value {}, aux {})", r.value, r.aux),
        Tombstoned(Err(f)) => format!("tombstoned (failed: {f})"),
        other => other.name().to_string(),
    }
}

/// Runs `kvring` with `args` (the first is the program's name).
pub fn main(args: Vec<OsString>) -> ExitCode {
    let cli = match crate::parse::<Cli>(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // Logs go to stderr through `tracing`: warnings and errors by default,
    // more with RUST_LOG (e.g. RUST_LOG=kvring=debug). Already set when the
    // command runs a second time in one process.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    if let Cmd::Health {
        http,
        ready,
        timeout_s,
    } = &cli.cmd
    {
        return crate::health::run(http, *ready, *timeout_s);
    }
    if let Cmd::Inspect { args } = cli.cmd {
        let argv = std::iter::once(OsString::from("kvring inspect")).chain(args);
        return crate::inspect_cmd::main(argv.collect());
    }
    // How a child process (the demo's server and workers) runs this
    // binary again.
    let this = std::env::current_exe()
        .map(|p| vec![p.into_os_string()])
        .unwrap_or_else(|_| vec![OsString::from("kvring")]);
    match run(cli, this) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvring: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, this: Vec<OsString>) -> kvring::Result<()> {
    match cli.cmd {
        Cmd::Serve(args) => crate::serve::run(args),
        Cmd::Ping {
            target,
            count,
            size,
            timeout_ms,
        } => {
            let mut c = Client::builder(&target.name)
                .runtime_dir(target.dir())
                .connect()?;
            let payload: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
            let mut rtts = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let t = Instant::now();
                let back = c.ping(&payload, t + Duration::from_millis(timeout_ms))?;
                rtts.push(t.elapsed().as_nanos() as u64);
                if back != payload {
                    return Err(kvring::Error::Protocol(
                        "ping payload came back changed".into(),
                    ));
                }
            }
            rtts.sort_unstable();
            let pct = |p: f64| rtts[((rtts.len() as f64 - 1.0) * p) as usize];
            println!(
                "{} pings of {} bytes to {} (slot {}): p50 {} ns, p99 {} ns, max {} ns",
                count,
                size,
                target.name,
                c.slot(),
                pct(0.5),
                pct(0.99),
                rtts.last().copied().unwrap_or(0)
            );
            Ok(())
        }
        Cmd::Demo { json } => crate::demo::run(json, &this),
        Cmd::Inspect { .. } | Cmd::Health { .. } => unreachable!("run by `main`"),
        Cmd::DemoWorker { target, rank } => crate::demo::worker(&target.name, &target.dir(), rank),
        Cmd::DelayJob {
            target,
            pending_ms,
            running_ms,
            fail,
            keep,
        } => {
            let mut c = Client::builder(&target.name)
                .runtime_dir(target.dir())
                .connect()?;
            let mut req = kvring::DelayJob::new(
                Duration::from_millis(pending_ms),
                Duration::from_millis(running_ms),
            )
            .progress_every(Duration::from_millis(1))
            .result(1, 0);
            if fail {
                req = req.fail(kvring::jobs::FailReason::Requested);
            }
            let start = Instant::now();
            // Released below by id (or kept, with --keep).
            let id = c.delay_job(req)?.into_id();
            println!("submitted {id}");
            let deadline = start + Duration::from_millis(pending_ms + running_ms + 10_000);
            let mut last = None;
            let st = loop {
                let st = c.job_status(id)?;
                if last != Some(st) {
                    println!(
                        "{:>9.3} ms  {}",
                        start.elapsed().as_secs_f64() * 1e3,
                        show(&st)
                    );
                    last = Some(st);
                }
                if st.is_terminal() {
                    break st;
                }
                if Instant::now() > deadline {
                    return Err(kvring::Error::Timeout(deadline - start));
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            if !keep {
                c.release_job(id)?;
                println!("released: {}", show(&c.job_status(id)?));
            }
            if fail != matches!(st, kvring::jobs::JobStatus::Failed(_)) {
                return Err(kvring::Error::Protocol(format!("job ended {}", show(&st))));
            }
            Ok(())
        }
    }
}
