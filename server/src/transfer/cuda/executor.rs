//! One worker's CUDA executor: per device a stream per direction and [`DEPTH`] staging
//! slots, each slot one chunk in flight.
//!
//! [`DEPTH`]: super::DEPTH

use super::devices::{BackendState, CudaDevice, DeviceTable};
use super::COPY_DEADLINE;
use crate::registry::Registration;
use crate::transfer::backend::{ChunkCopy, CopyError, CopyExecutor};
use crate::transfer::host::{host_copy, RunBuffers};
use crate::transfer::job::Dir;
use kvring::device::IpcEventHandle;
use kvring::gpu::kernels::KvCopyArgs;
use kvring::gpu::{DeviceBuffer, Event, EventKind, PinnedHostBuffer, Stream};
use kvring::job_words::{self, Words};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most block ids one chunk may carry (the slots' id buffers).
const MAX_CHUNK_BLOCKS: usize = 4096;
/// Most engine events a worker keeps open.
const MAX_OPEN_EVENTS: usize = 1024;

/// Where a staging slot stands.
enum SlotState {
    Free,
    /// A chunk's copy is queued: its token, the bytes it moves, since when.
    Busy {
        token: usize,
        moved: u64,
        started: Instant,
    },
    /// A copy here never finished, or queuing it failed part way: the
    /// slot's buffers may still be in use. With `recorded`, its event was
    /// recorded after whatever was queued, and the slot is free again once
    /// that completes; without, it is never used again.
    Wedged {
        recorded: bool,
    },
}

/// One chunk in flight on a device: its staging buffer (grown to the
/// largest object; none on the zero-copy path), its block ids in pinned
/// host memory and on the device, and the event recorded after its copy.
struct StagingSlot {
    staging: Option<DeviceBuffer>,
    ids_dev: DeviceBuffer,
    ids_host: PinnedHostBuffer,
    event: Event,
    state: SlotState,
}

/// One worker's queue on one device: a stream per direction and its
/// staging slots. A store's device-to-host transfer and a retrieve's
/// host-to-device one never wait for each other in one stream's order, so
/// both copy engines (PCIe is full duplex) run when stores and retrieves
/// are in flight together.
struct DeviceQueue {
    /// Drained and destroyed first (declaration order), so no queued copy
    /// still uses the slots' buffers when they are freed.
    streams: [Stream; 2],
    device: Arc<CudaDevice>,
    slots: Vec<StagingSlot>,
}

impl DeviceQueue {
    fn new(device: &Arc<CudaDevice>, depth: usize) -> Result<DeviceQueue, CopyError> {
        let ctx = &device.ctx;
        let streams = [Stream::new(ctx)?, Stream::new(ctx)?];
        let mut slots = Vec::with_capacity(depth);
        for _ in 0..depth {
            slots.push(StagingSlot {
                staging: None,
                // The block ids, then the job-words gate's verdict.
                ids_dev: DeviceBuffer::new(ctx, MAX_CHUNK_BLOCKS * 4 + 4)?,
                ids_host: PinnedHostBuffer::new(ctx, MAX_CHUNK_BLOCKS * 4)?,
                event: Event::new(ctx, EventKind::Local)?,
                state: SlotState::Free,
            });
        }
        Ok(DeviceQueue {
            streams,
            device: device.clone(),
            slots,
        })
    }

    /// Stage: takes a free slot, puts the chunk's block ids in its pinned
    /// buffer and makes sure its staging buffer holds `obj_bytes`.
    fn stage(
        &mut self,
        c: &ChunkCopy<'_>,
        obj_bytes: u64,
        zero_copy: bool,
    ) -> Result<usize, CopyError> {
        let k = self
            .slots
            .iter()
            .position(|s| matches!(s.state, SlotState::Free))
            .ok_or(CopyError::NoFreeSlot)?;
        let slot = &mut self.slots[k];
        if !zero_copy
            && slot
                .staging
                .as_ref()
                .is_none_or(|s| (s.bytes() as u64) < obj_bytes)
        {
            slot.staging = None;
            slot.staging = Some(DeviceBuffer::new(&self.device.ctx, obj_bytes as usize)?);
        }
        let n = c.blocks.len();
        if n > MAX_CHUNK_BLOCKS {
            return Err(CopyError::TooManyBlocks {
                blocks: n,
                capacity: MAX_CHUNK_BLOCKS,
            });
        }
        // SAFETY: `ids_host` holds `MAX_CHUNK_BLOCKS` u32s (n fit, checked
        // above), and the previous transfer from it finished (the slot is
        // free: its event completed); the two buffers cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                c.blocks.as_ptr() as *const u8,
                slot.ids_host.as_mut_ptr(),
                n * 4,
            )
        };
        Ok(k)
    }

    /// Enqueue copy: on the stream, the block ids to the device, the
    /// kernel and the transfer (or the zero-copy kernel), then the slot's
    /// event. The stream never waits on anything another process records:
    /// a copy after an engine's event is enqueued only once the worker saw
    /// that event complete (`engine_event_ready`).
    ///
    /// The kernel enters the job's words (`words`: their device address)
    /// and checks its `cancel` before it touches the engine's memory, and
    /// the stream writes the job's `done[worker]` right after it. `gated`
    /// is set once the gate is queued (from then on the job's words may be
    /// written by the device).
    #[allow(clippy::too_many_arguments)]
    fn enqueue_copy(
        &mut self,
        k: usize,
        c: &ChunkCopy<'_>,
        table: &DeviceTable,
        span: &LayerSpan,
        zero_copy_ctas: u32,
        words: u64,
        gated: &mut bool,
    ) -> Result<(), CopyError> {
        let n = c.blocks.len();
        let slot = &self.slots[k];
        let stream = &self.streams[usize::from(c.dir == Dir::FromPool)];
        let kernels = &self.device.kernels;
        let staging = slot.staging.as_ref().map_or(0, |s| s.ptr());
        let obj_bytes = span.bytes;
        let src_object = span.object;
        let layers = table.layers.ptr() + span.table_offset;
        let ids = slot.ids_dev.ptr();
        let object = if zero_copy_ctas > 0 {
            src_object as u64
        } else {
            staging
        };
        let vec = table.align.min(kvring::kv::plan::align_of(object));
        let mut args = KvCopyArgs::new(
            &c.inst.plan,
            span.layers,
            n as u32,
            c.chunk_tokens,
            c.skip_blocks,
            c.dir == Dir::FromPool,
            vec,
        );
        let (entry, worker) = (c.word.job.entry, c.word.worker);
        let at = |off: usize| words + Words::offset(entry, off) as u64;
        args.entered = at(job_words::ENTERED + 4 * worker as usize);
        args.cancel = at(job_words::CANCEL);
        args.verdict = ids + MAX_CHUNK_BLOCKS as u64 * 4;
        args.seq = c.word.seq;
        args.generation = c.word.job.generation;
        let done = at(job_words::DONE + 4 * worker as usize);
        // SAFETY: `ids_host` holds the `n` ids staged for this slot and is
        // not touched again until the slot's event completes; `ids_dev`
        // holds `MAX_CHUNK_BLOCKS` >= n ids.
        unsafe { stream.copy_htod_async(ids, slot.ids_host.as_ptr(), n * 4) }?;
        // SAFETY: `entered` and `cancel` are in the job's words, registered
        // and mapped while the task holds the job's client memory (until
        // the slot's event, recorded after this); `verdict` is the word
        // after the ids in `ids_dev`, which has room for it.
        unsafe { kernels.gate(stream, args) }?;
        *gated = true;
        // Every address below stays valid until the slot's event completes
        // (recorded after them on this stream): the registration's memory
        // and its layer table (the worker holds the task, which
        // holds the registration), the pool object (pinned, allocated to
        // this job for `obj_bytes` bytes; no other copy touches it until the
        // job ends), the slot's `ids` and `staging` (`staging` holds
        // `obj_bytes`, reused only once the slot is free again).
        match c.dir {
            // Zero-copy: the kernel reads or writes the pinned pool object
            // itself (registered device-mapped; with unified addressing its
            // device address is its host address).
            _ if zero_copy_ctas > 0 => {
                // SAFETY: `layers` and `ids` are live device tables of this
                // registration and slot; the block ids are below the
                // layout's block count (checked at acceptance) and the
                // layout was validated against the opened memory; `vec`
                // divides every address (the table's alignment and the
                // object's); the pool object is device-mapped and
                // `object_bytes` long, what the kernel addresses for these
                // `args`.
                unsafe { kernels.launch(stream, layers, ids, object, args, zero_copy_ctas) }?;
                // SAFETY: `done` is in the job's words, registered and
                // mapped while the job's client memory lives (the task
                // holds it until the slot's event, recorded after this).
                unsafe { stream.write_value(done, c.word.seq) }?;
            }
            Dir::ToPool => {
                // SAFETY: as for the zero-copy launch, with the slot's
                // `staging` (`obj_bytes` of device memory) as the object.
                unsafe { kernels.launch(stream, layers, ids, staging, args, 0) }?;
                // SAFETY: as for the zero-copy path's write.
                unsafe { stream.write_value(done, c.word.seq) }?;
                // SAFETY: `staging` holds `obj_bytes` device bytes, the
                // pinned pool object as many host bytes.
                unsafe { stream.copy_dtoh_async(src_object, staging, obj_bytes as usize) }?;
            }
            Dir::FromPool => {
                // SAFETY: the pinned pool object holds `obj_bytes` host
                // bytes, `staging` as many device bytes.
                unsafe { stream.copy_htod_async(staging, src_object, obj_bytes as usize) }?;
                // SAFETY: as for the zero-copy launch, with the slot's
                // `staging` (`obj_bytes` of device memory) as the object.
                unsafe { kernels.launch(stream, layers, ids, staging, args, 0) }?;
                // SAFETY: as for the zero-copy path's write.
                unsafe { stream.write_value(done, c.word.seq) }?;
            }
        }
        slot.event.record(stream)?;
        Ok(())
    }
}

