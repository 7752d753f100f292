//! The engine's side of the CUDA data plane: a paged KV cache in device
//! memory, as an engine allocates it for kvring (all tensors in one
//! allocation, exported either as a legacy CUDA IPC handle, `cuMemAlloc`
//! memory, or as a VMM allocation's POSIX fd, what PyTorch's expandable
//! segments hand out), the engine's stream (which can wait on the device
//! for a job, through its job word), and the interprocess event it records
//! after its writes. Used by GPU engines written in Rust, the tests and the
//! demo.
#![cfg(feature = "cuda")]

use super::registration::Memory;
use crate::device::{DeviceUuid, IpcEventHandle};
use crate::gpu::{Context, DeviceBuffer, Event, EventKind, ExportedVmm, HostRegistration, Stream};
pub use crate::gpu::HostWord;
use crate::kv::pattern::{KvMemory, Run};
use crate::kv::KvLayout;
use crate::proto::kv::MemoryPiece;
use std::sync::Arc;

/// How the cache's memory is shared with the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Export {
    /// `cuMemAlloc` + `cuIpcGetMemHandle`.
    Ipc,
    /// `cuMemCreate` (POSIX fd handle type) + `cuMemExportToShareableHandle`,
    /// one chunk.
    VmmFd,
    /// As `VmmFd`, in chunks of this many bytes mapped contiguously, one fd
    /// each (PyTorch's expandable segments: 20 MiB).
    VmmChunks(u64),
}

enum Alloc {
    Ipc { _buf: DeviceBuffer, handle: [u8; 64] },
    Vmm(ExportedVmm),
}

/// A device KV cache an engine owns: every allocation of its layout in one
/// device allocation, each at a 64 KiB-aligned offset (as a caching
/// allocator places tensors in a larger block).
pub struct CudaKvCache {
    layout: KvLayout,
    ctx: Arc<Context>,
    base: u64,
    size: u64,
    offsets: Vec<u64>,
    alloc: Alloc,
}

