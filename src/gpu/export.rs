//! Device memory this process already has (a torch tensor's, whatever
//! allocator made it), found from an address and exported so that another
//! process can map it: a legacy CUDA IPC handle for `cuMemAlloc` memory
//! (torch's caching allocator), or one POSIX fd per VMM mapping for memory
//! from `cuMemCreate` (torch's expandable segments, 20 MiB per mapping;
//! vLLM's cumem allocator and extensible KV cache, one mapping).
//!
//! Only the driver's view of the memory is used: no allocator's own
//! sharing call (torch's `_share_cuda_` swaps the storage's data pointer
//! and creates files and events as a side effect).

use super::{check, sys, Context, CudaError, GpuError};
use std::ffi::c_void;
use std::os::fd::OwnedFd;

/// How a range of device memory is exported.
#[derive(Debug)]
pub enum RangeExport {
    /// The range starts `offset` bytes into the `cuMemAlloc` allocation
    /// whose legacy IPC handle this is.
    Ipc { handle: [u8; 64], offset: u64 },
    /// The range starts `offset` bytes into the concatenation of these VMM
    /// mappings (each: an fd of its physical allocation, the mapping's
    /// size), which lie one after another in this process.
    Vmm {
        offset: u64,
        chunks: Vec<(OwnedFd, u64)>,
    },
}

/// A range of device memory and the device it lives on.
#[derive(Debug)]
pub struct ExportedRange {
    pub device: i32,
    pub export: RangeExport,
}

/// The current context of the calling thread, put back on drop (the
/// engine's own CUDA runtime, torch's, keeps state in it).
struct Restore(sys::CUcontext);

impl Restore {
    fn save() -> Result<Restore, CudaError> {
        let mut cur = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        Ok(Restore(cur))
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        // SAFETY: the context that was current before (or none); the
        // caller's runtime still holds it (this thread had it current).
        let _ = unsafe { sys::cuCtxSetCurrent(self.0) };
    }
}

/// One pointer attribute of `addr`, as the plain value the driver writes.
fn attribute<T: Default>(addr: u64, a: sys::CUpointer_attribute) -> Result<T, CudaError> {
    let mut v = T::default();
    check(
        // SAFETY: `v` is a valid out-pointer of the type the driver writes
        // for the attributes this module asks (int, pointer or size).
        unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, a, addr) },
        "cuPointerGetAttribute",
    )?;
    Ok(v)
}

fn not_exportable(msg: String) -> GpuError {
    GpuError::NotExportable(msg)
}

/// Finds the allocation(s) behind `[addr, addr + bytes)` of this process's
/// device memory and exports them.
///
/// Refused, with the reason: an address that is not device memory,
/// memory from a stream-ordered pool (`cudaMallocAsync`), VMM memory made
/// without the POSIX-fd handle type, a range that leaves its `cuMemAlloc`
/// allocation or runs into unmapped addresses.
pub fn export_range(addr: u64, bytes: u64) -> Result<ExportedRange, GpuError> {
    use sys::CUpointer_attribute as A;
    super::probe()?;
    if bytes == 0 {
        return Err(not_exportable("an empty range".into()));
    }
    let end = addr
        .checked_add(bytes)
        .ok_or_else(|| not_exportable(format!("[{addr:#x}, +{bytes}) wraps around")))?;
    let restore = Restore::save()?;
    let mut device = attribute::<i32>(addr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
    // Retained while it is current (until `restore` puts the caller's
    // context back, or the function returns).
    let mut _any = None;
    if matches!(&device, Err(e) if e.code == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT) {
        // No context on this thread yet: any device's primary context
        // answers for unified addresses.
        let any = _any.insert(Context::by_ordinal(0)?);
        any.bind()?;
        device = attribute(addr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
    }
    let device: i32 = device.map_err(|e| {
        not_exportable(format!(
            "address {addr:#x} is not CUDA device memory of this process ({e})"
        ))
    })?;
    if device < 0 {
        return Err(not_exportable(format!(
            "address {addr:#x} is not device memory (host or managed memory)"
        )));
    }
    let ctx = Context::by_ordinal(device)?;
    ctx.bind()?;
    let legacy: i32 = attribute(addr, A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)?;
    let export = if legacy != 0 {
        let (mut base, mut size) = (0, 0usize);
        check(
            // SAFETY: valid out-pointers; `addr` is device memory (above).
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) },
            "cuMemGetAddressRange",
        )?;
        if end > base + size as u64 {
            return Err(not_exportable(format!(
                "[{addr:#x}, +{bytes}) runs past its allocation [{base:#x}, +{size})"
            )));
        }
        // SAFETY: `CUipcMemHandle` is plain bytes; all-zero is valid.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: `h` is a valid out-pointer; `base` is the start of a
            // `cuMemAlloc` allocation (the driver says it is IPC capable).
            unsafe { sys::cuIpcGetMemHandle(&mut h, base) },
            "cuIpcGetMemHandle",
        )?;
        RangeExport::Ipc {
            handle: h.reserved.map(|b| b as u8),
            offset: addr - base,
        }
    } else {
        let mut chunks = Vec::new();
        let mut at = addr;
        let mut offset = 0;
        while at < end {
            let (base, size) = vmm_mapping(at)?;
            if chunks.is_empty() {
                offset = at - base;
            }
            chunks.push((export_mapping(base)?, size));
            at = base + size;
        }
        RangeExport::Vmm { offset, chunks }
    };
    drop(restore);
    Ok(ExportedRange { device, export })
}

/// The VMM mapping that holds `at`: its base and size.
fn vmm_mapping(at: u64) -> Result<(u64, u64), GpuError> {
    use sys::CUpointer_attribute as A;
    let base: u64 = attribute(at, A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR).map_err(|e| {
        not_exportable(format!(
            "address {at:#x} is neither cuMemAlloc nor mapped VMM memory (memory from a stream-ordered pool such as cudaMallocAsync cannot be shared; {e})"
        ))
    })?;
    let size: usize = attribute(at, A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE)?;
    if size == 0 || base > at || at - base >= size as u64 {
        return Err(not_exportable(format!(
            "the driver places {at:#x} in the mapping [{base:#x}, +{size})"
        )));
    }
    Ok((base, size as u64))
}

/// A POSIX fd of the physical allocation mapped at `base`.
fn export_mapping(base: u64) -> Result<OwnedFd, GpuError> {
    use sys::CUmemAllocationHandleType as H;
    let mut handle = 0;
    check(
        // SAFETY: `handle` is a valid out-pointer; `base` is a mapped VMM
        // address; the retained handle is released below.
        unsafe { sys::cuMemRetainAllocationHandle(&mut handle, base as *mut c_void) },
        "cuMemRetainAllocationHandle",
    )?;
    let exported = (|| {
        // SAFETY: plain data; all-zero is valid.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: `prop` is a valid out-pointer; `handle` was retained above.
            unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) },
            "cuMemGetAllocationPropertiesFromHandle",
        )?;
        let types = prop.requestedHandleTypes.0;
        if types & H::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 == 0 {
            return Err(not_exportable(format!(
                "the VMM allocation at {base:#x} was made without POSIX-fd handles (requested handle types {types:#x}); allocate it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
            )));
        }
        Ok(super::memory::posix_fd(handle)?)
    })();
    // SAFETY: drops the reference `cuMemRetainAllocationHandle` took, once;
    // the engine's own mapping keeps the memory.
    let _ = unsafe { sys::cuMemRelease(handle) };
    exported
}
