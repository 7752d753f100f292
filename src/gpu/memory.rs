//! Memory: device buffers, pinned host memory, VMM allocations exported as
//! POSIX fds, and other processes' device memory opened here.

use super::{check, sys, Context, CudaError};
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

impl Context {
    /// Copies `src` to device address `dst` and returns once it is there.
    ///
    /// # Safety
    /// `dst` must address `src.len()` bytes of device memory of this
    /// context that nothing else writes meanwhile.
    pub unsafe fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        check(
            // SAFETY: the caller's contract; `src` is a live slice.
            unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()) },
            "cuMemcpyHtoD",
        )?;
        // From pageable memory the copy returns once the bytes are staged,
        // possibly before the DMA into device memory is done; another
        // process (another stream) may read them right after this returns,
        // so wait for it.
        self.synchronize()
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst`.
    ///
    /// # Safety
    /// `src` must address `dst.len()` bytes of device memory of this
    /// context.
    pub unsafe fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's contract; `dst` is a live, exclusive slice.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    /// Sets `bytes` bytes at `dst` to `byte` and returns once done.
    ///
    /// # Safety
    /// `dst` must address `bytes` bytes of device memory of this context
    /// that nothing else accesses meanwhile.
    pub unsafe fn memset_d8(&self, dst: u64, byte: u8, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        check(
            // SAFETY: the caller's contract.
            unsafe { sys::cuMemsetD8_v2(dst, byte, bytes) },
            "cuMemsetD8",
        )?;
        self.synchronize()
    }
}

/// Device memory from `cuMemAlloc` (which, unlike stream-ordered memory,
/// can be exported by IPC handle), freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<Context>,
    ptr: u64,
    bytes: usize,
}

// SAFETY: a device address, used with its context bound.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&DeviceBuffer` gives only the address and size, and synchronous
// copies the driver serializes.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` bytes (at least 16) in `ctx`.
    pub fn new(ctx: &Arc<Context>, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        ctx.bind()?;
        let mut ptr = 0;
        check(
            // SAFETY: `ptr` is a valid out-pointer; freed in `Drop`.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(16)) },
            "cuMemAlloc",
        )?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `src` to the start of the buffer (synchronously).
    pub fn write(&self, src: &[u8]) -> Result<(), CudaError> {
        assert!(src.len() <= self.bytes, "a write past a device buffer");
        // SAFETY: `src.len()` bytes fit in this allocation (checked above).
        unsafe { self.ctx.copy_htod(self.ptr, src) }
    }

    /// The 64-byte legacy IPC handle other processes open this buffer with.
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        self.ctx.bind()?;
        // SAFETY: `CUipcMemHandle` is 64 plain bytes; all-zero is valid.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: `h` is a valid out-pointer; `ptr` is this allocation.
            unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        Ok(h.reserved.map(|b| b as u8))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees what `new` allocated, once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Pinned host memory from `cuMemAllocHost`, freed on drop.
pub struct PinnedHostBuffer {
    ctx: Arc<Context>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: host memory owned by this value; access goes through `&mut self`
// or raw pointers whose users follow the asynchronous-copy contracts.
unsafe impl Send for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// Allocates `bytes` bytes of pinned host memory in `ctx`.
    pub fn new(ctx: &Arc<Context>, bytes: usize) -> Result<PinnedHostBuffer, CudaError> {
        ctx.bind()?;
        let mut ptr = std::ptr::null_mut();
        check(
            // SAFETY: `ptr` is a valid out-pointer; freed in `Drop`.
            unsafe { sys::cuMemAllocHost_v2(&mut ptr, bytes.max(1)) },
            "cuMemAllocHost",
        )?;
        Ok(PinnedHostBuffer {
            ctx: ctx.clone(),
            ptr: ptr as *mut u8,
            bytes,
        })
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees what `new` allocated, once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr as *mut c_void) };
    }
}

