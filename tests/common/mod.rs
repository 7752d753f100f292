//! Shared test harness: unique names and runtime directories, the real
//! `kvring` binary as the server, child client processes (this test binary
//! re-executed), and a watchdog so a hang fails fast; [`Fixture`] puts the
//! four together. Also the KV helpers several test files use: layouts,
//! prompts, waiting for a job's result, an [`Engine`] (a client with a
//! registered cache, host memory or GPU), a store-and-retrieve
//! [`round_trip`], and the [`Backend`]s the conformance suite runs against
//! ([`Host`], [`SimulatedDevices`], `Cuda`).
#![allow(dead_code)]

pub mod disk;
pub mod tier;
pub mod valkey;

use kvring::jobs::{JobResult, JobStatus};
use kvring::kv::pattern::KvMemory;
use kvring::kv::{
    chunk_hashes, model_id, pattern, ChunkHash, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset,
};
use kvring::proto::kv::BackendKind;
use kvring::proto::Status;
use kvring::{
    Client, Error, HostKvCache, Job, KvSpec, Lease, Lookup, Registration, Retrieve, Store,
};

#[cfg(feature = "cuda")]
use kvring::client::cuda_cache::{CudaKvCache, Export};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The `kvring` binary: `$KVRING_BIN` when set (test binaries copied to
/// another machine), else the one Cargo built.
pub fn kvring_bin() -> PathBuf {
    std::env::var_os("KVRING_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvring")))
}

/// Aborts the whole test process if the calling test runs past `limit`.
pub struct Watchdog(std::sync::mpsc::Sender<()>);

pub fn watchdog(limit: Duration) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let name = std::thread::current().name().unwrap_or("test").to_string();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("watchdog: {name} ran past {limit:?}; aborting");
            std::process::abort();
        }
    });
    Watchdog(tx)
}

/// A unique server name and a private runtime directory, removed on drop.
pub struct Scope {
    pub name: String,
    pub dir: PathBuf,
}

