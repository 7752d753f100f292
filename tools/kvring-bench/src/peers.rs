//! The transports measured, each between this process and a forked child
//! (or, for kvring, a re-executed server). iceoryx2 is in `iceoryx.rs`.

use kvring::proto::Opcode;
use kvring::wait::WaitPolicy;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const WARMUP: usize = 10_000;
const PAYLOAD: [u8; 64] = [0x5a; 64];

/// (client cpu, server cpu), or None each when the machine has one CPU.
/// Decided once, before anything is pinned (pinning shrinks what
/// `available_parallelism` reports).
pub fn cpus() -> (Option<usize>, Option<usize>) {
    static CPUS: std::sync::OnceLock<(Option<usize>, Option<usize>)> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| {
        let n = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if n >= 2 {
            (Some(0), Some(1))
        } else {
            (None, None)
        }
    })
}

pub fn pin(cpu: Option<usize>) {
    let Some(cpu) = cpu else { return };
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it;
    // sched_setaffinity reads it for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!("warning: could not pin to cpu {cpu}");
        }
    }
}

/// Runs `f` in a forked child pinned to the server CPU; the child exits when
/// `f` returns. Must be called while this process has a single thread.
pub fn fork_child(f: impl FnOnce()) -> libc::pid_t {
    // SAFETY: the benchmark forks only while single-threaded, so the child
    // inherits no lock held by another thread.
    match unsafe { libc::fork() } {
        0 => {
            pin(cpus().1);
            f();
            // SAFETY: leave the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(0) }
        }
        -1 => panic!("fork failed: {}", std::io::Error::last_os_error()),
        pid => pid,
    }
}

pub fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
}

/// Times `iters` calls of `f` after a warm-up; one clock read per sample.
pub fn sample(iters: usize, mut f: impl FnMut()) -> Vec<u64> {
    for _ in 0..WARMUP {
        f();
    }
    let mut v = Vec::with_capacity(iters);
    let mut t0 = Instant::now();
    for _ in 0..iters {
        f();
        let t1 = Instant::now();
        v.push((t1 - t0).as_nanos() as u64);
        t0 = t1;
    }
    v
}

/// What one clock read adds to every sample.
pub fn timer_overhead(iters: usize) -> Vec<u64> {
    sample(iters, || {})
}

/// The physical floor: a cache-line ping-pong through shared atomics.
pub fn floor(iters: usize) -> Vec<u64> {
    // SAFETY: an anonymous shared mapping of one page; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the page is mapped in both processes and holds two u64 words on
    // separate 128-byte lines; only atomics touch it.
    let (ping, pong) = unsafe {
        (
            &*(p as *const AtomicU64),
            &*((p as *const u8).add(128) as *const AtomicU64),
        )
    };
    let total = (WARMUP + iters) as u64;
    let child = fork_child(|| {
        for i in 1..=total {
            // Acquire pairs with the parent's Release store of ping.
            while ping.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            // Release pairs with the parent's Acquire load of pong.
            pong.store(i, Ordering::Release);
        }
    });
    pin(cpus().0);
    let mut i = 0u64;
    let v = sample(iters, || {
        i += 1;
        // Release pairs with the child's Acquire load of ping; Acquire with
        // its Release store of pong.
        ping.store(i, Ordering::Release);
        while pong.load(Ordering::Acquire) != i {
            std::hint::spin_loop();
        }
    });
    reap(child);
    // SAFETY: unmapping the page mapped above.
    unsafe { libc::munmap(p, 4096) };
    v
}

fn bench_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvring-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    d
}

/// Starts a kvring server in a fresh process (this binary re-executed with
/// `serve-child`), pinned to the server CPU. Returns the child and its name.
pub fn kvring_server(tag: &str, policy: WaitPolicy) -> (std::process::Child, String) {
    kvring_server_with(tag, policy, &[], true)
}

