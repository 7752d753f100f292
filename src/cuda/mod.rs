//! CUDA through the driver API, loaded at run time: kvring builds and runs
//! everywhere, and uses a GPU only where `libcuda` and a device exist
//! ([`probe`] says why not otherwise).
//!
//! * [`Context`]: a device's primary context, matched by UUID;
//! * [`OpenedMemory`] / [`DeviceTensor`]: an engine's device memory opened
//!   in the server (legacy IPC handle, or a VMM allocation imported from a
//!   POSIX fd), closed when the last tensor using it goes;
//! * [`kernels`]: the KV copy kernels, compiled by NVRTC for the device and
//!   cached on disk;
//! * [`engine_cache`]: a paged KV cache in device memory that an engine (or
//!   a test, or the demo) allocates and exports.

pub mod engine_cache;
pub mod kernels;

pub use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::Arc;

/// `Err` with the call and the driver's error name unless `r` is success.
pub fn ck(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// A device as the driver reports it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub uuid: [u8; 16],
    pub name: String,
    pub compute_capability: (i32, i32),
}

/// Loads the driver and lists the devices, or says why CUDA is not usable.
pub fn probe() -> Result<Vec<DeviceInfo>, String> {
    // SAFETY: only tries to load the library.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda.so (the NVIDIA driver library) is not installed".into());
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ck(sys::cuInit(0), "cuInit")?;
        let mut n = 0;
        ck(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
        if n == 0 {
            return Err("the driver reports no CUDA device".into());
        }
        (0..n).map(device_info).collect()
    }
}

