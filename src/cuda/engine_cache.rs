//! A paged KV cache in device memory, as an engine allocates it for kvring:
//! all tensors in one allocation, exported either as a legacy CUDA IPC
//! handle (`cuMemAlloc` memory) or as a VMM allocation's POSIX fd (what
//! PyTorch's expandable segments hand out). Used by GPU engines written in
//! Rust, the tests and the demo.

use super::{ck, sys, Context};
use crate::kv::KvLayout;
use crate::proto::kv::CudaRegion;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

/// How the cache's memory is shared with the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Export {
    /// `cuMemAlloc` + `cuIpcGetMemHandle`.
    Ipc,
    /// `cuMemCreate` (POSIX fd handle type) + `cuMemExportToShareableHandle`.
    VmmFd,
}

enum Alloc {
    Ipc,
    Vmm {
        handle: sys::CUmemGenericAllocationHandle,
        fd: OwnedFd,
    },
}

/// A device KV cache an engine owns.
pub struct CudaKvCache {
    layout: KvLayout,
    ctx: Arc<Context>,
    base: u64,
    size: u64,
    stride: u64,
    alloc: Alloc,
    ipc: [u8; 64],
}

// SAFETY: device addresses used with the owning context bound.
unsafe impl Send for CudaKvCache {}
// SAFETY: as above.
unsafe impl Sync for CudaKvCache {}