/// `kvring_server` with extra `serve-child` arguments.
pub fn kvring_server_with(
    tag: &str,
    policy: WaitPolicy,
    extra: &[String],
    pin_server: bool,
) -> (std::process::Child, String) {
    use std::os::unix::process::CommandExt;
    let name = format!("bench-{}-{tag}", std::process::id());
    let spin_us = if policy.spin == Duration::MAX {
        u64::MAX
    } else {
        policy.spin.as_micros() as u64
    };
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "serve-child",
        "--name",
        &name,
        "--spin-us",
        &spin_us.to_string(),
        "--dir",
    ])
    .arg(bench_dir())
    .args(extra);
    let cpu = if pin_server { cpus().1 } else { None };
    // SAFETY: the hook only calls sched_setaffinity, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            pin(cpu);
            Ok(())
        });
    }
    let child = cmd
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("spawn bench server");
    (child, name)
}

/// The body of `serve-child`: run a server until stdin closes.
#[allow(clippy::too_many_arguments)]
pub fn serve_child(
    name: &str,
    dir: &std::path::Path,
    spin_us: u64,
    pool_mib: u64,
    copy_threads: u32,
    prefault: bool,
    backend: &str,
    cuda_zero_copy_ctas: u32,
    chunk_tokens: u32,
    http: Option<&str>,
    disk: Option<(std::path::PathBuf, u64)>,
) {
    let mut cfg = kvring_server::ServerConfig::new(name);
    cfg.disk = disk.map(|(dir, bytes)| kvring_server::DiskConfig {
        mode: kvring_server::L2WriteMode::Through,
        ..kvring_server::DiskConfig::new(dir, bytes)
    });
    // No HTTP thread unless the benchmark measures it.
    cfg.http = http.map(|a| kvring_server::HttpConfig {
        addr: a.parse().expect("--http ADDR:PORT"),
        required: true,
        ..kvring_server::HttpConfig::default_endpoint()
    });
    cfg.copy.backend = backend.parse().expect("backend");
    cfg.copy.cuda_zero_copy_ctas = cuda_zero_copy_ctas;
    cfg.cache.chunk_tokens = chunk_tokens;
    cfg.runtime_dir = dir.to_path_buf();
    cfg.cache.pool_bytes = pool_mib << 20;
    cfg.copy.copy_threads = Some(copy_threads);
    cfg.cache.prefault = prefault;
    cfg.ring_wait = if spin_us == u64::MAX {
        WaitPolicy::SPIN
    } else if spin_us == 0 {
        WaitPolicy::PARK
    } else {
        WaitPolicy {
            spin: Duration::from_micros(spin_us),
            ..WaitPolicy::default()
        }
    };
    let srv = kvring_server::start(cfg).expect("start server");
    let mut b = [0u8; 1];
    let _ = std::io::stdin().read(&mut b);
    srv.stop();
}

/// Closes the server's stdin (it stops cleanly) and reaps it.
pub fn stop_server(mut child: std::process::Child) {
    drop(child.stdin.take());
    let _ = child.wait();
}

pub fn kvring_client(name: &str) -> kvring::Client {
    kvring::Client::builder(name)
        .runtime_dir(bench_dir())
        .connect_timeout(Duration::from_secs(10))
        .wait_policy(WaitPolicy::SPIN)
        .connect()
        .expect("connect to bench server")
}

