//! The CUDA backend: engines' KV caches in device memory, the pool in pinned
//! host memory, and the server's own kernels in between.
//!
//! Per chunk, on the worker's own stream (no engine SMs beyond one short
//! kernel, no host callback, no lock on any driver thread):
//!
//! * STORE: [wait for the engine's IPC event] -> block ids to the device ->
//!   `kv_copy` gathers the chunk's slabs from the paged cache into a device
//!   staging buffer -> one copy-engine transfer staging -> pinned pool object
//!   -> record an event;
//! * RETRIEVE: [wait for the engine's event] -> block ids -> one transfer
//!   pool object -> staging -> `kv_copy` scatters the slabs into the paged
//!   cache -> record an event.
//!
//! Each worker keeps two chunks in flight per device (two staging buffers),
//! so one chunk's transfer overlaps the next one's kernel, and several
//! workers keep the copy engines busy. The worker learns a chunk is done by
//! polling its event (`cuEventQuery`, ~30 ns), never from a host callback:
//! the deadlock of a callback needing a lock held by a thread that waits on
//! the stream cannot happen.
//!
//! The pool is registered with the driver (`cuMemHostRegister`, portable)
//! in segments on a background thread, so start-up does not wait for it; an
//! object never spans two segments (the pool allocator keeps to them), and a
//! copy into a segment not registered yet waits for it.

use super::copier::{Backend, ChunkCopy, Dir, Engine};
use super::pool::PoolMemory;
use super::registry::{Refusal, Tensor};
use crate::cuda::kernels::{Kernels, KvCopyArgs};
use crate::cuda::{ck, sys, Context, DeviceTensor, OpenedMemory};
use crate::proto::kv::{CudaRegion, MemKind, RegisterKv};
use crate::proto::Status;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Bytes per pool registration (a copy never spans two).
pub const PIN_SEGMENT: u64 = 1 << 30;
/// Chunks one worker keeps in flight per device, unless
/// `KVRING_CUDA_DEPTH` says otherwise (1..=8).
const DEPTH: usize = 4;

fn depth() -> usize {
    std::env::var("KVRING_CUDA_DEPTH")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|d| (1..=8).contains(d))
        .unwrap_or(DEPTH)
}
/// Longest a chunk copy may take on the device before it is reported failed.
const COPY_DEADLINE: Duration = Duration::from_secs(60);

/// One device: its context and kernels.
pub struct DeviceRes {
    pub ctx: Arc<Context>,
    pub kernels: Kernels,
}

/// Device memory owned by the server (freed in its context on drop).
pub struct DevBuf {
    ctx: Arc<Context>,
    pub ptr: u64,
    pub bytes: usize,
}

// SAFETY: a device address, used with its context bound.
unsafe impl Send for DevBuf {}
// SAFETY: as above.
unsafe impl Sync for DevBuf {}

