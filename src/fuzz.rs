//! Entry points of the fuzz targets (`fuzz/fuzz_targets/`) and of their
//! bounded runs in the test suite (`tests/fuzz.rs`).
//!
//! Each function takes arbitrary bytes, drives one piece of kvring that
//! reads untrusted input with them, and panics when a property breaks. An
//! input the code refuses with an error is a pass; a panic, an out-of-bounds
//! access (caught by the sanitizer under `cargo fuzz`), a hang (caught by
//! the deadlines below) or a wrong answer is a failure.
//!
//! * [`ring_frames`]: the ring consumer against a hostile producer (any
//!   indices, any words in the data area), and producer + consumer against
//!   a model of the frames in flight;
//! * [`requests`]: any frames (opcode, flags, payload) submitted to a live
//!   in-process server with a registered KV cache: every request is answered
//!   exactly once with a known status, jobs it creates end, the connection
//!   survives;
//! * [`registration`]: any registration message and tables (allocations,
//!   memory pieces, layer placements) against the server's registry (with
//!   real sealed and unsealed memfds), and any layout descriptor — raw, or
//!   a preset with hostile edits — against its own addressing: whatever is
//!   accepted addresses only memory it mapped, and no two of its rows share
//!   a byte;
//! * [`l2_value`]: the second tier's value decoder against any bytes under
//!   any key (taken only if it is exactly what sealing gives), and a sealed
//!   value damaged in one byte (always refused);
//! * [`http_request`]: any bytes to the HTTP endpoint's request reader, in
//!   any split into reads: the same answer however they are split, never a
//!   request over the bound, a body of exactly its `Content-Length`.

use crate::jobs::{JobId, JobStatus};
use crate::kv::{Dtype, KvGeometry, KvLayout, KvShape, LayerPlacement, LayoutPreset};
use crate::proto::kv::{KvAllocation, MemoryPiece, RegisterKv, RegisterTables};
use crate::proto::{Opcode, Status};
use crate::ring::heap::HeapRing;
use crate::ring::{frame_bytes, Consumer, FrameFlags, FrameHeader, RingError, HEADER_BYTES};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Reads an input front to back; past its end every read is zero.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The ring consumer against a hostile producer, then (second mode) a
/// producer and consumer against a model.
pub fn ring_frames(data: &[u8]) {
    let mut inp = Input(data);
    let mode = inp.u8();
    let capacity = 4096usize << (inp.u8() % 4);
    // Any frame bound the consumer accepts, up to the whole ring.
    let max_frame = HEADER_BYTES + 8 * (usize::from(inp.u16()) % ((capacity - HEADER_BYTES) / 8));
    let ring = HeapRing::new(capacity, max_frame);
    if mode % 2 == 0 {
        hostile_producer(&ring, &mut inp);
    } else {
        modelled_ring(&ring, &mut inp);
    }
}

/// Plays the producer from the same thread as the consumer: the orderings
/// of its stores only mirror a real producer's (Release on the tail it
/// publishes, which the consumer's Acquire load of the tail pairs with).
fn hostile_producer(ring: &HeapRing, inp: &mut Input) {
    let capacity = ring.data.len() as u64 * 8;
    let start = match inp.u8() % 3 {
        0 => inp.u64(),
        1 => u64::MAX - u64::from(inp.u16()),
        _ => u64::from(inp.u16()) * 8,
    };
    ring.head.store(start, Ordering::Relaxed);
    ring.tail
        .store(start.wrapping_add(u64::from(inp.u16())), Ordering::Relaxed);
    for w in &ring.data {
        if inp.is_empty() {
            break;
        }
        w.store(inp.u64(), Ordering::Relaxed);
    }
    // SAFETY: the ring's memory lives in `ring` for the whole function and
    // this is its only consumer.
    let Ok(mut c) = (unsafe { Consumer::new(ring.ptrs()) }) else {
        return;
    };
    let mut buf = vec![0u64; ring.max_frame / 8];
    for _ in 0..10_000 {
        if inp.is_empty() {
            break;
        }
        let before = c.head();
        let r = match inp.u8() % 6 {
            0 | 1 => c.pop(&mut buf),
            2 => c.skip(),
            3 => {
                c.release();
                Ok(None)
            }
            4 => {
                let t = match inp.u8() % 3 {
                    0 => inp.u64(),
                    1 => ring
                        .tail
                        .load(Ordering::Relaxed)
                        .wrapping_add(u64::from(inp.u16())),
                    _ => ring
                        .tail
                        .load(Ordering::Relaxed)
                        .wrapping_add(8 * u64::from(inp.u8())),
                };
                // Release as a producer publishes; pairs with the consumer's
                // Acquire load of the tail.
                ring.tail.store(t, Ordering::Release);
                Ok(None)
            }
            _ => {
                let i = inp.u32() as usize % ring.data.len();
                ring.data[i].store(inp.u64(), Ordering::Relaxed);
                Ok(None)
            }
        };
        match r {
            Ok(Some(h)) => {
                // A frame within the bound, wholly inside the published bytes.
                assert!(h.len as usize <= c.max_payload(), "frame over the bound");
                let moved = c.head().wrapping_sub(before);
                assert_eq!(moved, frame_bytes(h.len as usize) as u64);
                assert!(moved <= capacity);
            }
            Ok(None) => {}
            Err(RingError::Corrupt(_)) => {}
            Err(e) => panic!("a consumer reports only corruption, got {e}"),
        }
    }
}