/// kvring PING round trips. `spin`: both sides busy-poll. Otherwise the server
/// parks when idle, and every timed request is sent only once it is parked.
pub fn kvring_rtt(iters: usize, spin: bool) -> Vec<u64> {
    let policy = if spin {
        WaitPolicy::SPIN
    } else {
        WaitPolicy::PARK
    };
    let (child, name) = kvring_server(if spin { "spin" } else { "futex" }, policy);
    pin(cpus().0);
    let mut c = kvring_client(&name);
    let mut buf = Vec::with_capacity(64);
    let far = Instant::now() + Duration::from_secs(3600);
    let mut tag = 0u64;
    let v = if spin {
        sample(iters, || {
            tag += 1;
            c.raw().submit(Opcode::Ping, &PAYLOAD, tag).unwrap();
            c.raw().wait_into(far, &mut buf).unwrap();
        })
    } else {
        let mut v = Vec::with_capacity(iters);
        for i in 0..(WARMUP / 10 + iters) {
            let view = c.segment().view();
            let t = Instant::now();
            // Acquire pairs with the server's store of its sleeping flag
            // before FUTEX_WAIT (wait.rs, F1).
            while view.header().server_sleeping == 0 {
                assert!(t.elapsed() < Duration::from_secs(5), "server never parked");
                std::hint::spin_loop();
            }
            // The flag goes up just before FUTEX_WAIT; give it time to sleep.
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(20) {
                std::hint::spin_loop();
            }
            let t0 = Instant::now();
            c.raw().submit(Opcode::Ping, &PAYLOAD, i as u64).unwrap();
            c.raw().wait_into(far, &mut buf).unwrap();
            if i >= WARMUP / 10 {
                v.push(t0.elapsed().as_nanos() as u64);
            }
        }
        v
    };
    assert_eq!(buf, PAYLOAD);
    drop(c);
    stop_server(child);
    v
}

/// Requests per second (millions) with one client pipelining PINGs.
pub fn kvring_pipelined(total: u64) -> f64 {
    let (child, name) = kvring_server("pipe", WaitPolicy::SPIN);
    pin(cpus().0);
    let mut c = kvring_client(&name);
    let mut buf = Vec::with_capacity(64);
    let far = Instant::now() + Duration::from_secs(3600);
    let run = |c: &mut kvring::Client, buf: &mut Vec<u8>, n: u64| {
        let (mut sent, mut done) = (0u64, 0u64);
        while done < n {
            while sent < n && sent - done < 512 {
                match c.raw().enqueue(Opcode::Ping, &PAYLOAD, sent) {
                    Ok(()) => sent += 1,
                    Err(_) => break,
                }
            }
            c.raw().flush();
            let mut got = 0;
            while let Some(_h) = c.raw().poll_into(buf).unwrap() {
                got += 1;
            }
            if got == 0 && done < sent {
                c.raw().wait_into(far, buf).unwrap();
                got = 1;
            }
            done += got;
        }
    };
    run(&mut c, &mut buf, 100_000);
    let t = Instant::now();
    run(&mut c, &mut buf, total);
    let secs = t.elapsed().as_secs_f64();
    drop(c);
    stop_server(child);
    total as f64 / secs / 1e6
}

/// A Unix stream socket pair, both sides blocking.
pub fn uds(iters: usize) -> Vec<u64> {
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
    let total = WARMUP + iters;
    let child = fork_child(move || {
        let mut m = [0u8; 64];
        for _ in 0..total {
            b.read_exact(&mut m).unwrap();
            b.write_all(&m).unwrap();
        }
    });
    pin(cpus().0);
    let mut m = PAYLOAD;
    let v = sample(iters, || {
        a.write_all(&m).unwrap();
        a.read_exact(&mut m).unwrap();
    });
    reap(child);
    v
}

/// ZeroMQ DEALER (client) / ROUTER (server) over ipc://, as LMCache's
/// multi-process mode uses it.
pub fn zmq(iters: usize) -> Vec<u64> {
    // A fresh endpoint per call: each call binds its own ROUTER.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    // Relaxed: a counter that only has to hand out distinct values.
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = bench_dir().join(format!("zmq-{n}.ipc"));
    let ep = format!("ipc://{}", path.display());
    let ep2 = ep.clone();
    let total = WARMUP + iters;
    let child = fork_child(move || {
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::ROUTER).unwrap();
        s.bind(&ep2).unwrap();
        for _ in 0..total {
            let parts = s.recv_multipart(0).unwrap();
            s.send_multipart(parts, 0).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
    });
    pin(cpus().0);
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.connect(&ep).unwrap();
    let mut m = zmq::Message::new();
    let v = sample(iters, || {
        s.send(&PAYLOAD[..], 0).unwrap();
        s.recv(&mut m, 0).unwrap();
    });
    assert_eq!(&m[..], &PAYLOAD[..]);
    drop(s);
    reap(child);
    let _ = std::fs::remove_file(&path);
    v
}