fn round(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
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
            .map_err(crate::Error::Config)?;
        let ctx = Context::by_ordinal(ordinal).map_err(crate::Error::Cuda)?;
        ctx.bind().map_err(crate::Error::Cuda)?;
        let stride = round(layout.tensor_bytes(), 1 << 16);
        let want = stride * u64::from(layout.num_tensors());
        let r = match export {
            Export::Ipc => Self::alloc_ipc(want),
            Export::VmmFd => Self::alloc_vmm(&ctx, want),
        };
        let (base, size, alloc, ipc) = r.map_err(crate::Error::Cuda)?;
        Ok(CudaKvCache {
            layout,
            ctx,
            base,
            size,
            stride,
            alloc,
            ipc,
        })
    }

    fn alloc_ipc(size: u64) -> Result<(u64, u64, Alloc, [u8; 64]), String> {
        // SAFETY: driver calls with valid out-pointers.
        unsafe {
            let mut p = 0;
            ck(sys::cuMemAlloc_v2(&mut p, size as usize), "cuMemAlloc")?;
            let mut h: sys::CUipcMemHandle = std::mem::zeroed();
            if let Err(e) = ck(sys::cuIpcGetMemHandle(&mut h, p), "cuIpcGetMemHandle") {
                let _ = sys::cuMemFree_v2(p);
                return Err(e);
            }
            Ok((p, size, Alloc::Ipc, h.reserved.map(|b| b as u8)))
        }
    }

    fn alloc_vmm(ctx: &Context, want: u64) -> Result<(u64, u64, Alloc, [u8; 64]), String> {
        // SAFETY: driver calls with valid pointers; failures release what
        // was taken.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = ctx.info.ordinal;
            let mut gran = 0usize;
            ck(
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            )?;
            let size = round(want, gran as u64);
            let mut handle = 0;
            ck(
                sys::cuMemCreate(&mut handle, size as usize, &prop, 0),
                "cuMemCreate",
            )?;
            let mut va = 0;
            if let Err(e) = ck(
                sys::cuMemAddressReserve(&mut va, size as usize, 0, 0, 0),
                "cuMemAddressReserve",
            ) {
                let _ = sys::cuMemRelease(handle);
                return Err(e);
            }
            let mapped = ck(sys::cuMemMap(va, size as usize, 0, handle, 0), "cuMemMap");
            let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = ctx.info.ordinal;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            let access = mapped.and_then(|()| {
                ck(
                    sys::cuMemSetAccess(va, size as usize, &desc, 1),
                    "cuMemSetAccess",
                )
            });
            let mut fd: i32 = -1;
            let exported = access.and_then(|()| {
                ck(
                    sys::cuMemExportToShareableHandle(
                        &mut fd as *mut i32 as *mut c_void,
                        handle,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    ),
                    "cuMemExportToShareableHandle",
                )
            });
            if let Err(e) = exported {
                let _ = sys::cuMemUnmap(va, size as usize);
                let _ = sys::cuMemAddressFree(va, size as usize);
                let _ = sys::cuMemRelease(handle);
                return Err(e);
            }
            Ok((
                va,
                size,
                Alloc::Vmm {
                    handle,
                    fd: OwnedFd::from_raw_fd(fd),
                },
                [0; 64],
            ))
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn device_uuid(&self) -> crate::DeviceUuid {
        crate::DeviceUuid::from_bytes(self.ctx.info.uuid)
    }

    pub fn export(&self) -> Export {
        match self.alloc {
            Alloc::Ipc => Export::Ipc,
            Alloc::Vmm { .. } => Export::VmmFd,
        }
    }

    /// The VMM allocation's fd (sent with the registration), if any.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.alloc {
            Alloc::Vmm { fd, .. } => Some(std::os::fd::AsFd::as_fd(fd)),
            Alloc::Ipc => None,
        }
    }

    /// Where each tensor lives (for registration).
    pub fn regions(&self) -> Vec<CudaRegion> {
        (0..self.layout.num_tensors())
            .map(|i| CudaRegion {
                ipc_handle: self.ipc,
                offset: u64::from(i) * self.stride,
                alloc_bytes: self.size,
                fd_index: 0,
                _reserved: 0,
            })
            .collect()
    }

    fn slab_addr(&self, layer: u32, part: u32, block: u32) -> u64 {
        let l = &self.layout;
        assert!(layer < l.num_layers && part < l.parts() && block < l.num_blocks);
        let (t, off) = l.slab_at(layer, part, block);
        self.base + u64::from(t) * self.stride + off
    }

    /// Writes one slab; the bytes are in device memory when it returns.
    pub fn write_slab(&self, layer: u32, part: u32, block: u32, bytes: &[u8]) -> crate::Result<()> {
        assert_eq!(bytes.len() as u64, self.layout.slab_bytes());
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        let at = self.slab_addr(layer, part, block);
        // SAFETY: `at` addresses one slab inside our allocation.
        ck(
            unsafe { sys::cuMemcpyHtoD_v2(at, bytes.as_ptr() as *const c_void, bytes.len()) },
            "cuMemcpyHtoD",
        )
        .map_err(crate::Error::Cuda)?;
        // From pageable memory the copy returns once the bytes are staged,
        // possibly before the DMA into device memory is done; the server
        // (another process, another stream) may read them right after this
        // returns, so wait for it.
        // SAFETY: no arguments.
        ck(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize").map_err(crate::Error::Cuda)
    }

    /// Reads one slab (synchronously).
    pub fn read_slab(
        &self,
        layer: u32,
        part: u32,
        block: u32,
        out: &mut [u8],
    ) -> crate::Result<()> {
        assert_eq!(out.len() as u64, self.layout.slab_bytes());
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        let at = self.slab_addr(layer, part, block);
        // SAFETY: as in `write_slab`.
        ck(
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, at, out.len()) },
            "cuMemcpyDtoH",
        )
        .map_err(crate::Error::Cuda)
    }

    /// Sets every byte of the cache to `byte`.
    pub fn fill(&self, byte: u8) -> crate::Result<()> {
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: the whole allocation.
        let r = unsafe { sys::cuMemsetD8_v2(self.base, byte, self.size as usize) };
        ck(r, "cuMemsetD8").map_err(crate::Error::Cuda)?;
        // SAFETY: no arguments.
        ck(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize").map_err(crate::Error::Cuda)
    }

    pub fn bytes(&self) -> u64 {
        self.size
    }

    /// Device address of the first tensor (tensor `i` is at `i * stride`,
    /// the stride being `tensor_bytes` rounded up to 64 KiB).
    pub fn device_base(&self) -> u64 {
        self.base
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees what `new` allocated.
        unsafe {
            match &self.alloc {
                Alloc::Ipc => {
                    let _ = sys::cuMemFree_v2(self.base);
                }
                Alloc::Vmm { handle, .. } => {
                    let _ = sys::cuMemUnmap(self.base, self.size as usize);
                    let _ = sys::cuMemAddressFree(self.base, self.size as usize);
                    let _ = sys::cuMemRelease(*handle);
                }
            }
        }
    }
}

/// A stream of the engine's own, for asynchronous work the server must be
/// ordered after (through an [`IpcEvent`]).
pub struct EngineStream {
    ctx: Arc<Context>,
    stream: sys::CUstream,
}

// SAFETY: a stream handle, used with its context bound.
unsafe impl Send for EngineStream {}

impl EngineStream {
    pub fn new(cache: &CudaKvCache) -> crate::Result<EngineStream> {
        cache.ctx.bind().map_err(crate::Error::Cuda)?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ck(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )
        .map_err(crate::Error::Cuda)?;
        Ok(EngineStream {
            ctx: cache.ctx.clone(),
            stream,
        })
    }

    /// Queues setting every byte of `cache` to `byte`.
    pub fn fill_async(&self, cache: &CudaKvCache, byte: u8) -> crate::Result<()> {
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: the whole allocation of a live cache.
        ck(
            unsafe { sys::cuMemsetD8Async(cache.base, byte, cache.size as usize, self.stream) },
            "cuMemsetD8Async",
        )
        .map_err(crate::Error::Cuda)
    }

