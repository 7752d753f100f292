//! `ring`: the round trip of a 64-byte request and its response over every
//! transport, and one client's pipelined request rate, in interleaved rounds.
//!
//! Each round runs a block of every transport, in an order that rotates from
//! round to round, with a cache-line floor probe before the first block and
//! after every block. On a VM the two vCPUs move between placements (SMT
//! siblings, near cores, far cores) that change every shared-memory figure by
//! 2-3x, sometimes within seconds; a block whose two probes do not read the
//! run's usual floor was taken in another placement and is left out, and so
//! is one during which other processes took much of the machine (as long as
//! a quieter block of that transport remains). Every transport then has one
//! figure per round, taken next to the others, and its ratios to the floor
//! and to kvring are per round, with their spread.

use crate::iceoryx;
use crate::peers;
use crate::stats::{Spread, Summary};
use serde_json::{json, Map, Value};
use std::time::Instant;

/// Round trips per floor probe (fewer when the blocks are smaller).
const PROBE: usize = 20_000;

/// A block counts when both of its probes read within this factor of the
/// run's floor (the median of all probes): one placement's probes agree
/// within about 20%, the next placement is 2x away.
const PLACEMENT_TOLERANCE: f64 = 1.35;

/// The transport every ratio is taken against, besides the floor.
const KVRING: &str = "kvring_spin";

enum Run {
    /// Takes `n` round-trip samples (ns).
    Rtt(fn(usize) -> Vec<u64>),
    /// Pipelines `n` requests; millions of requests per second.
    Rate(fn(u64) -> f64),
}

struct Transport {
    name: &'static str,
    about: &'static str,
    /// Blocks on a syscall per message: ~100x slower, a quarter of the samples.
    blocking: bool,
    run: Run,
}

fn transports() -> Vec<Transport> {
    vec![
        Transport {
            name: KVRING,
            about: "kvring PING, client and server busy-polling",
            blocking: false,
            run: Run::Rtt(|n| peers::kvring_rtt(n, true)),
        },
        Transport {
            name: "kvring_futex",
            about: "kvring PING, server parked on its futex before every request",
            blocking: true,
            run: Run::Rtt(|n| peers::kvring_rtt(n, false)),
        },
        Transport {
            name: "uds",
            about: "Unix stream socket pair, blocking reads",
            blocking: true,
            run: Run::Rtt(peers::uds),
        },
        Transport {
            name: "zmq",
            about: "ZeroMQ DEALER/ROUTER over ipc://",
            blocking: true,
            run: Run::Rtt(peers::zmq),
        },
        Transport {
            name: "iceoryx2",
            about: "iceoryx2 publish-subscribe ping/pong, loaned samples, busy-polling",
            blocking: false,
            run: Run::Rtt(iceoryx::pubsub),
        },
        Transport {
            name: "iceoryx2_rr",
            about: "iceoryx2 request-response (RPC with per-request channel tracking), \
                    default QoS, send_copy, busy-polling",
            blocking: false,
            run: Run::Rtt(|n| iceoryx::request_response(n, false)),
        },
        Transport {
            name: "iceoryx2_rr_tuned",
            about: "iceoryx2 request-response, QoS for one client and one server, \
                    next request pre-loaned, reply written into a loan, busy-polling",
            blocking: false,
            run: Run::Rtt(|n| iceoryx::request_response(n, true)),
        },
        Transport {
            name: "kvring_pipelined",
            about: "one kvring client pipelining PINGs, up to 512 in flight (M requests/s)",
            blocking: false,
            run: Run::Rate(peers::kvring_pipelined),
        },
    ]
}

struct Block {
    round: usize,
    /// Round-trip samples (ns); none for a rate.
    samples: Vec<u64>,
    /// Round-trip p50 (ns), or the rate.
    value: f64,
    /// Floor probe p50s (ns) just before and just after.
    probes: (f64, f64),
    /// Other processes' share of all CPUs while the block ran (the kernel
    /// counts in ticks of 10 ms or so: coarse for a short block).
    other: Option<f64>,
    /// Times one of the block's processes lost its CPU to another task.
    preempted: u64,
}