fn modelled_ring(ring: &HeapRing, inp: &mut Input) {
    let capacity = ring.data.len() * 8;
    // SAFETY: the ring's memory lives in `ring` for the whole function; one
    // producer and one consumer, both used only here.
    let (mut p, mut c) = unsafe { ring.pair() };
    let mut buf = vec![0u64; ring.max_frame / 8];
    // Frames written (and whether published), in order.
    let mut written: VecDeque<(FrameHeader, Vec<u8>)> = VecDeque::new();
    let mut published = 0usize;
    // Bytes written and not yet released by the consumer.
    let mut unreleased = 0usize;
    let mut consumed = 0usize;
    let mut serial = 0u64;
    for _ in 0..10_000 {
        if inp.is_empty() {
            break;
        }
        match inp.u8() % 4 {
            0 | 1 => {
                let len = usize::from(inp.u16()) % (ring.max_frame + 16);
                let fill = inp.u8();
                let payload: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
                serial += 1;
                let h = FrameHeader {
                    opcode: inp.u16(),
                    flags: if inp.u8() % 2 == 0 {
                        0
                    } else {
                        FrameFlags::MORE.bits()
                    },
                    session: 7,
                    user_data: serial,
                    ..Default::default()
                };
                let need = frame_bytes(len);
                match p.write(&h, &payload) {
                    Ok(()) => {
                        unreleased += need;
                        written.push_back((h, payload));
                    }
                    Err(RingError::TooLarge { .. }) => assert!(need > ring.max_frame),
                    Err(RingError::Full { .. }) => {
                        assert!(need <= ring.max_frame);
                        assert!(unreleased + need > capacity, "refused a frame that fits");
                    }
                    Err(e) => panic!("producer: {e}"),
                }
            }
            2 => {
                p.publish();
                published = written.len();
            }
            _ => match c.pop(&mut buf).expect("an honest ring is never corrupt") {
                Some(h) => {
                    assert!(published > 0, "a frame came out before it was published");
                    let (wh, wp) = written.pop_front().expect("a frame was written");
                    published -= 1;
                    assert_eq!(
                        (h.opcode, h.flags, h.user_data),
                        (wh.opcode, wh.flags, wh.user_data)
                    );
                    assert_eq!(
                        &bytemuck::cast_slice::<u64, u8>(&buf)[..h.len as usize],
                        &wp[..]
                    );
                    consumed += frame_bytes(wp.len());
                    if inp.u8() % 2 == 0 {
                        c.release();
                        unreleased -= consumed;
                        consumed = 0;
                    }
                }
                None => assert_eq!(published, 0, "a published frame did not come out"),
            },
        }
    }
}