impl DevBuf {
    fn new(ctx: &Arc<Context>, bytes: usize) -> Result<DevBuf, String> {
        ctx.bind()?;
        let mut ptr = 0;
        ck(
            // SAFETY: valid out-pointer.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(16)) },
            "cuMemAlloc",
        )?;
        Ok(DevBuf {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees what `new` allocated.
        unsafe {
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// What an instance in device memory needs on the server: its device and
/// the table of its tensors' addresses, in device memory.
pub struct InstanceDevice {
    pub dev: Arc<DeviceRes>,
    pub bases: DevBuf,
}

/// Pool segments' registration state: 0 pending, 1 pinned, 2 failed.
struct Pinning {
    state: Vec<AtomicU8>,
    error: Mutex<Option<String>>,
}

/// (client slot, IPC handle) of an opened allocation.
type OpenedKey = (u32, [u8; 64]);

/// One client's job events on one device: interprocess events recorded, in
/// turn, on one in-order gate stream after all of a job's chunk copies.
pub struct JobEvents {
    ctx: Arc<Context>,
    gate: sys::CUstream,
    events: Vec<sys::CUevent>,
    handles: Vec<[u8; 64]>,
    next: std::sync::atomic::AtomicU32,
}

// SAFETY: stream and event handles, used with their context bound (the
// driver's calls on them are thread-safe).
unsafe impl Send for JobEvents {}
// SAFETY: as above.
unsafe impl Sync for JobEvents {}

impl JobEvents {
    fn new(ctx: &Arc<Context>) -> Result<JobEvents, String> {
        ctx.bind()?;
        let mut je = JobEvents {
            ctx: ctx.clone(),
            gate: std::ptr::null_mut(),
            events: Vec::new(),
            handles: Vec::new(),
            next: std::sync::atomic::AtomicU32::new(0),
        };
        // SAFETY: valid out-pointers; what is created is destroyed by Drop.
        unsafe {
            ck(
                sys::cuStreamCreate(
                    &mut je.gate,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            for _ in 0..crate::proto::kv::JOB_EVENTS {
                let mut ev = std::ptr::null_mut();
                let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
                    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                ck(sys::cuEventCreate(&mut ev, flags), "cuEventCreate")?;
                je.events.push(ev);
                let mut h: sys::CUipcEventHandle = std::mem::zeroed();
                ck(sys::cuIpcGetEventHandle(&mut h, ev), "cuIpcGetEventHandle")?;
                je.handles.push(h.reserved.map(|b| b as u8));
                // Recorded once, so a wait on it before its first job use
                // does not wait forever.
                ck(sys::cuEventRecord(ev, je.gate), "cuEventRecord")?;
            }
        }
        Ok(je)
    }
}

impl Drop for JobEvents {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys what `new` created, after the gate drained.
        unsafe {
            if !self.gate.is_null() {
                let _ = sys::cuStreamSynchronize(self.gate);
            }
            for ev in &self.events {
                let _ = sys::cuEventDestroy_v2(*ev);
            }
            if !self.gate.is_null() {
                let _ = sys::cuStreamDestroy_v2(self.gate);
            }
        }
    }
}

/// The CUDA backend.
pub struct CudaBackend {
    devices: Mutex<HashMap<[u8; 16], Arc<DeviceRes>>>,
    /// Allocations each client has opened, so each is opened once.
    opened: Mutex<HashMap<OpenedKey, Weak<OpenedMemory>>>,
    /// Job events per (client slot, device ordinal).
    job_events: Mutex<HashMap<(u32, i32), Arc<JobEvents>>>,
    pinning: Arc<Pinning>,
    pool_base: usize,
    pool_len: u64,
    /// Devices present at start (for messages).
    pub summary: String,
    /// 0: the staged path (kernel + copy engine); N: the zero-copy path,
    /// kernels reading or writing the pinned pool directly with at most N
    /// CTAs.
    zero_copy_ctas: u32,
}

impl CudaBackend {
    /// Checks CUDA is usable, loads the kernels on every device, and starts
    /// pinning the pool in the background.
    pub fn new(pool: &PoolMemory, zero_copy_ctas: u32) -> Result<CudaBackend, String> {
        let devs = crate::cuda::probe()?;
        let mut devices = HashMap::new();
        let mut summary = Vec::new();
        for d in &devs {
            let ctx = Context::by_ordinal(d.ordinal)?;
            let kernels = Kernels::load(&ctx)?;
            summary.push(format!(
                "{} {} (sm_{}{}; kernels {})",
                d.ordinal, d.name, d.compute_capability.0, d.compute_capability.1, kernels.origin
            ));
            devices.insert(d.uuid, Arc::new(DeviceRes { ctx, kernels }));
        }
        let segs = pool.len().div_ceil(PIN_SEGMENT) as usize;
        let pinning = Arc::new(Pinning {
            state: (0..segs).map(|_| AtomicU8::new(0)).collect(),
            error: Mutex::new(None),
        });
        let (base, len) = (pool.at(0) as usize, pool.len());
        let first = devices.values().next().expect("a device").ctx.clone();
        {
            let pinning = pinning.clone();
            std::thread::Builder::new()
                .name("kvring-pin".into())
                .spawn(move || pin_pool(&first, base, len, &pinning))
                .map_err(|e| format!("spawn the pinning thread: {e}"))?;
        }
        Ok(CudaBackend {
            devices: Mutex::new(devices),
            opened: Mutex::new(HashMap::new()),
            job_events: Mutex::new(HashMap::new()),
            pinning,
            pool_base: base,
            pool_len: len,
            summary: format!(
                "{}; {}",
                summary.join("; "),
                if zero_copy_ctas == 0 {
                    "staged copies (kernel + copy engine)".to_string()
                } else {
                    format!("zero-copy kernels, at most {zero_copy_ctas} CTAs")
                }
            ),
            zero_copy_ctas,
        })
    }

    /// Client `slot`'s job events on `dev` (created at first use).
    fn events_of(&self, slot: u32, dev: &Arc<DeviceRes>) -> Result<Arc<JobEvents>, String> {
        let mut m = self.job_events.lock().unwrap_or_else(|e| e.into_inner());
        let key = (slot, dev.ctx.info.ordinal);
        if let Some(je) = m.get(&key) {
            return Ok(je.clone());
        }
        let je = Arc::new(JobEvents::new(&dev.ctx)?);
        m.insert(key, je.clone());
        Ok(je)
    }

    fn device(&self, uuid: &[u8; 16]) -> Option<Arc<DeviceRes>> {
        self.devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(uuid)
            .cloned()
    }

    /// Waits until the pool segment holding `[off, off + len)` is pinned.
    fn wait_pinned(&self, off: u64, len: u64) -> Result<(), String> {
        let seg = (off / PIN_SEGMENT) as usize;
        if (off + len - 1) / PIN_SEGMENT != seg as u64 {
            return Err("a pool object spans two registrations".into());
        }
        let deadline = Instant::now() + COPY_DEADLINE;
        loop {
            // Acquire pairs with the pinning thread's Release store: the
            // registration happened before.
            match self.pinning.state[seg].load(Ordering::Acquire) {
                1 => return Ok(()),
                2 => {
                    let e = self.pinning.error.lock().unwrap_or_else(|e| e.into_inner());
                    return Err(format!(
                        "pinning the pool failed: {}",
                        e.as_deref().unwrap_or("?")
                    ));
                }
                _ if Instant::now() > deadline => {
                    return Err("the pool was not pinned in time".into())
                }
                _ => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

fn pin_pool(ctx: &Context, base: usize, len: u64, p: &Pinning) {
    let bind = ctx.bind();
    for (i, st) in p.state.iter().enumerate() {
        let off = i as u64 * PIN_SEGMENT;
        let n = PIN_SEGMENT.min(len - off);
        let r = bind.clone().and_then(|()| {
            // SAFETY: a range of the pool mapping, which lives as long as
            // the server; portable, so every context sees it pinned.
            ck(
                unsafe {
                    sys::cuMemHostRegister_v2(
                        (base + off as usize) as *mut c_void,
                        n as usize,
                        sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                    )
                },
                "cuMemHostRegister",
            )
        });
        if let Err(e) = r {
            *p.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
            // Release pairs with `wait_pinned`'s Acquire load.
            st.store(2, Ordering::Release);
        } else {
            st.store(1, Ordering::Release);
        }
    }
}

fn refuse(s: impl Into<String>) -> Refusal {
    (Status::InvalidArgument, s.into())
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn code(&self) -> u32 {
        2
    }

    fn device_uuids(&self) -> Vec<[u8; 16]> {
        let mut v: Vec<[u8; 16]> = self
            .devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    fn job_events(&self, slot: u32, uuid: &[u8; 16]) -> Result<Vec<[u8; 64]>, Status> {
        let dev = self.device(uuid).ok_or(Status::InvalidArgument)?;
        self.events_of(slot, &dev)
            .map(|je| je.handles.clone())
            .map_err(|e| {
                eprintln!("kvring: job events: {e}");
                Status::ServerError
            })
    }

    fn client_gone(&self, slot: u32) {
        self.job_events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| k.0 != slot);
    }

    fn engine(&self) -> Result<Box<dyn Engine>, String> {
        Ok(Box::new(CudaEngine {
            be: self as *const CudaBackend,
            depth: depth(),
            per_dev: HashMap::new(),
            slots: Vec::new(),
            events: HashMap::new(),
            host_done: Vec::new(),
        }))
    }

    fn open_device(
        &self,
        slot: u32,
        req: &RegisterKv,
        regions: &[CudaRegion],
        fds: &[OwnedFd],
    ) -> Result<(Vec<Tensor>, InstanceDevice), Refusal> {
        let dev = self.device(&req.device_uuid).ok_or_else(|| {
            refuse(format!(
                "no device with UUID {} on this server",
                crate::cuda::hex(&req.device_uuid)
            ))
        })?;
        let bytes = req.layout.tensor_bytes();
        let mut tensors = Vec::with_capacity(regions.len());
        let mut bases = Vec::with_capacity(regions.len());
        for (i, r) in regions.iter().enumerate() {
            let mem = if req.mem_kind == MemKind::CudaIpc as u32 {
                self.open_ipc(slot, &dev, &r.ipc_handle)
            } else {
                let fd = fds.get(r.fd_index as usize).ok_or_else(|| {
                    refuse(format!("tensor {i}: descriptor {} not sent", r.fd_index))
                })?;
                self.import_fd(slot, &dev, fd, r)
            }
            .map_err(|e| refuse(format!("tensor {i}: {e}")))?;
            let end = r.offset.checked_add(bytes);
            if end.is_none_or(|e| e > mem.size) {
                return Err(refuse(format!(
                    "tensor {i}: [{}, +{bytes}) exceeds its allocation of {} bytes",
                    r.offset, mem.size
                )));
            }
            bases.push(mem.base + r.offset);
            tensors.push(Tensor::Device(DeviceTensor {
                dptr: mem.base + r.offset,
                bytes,
                memory: mem,
            }));
        }
        let table = DevBuf::new(&dev.ctx, bases.len() * 8).map_err(refuse)?;
        ck(
            // SAFETY: `table` holds `bases.len()` words.
            unsafe {
                sys::cuMemcpyHtoD_v2(table.ptr, bases.as_ptr() as *const c_void, bases.len() * 8)
            },
            "cuMemcpyHtoD",
        )
        .map_err(refuse)?;
        Ok((tensors, InstanceDevice { dev, bases: table }))
    }
}

impl CudaBackend {
    fn open_ipc(
        &self,
        slot: u32,
        dev: &Arc<DeviceRes>,
        handle: &[u8; 64],
    ) -> Result<Arc<OpenedMemory>, String> {
        let mut opened = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        opened.retain(|_, w| w.strong_count() > 0);
        if let Some(m) = opened.get(&(slot, *handle)).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(OpenedMemory::open_ipc(&dev.ctx, handle)?);
        opened.insert((slot, *handle), Arc::downgrade(&m));
        Ok(m)
    }

    fn import_fd(
        &self,
        _slot: u32,
        dev: &Arc<DeviceRes>,
        fd: &OwnedFd,
        r: &CudaRegion,
    ) -> Result<Arc<OpenedMemory>, String> {
        Ok(Arc::new(OpenedMemory::import_vmm_fd(
            &dev.ctx,
            fd.as_raw_fd(),
            r.alloc_bytes,
        )?))
    }
}

struct Slot {
    staging: Option<DevBuf>,
    ids_dev: DevBuf,
    /// Pinned host memory for the block ids (`cuMemAllocHost`).
    ids_host: *mut u32,
    ids_cap: usize,
    event: sys::CUevent,
    busy: Option<(usize, u64, Instant)>,
}

struct DevEngine {
    res: Arc<DeviceRes>,
    stream: sys::CUstream,
    slots: Vec<Slot>,
}

/// One worker's CUDA engine: a stream and two staging slots per device.
struct CudaEngine {
    be: *const CudaBackend,
    depth: usize,
    per_dev: HashMap<i32, DevEngine>,
    /// token -> (device ordinal, slot index)
    slots: Vec<(i32, usize)>,
    /// Engines' IPC events opened by this worker.
    events: HashMap<[u8; 64], sys::CUevent>,
    /// Copies of host-memory engines, done in `submit`.
    host_done: Vec<(usize, Result<u64, String>)>,
}

impl CudaEngine {
    fn be(&self) -> &CudaBackend {
        // SAFETY: the backend outlives every worker (workers are joined
        // before the server's state is dropped).
        unsafe { &*self.be }
    }

    fn dev_engine(&mut self, res: &Arc<DeviceRes>) -> Result<&mut DevEngine, String> {
        let ord = res.ctx.info.ordinal;
        #[allow(clippy::map_entry)] // the entry is built fallibly below
        if !self.per_dev.contains_key(&ord) {
            res.ctx.bind()?;
            let mut stream = std::ptr::null_mut();
            // SAFETY: valid out-pointers.
            unsafe {
                ck(
                    sys::cuStreamCreate(
                        &mut stream,
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    ),
                    "cuStreamCreate",
                )?;
            }
            let mut slots = Vec::new();
            for _ in 0..self.depth {
                let mut event = std::ptr::null_mut();
                let mut host = std::ptr::null_mut();
                let cap = 4096usize;
                // SAFETY: valid out-pointers.
                unsafe {
                    ck(
                        sys::cuEventCreate(
                            &mut event,
                            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                        ),
                        "cuEventCreate",
                    )?;
                    ck(sys::cuMemAllocHost_v2(&mut host, cap * 4), "cuMemAllocHost")?;
                }
                slots.push(Slot {
                    staging: None,
                    ids_dev: DevBuf::new(&res.ctx, cap * 4)?,
                    ids_host: host as *mut u32,
                    ids_cap: cap,
                    event,
                    busy: None,
                });
            }
            self.per_dev.insert(
                ord,
                DevEngine {
                    res: res.clone(),
                    stream,
                    slots,
                },
            );
        }
        Ok(self.per_dev.get_mut(&ord).expect("inserted"))
    }
}

impl Engine for CudaEngine {
    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), String> {
        let Some(dev) = c.inst.device.as_ref() else {
            // An engine in host memory: the host copy, done now.
            let r = super::copier::host_copy(c);
            self.host_done.push((token, r));
            return Ok(());
        };
        let l = c.layout;
        let obj_bytes = l.object_bytes(c.chunk_tokens);
        let pool_off = (c.object as usize - self.be().pool_base) as u64;
        if pool_off + obj_bytes > self.be().pool_len {
            return Err("object outside the pool".into());
        }
        self.be().wait_pinned(pool_off, obj_bytes)?;
        let event = match c.event {
            Some(h) => Some(self.engine_event(&dev.dev, &h)?),
            None => None,
        };
        let bases = dev.bases.ptr;
        dev.dev.ctx.bind()?;
        let zero_copy = self.be().zero_copy_ctas;
        let gate = match &c.publish {
            Some(p) => Some(self.be().events_of(p.owner_slot, &dev.dev)?),
            None => None,
        };
        let de = self.dev_engine(&dev.dev)?;
        let k = de
            .slots
            .iter()
            .position(|s| s.busy.is_none())
            .ok_or("no free staging slot")?;
        let stream = de.stream;
        let slot = &mut de.slots[k];
        let slot_event = slot.event;
        if zero_copy == 0
            && slot
                .staging
                .as_ref()
                .is_none_or(|s| (s.bytes as u64) < obj_bytes)
        {
            slot.staging = None;
            slot.staging = Some(DevBuf::new(&de.res.ctx, obj_bytes as usize)?);
        }
        let n = c.blocks.len();
        if n > slot.ids_cap {
            return Err(format!("{n} blocks per chunk exceed {}", slot.ids_cap));
        }
        // SAFETY: `ids_host` holds `ids_cap` u32s and the previous transfer
        // from it finished (the slot is free: its event completed).
        unsafe { std::ptr::copy_nonoverlapping(c.blocks.as_ptr(), slot.ids_host, n) };
        let staging = slot.staging.as_ref().map_or(0, |s| s.ptr);
        let args = KvCopyArgs {
            kind: l.kind,
            num_layers: l.num_layers,
            parts: l.parts(),
            num_blocks: l.num_blocks,
            blocks_per_chunk: n as u32,
            skip_blocks: c.skip_blocks,
            slab_bytes: l.slab_bytes(),
            to_engine: u32::from(c.dir == Dir::FromPool),
            _pad: 0,
        };
        // SAFETY: every address is live: the instance's tensors and table
        // (the worker holds the task, which holds the instance), the pool
        // object (pinned, allocated to this job), the slot's buffers; the
        // block ids were checked against `num_blocks` at acceptance.
        unsafe {
            if let Some(ev) = event {
                ck(sys::cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")?;
            }
            ck(
                sys::cuMemcpyHtoDAsync_v2(
                    slot.ids_dev.ptr,
                    slot.ids_host as *const c_void,
                    n * 4,
                    stream,
                ),
                "cuMemcpyHtoDAsync ids",
            )?;
            match c.dir {
                // Zero-copy: the kernel reads or writes the pinned pool
                // object itself (registered device-mapped; with unified
                // addressing its device address is its host address).
                _ if zero_copy > 0 => {
                    de.res.kernels.launch(
                        stream,
                        bases,
                        slot.ids_dev.ptr,
                        c.object as u64,
                        args,
                        zero_copy,
                    )?;
                }
                Dir::ToPool => {
                    de.res
                        .kernels
                        .launch(stream, bases, slot.ids_dev.ptr, staging, args, 0)?;
                    ck(
                        sys::cuMemcpyDtoHAsync_v2(
                            c.object as *mut c_void,
                            staging,
                            obj_bytes as usize,
                            stream,
                        ),
                        "cuMemcpyDtoHAsync",
                    )?;
                }
                Dir::FromPool => {
                    ck(
                        sys::cuMemcpyHtoDAsync_v2(
                            staging,
                            c.object as *const c_void,
                            obj_bytes as usize,
                            stream,
                        ),
                        "cuMemcpyHtoDAsync",
                    )?;
                    de.res
                        .kernels
                        .launch(stream, bases, slot.ids_dev.ptr, staging, args, 0)?;
                }
            }
            ck(sys::cuEventRecord(slot.event, stream), "cuEventRecord")?;
        }
        if let (Some(p), Some(je)) = (&c.publish, gate) {
            // The gate waits for this chunk now (capturing this record); the
            // last chunk queued records the job event after all of them.
            ck(
                // SAFETY: live stream and event of this context.
                unsafe { sys::cuStreamWaitEvent(je.gate, slot_event, 0) },
                "cuStreamWaitEvent gate",
            )?;
            // AcqRel: every other chunk's gate wait happens before the last
            // decrement, so the record below comes after all of them.
            if p.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                let k = je.next.fetch_add(1, Ordering::Relaxed) as usize % je.events.len();
                ck(
                    // SAFETY: live event and stream of this context.
                    unsafe { sys::cuEventRecord(je.events[k], je.gate) },
                    "cuEventRecord job event",
                )?;
                (p.done)(k as u64 + 1);
            }
        }
        let moved = u64::from(l.parts())
            * u64::from(l.num_layers)
            * (n as u64 - u64::from(c.skip_blocks.min(n as u32)))
            * l.slab_bytes();
        slot.busy = Some((token, moved, Instant::now()));
        if self.slots.len() <= token {
            self.slots.resize(token + 1, (0, 0));
        }
        self.slots[token] = (dev.dev.ctx.info.ordinal, k);
        Ok(())
    }

    fn poll(&mut self, wait: bool, out: &mut Vec<(usize, Result<u64, String>)>) {
        out.append(&mut self.host_done);
        let mut spins = 0u32;
        loop {
            let mut any_busy = false;
            for de in self.per_dev.values_mut() {
                for s in de.slots.iter_mut() {
                    let Some((token, moved, started)) = s.busy else {
                        continue;
                    };
                    // SAFETY: an event of this slot's context.
                    let r = unsafe { sys::cuEventQuery(s.event) };
                    if r == sys::CUresult::CUDA_SUCCESS {
                        s.busy = None;
                        out.push((token, Ok(moved)));
                    } else if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                        if started.elapsed() > COPY_DEADLINE {
                            // The device never finished: this slot's buffers
                            // may still be in use, so it stays busy forever.
                            s.busy = Some((usize::MAX, 0, Instant::now() + COPY_DEADLINE * 1000));
                            out.push((
                                token,
                                Err("the device did not finish the copy in 60 s".into()),
                            ));
                        } else {
                            any_busy = true;
                        }
                    } else {
                        s.busy = None;
                        out.push((token, Err(format!("copy failed on the device: {r:?}"))));
                    }
                }
            }
            if !wait || !out.is_empty() || !any_busy {
                return;
            }
            // Spin briefly (a chunk takes ~0.1-1 ms), then sleep in short
            // steps: the worker has nothing else to do.
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(5));
            }
        }
    }
}

impl CudaEngine {
    fn engine_event(&mut self, dev: &Arc<DeviceRes>, h: &[u8; 64]) -> Result<sys::CUevent, String> {
        if let Some(e) = self.events.get(h) {
            return Ok(*e);
        }
        dev.ctx.bind()?;
        // SAFETY: a 64-byte handle as the driver defines it.
        let ev = unsafe {
            let mut handle: sys::CUipcEventHandle = std::mem::zeroed();
            for (d, s) in handle.reserved.iter_mut().zip(h) {
                *d = *s as _;
            }
            let mut ev = std::ptr::null_mut();
            ck(
                sys::cuIpcOpenEventHandle(&mut ev, handle),
                "cuIpcOpenEventHandle",
            )?;
            ev
        };
        self.events.insert(*h, ev);
        Ok(ev)
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        for de in self.per_dev.values() {
            let _ = de.res.ctx.bind();
            // SAFETY: destroys what `dev_engine` created, after the stream
            // drained.
            unsafe {
                let _ = sys::cuStreamSynchronize(de.stream);
                for s in &de.slots {
                    let _ = sys::cuEventDestroy_v2(s.event);
                    let _ = sys::cuMemFreeHost(s.ids_host as *mut c_void);
                }
                let _ = sys::cuStreamDestroy_v2(de.stream);
            }
        }
        for ev in self.events.values() {
            // SAFETY: events opened by `engine_event`.
            unsafe {
                let _ = sys::cuEventDestroy_v2(*ev);
            }
        }
    }
}