/// The part of a chunk object one copy moves: the layers `c.layers` (the
/// object is `[layer][token][head][K then V]`, so they are one run of it)
/// and where their entries start in the registration's layer table.
struct LayerSpan {
    object: *mut u8,
    bytes: u64,
    layers: u32,
    table_offset: u64,
}

impl LayerSpan {
    fn of(c: &ChunkCopy<'_>, obj_bytes: u64) -> LayerSpan {
        let all = u64::from(c.inst.layout.geometry().layers);
        let per_layer = obj_bytes / all;
        let (first, layers) = (u64::from(c.layers.start), c.layers.len() as u64);
        debug_assert!(first + layers <= all && per_layer * all == obj_bytes);
        LayerSpan {
            // SAFETY: inside the object (`first + layers <= all`: the task's
            // layers are a layer group of the registration's layers).
            object: unsafe { c.object.add((first * per_layer) as usize) },
            bytes: layers * per_layer,
            layers: layers as u32,
            table_offset: first * std::mem::size_of::<kvring::gpu::kernels::LayerEntry>() as u64,
        }
    }
}

/// One worker's CUDA executor: a stream and [`super::DEPTH`] staging slots
/// per device it has copied on.
pub(super) struct CudaExecutor {
    per_dev: HashMap<i32, DeviceQueue>,
    backend: Arc<BackendState>,
    /// Inference engines' IPC events opened by this worker.
    client_events: HashMap<[u8; 64], Arc<Event>>,
    /// Copies of engines in host memory, done in `submit`.
    host_done: Vec<(usize, Result<u64, CopyError>)>,
    /// The host copy's run buffers.
    runs: RunBuffers,
}