/// The in-process server and client [`requests`] talks to.
struct RequestTarget {
    client: crate::Client,
    instance: crate::Registration,
    _cache: crate::HostKvCache,
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
        cfg.kv.chunk_tokens = 32;
        cfg.kv.pool_bytes = 8 << 20;
        cfg.kv.copy_threads = Some(1);
        cfg.kv.max_request_bytes = 256 << 10;
        cfg.kv.backend = crate::server::BackendChoice::Host;
        let server = crate::server::start(cfg).expect("in-process server");
        let mut client = crate::Client::builder(&format!("fuzz-{pid}"))
            .runtime_dir(&dir)
            .connect()
            .expect("connect");
        let cache = crate::HostKvCache::new(fuzz_layout(), 32).expect("cache");
        let instance = client
            .register_host(
                &crate::KvSpec::new(crate::kv::model_id("fuzz"), 1, 0),
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
    let _ = nix::sys::mman::shm_unlink(crate::rundir::shm_name(&name).as_str());
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
fn submit(c: &mut crate::Client, h: FrameHeader, payload: &[u8], answered: bool) {
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

/// A sealed memfd of `bytes` bytes, or an unsealed one.
fn memfd(bytes: u64, sealed: bool) -> std::os::fd::OwnedFd {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(c"kvring-fuzz", MFdFlags::MFD_ALLOW_SEALING).expect("memfd");
    nix::unistd::ftruncate(&fd, bytes as i64).expect("ftruncate");
    if sealed {
        use std::os::fd::AsRawFd;
        // SAFETY: F_ADD_SEALS on a descriptor this function owns.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(r, 0, "seal");
    }
    fd
}

/// A layout from fuzz input: a preset of a small geometry with some of its
/// numbers overwritten, or every number raw.
fn fuzz_descriptor(inp: &mut Input<'_>) -> KvLayout {
    let raw = inp.u8() % 4 == 0;
    let mut g = KvGeometry::mha(
        KvShape {
            layers: 1 + u32::from(inp.u8() % 4),
            blocks: 1 + u32::from(inp.u8() % 8),
            block_tokens: 1 << (inp.u8() % 4),
            heads: 1 + u32::from(inp.u8() % 3),
            head_dim: 1 + u32::from(inp.u8() % 12),
        },
        [Dtype::Fp8, Dtype::Bf16, Dtype::F32][usize::from(inp.u8() % 3)],
    );
    if inp.u8() % 4 == 0 {
        g = KvGeometry::mla(g.layers, g.blocks, g.block_tokens, g.k_dim, Dtype::Bf16);
    }
    let preset = LayoutPreset::ALL[usize::from(inp.u8()) % LayoutPreset::ALL.len()];
    let base = KvLayout::preset(preset, g)
        .or_else(|_| KvLayout::preset(LayoutPreset::Lbnhc, g))
        .expect("a one-buffer preset fits every geometry");
    let mut allocs = base.allocations().to_vec();
    let mut layers = base.layers().to_vec();
    if raw {
        let mut raw_g = [0u8; std::mem::size_of::<KvGeometry>()];
        let b = inp.bytes(raw_g.len());
        raw_g[..b.len()].copy_from_slice(b);
        g = bytemuck::pod_read_unaligned(&raw_g);
        g.layers %= 5;
        allocs = (0..inp.u8() % 3).map(|_| inp.u64() % (1 << 20)).collect();
        layers = (0..g.layers)
            .map(|_| {
                let mut raw_p = [0u8; std::mem::size_of::<LayerPlacement>()];
                let b = inp.bytes(raw_p.len());
                raw_p[..b.len()].copy_from_slice(b);
                bytemuck::pod_read_unaligned(&raw_p)
            })
            .collect();
    } else {
        // Hostile edits: any field of any placement, or an allocation size.
        for _ in 0..inp.u8() % 4 {
            let v = match inp.u8() % 4 {
                0 => inp.u64(),
                1 => u64::from(inp.u16()),
                2 => 0,
                _ => u64::MAX - u64::from(inp.u8()),
            };
            let field = inp.u8();
            if field % 8 == 7 {
                if let Some(a) = allocs.first_mut() {
                    *a = v;
                }
                continue;
            }
            let n = layers.len();
            let p = &mut layers[usize::from(inp.u8()) % n];
            match field % 8 {
                0 => p.k_offset = v,
                1 => p.v_offset = v,
                2 => p.block_stride = v,
                3 => p.head_stride = v,
                4 => p.token_stride = v,
                5 => p.alloc = v as u32,
                _ => p.k_offset = p.v_offset.wrapping_add(v % 64),
            }
        }
    }
    KvLayout::new(g, allocs, layers)
}

/// Any registration against the registry, and any layout against its own
/// addressing.
pub fn registration(data: &[u8]) {
    let mut inp = Input(data);
    let chunk_tokens = 1 + u32::from(inp.u16()) % 1024;
    let layout = fuzz_descriptor(&mut inp);
    check_layout(&layout, chunk_tokens);
    let mut raw = [0u8; std::mem::size_of::<RegisterKv>()];
    let head = inp.bytes(raw.len());
    raw[..head.len()].copy_from_slice(head);
    let mut req: RegisterKv = bytemuck::pod_read_unaligned(&raw);
    // Mostly host memory (the only kind without a GPU), mostly the
    // descriptor built above in one memfd.
    if inp.u8() % 4 != 0 {
        req.mem_kind = crate::proto::kv::MemKind::HostFd as u32;
    }
    let table = if inp.u8() % 4 != 0 {
        req.geometry = *layout.geometry();
        let mut at = 0u64;
        let mut t = RegisterTables {
            allocs: Vec::new(),
            pieces: Vec::new(),
            layers: layout.layers().to_vec(),
        };
        for &bytes in layout.allocations() {
            t.allocs.push(KvAllocation {
                ipc_handle: [0; 64],
                offset: 0,
                bytes,
                first_piece: t.pieces.len() as u32,
                n_pieces: 1,
            });
            t.pieces.push(MemoryPiece {
                first_fd: u32::from(inp.u8() % 2),
                n_fds: 1,
                fd_offset: at,
                fd_bytes: bytes,
            });
            at = at.wrapping_add(bytes.wrapping_add(4095) & !4095);
        }
        req.n_allocs = t.allocs.len() as u32;
        req.n_pieces = t.pieces.len() as u32;
        t.encode()
    } else {
        inp.bytes(4096).to_vec()
    };

    static FDS: OnceLock<Vec<std::os::fd::OwnedFd>> = OnceLock::new();
    let fds = FDS.get_or_init(|| vec![memfd(1 << 20, true), memfd(1 << 20, false), memfd(0, true)]);
    let nfds = usize::from(inp.u8()) % (fds.len() + 1);
    let sent: Vec<std::os::fd::OwnedFd> = fds[..nfds]
        .iter()
        .map(|f| f.try_clone().expect("dup"))
        .collect();
    let mut reg = crate::server::registry::Registry::default();
    let backend = crate::server::HostBackend;
    if let Ok(inst) = reg.register(3, 1, None, chunk_tokens, &req, &table, &sent, &backend) {
        let l = &inst.layout;
        assert!(l.validate(chunk_tokens).is_ok());
        assert_eq!(inst.host.len(), l.allocations().len());
        // Host memory by type: `host` holds only host mappings.
        for (m, &bytes) in inst.host.iter().zip(l.allocations()) {
            assert!(
                m.bytes() >= bytes,
                "an allocation mapped smaller than its layout"
            );
        }
        check_layout(l, chunk_tokens);
        assert_eq!(reg.len(), 1);
        assert!(reg.unregister(3, 1, inst.id));
        assert_eq!(reg.len(), 0);
    }
}

/// A layout that validates addresses only its allocations and objects, and
/// no two of its rows share a byte (checked byte range by byte range).
fn check_layout(l: &KvLayout, chunk_tokens: u32) {
    if l.validate(chunk_tokens).is_err() {
        return;
    }
    let g = l.geometry();
    let bpc = l.blocks_per_chunk(chunk_tokens);
    assert!(bpc >= 1);
    let ob = l.object_bytes(chunk_tokens);
    let plan = l.plan();
    // Every run of every page, with the blocks of one chunk placed at the
    // start of the object (larger block counts cycle through it).
    let mut ranges: Vec<(u32, u64, u64)> = Vec::new();
    let rows = u64::from(g.layers) * u64::from(g.blocks) * g.page_bytes() / g.row_bytes().max(1);
    for layer in 0..g.layers {
        let alloc = l.layers()[layer as usize].alloc;
        for block in 0..g.blocks {
            let j = block % bpc;
            plan.for_each_run(l, chunk_tokens, layer, block, j, |_, eng, obj, n| {
                assert!(
                    eng.checked_add(n)
                        .is_some_and(|e| e <= l.allocations()[alloc as usize]),
                    "a run past its allocation"
                );
                assert!(
                    obj.checked_add(n).is_some_and(|e| e <= ob),
                    "a run past the object"
                );
                if rows <= 1 << 14 {
                    ranges.push((alloc, eng, eng + n));
                }
            });
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(
            w[0].0 != w[1].0 || w[0].2 <= w[1].1,
            "two runs share bytes: {:?} {:?}",
            w[0],
            w[1]
        );
    }
}

/// The second tier's value decoder against any bytes under any key, and
/// against a value sealed here and then damaged in one byte: a value is
/// taken only if it is exactly what sealing its object under the key it
/// was read from gives (so no bytes but a sealer's can pass), copying it
/// out agrees with checking it, and one damaged byte is always refused.
pub fn l2_value(data: &[u8]) {
    use crate::server::l2::value::{self, MacKey, Seal, Value};
    let mut input = Input(data);
    let mode = input.u8();
    let seal = if mode & 1 == 0 {
        Seal::Checksum
    } else {
        Seal::Mac(MacKey::from_secret(b"the fuzz target's secret").expect("a secret"))
    };
    let key_len = usize::from(input.u8() % 128);
    let key = String::from_utf8_lossy(input.bytes(key_len)).into_owned();
    let at = input.u32();
    let flip = input.u8() | 1;
    let said = input.u64();
    let rest = input.0;
    // Any bytes, as read from the tier, for the size they have and for a
    // size the input names.
    for len in [rest.len().saturating_sub(value::HEADER) as u64, said] {
        let opened = value::open(rest, &key, len, &seal);
        let checked = value::decode(rest, &key, len, &seal);
        assert_eq!(
            opened.is_ok(),
            checked.is_ok() || matches!(checked, Err(value::BadValue::Check(_)))
        );
        if let Ok(body) = checked {
            assert_eq!(
                Value::seal(&key, body, &seal).to_vec(),
                rest,
                "taken, yet not sealed here"
            );
        }
        if let Ok(o) = value::open(rest, &key, len, &seal) {
            let mut dst = vec![0u8; o.len()];
            assert_eq!(o.copy_into(&mut dst).is_ok(), checked.is_ok());
        }
    }
    // A value sealed here opens, and any one byte of it damaged does not.
    let body = rest;
    let mut v = Value::seal(&key, body, &seal).to_vec();
    let n = body.len() as u64;
    assert_eq!(
        value::decode(&v, &key, n, &seal).expect("a sealed value"),
        body
    );
    let i = at as usize % v.len();
    v[i] ^= flip;
    assert!(
        value::decode(&v, &key, n, &seal).is_err(),
        "byte {i} damaged, yet taken"
    );
    // Under another key, or with the other seal, it is refused whole.
    v[i] ^= flip;
    assert!(value::decode(&v, &format!("{key}x"), n, &seal).is_err());
    let other = match seal {
        Seal::Checksum => {
            Seal::Mac(MacKey::from_secret(b"the fuzz target's secret").expect("a secret"))
        }
        Seal::Mac(_) => Seal::Checksum,
    };
    assert!(value::decode(&v, &key, n, &other).is_err());
}

/// What the HTTP request reader made of a stream of bytes.
#[derive(Debug)]
struct HttpOutcome {
    result: Result<crate::server::http::Request, u16>,
    /// How many times it asked for `100 Continue`.
    continues: usize,
    /// The bytes the request took, when it was read whole.
    len: Option<usize>,
    /// The bytes it was given.
    fed: usize,
}

/// Reads `stream` with a fresh reader, each read at most `next_len()`
/// bytes (and the reader's room); the end of `stream` is the client
/// closing its side.
fn read_http(stream: &[u8], mut next_len: impl FnMut() -> usize) -> HttpOutcome {
    use crate::server::http::{RequestReader, Step};
    let mut r = RequestReader::default();
    let (mut at, mut continues) = (0, 0);
    loop {
        let room = r.room();
        assert!(room > 0, "the reader wants more bytes but has no room");
        let n = next_len().clamp(1, room).min(stream.len() - at);
        let step = r.push(&stream[at..at + n]);
        at += n;
        match step {
            Step::More => {}
            Step::SendContinue => continues += 1,
            Step::Done(result) => {
                return HttpOutcome {
                    result: result.map_err(|resp| resp.code()),
                    continues,
                    len: r.request_len(),
                    fed: at,
                }
            }
        }
    }
}

/// The values of the `Content-Length` headers of a request head, found
/// without the reader's parser: each line after the first, split at its
/// first colon.
fn content_lengths(head: &[u8]) -> Vec<String> {
    head.split(|&c| c == b'\n')
        .skip(1)
        .filter_map(|line| {
            let colon = line.iter().position(|&c| c == b':')?;
            let (name, value) = line.split_at(colon);
            name.eq_ignore_ascii_case(b"content-length").then(|| {
                String::from_utf8_lossy(&value[1..])
                    .trim_end_matches('\r')
                    .trim()
                    .to_string()
            })
        })
        .collect()
}

/// The HTTP endpoint's request reader over any bytes: the first eight are
/// a seed (how the rest is split into reads, and whether it is repeated to
/// run past the request bound), the rest the bytes a client sends before
/// it closes its side. Read in one piece, in the seed's pieces and (when
/// short) byte by byte, the answer is the same; a request read is within
/// [`crate::server::http::REQUEST_LIMIT`] and its body is exactly the
/// bytes its `Content-Length` says, right after its head; `100 Continue`
/// is asked for once at most; a refusal is 400 or 413.
pub fn http_request(data: &[u8]) {
    use crate::server::http::REQUEST_LIMIT;
    let mut inp = Input(data);
    let mut seed = inp.u64() | 1;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let rest = inp.0;
    // Repeated up to about twice the bound, at times, to reach it.
    let repeats = match next() % 8 {
        0 if !rest.is_empty() => (2 * REQUEST_LIMIT / rest.len()).clamp(1, 4096),
        _ => 1,
    };
    let stream = rest.repeat(repeats);
    let whole = read_http(&stream, || usize::MAX);
    let pieces = read_http(&stream, || match next() % 4 {
        0 => 1 + (next() % 4096) as usize,
        _ => 1 + (next() % 64) as usize,
    });
    assert_eq!(whole.result, pieces.result, "split into pieces");
    assert_eq!(whole.len, pieces.len);
    if stream.len() <= 512 {
        let bytes = read_http(&stream, || 1);
        assert_eq!(whole.result, bytes.result, "byte by byte");
        assert_eq!(whole.len, bytes.len);
    }
    for o in [&whole, &pieces] {
        assert!(o.continues <= 1, "{o:?}");
        assert!(o.fed <= REQUEST_LIMIT + 1, "{o:?}");
    }
    match &whole.result {
        Ok(req) => {
            let len = whole.len.expect("a request read has a length");
            assert!(len <= REQUEST_LIMIT, "a request of {len} bytes");
            assert!(len <= whole.fed && len <= stream.len());
            let body = req.body.as_deref().unwrap_or_default();
            let head = &stream[..len - body.len()];
            assert!(
                head.ends_with(b"\n"),
                "a head of {} bytes ending {:?}",
                head.len(),
                String::from_utf8_lossy(&head[head.len().saturating_sub(16)..])
            );
            let lengths = content_lengths(head);
            match &req.body {
                Some(b) => {
                    assert!(
                        stream[head.len()..len] == b[..],
                        "the body is not the {} bytes after the head",
                        b.len()
                    );
                    assert!(!lengths.is_empty(), "a body without a Content-Length");
                    for l in &lengths {
                        assert_eq!(l.parse::<usize>().ok(), Some(b.len()), "{lengths:?}");
                    }
                }
                None => assert!(lengths.is_empty(), "{lengths:?} and no body"),
            }
        }
        Err(code) => assert!(matches!(code, 400 | 413), "refused with {code}"),
    }
}
