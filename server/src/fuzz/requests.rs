//! Requests: any frames submitted to a live in-process server with a
//! registered KV cache.

use super::Input;
use kvring::jobs::{JobId, JobStatus};
use kvring::kv::{Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
use kvring::proto::{Opcode, Status};
use kvring::ring::{FrameFlags, FrameHeader, RingError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The in-process server and client [`requests`] talks to.
struct RequestTarget {
    client: kvring::Client,
    instance: kvring::Registration,
    _cache: kvring::HostKvCache,
    _server: crate::ServerHandle,
}

fn request_target() -> &'static Mutex<RequestTarget> {
    static T: OnceLock<Mutex<RequestTarget>> = OnceLock::new();
    T.get_or_init(|| {
        let pid = std::process::id();
        sweep_dead_targets();
        let dir = std::env::temp_dir().join(format!("kvring-fuzz-{pid}"));
        // The process ends with exit() (libFuzzer, the test harness), which
        // drops no statics: remove the segment and directory then.
        extern "C" fn cleanup() {
            remove_target(std::process::id());
        }
        // SAFETY: registers a plain function with no arguments.
        unsafe { libc::atexit(cleanup) };
        std::fs::create_dir_all(&dir).expect("fuzz runtime directory");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .expect("runtime directory mode");
        let mut cfg = crate::ServerConfig::new(&format!("fuzz-{pid}"));
        cfg.runtime_dir = dir.clone();
        cfg.cache.chunk_tokens = 32;
        cfg.cache.pool_bytes = 8 << 20;
        cfg.copy.copy_threads = Some(1);
        cfg.cache.max_request_bytes = 256 << 10;
        cfg.copy.backend = crate::BackendChoice::Host;
        let server = crate::start(cfg).expect("in-process server");
        let mut client = kvring::Client::builder(&format!("fuzz-{pid}"))
            .runtime_dir(&dir)
            .connect()
            .expect("connect");
        let cache = kvring::HostKvCache::new(fuzz_layout(), 32).expect("cache");
        let instance = client
            .register_host(
                &kvring::KvSpec::new(kvring::kv::model_id("fuzz"), 1, 0),
                &cache,
            )
            .expect("register");
        Mutex::new(RequestTarget {
            client,
            instance,
            _cache: cache,
            _server: server,
        })
    })
}

/// Removes the segment and runtime directory of the request target of
/// process `pid`.
fn remove_target(pid: u32) {
    let name = format!("fuzz-{pid}");
    let _ = nix::sys::mman::shm_unlink(kvring::rundir::shm_name(&name).as_str());
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("kvring-fuzz-{pid}")));
}

/// Removes what request targets of processes that no longer exist left
/// (a crashed fuzzer does not run its exit handlers).
fn sweep_dead_targets() {
    let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("kvring-fuzz-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove_target(pid);
        }
    }
}

fn fuzz_layout() -> KvLayout {
    let shape = KvShape {
        layers: 2,
        blocks: 16,
        block_tokens: 16,
        heads: 1,
        head_dim: 16,
    };
    KvLayout::preset(LayoutPreset::FlashAttn, KvGeometry::mha(shape, Dtype::Bf16))
        .expect("a valid preset")
}