impl CudaExecutor {
    pub(super) fn new(backend: Arc<BackendState>) -> CudaExecutor {
        CudaExecutor {
            per_dev: HashMap::new(),
            backend,
            client_events: HashMap::new(),
            host_done: Vec::new(),
            runs: RunBuffers::default(),
        }
    }

    fn device_queue(&mut self, dev: &Arc<CudaDevice>) -> Result<&mut DeviceQueue, CopyError> {
        let depth = self.backend.depth;
        match self.per_dev.entry(dev.ctx.info.ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                Ok(e.insert(DeviceQueue::new(dev, depth)?))
            }
        }
    }

    /// The inference engine's event `h` (that its writes are done), opened
    /// in `dev`'s context at first use.
    fn client_ready_event(
        &mut self,
        dev: &CudaDevice,
        h: &[u8; 64],
    ) -> Result<Arc<Event>, CopyError> {
        if let Some(e) = self.client_events.get(h) {
            return Ok(e.clone());
        }
        // Engines come and go, each with events of its own: past a bound
        // the cache starts over (an engine's events are opened again at
        // their next use, a few microseconds), so the events of engines
        // long gone are not kept open for the server's life.
        if self.client_events.len() >= MAX_OPEN_EVENTS {
            self.client_events.clear();
        }
        let ev = Arc::new(Event::open_ipc(&dev.ctx, &IpcEventHandle::from_bytes(*h))?);
        self.client_events.insert(*h, ev.clone());
        Ok(ev)
    }
}