/// A host range registered with the driver (`cuMemHostRegister`, portable
/// and device-mapped), so copies to and from it run at the link's speed;
/// unregistered on drop.
pub struct HostRegistration {
    ctx: Arc<Context>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: only the address of a registration the driver keeps and the
// context it was made in; `drop` binds that context on whatever thread it
// runs.
unsafe impl Send for HostRegistration {}
// SAFETY: `&HostRegistration` exposes nothing but the range.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `[ptr, ptr + bytes)` while `ctx` is bound.
    ///
    /// # Safety
    /// The range must be mapped, readable and writable, and stay mapped
    /// until this registration is dropped (or the process exits).
    pub unsafe fn new(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        bytes: usize,
    ) -> Result<HostRegistration, CudaError> {
        ctx.bind()?;
        check(
            // SAFETY: the caller's contract; portable, so every context sees
            // the range pinned.
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr as *mut c_void,
                    bytes,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            },
            "cuMemHostRegister",
        )?;
        Ok(HostRegistration {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The range's device address (the same in every context).
    pub fn device_ptr(&self) -> Result<u64, CudaError> {
        self.ctx.bind()?;
        let mut dev = 0u64;
        check(
            // SAFETY: the range is registered device-mapped; `dev` is a
            // valid out-pointer.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, self.ptr as *mut c_void, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(dev)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // The driver unregisters in the current context: the one that
        // registered. Without it bound the call would fail and leave the
        // range pinned.
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: unregisters what `new` registered, once, with its context
        // bound; the range is still mapped (`new`'s contract).
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) };
    }
}

/// VMM allocations (chunks) mapped one after another in one reserved range,
/// with read-write access for the context's device: unmapped, freed and
/// released on drop, whatever step a failure stopped at.
struct VmmMapping {
    ctx: Arc<Context>,
    va: u64,
    size: u64,
    /// Every chunk's handle (owned: released on drop) and size.
    chunks: Vec<(sys::CUmemGenericAllocationHandle, u64)>,
    /// Whether `va .. va + size` is reserved.
    reserved: bool,
    /// Chunks mapped so far (the first `mapped` of `chunks`).
    mapped: usize,
}

impl VmmMapping {
    /// Maps `chunks` (handles taken over: released on every path) in order,
    /// contiguously, for `ctx`'s device.
    fn map(
        ctx: &Arc<Context>,
        chunks: Vec<(sys::CUmemGenericAllocationHandle, u64)>,
    ) -> Result<VmmMapping, CudaError> {
        let size = chunks.iter().map(|c| c.1).sum();
        // From here `Drop` undoes whatever was done.
        let mut m = VmmMapping {
            ctx: ctx.clone(),
            va: 0,
            size,
            chunks,
            reserved: false,
            mapped: 0,
        };
        ctx.bind()?;
        check(
            // SAFETY: `va` is a valid out-pointer; the range is freed in
            // `Drop`.
            unsafe { sys::cuMemAddressReserve(&mut m.va, size as usize, 0, 0, 0) },
            "cuMemAddressReserve",
        )?;
        m.reserved = true;
        let mut at = m.va;
        for &(handle, bytes) in &m.chunks {
            check(
                // SAFETY: maps the chunk into the range reserved above, after
                // the chunks before it (the driver fails it if the chunk is
                // smaller than `bytes`).
                unsafe { sys::cuMemMap(at, bytes as usize, 0, handle, 0) },
                "cuMemMap",
            )?;
            m.mapped += 1;
            at += bytes;
        }
        // SAFETY: `CUmemAccessDesc` is plain data; all-zero is valid.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = ctx.info.ordinal;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        check(
            // SAFETY: the range mapped above; `desc` is one valid descriptor.
            unsafe { sys::cuMemSetAccess(m.va, size as usize, &desc, 1) },
            "cuMemSetAccess",
        )?;
        Ok(m)
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let mut at = self.va;
        for &(_, bytes) in &self.chunks[..self.mapped] {
            // SAFETY: unmaps a chunk `map` mapped, once.
            let _ = unsafe { sys::cuMemUnmap(at, bytes as usize) };
            at += bytes;
        }
        if self.reserved {
            // SAFETY: frees the range `map` reserved, once.
            let _ = unsafe { sys::cuMemAddressFree(self.va, self.size as usize) };
        }
        for &(handle, _) in &self.chunks {
            // SAFETY: releases a handle this mapping took over, once.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
    }
}

/// Device memory allocated with `cuMemCreate` for export as POSIX fds, in
/// one chunk or several mapped contiguously (what PyTorch's expandable
/// segments hand out: one fd per 20 MiB chunk), mapped here.
pub struct ExportedVmm {
    mapping: VmmMapping,
    fds: Vec<OwnedFd>,
    chunk: u64,
}

// SAFETY: a device address and fds, used with the context bound.
unsafe impl Send for ExportedVmm {}
// SAFETY: `&ExportedVmm` gives only the address, sizes and fds.
unsafe impl Sync for ExportedVmm {}

impl ExportedVmm {
    /// Allocates at least `want` bytes (rounded up to the allocation
    /// granularity) on `ctx`'s device as one chunk and exports it.
    pub fn new(ctx: &Arc<Context>, want: u64) -> Result<ExportedVmm, CudaError> {
        ExportedVmm::chunked(ctx, want, u64::MAX)
    }