fn device_info(ordinal: i32) -> Result<DeviceInfo, String> {
    // SAFETY: driver calls with valid out-pointers and buffer sizes.
    unsafe {
        let mut dev = 0;
        ck(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        let mut u: sys::CUuuid = std::mem::zeroed();
        ck(sys::cuDeviceGetUuid_v2(&mut u, dev), "cuDeviceGetUuid")?;
        let mut name = [0i8; 256];
        ck(
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            "cuDeviceGetName",
        )?;
        let name = std::ffi::CStr::from_ptr(name.as_ptr())
            .to_string_lossy()
            .into_owned();
        let attr = |a| {
            let mut v = 0;
            ck(
                sys::cuDeviceGetAttribute(&mut v, a, dev),
                "cuDeviceGetAttribute",
            )
            .map(|()| v)
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(DeviceInfo {
            ordinal,
            uuid: u.bytes.map(|b| b as u8),
            name,
            compute_capability: (major, minor),
        })
    }
}

/// The UUID of device `ordinal`.
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16], String> {
    probe()?;
    device_info(ordinal).map(|d| d.uuid)
}

/// A device's primary context, retained for this object's life.
pub struct Context {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    pub info: DeviceInfo,
}

// SAFETY: a CUcontext may be made current on any thread; the driver
// serializes what needs it.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of the device with this UUID.
    pub fn by_uuid(uuid: &[u8; 16]) -> Result<Arc<Context>, String> {
        let info = probe()?
            .into_iter()
            .find(|d| &d.uuid == uuid)
            .ok_or_else(|| format!("no CUDA device with UUID {}", hex(uuid)))?;
        Self::retain(info)
    }

    /// Retains the primary context of device `ordinal`.
    pub fn by_ordinal(ordinal: i32) -> Result<Arc<Context>, String> {
        probe()?;
        Self::retain(device_info(ordinal)?)
    }

    fn retain(info: DeviceInfo) -> Result<Arc<Context>, String> {
        // SAFETY: driver calls with valid out-pointers.
        unsafe {
            let mut dev = 0;
            ck(sys::cuDeviceGet(&mut dev, info.ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            ck(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            Ok(Arc::new(Context { ctx, dev, info }))
        }
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: a retained context.
        ck(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    pub fn device(&self) -> sys::CUdevice {
        self.dev
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `retain`.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Lower-case hex of a byte string.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// How the server reached an engine's allocation.
enum Opened {
    /// `cuIpcOpenMemHandle` at `base`.
    Ipc,
    /// A VMM allocation imported from a POSIX fd and mapped at `base`.
    Vmm {
        handle: sys::CUmemGenericAllocationHandle,
    },
}

/// One engine allocation opened in the server; closed when dropped.
pub struct OpenedMemory {
    pub base: u64,
    pub size: u64,
    how: Opened,
    ctx: Arc<Context>,
}

// SAFETY: device addresses, used under the owning context.
unsafe impl Send for OpenedMemory {}
// SAFETY: as above.
unsafe impl Sync for OpenedMemory {}

impl OpenedMemory {
    /// Opens a legacy IPC handle in `ctx`; the size is what the driver says
    /// the allocation is (never what the engine claims).
    pub fn open_ipc(ctx: &Arc<Context>, handle: &[u8; 64]) -> Result<OpenedMemory, String> {
        ctx.bind()?;
        // SAFETY: a 64-byte handle as the driver defines it; out-pointers
        // valid.
        unsafe {
            let mut h: sys::CUipcMemHandle = std::mem::zeroed();
            for (d, s) in h.reserved.iter_mut().zip(handle) {
                *d = *s as _;
            }
            let mut base = 0;
            ck(
                sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                ),
                "cuIpcOpenMemHandle",
            )?;
            let (mut b, mut size) = (0, 0usize);
            let r = sys::cuMemGetAddressRange_v2(&mut b, &mut size, base);
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuIpcCloseMemHandle(base);
                return Err(format!("cuMemGetAddressRange: {r:?}"));
            }
            Ok(OpenedMemory {
                base,
                size: size as u64,
                how: Opened::Ipc,
                ctx: ctx.clone(),
            })
        }
    }

    /// Imports a VMM allocation exported as a POSIX fd and maps `size` bytes
    /// of it (the mapping fails if the allocation is smaller).
    pub fn import_vmm_fd(ctx: &Arc<Context>, fd: i32, size: u64) -> Result<OpenedMemory, String> {
        ctx.bind()?;
        // SAFETY: driver calls with valid out-pointers; every failure path
        // releases what was taken.
        unsafe {
            let mut handle = 0;
            ck(
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd as isize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ),
                "cuMemImportFromShareableHandle",
            )?;
            let mut va = 0;
            let r = sys::cuMemAddressReserve(&mut va, size as usize, 0, 0, 0);
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuMemRelease(handle);
                return Err(format!("cuMemAddressReserve: {r:?}"));
            }
            let r = sys::cuMemMap(va, size as usize, 0, handle, 0);
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuMemAddressFree(va, size as usize);
                let _ = sys::cuMemRelease(handle);
                return Err(format!("cuMemMap of {size} bytes: {r:?}"));
            }
            let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = ctx.info.ordinal;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            let r = sys::cuMemSetAccess(va, size as usize, &desc, 1);
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuMemUnmap(va, size as usize);
                let _ = sys::cuMemAddressFree(va, size as usize);
                let _ = sys::cuMemRelease(handle);
                return Err(format!("cuMemSetAccess: {r:?}"));
            }
            Ok(OpenedMemory {
                base: va,
                size,
                how: Opened::Vmm { handle },
                ctx: ctx.clone(),
            })
        }
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for OpenedMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: closes exactly what `open_ipc` / `import_vmm_fd` opened.
        unsafe {
            match self.how {
                Opened::Ipc => {
                    let _ = sys::cuIpcCloseMemHandle(self.base);
                }
                Opened::Vmm { handle } => {
                    let _ = sys::cuMemUnmap(self.base, self.size as usize);
                    let _ = sys::cuMemAddressFree(self.base, self.size as usize);
                    let _ = sys::cuMemRelease(handle);
                }
            }
        }
    }
}

/// One registered tensor in device memory.
pub struct DeviceTensor {
    /// Device address of the tensor's first byte.
    pub dptr: u64,
    pub bytes: u64,
    pub memory: Arc<OpenedMemory>,
}