/// CPU seconds the whole machine was busy (steal included: time a vCPU of
/// ours wanted and did not get), and what this process and its reaped
/// children used; their difference is other load.
struct CpuClock {
    wall: Instant,
    busy: Option<f64>,
    own: f64,
    preempted: u64,
}

impl CpuClock {
    fn now() -> CpuClock {
        let (own, preempted) = own_usage();
        CpuClock {
            wall: Instant::now(),
            busy: machine_busy_secs(),
            own,
            preempted,
        }
    }

    /// Share of all CPUs that other processes used since `self`.
    fn other_share(&self) -> Option<f64> {
        self.since().0
    }

    /// Other processes' share of all CPUs, and our preemptions, since `self`.
    fn since(&self) -> (Option<f64>, u64) {
        let now = CpuClock::now();
        let preempted = now.preempted - self.preempted;
        // SAFETY: sysconf has no memory effects.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as f64;
        let wall = (now.wall - self.wall).as_secs_f64();
        let share = match (now.busy, self.busy) {
            (Some(b1), Some(b0)) => {
                Some((((b1 - b0) - (now.own - self.own)) / (wall * cpus)).max(0.0))
            }
            _ => None,
        };
        (share, preempted)
    }
}

fn machine_busy_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let f: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // user nice system idle iowait irq softirq steal
    let busy = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| f.get(i).copied().unwrap_or(0.0))
        .sum::<f64>();
    // SAFETY: sysconf has no memory effects.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(busy / tick)
}

/// CPU seconds used by this process and its reaped children, and how many
/// times the scheduler took the CPU from one of them for another task.
fn own_usage() -> (f64, u64) {
    let usage = |who| {
        // SAFETY: a zeroed rusage is valid; getrusage fills it.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid, writable rusage.
        unsafe { libc::getrusage(who, &mut u) };
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        (tv(u.ru_utime) + tv(u.ru_stime), u.ru_nivcsw as u64)
    };
    let (a, b) = (usage(libc::RUSAGE_SELF), usage(libc::RUSAGE_CHILDREN));
    (a.0 + b.0, a.1 + b.1)
}

fn p50(v: &[u64]) -> f64 {
    Summary::of(v.to_vec()).p50 as f64
}

/// The build every peer is measured in: kvring, its server and the Rust
/// peers are compiled into this one binary, so they share one profile.
fn build() -> Value {
    json!({
        "profile": env!("KVRING_BENCH_PROFILE"),
        "opt_level": env!("KVRING_BENCH_OPT_LEVEL"),
        "debuginfo": env!("KVRING_BENCH_DEBUG"),
        "debug_assertions": cfg!(debug_assertions),
        "peers": "kvring, its server, iceoryx2 and the socket code are compiled into this \
                  binary under this profile; ZeroMQ is libzmq (C++), built from source by \
                  zeromq-src with this profile's opt level",
    })
}

/// Which blocks the figures come from: those taken in the usual placement
/// with little other load; failing that, those in the usual placement;
/// failing that, all.
const KEPT_BY: [&str; 3] = ["placement and load", "placement", "none"];