    /// Waits for everything queued.
    pub fn synchronize(&self) -> crate::Result<()> {
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: a live stream.
        ck(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
        .map_err(crate::Error::Cuda)
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys the stream created in `new`.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.stream);
            let _ = sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// An interprocess event: the engine records it after its writes, sends
/// its handle with a STORE (or RETRIEVE), and the server's copies wait for it
/// on the device.
pub struct IpcEvent {
    ctx: Arc<Context>,
    event: sys::CUevent,
    handle: [u8; 64],
}

// SAFETY: an event handle, used with its context bound.
unsafe impl Send for IpcEvent {}

impl IpcEvent {
    pub fn new(cache: &CudaKvCache) -> crate::Result<IpcEvent> {
        cache.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: valid out-pointers.
        unsafe {
            let mut event = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
                | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            ck(sys::cuEventCreate(&mut event, flags), "cuEventCreate")
                .map_err(crate::Error::Cuda)?;
            let mut h: sys::CUipcEventHandle = std::mem::zeroed();
            ck(
                sys::cuIpcGetEventHandle(&mut h, event),
                "cuIpcGetEventHandle",
            )
            .map_err(crate::Error::Cuda)?;
            Ok(IpcEvent {
                ctx: cache.ctx.clone(),
                event,
                handle: h.reserved.map(|b| b as u8),
            })
        }
    }

    /// Records the event on `stream` (after what is queued there).
    pub fn record(&self, stream: &EngineStream) -> crate::Result<()> {
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: live event and stream of this context.
        ck(
            unsafe { sys::cuEventRecord(self.event, stream.stream) },
            "cuEventRecord",
        )
        .map_err(crate::Error::Cuda)
    }

    /// The handle to send to the server.
    pub fn handle(&self) -> crate::IpcEventHandle {
        crate::IpcEventHandle::from_bytes(self.handle)
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys the event created in `new`.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.event);
        }
    }
}

/// The server's job events for this engine (see `Opcode::JobEvents`),
/// opened in the engine's context.
pub struct ServerEvents {
    ctx: Arc<Context>,
    events: Vec<sys::CUevent>,
}

// SAFETY: event handles, used with their context bound.
unsafe impl Send for ServerEvents {}

impl ServerEvents {
    /// Opens the handles a `Client::job_events` call returned.
    pub fn open(
        cache: &CudaKvCache,
        handles: &[crate::IpcEventHandle],
    ) -> crate::Result<ServerEvents> {
        cache.ctx.bind().map_err(crate::Error::Cuda)?;
        let mut events = Vec::with_capacity(handles.len());
        for h in handles {
            // SAFETY: a 64-byte handle as the driver defines it.
            let ev = unsafe {
                let mut handle: sys::CUipcEventHandle = std::mem::zeroed();
                for (d, s) in handle.reserved.iter_mut().zip(h.as_bytes()) {
                    *d = *s as _;
                }
                let mut ev = std::ptr::null_mut();
                ck(
                    sys::cuIpcOpenEventHandle(&mut ev, handle),
                    "cuIpcOpenEventHandle",
                )
                .map_err(crate::Error::Cuda)?;
                ev
            };
            events.push(ev);
        }
        Ok(ServerEvents {
            ctx: cache.ctx.clone(),
            events,
        })
    }
}

impl Drop for ServerEvents {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        for ev in &self.events {
            // SAFETY: events opened in `open`.
            unsafe {
                let _ = sys::cuEventDestroy_v2(*ev);
            }
        }
    }
}

impl EngineStream {
    /// Makes this stream wait (on the device) for the server's job event
    /// `index` (the job's `progress` - 1).
    pub fn wait_server_event(&self, events: &ServerEvents, index: u32) -> crate::Result<()> {
        let ev = *events
            .events
            .get(index as usize)
            .ok_or_else(|| crate::Error::Protocol(format!("job event {index} out of range")))?;
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: live stream and event of this context.
        ck(
            unsafe { sys::cuStreamWaitEvent(self.stream, ev, 0) },
            "cuStreamWaitEvent",
        )
        .map_err(crate::Error::Cuda)
    }

    /// Queues copying all of `src` into `dst` (caches of equal size).
    pub fn copy_cache_async(&self, src: &CudaKvCache, dst: &CudaKvCache) -> crate::Result<()> {
        assert_eq!(src.size, dst.size);
        self.ctx.bind().map_err(crate::Error::Cuda)?;
        // SAFETY: two live allocations of `size` bytes.
        ck(
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst.base, src.base, src.size as usize, self.stream)
            },
            "cuMemcpyDtoDAsync",
        )
        .map_err(crate::Error::Cuda)
    }
}