    /// Allocates at least `want` bytes on `ctx`'s device in chunks of
    /// `chunk` bytes (rounded up to the granularity; the last one as
    /// large), mapped contiguously, and exports each chunk.
    pub fn chunked(ctx: &Arc<Context>, want: u64, chunk: u64) -> Result<ExportedVmm, CudaError> {
        ctx.bind()?;
        // SAFETY: `CUmemAllocationProp` is plain data; all-zero is valid.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ctx.info.ordinal;
        let mut gran = 0usize;
        check(
            // SAFETY: `gran` is a valid out-pointer, `prop` a valid property.
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        let gran = gran as u64;
        let want = want.max(1).div_ceil(gran) * gran;
        let chunk = chunk.min(want).div_ceil(gran) * gran;
        let mut handles = Vec::new();
        let mut made = 0;
        while made < want {
            let mut handle = 0;
            let r = check(
                // SAFETY: `handle` is a valid out-pointer; the mapping below
                // (or the cleanup on failure) takes it over.
                unsafe { sys::cuMemCreate(&mut handle, chunk as usize, &prop, 0) },
                "cuMemCreate",
            );
            if let Err(e) = r {
                for (h, _) in handles {
                    // SAFETY: a handle created above, released once.
                    let _ = unsafe { sys::cuMemRelease(h) };
                }
                return Err(e);
            }
            handles.push((handle, chunk));
            made += chunk;
        }
        let mapping = VmmMapping::map(ctx, handles)?;
        let fds = mapping
            .chunks
            .iter()
            .map(|&(handle, _)| posix_fd(handle))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExportedVmm {
            mapping,
            fds,
            chunk,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.mapping.va
    }

    pub fn bytes(&self) -> u64 {
        self.mapping.size
    }

    /// Bytes of each chunk.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk
    }

    /// Each chunk's fd, in address order.
    pub fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        self.fds.iter().map(std::os::fd::AsFd::as_fd).collect()
    }
}

/// A POSIX fd of the physical allocation `handle` (made with the POSIX fd
/// handle type), for another process to import.
pub(super) fn posix_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd, CudaError> {
    let mut fd: i32 = -1;
    check(
        // SAFETY: for the POSIX fd handle type the out-pointer is an `int`;
        // `handle` is a live allocation handle (the caller's).
        unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        "cuMemExportToShareableHandle",
    )?;
    // SAFETY: a fresh descriptor the driver just made for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How this process reached another's allocation.
enum Opened {
    /// `cuIpcOpenMemHandle`.
    Ipc,
    /// A VMM allocation imported from a POSIX fd and mapped (undone when
    /// the mapping drops).
    Vmm { _mapping: VmmMapping },
}

/// One allocation of another process, opened here; closed when dropped.
pub struct OpenedMemory {
    base: u64,
    size: u64,
    how: Opened,
    ctx: Arc<Context>,
}

// SAFETY: device addresses, used under the owning context.
unsafe impl Send for OpenedMemory {}
// SAFETY: `&OpenedMemory` gives only the address and size.
unsafe impl Sync for OpenedMemory {}

impl OpenedMemory {
    /// The device address the allocation is mapped at here.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The allocation's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Opens a legacy IPC handle in `ctx`; the size is what the driver says
    /// the allocation is (never what the exporter claims).
    pub fn open_ipc(ctx: &Arc<Context>, handle: &[u8; 64]) -> Result<OpenedMemory, CudaError> {
        ctx.bind()?;
        // SAFETY: `CUipcMemHandle` is 64 plain bytes; all-zero is valid.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut base = 0;
        check(
            // SAFETY: `base` is a valid out-pointer; the handle is passed by
            // value and checked by the driver; closed below or in `Drop`.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        let mut opened = OpenedMemory {
            base,
            size: 0,
            how: Opened::Ipc,
            ctx: ctx.clone(),
        };
        let (mut b, mut size) = (0, 0usize);
        check(
            // SAFETY: valid out-pointers; `base` lies in the mapping just opened.
            unsafe { sys::cuMemGetAddressRange_v2(&mut b, &mut size, base) },
            "cuMemGetAddressRange",
        )?;
        opened.size = size as u64;
        Ok(opened)
    }

    /// Imports VMM chunks exported as POSIX fds (`(fd, bytes)` each) and
    /// maps them in order, contiguously (the mapping fails if a chunk is
    /// smaller than it is said to be).
    pub fn import_vmm_fds(
        ctx: &Arc<Context>,
        chunks: &[(i32, u64)],
    ) -> Result<OpenedMemory, CudaError> {
        ctx.bind()?;
        let mut handles = Vec::with_capacity(chunks.len());
        for &(fd, bytes) in chunks {
            let mut handle = 0;
            let r = check(
                // SAFETY: `handle` is a valid out-pointer; for the POSIX fd
                // handle type the "handle" argument is the fd itself, which
                // the driver duplicates; the mapping (or the cleanup below)
                // takes the handle over.
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd as isize as *mut c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            );
            if let Err(e) = r {
                for (h, _) in handles {
                    // SAFETY: a handle imported above, released once.
                    let _ = unsafe { sys::cuMemRelease(h) };
                }
                return Err(e);
            }
            handles.push((handle, bytes));
        }
        let mapping = VmmMapping::map(ctx, handles)?;
        Ok(OpenedMemory {
            base: mapping.va,
            size: mapping.size,
            how: Opened::Vmm { _mapping: mapping },
            ctx: ctx.clone(),
        })
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for OpenedMemory {
    fn drop(&mut self) {
        if let Opened::Ipc = self.how {
            let _ = self.ctx.bind();
            // SAFETY: closes what `open_ipc` opened, once. (A VMM import is
            // undone by its `VmmMapping`'s drop.)
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}