pub fn run(json_out: bool, iters: usize, pipelined: u64, rounds: usize, max_other_load: f64) {
    let rounds = rounds.max(1);
    let (client_cpu, server_cpu) = peers::cpus();
    let per_block = |total: usize| total.div_ceil(rounds).max(1);
    let (spin_n, block_n) = (per_block(iters), per_block(iters / 4));
    let rate_n = pipelined.div_ceil(rounds as u64).max(1);
    let probe_n = PROBE.min(spin_n);
    eprintln!(
        "pinning: client cpu {client_cpu:?}, server cpu {server_cpu:?}; {rounds} rounds of \
         {spin_n} round trips ({block_n} for blocking transports, {rate_n} pipelined), \
         floor probes of {probe_n}; after each block: [times preempted, other load]"
    );
    let timer = Summary::of(peers::timer_overhead(iters));
    let ts = transports();
    let mut blocks: Vec<Vec<Block>> = ts.iter().map(|_| Vec::new()).collect();
    // probes[round] = (p50, samples) of each probe in the order taken.
    let mut probes: Vec<Vec<(f64, Vec<u64>)>> = Vec::new();
    let mut other_load = Vec::new();
    for r in 0..rounds {
        let clock = CpuClock::now();
        let probe = || {
            let v = peers::floor(probe_n);
            (p50(&v), v)
        };
        let mut taken = vec![probe()];
        let mut line = format!("round {}/{rounds}: floor {:.0}", r + 1, taken[0].0);
        for k in 0..ts.len() {
            let i = (r + k) % ts.len();
            let t = &ts[i];
            let clock = CpuClock::now();
            let (samples, value) = match t.run {
                Run::Rtt(f) => {
                    let v = f(if t.blocking { block_n } else { spin_n });
                    let m = p50(&v);
                    (v, m)
                }
                Run::Rate(f) => (Vec::new(), f(rate_n)),
            };
            let (other, preempted) = clock.since();
            let before = taken[taken.len() - 1].0;
            taken.push(probe());
            let after = taken[taken.len() - 1].0;
            line += &format!(
                " | {} {value:.0} [{preempted} {:.0}%] | floor {after:.0}",
                t.name,
                other.unwrap_or(f64::NAN) * 100.0
            );
            blocks[i].push(Block {
                round: r,
                samples,
                value,
                probes: (before, after),
                other,
                preempted,
            });
        }
        let share = clock.other_share();
        if let Some(s) = share {
            line += &format!(" | other load {:.0}%", s * 100.0);
        }
        eprintln!("{line}");
        other_load.push(share);
        probes.push(taken);
    }

    // The run's floor, and which probes read it.
    let all: Vec<f64> = probes.iter().flatten().map(|p| p.0).collect();
    let floor = Spread::of(&all).expect("probes").median;
    let steady = |p: f64| p <= floor * PLACEMENT_TOLERANCE && p >= floor / PLACEMENT_TOLERANCE;
    let placed = |b: &Block| steady(b.probes.0) && steady(b.probes.1);
    let quiet = |b: &Block| b.other.is_none_or(|o| o <= max_other_load);
    // One filter for the whole run, so that every transport's figures and
    // ratios come from blocks that passed the same test: the strictest that
    // leaves every transport half its blocks, failing that one block.
    let tests: [&dyn Fn(&Block) -> bool; 3] = [&|b| placed(b) && quiet(b), &placed, &|_| true];
    let level = [rounds.div_ceil(2), 1]
        .iter()
        .find_map(|&need| {
            tests.iter().position(|test| {
                blocks
                    .iter()
                    .all(|bs| bs.iter().filter(|b| test(b)).count() >= need)
            })
        })
        .unwrap_or(tests.len() - 1);
    let chosen: Vec<(Vec<usize>, usize)> = blocks
        .iter()
        .map(|bs| {
            (
                (0..bs.len()).filter(|&i| tests[level](&bs[i])).collect(),
                level,
            )
        })
        .collect();
    // Per round: the median of its steady probes (of all, if none was).
    let round_floor: Vec<f64> = probes
        .iter()
        .map(|ps| {
            let s: Vec<f64> = ps.iter().map(|p| p.0).filter(|&p| steady(p)).collect();
            let s = if s.is_empty() {
                ps.iter().map(|p| p.0).collect()
            } else {
                s
            };
            Spread::of(&s).expect("probes").median
        })
        .collect();
    let kvring_idx = ts.iter().position(|t| t.name == KVRING).expect("kvring");
    let kvring_round: Vec<Option<f64>> = (0..rounds)
        .map(|r| {
            chosen[kvring_idx]
                .0
                .iter()
                .map(|&i| &blocks[kvring_idx][i])
                .find(|b| b.round == r)
                .map(|b| b.value)
        })
        .collect();

    let mut rows = Vec::new();
    // The floor: its steady probes.
    let floor_samples: Vec<u64> = probes
        .iter()
        .flatten()
        .filter(|p| steady(p.0))
        .flat_map(|p| p.1.iter().copied())
        .collect();
    let floor_over_kvring: Vec<f64> = (0..rounds)
        .filter_map(|r| kvring_round[r].map(|k| round_floor[r] / k))
        .collect();
    rows.push(Row {
        name: "floor",
        about: "cache-line ping-pong through shared atomics (the physical floor)",
        summary: Some(Summary::of(floor_samples)),
        rounds: round_floor.clone(),
        over_floor: Vec::new(),
        over_kvring: floor_over_kvring,
        kept: all.iter().filter(|&&p| steady(p)).count(),
        taken: all.len(),
        kept_by: KEPT_BY[1],
        other: Vec::new(),
        preempted: Vec::new(),
    });
    for ((t, bs), (idx, level)) in ts.iter().zip(&blocks).zip(&chosen) {
        let chosen: Vec<&Block> = idx.iter().map(|&i| &bs[i]).collect();
        let summary = match t.run {
            Run::Rtt(_) => Some(Summary::of(
                chosen
                    .iter()
                    .flat_map(|b| b.samples.iter().copied())
                    .collect(),
            )),
            Run::Rate(_) => None,
        };
        let (over_floor, over_kvring) = match t.run {
            Run::Rtt(_) => (
                chosen
                    .iter()
                    .map(|b| b.value / ((b.probes.0 + b.probes.1) / 2.0))
                    .collect(),
                chosen
                    .iter()
                    .filter_map(|b| kvring_round[b.round].map(|k| b.value / k))
                    .collect(),
            ),
            Run::Rate(_) => (Vec::new(), Vec::new()),
        };
        rows.push(Row {
            name: t.name,
            about: t.about,
            summary,
            rounds: chosen.iter().map(|b| b.value).collect(),
            over_floor,
            over_kvring,
            kept: chosen.len(),
            taken: bs.len(),
            kept_by: KEPT_BY[*level],
            other: chosen.iter().filter_map(|b| b.other).collect(),
            preempted: chosen.iter().map(|b| b.preempted as f64).collect(),
        });
    }

    eprintln!(
        "blocks kept by: {} (run floor p50 {floor:.0} ns, within {PLACEMENT_TOLERANCE}x; \
         other load at most {:.0}%)",
        KEPT_BY[level],
        max_other_load * 100.0
    );
    print_table(&rows);
    let row = |name: &str| rows.iter().find(|r| r.name == name).expect("row");
    let pooled = |name: &str| {
        row(name)
            .summary
            .as_ref()
            .map_or(f64::NAN, |s| s.p50 as f64)
    };
    let mut rtt = Map::new();
    let mut about = Map::new();
    let mut throughput = Map::new();
    for r in &rows {
        about.insert(r.name.into(), json!(r.about));
        match &r.summary {
            Some(s) => {
                let mut o = match s.to_json() {
                    Value::Object(m) => m,
                    _ => unreachable!("a summary is an object"),
                };
                o.insert("round_p50_ns".into(), spread_json(&r.rounds));
                o.insert("over_floor".into(), spread_json(&r.over_floor));
                o.insert("over_kvring_spin".into(), spread_json(&r.over_kvring));
                o.insert("blocks".into(), r.blocks_json());
                rtt.insert(r.name.into(), Value::Object(o));
            }
            None => {
                let s = Spread::of(&r.rounds).expect("one block per round");
                throughput.insert(r.name.into(), json!(s.median));
                throughput.insert(
                    format!("{}_rounds", r.name),
                    json!({ "min": s.min, "median": s.median, "max": s.max,
                            "blocks": r.blocks_json() }),
                );
            }
        }
    }
    let ratios = json!({
        "kvring_spin_over_floor": pooled(KVRING) / pooled("floor"),
        "kvring_futex_over_uds": pooled("kvring_futex") / pooled("uds"),
        "kvring_spin_over_iceoryx2": pooled(KVRING) / pooled("iceoryx2"),
        "kvring_spin_over_iceoryx2_rr": pooled(KVRING) / pooled("iceoryx2_rr"),
        "kvring_spin_over_iceoryx2_rr_tuned": pooled(KVRING) / pooled("iceoryx2_rr_tuned"),
        "kvring_spin_over_zmq": pooled(KVRING) / pooled("zmq"),
    });
    eprintln!("ratios (pooled p50): {ratios}");
    let probe_p50s: Vec<Vec<f64>> = probes
        .iter()
        .map(|ps| ps.iter().map(|p| p.0).collect())
        .collect();
    let out = json!({
        "bench": "ring",
        "payload_bytes": 64,
        "iterations": iters,
        "rounds": rounds,
        "block_round_trips": { "spinning": spin_n, "blocking": block_n, "floor_probe": probe_n },
        "build": build(),
        "pinned_cpus": { "client": client_cpu, "server": server_cpu },
        "timer_overhead_ns": timer.to_json(),
        "transports": about,
        "rtt_ns": rtt,
        "throughput_mps": throughput,
        "ratios": ratios,
        "placement": {
            "floor_p50_ns": floor,
            "tolerance": PLACEMENT_TOLERANCE,
            "max_other_cpu_share": max_other_load,
            "blocks_kept_by": KEPT_BY[level],
            "probe_p50_ns": probe_p50s,
        },
        "other_cpu_share": other_load,
    });
    if json_out {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
}

/// One transport's figures over the blocks that count.
struct Row {
    name: &'static str,
    about: &'static str,
    /// Round trips pooled over the blocks; None for a rate.
    summary: Option<Summary>,
    /// Per block: round-trip p50 (ns) or rate.
    rounds: Vec<f64>,
    over_floor: Vec<f64>,
    over_kvring: Vec<f64>,
    kept: usize,
    taken: usize,
    kept_by: &'static str,
    /// Of the kept blocks: other load, and preemptions.
    other: Vec<f64>,
    preempted: Vec<f64>,
}

impl Row {
    fn blocks_json(&self) -> Value {
        json!({
            "kept": self.kept,
            "taken": self.taken,
            "kept_by": self.kept_by,
            "other_cpu_share": spread_json(&self.other),
            "preemptions": spread_json(&self.preempted),
        })
    }
}

fn print_table(rows: &[Row]) {
    let spread = |v: &[f64], prec: usize| {
        Spread::of(v).map_or("-".to_string(), |s| {
            format!("{:.p$} ({:.p$}-{:.p$})", s.median, s.min, s.max, p = prec)
        })
    };
    eprintln!(
        "{:<18} {:>9} {:>9}  {:<26} {:<20} {:<20} {:>5}",
        "transport", "p50 ns", "p99 ns", "round p50 (min-max)", "x floor", "x kvring_spin", "kept"
    );
    for r in rows {
        let (p50, p99) = r.summary.as_ref().map_or(("-".into(), "-".into()), |s| {
            (s.p50.to_string(), s.p99.to_string())
        });
        let rounds = match r.summary {
            Some(_) => spread(&r.rounds, 0),
            None => format!("{} M req/s", spread(&r.rounds, 2)),
        };
        eprintln!(
            "{:<18} {:>9} {:>9}  {:<26} {:<20} {:<20} {:>2}/{}{}",
            r.name,
            p50,
            p99,
            rounds,
            spread(&r.over_floor, 2),
            spread(&r.over_kvring, 2),
            r.kept,
            r.taken,
            match r.kept_by {
                "placement and load" => "",
                "placement" => " (placement only)",
                _ => " (all: none in the usual placement)",
            }
        );
    }
}

fn spread_json(v: &[f64]) -> Value {
    Spread::of(v).map_or(Value::Null, |s| s.to_json())
}