impl Scope {
    pub fn new(tag: &str) -> Scope {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("t-{tag}-{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(format!("kvring-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        Scope { name, dir }
    }

    pub fn shm_name(&self) -> String {
        kvring::rundir::shm_name(&self.name)
    }

    /// Starts the real server binary for this scope.
    pub fn server(&self, extra: &[&str]) -> ServerProc {
        let child = Command::new(kvring_bin())
            .args(["serve", "--name", &self.name, "--runtime-dir"])
            .arg(&self.dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvring serve");
        let p = ServerProc { child: Some(child) };
        self.wait_ready();
        p
    }

    /// Runs `kvring serve` for this scope to completion (for start-up
    /// failures) and returns its output.
    pub fn serve_output(&self) -> std::process::Output {
        Command::new(kvring_bin())
            .args(["serve", "--name", &self.name, "--runtime-dir"])
            .arg(&self.dir)
            .output()
            .expect("run kvring serve")
    }

    /// Waits until the server's segment is published and its socket exists.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let sock = self.dir.join(format!("{}.sock", self.name));
        loop {
            if sock.exists() {
                if let Ok(s) = kvring::segment::ReadOnlySegment::open(&self.name) {
                    if s.server_alive().unwrap_or(false) {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "server {} did not come up",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn client(&self) -> Client {
        self.client_builder().connect().expect("connect")
    }

    /// A builder for a client of this scope's server (to set options).
    pub fn client_builder(&self) -> kvring::ClientBuilder {
        Client::builder(&self.name).runtime_dir(&self.dir)
    }

    /// Starts this test binary again as a child client process running
    /// `role` (see `child_main`). Its stdout is piped so the parent can wait
    /// for its "ready" line.
    pub fn child(&self, test_name: &str, role: &str) -> ChildProc {
        let child = Command::new(std::env::current_exe().unwrap())
            // --include-ignored: the parent may be an ignored test (GPU).
            .args([
                test_name,
                "--exact",
                "--nocapture",
                "--test-threads=1",
                "--include-ignored",
            ])
            .env("KVRING_CHILD_ROLE", role)
            .env("KVRING_CHILD_NAME", &self.name)
            .env("KVRING_CHILD_DIR", &self.dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        ChildProc { child }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let _ = nix::sys::mman::shm_unlink(self.shm_name().as_str());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server process; SIGKILLed on drop if still running.
pub struct ServerProc {
    pub child: Option<Child>,
}

impl ServerProc {
    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }
    pub fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }
    /// SIGSTOP, and wait until the kernel reports the process stopped.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
            let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
            if state == 'T' || state == 't' {
                return;
            }
            assert!(Instant::now() < deadline, "server did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    /// SIGTERM and wait for a clean exit; returns the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let mut c = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "server did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_ref() {
            // SAFETY: resume a possibly stopped child so the kill is reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
        }
        self.kill();
    }
}

/// A child client process.
pub struct ChildProc {
    pub child: Child,
}

impl ChildProc {
    /// Waits for the child to print `prefix`; returns the rest of that line
    /// from `prefix` on (the harness may have printed on the same line).
    pub fn expect_line(&mut self, prefix: &str) -> String {
        use std::io::BufRead;
        let out = self.child.stdout.as_mut().unwrap();
        let mut r = std::io::BufReader::new(out);
        let mut line = String::new();
        loop {
            line.clear();
            let n = r.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited before printing {prefix:?}");
            if let Some(at) = line.find(prefix) {
                return line[at..].trim().to_string();
            }
        }
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The role this process plays when started by `Scope::child`, if any.
pub fn child_role() -> Option<(String, String, PathBuf)> {
    let role = std::env::var("KVRING_CHILD_ROLE").ok()?;
    let name = std::env::var("KVRING_CHILD_NAME").unwrap();
    let dir = PathBuf::from(std::env::var("KVRING_CHILD_DIR").unwrap());
    Some((role, name, dir))
}

/// Tells the parent something from a child process. Written to the stdout
/// descriptor directly: the test harness captures `println!`.
pub fn tell_parent(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

/// Polls `f` until it returns true or `limit` passes; returns the time taken.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// A test with a server: a unique scope, the `kvring` binary serving it,
/// and a watchdog. Dereferences to its [`Scope`] (`f.client()`,
/// `f.child(..)`); `srv` is the server process (kill it, restart it).
pub struct Fixture {
    /// Declared first: the server goes before its scope's directory.
    pub srv: ServerProc,
    pub scope: Scope,
    _dog: Watchdog,
}

impl Fixture {
    /// Starts a server named after `tag` with `server_args`; the whole test
    /// process aborts if the test runs past `limit`.
    pub fn new(tag: &str, limit: Duration, server_args: &[&str]) -> Fixture {
        let dog = watchdog(limit);
        let scope = Scope::new(tag);
        let srv = scope.server(server_args);
        Fixture {
            srv,
            scope,
            _dog: dog,
        }
    }

    /// Starts a new server for this scope (after the old one was killed).
    pub fn restart(&mut self, server_args: &[&str]) {
        self.srv = self.scope.server(server_args);
    }
}

impl std::ops::Deref for Fixture {
    type Target = Scope;
    fn deref(&self) -> &Scope {
        &self.scope
    }
}

/// The chunk size (tokens) the KV tests run their servers with.
pub const CHUNK: u32 = 64;

/// Server arguments of the KV tests: 64-token chunks, a 64 MiB pool, two
/// copy workers.
pub const KV_SERVER_ARGS: [&str; 6] = [
    "--chunk-tokens",
    "64",
    "--pool-bytes",
    "64MiB",
    "--copy-threads",
    "2",
];

/// Twenty seconds from now: a deadline no healthy wait reaches.
pub fn far() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// The element type of `elem_bytes`-byte elements.
pub fn dtype(elem_bytes: u32) -> Dtype {
    match elem_bytes {
        1 => Dtype::Fp8,
        2 => Dtype::Bf16,
        4 => Dtype::F32,
        n => panic!("no {n}-byte element type"),
    }
}

/// A 3-layer cache in the layout `preset`, 16-token blocks, 2 heads of
/// `head_dim` `elem_bytes`-byte elements; for [`LayoutPreset::Mla`], an MLA
/// latent of `head_dim` elements.
pub fn kv_layout(preset: LayoutPreset, elem_bytes: u32, blocks: u32, head_dim: u32) -> KvLayout {
    let shape = KvShape {
        layers: 3,
        blocks,
        block_tokens: 16,
        heads: 2,
        head_dim,
    };
    let g = if preset == LayoutPreset::Mla {
        KvGeometry::mla(3, blocks, 16, head_dim, dtype(elem_bytes))
    } else {
        KvGeometry::mha(shape, dtype(elem_bytes))
    };
    KvLayout::preset(preset, g).unwrap()
}

/// An MLA cache (3 layers, 16-token blocks, a latent of `width`
/// `elem_bytes`-byte elements) in `preset`, one of the one-buffer layouts
/// (vLLM 0.33+) or [`LayoutPreset::Mla`] (earlier).
pub fn mla_layout(preset: LayoutPreset, elem_bytes: u32, blocks: u32, width: u32) -> KvLayout {
    KvLayout::preset(
        preset,
        KvGeometry::mla(3, blocks, 16, width, dtype(elem_bytes)),
    )
    .unwrap()
}

/// A small cache in vLLM's default layout (2 layers, 64 blocks of 16
/// tokens, 2 heads of 32 two-byte elements: 32 KiB per 64-token chunk
/// object).
pub fn small_layout() -> KvLayout {
    let shape = KvShape {
        layers: 2,
        blocks: 64,
        block_tokens: 16,
        heads: 2,
        head_dim: 32,
    };
    KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16)).unwrap()
}

/// `tokens` tokens of a prompt determined by `seed`.
pub fn prompt(seed: u32, tokens: usize) -> Vec<u32> {
    (0..tokens as u32)
        .map(|i| i.wrapping_mul(2654435761) ^ seed)
        .collect()
}

/// Waits (20 s at most) for a job that must end `Done` and returns its
/// result; the job is released when the handle drops here.
pub fn done(job: Job) -> JobResult {
    match job.wait(far()).unwrap() {
        JobStatus::Done(r) => r,
        other => panic!("{}: {other:?}", job.id()),
    }
}

/// The model the KV tests store under.
pub const MODEL: &str = "test-model";

/// A LOOKUP of `hashes` under [`MODEL`]; checks that every chunk was looked
/// at.
pub fn lookup(c: &mut Client, world: u32, salt: u64, hashes: &[ChunkHash]) -> Lease {
    let lease = c
        .lookup(Lookup::new(model_id(MODEL), world, hashes).salt(salt))
        .unwrap();
    assert_eq!(lease.result().aux, hashes.len() as u64);
    lease
}

/// A KV cache an engine owns, as the tests drive it: the host cache or a
/// GPU one (its bytes read and written through [`KvMemory`]).
pub trait EngineCache: KvMemory + Send {
    /// Sets every byte of the cache to `byte`.
    fn poison(&self, byte: u8);
    /// Registers the cache with `c`'s server under `spec`.
    fn register_with(&self, c: &mut Client, spec: &KvSpec) -> kvring::Result<Registration>;
}

impl EngineCache for HostKvCache {
    fn poison(&self, byte: u8) {
        self.fill(byte)
    }
    fn register_with(&self, c: &mut Client, spec: &KvSpec) -> kvring::Result<Registration> {
        c.register_host(spec, self)
    }
}

#[cfg(feature = "cuda")]
impl EngineCache for CudaKvCache {
    fn poison(&self, byte: u8) {
        self.fill(byte).expect("fill a device cache")
    }
    fn register_with(&self, c: &mut Client, spec: &KvSpec) -> kvring::Result<Registration> {
        c.register_cuda(spec, self)
    }
}

/// One engine worker: a client, a KV cache (host memory unless said
/// otherwise), its registration.
pub struct Engine<C: EngineCache = HostKvCache> {
    // The registration goes before its cache.
    pub inst: Registration,
    pub c: Client,
    pub cache: C,
    pub rank: u32,
}

impl Engine {
    /// A worker of [`MODEL`] with a host cache.
    pub fn new(s: &Scope, l: KvLayout, world: u32, rank: u32) -> Engine {
        Self::of_model(s, MODEL, l, world, rank)
    }

    pub fn of_model(s: &Scope, model: &str, l: KvLayout, world: u32, rank: u32) -> Engine {
        let cache = HostKvCache::new(l.clone(), CHUNK).unwrap();
        Engine::with_cache(s, cache, &KvSpec::new(model_id(model), world, rank))
    }
}

impl<C: EngineCache> Engine<C> {
    /// A worker with its own client, registering `cache` under `spec`.
    pub fn with_cache(s: &Scope, cache: C, spec: &KvSpec) -> Engine<C> {
        let mut c = s.client();
        let inst = cache.register_with(&mut c, spec).unwrap();
        Engine {
            c,
            cache,
            inst,
            rank: spec.rank,
        }
    }

    /// The content id of this rank's objects (MLA ranks share one).
    pub fn content(&self) -> u32 {
        if self.cache.kv_layout().geometry().shared() {
            u32::MAX
        } else {
            self.rank
        }
    }

    pub fn bpc(&self) -> u32 {
        self.inst.blocks_per_chunk()
    }

    /// Blocks for chunk `i`, spread over the cache in a scrambled order.
    pub fn blocks(&self, first_block: u32, n_chunks: usize) -> Vec<u32> {
        let nb = self.cache.kv_layout().geometry().blocks;
        (0..n_chunks as u32 * self.bpc())
            .map(|k| (first_block + k * 7) % nb)
            .collect()
    }

    pub fn write(&self, hashes: &[ChunkHash], blocks: &[u32]) {
        let bpc = self.bpc() as usize;
        for (h, b) in hashes.iter().zip(blocks.chunks(bpc)) {
            pattern::write_chunk(&self.cache, self.content(), h, b);
        }
    }

    /// Stores and waits for the result.
    pub fn store(&mut self, salt: u64, hashes: &[ChunkHash], blocks: &[u32]) -> JobResult {
        done(
            self.c
                .store(Store::new(&self.inst, hashes, blocks).salt(salt))
                .unwrap(),
        )
    }

    pub fn verify(&self, hashes: &[ChunkHash], blocks: &[u32], skip_blocks: u32, poison: u8) {
        let bpc = self.bpc() as usize;
        let mut skip = skip_blocks;
        for (i, (h, b)) in hashes.iter().zip(blocks.chunks(bpc)).enumerate() {
            let s = skip.min(bpc as u32);
            skip -= s;
            if let Err(e) = pattern::verify_chunk(&self.cache, self.content(), h, b, s, poison) {
                panic!("chunk {i}: {e}");
            }
        }
    }
}

/// Four chunks of a prompt of `seed` stored from a cache of `l` and
/// retrieved twice into a poisoned cache of another registration, byte for
/// byte: whole, then skipping the first block (which keeps its poison).
/// Both caches come from `new_cache`; both registrations and leases are
/// gone at the end.
pub fn round_trip<C: EngineCache>(
    s: &Scope,
    sched: &mut Client,
    l: KvLayout,
    new_cache: impl Fn() -> C,
    seed: u32,
) {
    let spec = KvSpec::new(model_id(MODEL), 1, 0);
    let mut a = Engine::with_cache(s, new_cache(), &spec);
    a.cache.poison(0x3c);
    let tokens = prompt(seed, 4 * CHUNK as usize + 10);
    let hashes = chunk_hashes(&tokens, CHUNK);
    assert_eq!(hashes.len(), 4);
    let blocks = a.blocks(3, 4);
    a.write(&hashes, &blocks);
    let r = a.store(0, &hashes, &blocks);
    assert_eq!((r.value, r.aux), (4, 0), "{l:?}");
    let lease = lookup(sched, 1, 0, &hashes);
    assert_eq!(lease.hits(), 4, "{l:?}");
    // A fresh, poisoned cache of another engine process of the same model:
    // the chunks land in other blocks, byte for byte.
    let mut b = Engine::with_cache(s, new_cache(), &spec);
    b.cache.poison(0xa5);
    let dst = b.blocks(11, 4);
    let r = done(b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst)).unwrap());
    assert_eq!(r.value, 4, "{l:?}");
    assert_eq!(r.aux, 4 * l.object_bytes(CHUNK), "{l:?}");
    b.verify(&hashes, &dst, 0, 0xa5);
    // Consumed by its retrieve: nothing left to end.
    let _ = lease.into_id();
    // Again, skipping the first 16-token block of the first chunk.
    b.cache.poison(0xa5);
    let lease = lookup(sched, 1, 0, &hashes);
    assert_eq!(lease.hits(), 4, "{l:?}");
    let r = done(
        b.c.retrieve(Retrieve::new(&b.inst, &lease, &dst).skip_tokens(16))
            .unwrap(),
    );
    assert_eq!(r.value, 4, "{l:?}");
    b.verify(&hashes, &dst, 16 / l.geometry().block_tokens, 0xa5);
    let _ = lease.into_id();
    a.c.unregister(a.inst).unwrap();
    b.c.unregister(b.inst).unwrap();
}

/// Fails unless `r` is the server's refusal with `st`.
pub fn expect_status<T: std::fmt::Debug>(r: kvring::Result<T>, st: Status) {
    match r {
        Err(Error::Status(s)) if s == st => {}
        other => panic!("expected {st:?}, got {other:?}"),
    }
}

/// The hashes of a `chunks`-chunk prompt of `seed`.
pub fn prompt_hashes(seed: u32, chunks: usize) -> Vec<ChunkHash> {
    chunk_hashes(&prompt(seed, chunks * CHUNK as usize), CHUNK)
}

/// Fails the test if any job of the segment is still pending
/// or running.
#[allow(dead_code)]
pub fn assert_no_unfinished_jobs(ro: &kvring::segment::ReadOnlySegment) {
    let left = unfinished_jobs(ro);
    assert!(
        left.is_empty(),
        "job slots left pending or running: {left:?}"
    );
}

/// The job slots of `ro` whose job is pending or running.
#[allow(dead_code)]
pub fn unfinished_jobs(ro: &kvring::segment::ReadOnlySegment) -> Vec<u32> {
    use kvring::jobs::JobState;
    let reader = ro.view().job_reader();
    (0..ro.view().info().geometry.job_slots)
        .filter(|&index| {
            reader.snapshot(index).ok().flatten().is_some_and(|snap| {
                matches!(
                    JobState::decode(snap.status.state).ok(),
                    Some(JobState::Pending | JobState::Running)
                )
            })
        })
        .collect()
}

/// Why the GPU tests are ignored by default, and what one run with
/// `--include-ignored` says where there is no usable GPU.
pub const NEEDS_GPU: &str = "needs an NVIDIA GPU (run with --include-ignored on a GPU machine)";

/// A copy backend of the server together with the engine caches it serves:
/// what the conformance suite (`tests/conformance.rs`) is generic over.
pub trait Backend {
    /// The engines' KV cache.
    type Cache: EngineCache;
    /// What GET_CONFIG reports as the server's backend.
    const KIND: BackendKind;
    /// Head size of the scenarios' layouts (rows of `2 * HEAD_DIM`
    /// elements).
    const HEAD_DIM: u32;
    /// The pool of a server under no memory pressure.
    const POOL: &'static str;

    /// Whether this machine can run the backend; why not, if it cannot.
    fn available() -> Result<(), String>;
    /// `kvring serve` arguments: 64-token chunks, a pool of `pool`.
    fn server_args(pool: &str) -> Vec<String>;
    /// A cache of `l` on device `device` (an index: which device of the
    /// server's the engine runs on).
    fn new_cache(l: KvLayout, device: u32) -> Self::Cache;
    /// `spec` for an engine on device `device`.
    fn on_device(spec: KvSpec, device: u32) -> KvSpec;

    /// A server of this backend with a pool of `pool` (failing the test,
    /// saying why, if the machine cannot run the backend).
    fn fixture(tag: &str, limit: Duration, pool: &str) -> Fixture {
        if let Err(why) = Self::available() {
            panic!("{why}");
        }
        let args = Self::server_args(pool);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Fixture::new(tag, limit, &args)
    }

    /// A worker of [`MODEL`] with a fresh cache of `l` on device `device`.
    fn engine(s: &Scope, l: KvLayout, world: u32, rank: u32, device: u32) -> Engine<Self::Cache> {
        let spec = Self::on_device(KvSpec::new(model_id(MODEL), world, rank), device);
        Engine::with_cache(s, Self::new_cache(l, device), &spec)
    }
}

/// The host backend: host-memory caches, copies by the server's workers.
pub struct Host;

fn host_args(pool: &str) -> Vec<String> {
    [
        "--backend",
        "host",
        "--chunk-tokens",
        "64",
        "--pool-bytes",
        pool,
        "--copy-threads",
        "2",
    ]
    .map(String::from)
    .to_vec()
}

impl Backend for Host {
    type Cache = HostKvCache;
    const KIND: BackendKind = BackendKind::Host;
    const HEAD_DIM: u32 = 24;
    const POOL: &'static str = "64MiB";

    fn available() -> Result<(), String> {
        Ok(())
    }
    fn server_args(pool: &str) -> Vec<String> {
        host_args(pool)
    }
    fn new_cache(l: KvLayout, _device: u32) -> HostKvCache {
        HostKvCache::new(l.clone(), CHUNK).unwrap()
    }
    fn on_device(spec: KvSpec, _device: u32) -> KvSpec {
        spec
    }
}

/// The UUID of a host-backend server's simulated device `i`.
pub fn simulated_device_uuid(i: u32) -> kvring::DeviceUuid {
    kvring_server::simulated_device_uuid(i)
}

/// The host backend with two simulated devices (`--simulated-devices 2`):
/// host caches whose engines say which device they run on, each device
/// with its own copy lane, as a CUDA server has per GPU.
pub struct SimulatedDevices;

impl Backend for SimulatedDevices {
    type Cache = HostKvCache;
    const KIND: BackendKind = Host::KIND;
    const HEAD_DIM: u32 = Host::HEAD_DIM;
    const POOL: &'static str = Host::POOL;

    fn available() -> Result<(), String> {
        Host::available()
    }
    fn server_args(pool: &str) -> Vec<String> {
        let mut args = Host::server_args(pool);
        args.extend(["--simulated-devices", "2"].map(String::from));
        args
    }
    fn new_cache(l: KvLayout, device: u32) -> HostKvCache {
        Host::new_cache(l, device)
    }
    fn on_device(spec: KvSpec, device: u32) -> KvSpec {
        spec.on_device(simulated_device_uuid(device))
    }
}

/// The CUDA backend: caches in GPU memory (exported by IPC handle), copies
/// by the server's CUDA streams. Device `i` is GPU `i` where the machine
/// has it, else GPU 0.
#[cfg(feature = "cuda")]
pub struct Cuda;

#[cfg(feature = "cuda")]
impl Backend for Cuda {
    type Cache = CudaKvCache;
    const KIND: BackendKind = BackendKind::Cuda;
    /// 80-byte rows at one-byte elements: not a multiple of 16, so the
    /// bytewise copy path runs too.
    const HEAD_DIM: u32 = 40;
    const POOL: &'static str = "512MiB";

    fn available() -> Result<(), String> {
        match kvring::gpu::probe() {
            Ok(d) => {
                eprintln!("GPU: {} ({} devices)", d[0].name, d.len());
                Ok(())
            }
            Err(e) => Err(format!("{NEEDS_GPU}: no usable GPU: {e}")),
        }
    }
    fn server_args(pool: &str) -> Vec<String> {
        [
            "--backend",
            "cuda",
            "--chunk-tokens",
            "64",
            "--pool-bytes",
            pool,
        ]
        .map(String::from)
        .to_vec()
    }
    fn new_cache(l: KvLayout, device: u32) -> CudaKvCache {
        static GPUS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        let gpus = *GPUS.get_or_init(|| kvring::gpu::probe().map_or(1, |d| d.len() as u32));
        let ordinal = if device < gpus { device } else { 0 };
        CudaKvCache::new(l.clone(), CHUNK, ordinal as i32, Export::Ipc).unwrap()
    }
    /// (The device is the cache's.)
    fn on_device(spec: KvSpec, _device: u32) -> KvSpec {
        spec
    }
}

/// A port free now on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends the raw HTTP request `raw` to loopback `port`; the status code
/// and the body.
pub fn http_exchange(port: u16, raw: &[u8]) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(raw).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

/// `GET path` from loopback `port`: the status code and the body.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    http_exchange(
        port,
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
    )
}

/// `/healthz`'s code, its reasons' kinds, and the whole answer.
pub fn health(port: u16) -> (u16, Vec<String>, serde_json::Value) {
    let (code, body) = http_get(port, "/healthz");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{body}"));
    let kinds = v["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kind"].as_str().unwrap().to_string())
        .collect();
    (code, kinds, v)
}

/// A server with its HTTP endpoint on a free loopback port and a 64 MiB
/// pool, plus `extra` arguments. Its admin token is known to
/// [`admin_header`] by the port.
pub fn server_with_http(tag: &str, extra: &[&str]) -> (Fixture, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec!["--http", addr.as_str(), "--pool-bytes", "64MiB"];
    args.extend_from_slice(extra);
    let f = Fixture::new(tag, Duration::from_secs(90), &args);
    remember_token(port, &f);
    (f, port)
}

/// The admin token file of `s`'s server (written at its start, 0600).
pub fn admin_token_path(s: &Scope) -> PathBuf {
    kvring::rundir::ServerPaths::in_dir(&s.name, &s.dir)
        .unwrap()
        .admin_token
}

/// The admin token of `s`'s server, read from its file.
pub fn admin_token(s: &Scope) -> String {
    let p = admin_token_path(s);
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("read the admin token {}: {e}", p.display()))
        .trim()
        .to_string()
}

/// The admin token files of the servers whose HTTP endpoint listens on a
/// port, by port.
static TOKENS: std::sync::Mutex<Vec<(u16, PathBuf)>> = std::sync::Mutex::new(Vec::new());

/// Remembers that `s`'s server answers HTTP on `port` (for [`admin_header`]).
pub fn remember_token(port: u16, s: &Scope) {
    let mut t = TOKENS.lock().unwrap_or_else(|e| e.into_inner());
    t.retain(|(p, _)| *p != port);
    t.push((port, admin_token_path(s)));
}

/// The `Authorization` header line (with its CRLF) an admin call to the
/// server on `port` carries: its token, read from the server's file now.
pub fn admin_header(port: u16) -> String {
    let path = TOKENS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(p, _)| *p == port)
        .map(|(_, path)| path.clone())
        .unwrap_or_else(|| panic!("no server of this test answers HTTP on port {port}"));
    let token = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read the admin token {}: {e}", path.display()));
    format!("Authorization: Bearer {}\r\n", token.trim())
}

/// `GET path` with the admin token of the server on `port`.
pub fn admin_get(port: u16, path: &str) -> (u16, String) {
    http_exchange(
        port,
        format!("GET {path} HTTP/1.1\r\n{}\r\n", admin_header(port)).as_bytes(),
    )
}

/// `POST path` (no body) with the admin token of the server on `port`.
pub fn admin_post(port: u16, path: &str) -> (u16, String) {
    http_exchange(
        port,
        format!("POST {path} HTTP/1.1\r\n{}\r\n", admin_header(port)).as_bytes(),
    )
}

/// Raises this process's soft limit on open descriptors to at least `n`
/// (up to its hard limit); the limit that applies.
pub fn raise_open_files(n: u64) -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft >= n {
        return soft;
    }
    let want = n.min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, want, hard).unwrap();
    want
}