/// Any frames submitted to a live server: each answered once with a known
/// status; every job created ends and is released; the connection survives.
pub fn requests(data: &[u8]) {
    let mut t = request_target().lock().unwrap_or_else(|e| e.into_inner());
    let t = &mut *t;
    let c = &mut t.client;
    let session = c.raw().session();
    let max = c.raw().max_payload();
    let mut inp = Input(data);
    let mut jobs: Vec<JobId> = Vec::new();
    let mut serial = 0u64;
    let deadline = || Instant::now() + Duration::from_secs(10);
    let mut frames = 0;
    let mut pieces = false;
    while !inp.is_empty() && frames < 64 {
        frames += 1;
        let sel = inp.u8();
        let opcode = if sel < 224 {
            Opcode::ALL[usize::from(sel) % Opcode::ALL.len()].raw()
        } else {
            inp.u16()
        };
        let flags = match inp.u8() % 8 {
            0 => FrameFlags::MORE.bits(),
            1 => inp.u16(),
            _ => 0,
        };
        let len = usize::from(inp.u16()) % (max + 1);
        let mut payload = inp.bytes(len).to_vec();
        payload.resize(len, 0);
        let fix = inp.u8();
        // Point requests at the registered instance, and keep delay jobs
        // short, so inputs reach the deep paths and end quickly.
        if fix & 1 != 0 {
            let id = t.instance.id().to_le_bytes();
            match Opcode::decode(opcode).ok() {
                Some(Opcode::Store) if len >= 4 => payload[..4].copy_from_slice(&id),
                Some(Opcode::Retrieve) if len >= 20 => payload[16..20].copy_from_slice(&id),
                _ => {}
            }
        }
        if Opcode::decode(opcode).ok() == Some(Opcode::DelayJob) && len >= 24 {
            for w in 0..3 {
                let v = u64::from_le_bytes(payload[w * 8..w * 8 + 8].try_into().unwrap()) % 2000;
                payload[w * 8..w * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        if fix & 2 != 0 && !jobs.is_empty() && len >= 16 {
            // Refer to a job of this input (lease, release).
            let j = jobs[usize::from(fix >> 2) % jobs.len()];
            payload[..16].copy_from_slice(bytemuck::bytes_of(&j));
        }
        serial += 1;
        let more = FrameFlags::from_bits_retain(flags).contains(FrameFlags::MORE);
        let h = FrameHeader {
            opcode,
            flags,
            session,
            user_data: serial,
            ..Default::default()
        };
        submit(c, h, &payload, !more);
        if more {
            pieces = true;
            continue;
        }
        let gathered = std::mem::take(&mut pieces);
        let done = c
            .raw()
            .wait_completion(deadline())
            .expect("every request is answered");
        let status = Status::decode(done.status)
            .ok()
            .unwrap_or_else(|| panic!("unknown status {} for opcode {opcode}", done.status));
        let op = Opcode::decode(opcode).ok();
        if op.is_none() {
            // (Pieces of a request that break the rules are refused first.)
            let want = [Status::UnknownOpcode, Status::BadLength];
            assert!(
                want[..1 + usize::from(gathered)].contains(&status),
                "{status:?}"
            );
        }
        if status == Status::Ok && op.is_some_and(|o| o.spec().job.is_some()) {
            assert_eq!(done.payload.len(), 16, "a job request answers its id");
            jobs.push(bytemuck::pod_read_unaligned(&done.payload));
        }
        if status == Status::Ok && op == Some(Opcode::Ping) {
            assert_eq!(done.payload, payload);
        }
    }
    // A last frame ends any gathered request; then the ring must still work.
    submit(
        c,
        FrameHeader {
            opcode: Opcode::Ping as u16,
            session,
            user_data: u64::MAX,
            ..Default::default()
        },
        b"end",
        true,
    );
    c.raw()
        .wait_completion(deadline())
        .expect("the closing frame is answered");
    assert_eq!(c.ping(b"alive", deadline()).unwrap(), b"alive");
    // Every job of the input ends (the longest delay job is 4 ms).
    for id in jobs {
        match c.wait_job(id, deadline()) {
            Ok(
                JobStatus::Done(_)
                | JobStatus::Failed(_)
                | JobStatus::Tombstoned(_)
                | JobStatus::Expired,
            ) => {}
            other => panic!("job {id:?} did not end: {other:?}"),
        }
        let _ = c.release_job(id);
    }
}

/// Submits a frame, waiting for ring space while the server drains it.
fn submit(c: &mut kvring::Client, h: FrameHeader, payload: &[u8], answered: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.raw().submit_raw(h, payload, answered) {
            Ok(()) => return,
            Err(crate::Error::Ring(RingError::Full { .. })) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(50));
            }
            Err(e) => panic!("submit: {e}"),
        }
    }
}