impl CopyExecutor for CudaExecutor {
    fn depth(&self) -> usize {
        self.backend.depth
    }

    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), CopyError> {
        let Some(table) = c
            .inst
            .device
            .as_ref()
            .and_then(|d| d.downcast_ref::<DeviceTable>())
        else {
            // An engine in host memory: the host copy, done now.
            let r = host_copy(c, &mut self.runs);
            self.host_done.push((token, r));
            return Ok(());
        };
        let obj_bytes = c.inst.layout.object_bytes(c.chunk_tokens);
        self.backend.pinned_pool_offset(c.object, obj_bytes)?;
        let span = LayerSpan::of(c, obj_bytes);
        let words = c.word.job.memory.words_device_ptr(&table.device.ctx)?;
        let zero_copy_ctas = self.backend.zero_copy_ctas;
        let queue = self.device_queue(&table.device)?;
        let k = queue.stage(c, span.bytes, zero_copy_ctas > 0)?;
        let mut gated = false;
        let r = queue.enqueue_copy(k, c, table, &span, zero_copy_ctas, words, &mut gated);
        if let Err(e) = r {
            // Part of the copy may be queued: the slot is used again only
            // once an event recorded after it completes (never, if that
            // cannot be recorded). Once the gate is queued the job's words
            // may still be written and its kernel may still run: the job is
            // never taken for over (`CopyError::may_still_run`).
            let stream = &queue.streams[usize::from(c.dir == Dir::FromPool)];
            let slot = &mut queue.slots[k];
            let recorded = slot.event.record(stream).is_ok();
            slot.state = SlotState::Wedged { recorded };
            return Err(match e {
                CopyError::Device(e) if gated => CopyError::Unsettled(e),
                other => other,
            });
        }
        let n = c.blocks.len() as u64;
        let g = c.inst.layout.geometry();
        let moved = u64::from(span.layers) * (n - u64::from(c.skip_blocks).min(n)) * g.page_bytes();
        queue.slots[k].state = SlotState::Busy {
            token,
            moved,
            started: Instant::now(),
        };
        Ok(())
    }

    fn engine_event_ready(
        &mut self,
        inst: &Registration,
        handle: &[u8; 64],
    ) -> Result<bool, CopyError> {
        let Some(table) = inst
            .device
            .as_ref()
            .and_then(|d| d.downcast_ref::<DeviceTable>())
        else {
            // An engine in host memory has no device event to order after.
            return Ok(true);
        };
        let ev = self.client_ready_event(&table.device, handle)?;
        // `cuEventQuery`: a host-side look, about 32 ns; never a device wait.
        Ok(ev.query()?)
    }

    fn poll(&mut self, wait: bool, out: &mut Vec<(usize, Result<u64, CopyError>)>) {
        out.append(&mut self.host_done);
        let mut spins = 0u32;
        loop {
            let mut any_busy = false;
            for q in self.per_dev.values_mut() {
                for s in q.slots.iter_mut() {
                    // A wedged slot whose work has finished after all is
                    // used again (its copy's job stays wedged).
                    if let SlotState::Wedged { recorded: true } = s.state {
                        if s.event.query() == Ok(true) {
                            s.state = SlotState::Free;
                        }
                        continue;
                    }
                    let SlotState::Busy {
                        token,
                        moved,
                        started,
                    } = s.state
                    else {
                        continue;
                    };
                    match s.event.query() {
                        Ok(true) => {
                            s.state = SlotState::Free;
                            out.push((token, Ok(moved)));
                        }
                        Ok(false) if started.elapsed() > COPY_DEADLINE => {
                            s.state = SlotState::Wedged { recorded: true };
                            out.push((token, Err(CopyError::Timeout(COPY_DEADLINE))));
                        }
                        Ok(false) => any_busy = true,
                        Err(e) => {
                            // Whether the copy ran is unknown: the slot's
                            // buffers may still be in use.
                            s.state = SlotState::Wedged { recorded: false };
                            out.push((token, Err(CopyError::Unsettled(e))));
                        }
                    }
                }
            }
            if !wait || !out.is_empty() || !any_busy {
                return;
            }
            // Spin briefly (a chunk takes ~0.1-1 ms), then sleep in short
            // steps: the worker takes nothing new until a copy finishes.
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(5));
            }
        }
    }
}