impl CudaKvCache {
    /// Allocates a cache for `layout` on device `ordinal`.
    pub fn new(
        layout: KvLayout,
        chunk_tokens: u32,
        ordinal: i32,
        export: Export,
    ) -> crate::Result<Self> {
        layout
            .validate(chunk_tokens)
            .map_err(|e| crate::Error::InvalidArgument(e.to_string()))?;
        let ctx = Context::by_ordinal(ordinal)?;
        let mut offsets = Vec::with_capacity(layout.allocations().len());
        let mut want = 0u64;
        for &b in layout.allocations() {
            offsets.push(want);
            want += b.div_ceil(1 << 16) << 16;
        }
        let alloc = match export {
            Export::Ipc => {
                let buf = DeviceBuffer::new(&ctx, want as usize)?;
                let handle = buf.ipc_handle()?;
                Alloc::Ipc { _buf: buf, handle }
            }
            Export::VmmFd => Alloc::Vmm(ExportedVmm::new(&ctx, want)?),
            Export::VmmChunks(chunk) => Alloc::Vmm(ExportedVmm::chunked(&ctx, want, chunk)?),
        };
        let (base, size) = match &alloc {
            Alloc::Ipc { _buf, .. } => (_buf.ptr(), want),
            Alloc::Vmm(v) => (v.ptr(), v.bytes()),
        };
        Ok(CudaKvCache {
            layout,
            ctx,
            base,
            size,
            offsets,
            alloc,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn device_uuid(&self) -> DeviceUuid {
        DeviceUuid::from_bytes(self.ctx.info.uuid)
    }

    /// The VMM chunks' fds (sent with the registration); none for IPC.
    pub fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        match &self.alloc {
            Alloc::Vmm(v) => v.fds(),
            Alloc::Ipc { .. } => Vec::new(),
        }
    }

    /// VMM chunks the memory is exported as (IPC: 0).
    pub fn chunks(&self) -> usize {
        self.fds().len()
    }

    /// Where each allocation lives (for registration): at its offset of the
    /// IPC allocation, or in the VMM chunks that cover it.
    pub fn memory(&self) -> Memory {
        match &self.alloc {
            Alloc::Ipc { handle, .. } => Memory::cuda_ipc(self.offsets.iter().map(|&o| (*handle, o))),
            Alloc::Vmm(v) => {
                let chunk = v.chunk_bytes();
                let pieces: Vec<(u64, MemoryPiece)> = self
                    .offsets
                    .iter()
                    .zip(self.layout.allocations())
                    .map(|(&o, &b)| {
                        let (first, last) = (o / chunk, (o + b - 1) / chunk);
                        (
                            o - first * chunk,
                            MemoryPiece {
                                first_fd: first as u32,
                                n_fds: (last - first + 1) as u32,
                                fd_offset: 0,
                                fd_bytes: chunk,
                            },
                        )
                    })
                    .collect();
                Memory::cuda_vmm(pieces.iter().map(|(o, p)| (*o, std::slice::from_ref(p))))
            }
        }
    }

    /// The device range `[lo, hi)` (offsets from `base`) covering `runs`.
    fn span(&self, runs: &[Run]) -> Option<(u64, u64)> {
        let sizes = self.layout.allocations();
        let mut span: Option<(u64, u64)> = None;
        for r in runs {
            assert!(r.offset + r.bytes <= sizes[r.alloc as usize], "run outside its allocation");
            let lo = self.offsets[r.alloc as usize] + r.offset;
            let hi = lo + r.bytes;
            span = Some(span.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
        }
        span
    }

    /// The device bytes the runs span (from offset `lo` of the cache), read
    /// in one copy; none for no runs.
    fn image(&self, runs: &[Run]) -> Option<(u64, Vec<u8>)> {
        let (lo, hi) = self.span(runs)?;
        let mut img = vec![0u8; (hi - lo) as usize];
        // SAFETY: `[base + lo, base + hi)` lies inside this cache's
        // allocation (`span` checks each run against its allocation).
        unsafe { self.ctx.copy_dtoh(&mut img, self.base + lo) }.expect("read the KV cache");
        Some((lo, img))
    }

    /// Where each run starts in an image read from offset `lo`.
    fn places<'a>(&'a self, runs: &'a [Run], lo: u64) -> impl Iterator<Item = usize> + 'a {
        runs.iter()
            .map(move |r| (self.offsets[r.alloc as usize] + r.offset - lo) as usize)
    }

    /// Sets every byte of the cache to `byte`.
    pub fn fill(&self, byte: u8) -> crate::Result<()> {
        // SAFETY: exactly this cache's allocation, `size` bytes at `base`.
        unsafe { self.ctx.memset_d8(self.base, byte, self.size as usize) }?;
        Ok(())
    }

    pub fn bytes(&self) -> u64 {
        self.size
    }

    /// Device address of the first allocation.
    pub fn device_base(&self) -> u64 {
        self.base
    }

    /// Device address of each allocation of the layout, in order.
    pub fn addresses(&self) -> Vec<u64> {
        self.offsets.iter().map(|o| self.base + o).collect()
    }
}

impl KvMemory for CudaKvCache {
    fn kv_layout(&self) -> &KvLayout {
        self.layout()
    }

    /// One read of the range the runs span, patched, one write back: the
    /// bytes are in device memory when it returns.
    fn write_runs(&self, runs: &[Run], src: &[u8]) {
        let Some((lo, mut img)) = self.image(runs) else {
            return;
        };
        for (r, at) in runs.iter().zip(self.places(runs, lo)) {
            img[at..at + r.bytes as usize]
                .copy_from_slice(&src[r.at as usize..][..r.bytes as usize]);
        }
        // SAFETY: `img` is the range `image` read, inside this cache's
        // allocation.
        unsafe { self.ctx.copy_htod(self.base + lo, &img) }.expect("write the KV cache");
    }

    /// One read of the range the runs span.
    fn read_runs(&self, runs: &[Run], dst: &mut [u8]) {
        let Some((lo, img)) = self.image(runs) else {
            return;
        };
        for (r, at) in runs.iter().zip(self.places(runs, lo)) {
            dst[r.at as usize..][..r.bytes as usize]
                .copy_from_slice(&img[at..at + r.bytes as usize]);
        }
    }
}

/// A stream of the engine's own, for asynchronous work the server must be
/// ordered after (through an [`IpcEvent`]), or that must come after a job
/// ([`EngineStream::wait_job`]).
pub struct EngineStream {
    /// Declared first: drained (on drop) before the gates are freed.
    stream: Stream,
    /// Words this stream waits (or waited) on: kept allocated as long as
    /// the stream, and set to `u32::MAX` before it drains on drop, so no
    /// wait outlives them and dropping never hangs on one.
    gates: std::sync::Mutex<Vec<Arc<HostWord>>>,
    /// Jobs this stream waited for (their connection, entry, generation):
    /// each connection (its job words' mapping and registration) is kept
    /// while the stream lives, and a job not released yet is given up on
    /// drop, so dropping never hangs on one.
    jobs: std::sync::Mutex<Vec<(Arc<super::connect::Link>, u32, u32)>>,
}

impl EngineStream {
    pub fn new(cache: &CudaKvCache) -> crate::Result<EngineStream> {
        Ok(EngineStream {
            stream: Stream::new(&cache.ctx)?,
            gates: Default::default(),
            jobs: Default::default(),
        })
    }

    /// Another library's stream (a torch stream's `cuda_stream`, any
    /// engine's) on device `ordinal`, for [`EngineStream::wait_job`]:
    /// dropping this gives up the jobs it waited for that are not released
    /// yet and drains the stream, which stays its owner's.
    ///
    /// # Safety
    ///
    /// `raw` is a live stream of device `ordinal`'s primary context (0: the
    /// legacy default stream) and outlives the returned value.
    pub unsafe fn borrow(ordinal: i32, raw: u64) -> crate::Result<EngineStream> {
        let ctx = crate::gpu::Context::by_ordinal(ordinal)
            .map_err(|e| crate::Error::Config(format!("CUDA device {ordinal}: {e}")))?;
        Ok(EngineStream {
            // SAFETY: the caller's contract.
            stream: unsafe { Stream::borrowed(&ctx, raw) },
            gates: Default::default(),
            jobs: Default::default(),
        })
    }

    /// A new word (holding 0) for [`EngineStream::wait_word`], in this
    /// stream's context.
    pub fn host_word(&self) -> crate::Result<Arc<HostWord>> {
        Ok(Arc::new(HostWord::new(self.stream.context())?))
    }

    /// Makes later work on this stream wait (on the device) until `word`
    /// holds at least `at_least`: a gate this process opens with
    /// [`HostWord::set`]. (An engine that holds back its own writes, or a
    /// test that plays an engine whose stream is stuck.)
    pub fn wait_word(&self, word: &Arc<HostWord>, at_least: u32) -> crate::Result<()> {
        let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the word is kept (in `gates`) until the stream has
        // drained on drop, after it was set past every wait.
        unsafe { self.stream.wait_word(word, at_least) }?;
        if !gates.iter().any(|g| Arc::ptr_eq(g, word)) {
            gates.push(word.clone());
        }
        Ok(())
    }

    /// Queues setting every byte of `cache` to `byte`.
    pub fn fill_async(&self, cache: &CudaKvCache, byte: u8) -> crate::Result<()> {
        // SAFETY: the whole allocation of `cache`; the stream is drained
        // before it is destroyed, and a cache outliving its queued fills is
        // the caller's ordering (as with any engine write).
        unsafe {
            self.stream
                .memset_d8_async(cache.base, byte, cache.size as usize)
        }?;
        Ok(())
    }

    /// Waits for everything queued.
    pub fn synchronize(&self) -> crate::Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Makes later work on this stream wait (on the device) until `job` (a
    /// STORE or RETRIEVE) is over: the server releases the job's word once
    /// every copy of it has ended (done or failed; ask the job which), and
    /// the client library releases it itself when it gives the job up (at
    /// its deadline, or when the server dies or stops: a watcher thread of
    /// the client does, whatever this process's threads are doing), only
    /// once no copy of it can touch the engine's memory any more. So the
    /// stream never waits for a server that died or stalled beyond the
    /// job's timeout, and never runs ahead of the copies. Keep the waits of
    /// one process on one stream: a few streams blocked on the device stall
    /// all of a process's GPU work. Dropping the stream gives up the jobs it
    /// waited for that are not released yet (a store given up that way does
    /// not commit).
    pub fn wait_job(&self, job: &super::Job) -> crate::Result<()> {
        let Some((entry, g)) = job.word() else {
            return Err(crate::Error::InvalidArgument(
                "only a STORE or RETRIEVE can be waited for on a stream".into(),
            ));
        };
        self.wait_job_word(job, entry, crate::job_words::GO, g)
    }

    /// Makes later work on this stream wait (on the device) until layer
    /// group `group` of `job` (a RETRIEVE in layer groups,
    /// `Retrieve::layer_groups`) landed, with every group before it: the
    /// server moves the job's `landed` word as each group's copies end, and
    /// the client library moves it to the end whenever it releases the
    /// job's `go` (a give-up at the deadline, a server that died or
    /// stopped), so this wait is bounded as [`EngineStream::wait_job`]'s
    /// is. The layers of group `k` are `LayerGroups::range(k)`.
    pub fn wait_layer_group(&self, job: &super::Job, group: u32) -> crate::Result<()> {
        let Some((entry, target)) = job.landed_target(group) else {
            return Err(crate::Error::InvalidArgument(format!(
                "layer group {group}: the job has {} (a RETRIEVE's, counted from 0)",
                job.layer_groups()
            )));
        };
        self.wait_job_word(job, entry, crate::job_words::LANDED, target)
    }

    /// Queues a wait for word `off` of the job's entry to reach `target`.
    fn wait_job_word(
        &self,
        job: &super::Job,
        entry: u32,
        off: usize,
        target: u32,
    ) -> crate::Result<()> {
        let (_, g) = job.word().expect("a job with job words");
        let link = job.link();
        let base = {
            let mut r = link
                .words_registered
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                let (ptr, bytes) = link
                    .seg
                    .memory()
                    .words_range()
                    .expect("a client's memory is mapped writable");
                // SAFETY: the job words are mapped readable and writable
                // for the link's life; the registration is dropped before
                // the mapping (field order in `Link`).
                *r = Some(unsafe { HostRegistration::new(self.stream.context(), ptr, bytes) }?);
            }
            r.as_ref().expect("registered").device_ptr()?
        };
        let word = base + crate::job_words::Words::offset(entry, off) as u64;
        // Watched before the wait is queued: a wait nobody would release at
        // the job's deadline is never queued (a release moves `go` and
        // `landed` to the job's end).
        link.words.watch(link, entry, g)?;
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the word stays mapped and registered while this stream
        // lives (its link is kept in `jobs`), and it is released on drop
        // before the stream drains.
        unsafe { self.stream.wait_value(word, target) }?;
        // Released jobs need no give-up on drop: only one entry per link
        // is kept for them (the waits they queued may not have run yet, so
        // each link's words stay mapped until the stream drains on drop).
        let mut seen: Vec<*const super::connect::Link> = Vec::new();
        jobs.retain(|(l, e, g)| {
            let first = !seen.contains(&Arc::as_ptr(l));
            if first {
                seen.push(Arc::as_ptr(l));
            }
            first || !l.words().released(*e, *g)
        });
        if !jobs
            .iter()
            .any(|(l, e, gg)| Arc::ptr_eq(l, link) && *e == entry && *gg == g)
        {
            jobs.push((link.clone(), entry, g));
        }
        Ok(())
    }

    /// Queues copying all of `src` into `dst` (caches of equal size).
    pub fn copy_cache_async(&self, src: &CudaKvCache, dst: &CudaKvCache) -> crate::Result<()> {
        assert_eq!(src.size, dst.size);
        // SAFETY: two live allocations of `size` bytes each.
        unsafe {
            self.stream
                .copy_dtod_async(dst.base, src.base, src.size as usize)
        }?;
        Ok(())
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        // Open every gate first: the stream drains when it is destroyed.
        for w in self.gates.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            w.set(u32::MAX);
        }
        // Jobs still running are given up, all at once (their copies stop
        // touching the engine's memory), which releases their words.
        let jobs = self.jobs.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut links: Vec<&Arc<super::connect::Link>> = Vec::new();
        for (l, _, _) in jobs.iter() {
            if !links.iter().any(|k| Arc::ptr_eq(k, l)) {
                links.push(l);
            }
        }
        for link in links {
            let due: Vec<_> = jobs
                .iter()
                .filter(|(l, e, g)| Arc::ptr_eq(l, link) && !l.words().released(*e, *g))
                .map(|&(_, e, g)| (e, g, super::GaveUp::Asked))
                .collect();
            if !due.is_empty() {
                link.words.give_up_all_within(link, &due, super::QUIESCE_BOUND);
            }
        }
        // Drained here, while the links (the words' mappings) are still
        // held: nothing on the device reads them afterwards.
        let _ = self.stream.synchronize();
    }
}

/// An interprocess event: the engine records it after its writes and sends
/// its handle with a STORE (or RETRIEVE); the server queues the job's copies
/// once it sees the event complete (it polls it from the host). Do not
/// record it again before that job has left `Pending`: a query sees only the
/// event's last record (keep a few events and use them in turn).
pub struct IpcEvent {
    event: Event,
    handle: IpcEventHandle,
}

impl IpcEvent {
    pub fn new(cache: &CudaKvCache) -> crate::Result<IpcEvent> {
        let event = Event::new(&cache.ctx, EventKind::Interprocess)?;
        let handle = event.ipc_handle()?;
        Ok(IpcEvent { event, handle })
    }

    /// Records the event on `stream` (after what is queued there).
    pub fn record(&self, stream: &EngineStream) -> crate::Result<()> {
        Ok(self.event.record(&stream.stream)?)
    }

    /// The handle to send to the server.
    pub fn handle(&self) -> IpcEventHandle {
        self.handle
    }
}
