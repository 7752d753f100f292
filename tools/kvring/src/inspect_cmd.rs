//! `kvring-inspect`: a read-only live and post-mortem view of every ring,
//! client and job of a kvring segment. It maps the segment PROT_READ through
//! a read-only descriptor, never writes, and never takes a lock the server
//! could wait on, so it answers while the server is wedged and after it died.

use clap::{Parser, Subcommand};
use kvring::inspect::{self, Snapshot, Thresholds};
use kvring::segment::ReadOnlySegment;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "kvring-inspect",
    version,
    about = "Read-only view of kvring segments: servers, clients, rings, jobs, counters"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every kvring segment of this user: server pid, alive or dead (proven
    /// by its liveness lock), epoch, clients, age.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One segment in full: server, clients and their rings, jobs, per-
    /// operation counters and latency, pool, anomalies.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
        /// Two readings this far apart show rings that stopped moving.
        #[arg(long, default_value_t = 200)]
        sample_ms: u64,
        #[command(flatten)]
        checks: Checks,
    },
    /// The segment's counters and histograms as Prometheus metrics
    /// (OpenMetrics text): for a textfile collector, or a dead server's last
    /// counters.
    Metrics {
        name: String,
        /// Two readings this far apart show rings that stopped moving
        /// (`kvring_anomalies`).
        #[arg(long, default_value_t = 200)]
        sample_ms: u64,
        #[command(flatten)]
        checks: Checks,
    },
    /// The job table: one row per slot that holds a job.
    Jobs {
        name: String,
        /// Only jobs in this state (pending, running, done, failed,
        /// tombstoned). Without it, tombstones are left out.
        #[arg(long)]
        state: Option<String>,
        /// Only jobs of this client slot.
        #[arg(long)]
        client: Option<u32>,
        /// Include tombstones.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// A live view refreshing several times a second, with rates and
    /// anomalies highlighted; `q` quits.
    Watch {
        name: String,
        #[arg(long, default_value_t = 250)]
        interval_ms: u64,
        #[command(flatten)]
        checks: Checks,
    },
}

/// The bounds of the checks that flag what has stopped.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Checks {
    /// Flag jobs unfinished for longer than this (seconds).
    #[arg(long, default_value_t = 10.0)]
    job_age_s: f64,
    /// Flag a copy worker with work that made no step for longer than this
    /// (seconds).
    #[arg(long, default_value_t = kvring::inspect::DEFAULT_LANE_STALL_S)]
    lane_stall_s: f64,
}

impl From<Checks> for Thresholds {
    fn from(c: Checks) -> Thresholds {
        Thresholds {
            job_age_s: c.job_age_s,
            lane_stall_s: c.lane_stall_s,
        }
    }
}

fn open(name: &str) -> kvring::Result<ReadOnlySegment> {
    ReadOnlySegment::open(name)
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string(v).expect("serializable"));
}

/// Runs `kvring-inspect` with `args` (the first is the program's name).
pub fn main(args: Vec<std::ffi::OsString>) -> ExitCode {
    let cli = match crate::parse::<Cli>(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvring-inspect: {e}");
            ExitCode::FAILURE
        }
    }
}

fn two_readings(seg: &ReadOnlySegment, th: Thresholds, gap: Duration) -> Snapshot {
    let first = inspect::snapshot(seg, th);
    std::thread::sleep(gap);
    let mut second = inspect::snapshot(seg, th);
    inspect::compare(&first, &mut second);
    second
}

/// Two readings of segment `name`, `sample_ms` apart, with the checks'
/// bounds.
fn reading(name: &str, sample_ms: u64, checks: Checks) -> kvring::Result<Snapshot> {
    let seg = open(name)?;
    Ok(two_readings(
        &seg,
        checks.into(),
        Duration::from_millis(sample_ms),
    ))
}

fn run(cli: Cli) -> kvring::Result<()> {
    match cli.cmd {
        Cmd::List { json } => {
            let entries = inspect::list();
            if json {
                print_json(&serde_json::json!({ "segments": entries }));
            } else {
                crate::render::list(&entries);
            }
        }
        Cmd::Show {
            name,
            json,
            sample_ms,
            checks,
        } => {
            let snap = reading(&name, sample_ms, checks)?;
            if json {
                print_json(&snap);
            } else {
                print!("{}", crate::render::show(&snap, None));
            }
        }
        Cmd::Metrics {
            name,
            sample_ms,
            checks,
        } => {
            let snap = reading(&name, sample_ms, checks)?;
            print!("{}", kvring_server::metrics::openmetrics(&snap));
        }
        Cmd::Jobs {
            name,
            state,
            client,
            all,
            json,
        } => {
            let seg = open(&name)?;
            let snap = inspect::snapshot(&seg, Thresholds::default());
            let rows: Vec<&inspect::JobRow> = snap
                .rows
                .iter()
                .filter(|r| match &state {
                    Some(s) => r.state == s.as_str(),
                    None => all || r.state != "tombstoned",
                })
                .filter(|r| client.is_none_or(|c| r.owner_slot == c))
                .collect();
            if json {
                print_json(&serde_json::json!({ "name": snap.name, "jobs": rows }));
            } else {
                print!("{}", crate::render::jobs(&rows));
            }
        }
        Cmd::Watch {
            name,
            interval_ms,
            checks,
        } => {
            let seg = open(&name)?;
            crate::render::watch(
                &seg,
                checks.into(),
                Duration::from_millis(interval_ms.max(50)),
            )
            .map_err(|source| kvring::Error::Io {
                context: "drive the terminal".into(),
                source,
            })?;
        }
    }
    Ok(())
}
