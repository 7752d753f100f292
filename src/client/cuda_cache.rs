//! The engine's side of the CUDA data plane: a paged KV cache in device
//! memory, as an engine allocates it for kvring (all tensors in one
//! allocation, exported either as a legacy CUDA IPC handle, `cuMemAlloc`
//! memory, or as a VMM allocation's POSIX fd, what PyTorch's expandable
//! segments hand out), the engine's stream, the interprocess event it
//! records after its writes, and the server's job events opened here. Used
//! by GPU engines written in Rust, the tests and the demo.
#![cfg(feature = "cuda")]

use crate::device::{DeviceUuid, IpcEventHandle};
use crate::gpu::{Context, DeviceBuffer, Event, EventKind, ExportedVmm, Stream};
use crate::kv::pattern::Slabs;
use crate::kv::KvLayout;
use crate::proto::kv::CudaRegion;
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
    Ipc { buf: DeviceBuffer, handle: [u8; 64] },
    Vmm(ExportedVmm),
}

/// A device KV cache an engine owns.
pub struct CudaKvCache {
    layout: KvLayout,
    ctx: Arc<Context>,
    base: u64,
    size: u64,
    stride: u64,
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
        let stride = layout.tensor_bytes().div_ceil(1 << 16) << 16;
        let want = stride * u64::from(layout.num_tensors());
        let alloc = match export {
            Export::Ipc => {
                let buf = DeviceBuffer::new(&ctx, want as usize)?;
                let handle = buf.ipc_handle()?;
                Alloc::Ipc { buf, handle }
            }
            Export::VmmFd => Alloc::Vmm(ExportedVmm::new(&ctx, want)?),
        };
        let (base, size) = match &alloc {
            Alloc::Ipc { buf, .. } => (buf.ptr(), want),
            Alloc::Vmm(v) => (v.ptr(), v.bytes()),
        };
        Ok(CudaKvCache {
            layout,
            ctx,
            base,
            size,
            stride,
            alloc,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn device_uuid(&self) -> DeviceUuid {
        DeviceUuid::from_bytes(self.ctx.info.uuid)
    }

    pub fn export(&self) -> Export {
        match self.alloc {
            Alloc::Ipc { .. } => Export::Ipc,
            Alloc::Vmm(_) => Export::VmmFd,
        }
    }

    /// The VMM allocation's fd (sent with the registration), if any.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.alloc {
            Alloc::Vmm(v) => Some(v.fd()),
            Alloc::Ipc { .. } => None,
        }
    }

    /// Where each tensor lives (for registration).
    pub fn regions(&self) -> Vec<CudaRegion> {
        let ipc_handle = match &self.alloc {
            Alloc::Ipc { handle, .. } => *handle,
            Alloc::Vmm(_) => [0; 64],
        };
        (0..self.layout.num_tensors())
            .map(|i| CudaRegion {
                ipc_handle,
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
        let at = self.slab_addr(layer, part, block);
        // SAFETY: `at` addresses one slab (`bytes.len()` bytes, checked
        // above) inside this cache's allocation (`slab_addr` checks the
        // coordinates; tensors tile the allocation by `stride`).
        unsafe { self.ctx.copy_htod(at, bytes) }?;
        Ok(())
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
        let at = self.slab_addr(layer, part, block);
        // SAFETY: as in `write_slab`: one slab inside the allocation.
        unsafe { self.ctx.copy_dtoh(out, at) }?;
        Ok(())
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

    /// Device address of the first tensor (tensor `i` is at `i * stride`,
    /// the stride being `tensor_bytes` rounded up to 64 KiB).
    pub fn device_base(&self) -> u64 {
        self.base
    }
}

impl Slabs for CudaKvCache {
    fn slab_layout(&self) -> &KvLayout {
        self.layout()
    }
    fn put_slab(&self, layer: u32, part: u32, block: u32, bytes: &[u8]) {
        self.write_slab(layer, part, block, bytes)
            .expect("write a slab to the device")
    }
    fn get_slab(&self, layer: u32, part: u32, block: u32, out: &mut [u8]) {
        self.read_slab(layer, part, block, out)
            .expect("read a slab from the device")
    }
}

/// A stream of the engine's own, for asynchronous work the server must be
/// ordered after (through an [`IpcEvent`]).
pub struct EngineStream {
    stream: Stream,
}

impl EngineStream {
    pub fn new(cache: &CudaKvCache) -> crate::Result<EngineStream> {
        Ok(EngineStream {
            stream: Stream::new(&cache.ctx)?,
        })
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

    /// Makes this stream wait (on the device) for the server's job event
    /// `index` (the job's `progress` - 1).
    pub fn wait_server_event(&self, events: &ServerEvents, index: u32) -> crate::Result<()> {
        let ev = events
            .events
            .get(index as usize)
            .ok_or_else(|| crate::Error::Protocol(format!("job event {index} out of range")))?;
        Ok(self.stream.wait_event(ev)?)
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

/// An interprocess event: the engine records it after its writes, sends
/// its handle with a STORE (or RETRIEVE), and the server's copies wait for it
/// on the device.
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

/// The server's job events for this engine (see `Opcode::JobEvents`),
/// opened in the engine's context.
pub struct ServerEvents {
    events: Vec<Event>,
}

impl ServerEvents {
    /// Opens the handles a `Client::job_events` call returned.
    pub fn open(cache: &CudaKvCache, handles: &[IpcEventHandle]) -> crate::Result<ServerEvents> {
        let events = handles
            .iter()
            .map(|h| Event::open_ipc(&cache.ctx, h))
            .collect::<Result<_, _>>()?;
        Ok(ServerEvents { events })
    }
}
