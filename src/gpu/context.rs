//! Devices and their primary contexts.

use super::{check, sys, CudaError, GpuError};
use std::sync::Arc;

/// A device as the driver reports it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub uuid: [u8; 16],
    pub name: String,
    pub compute_capability: (i32, i32),
}

/// Loads the driver and lists the devices, or says why CUDA is not usable.
pub fn probe() -> Result<Vec<DeviceInfo>, GpuError> {
    // SAFETY: only tries to load the library (cudarc panics on the first
    // driver call without it, hence this check first).
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    // SAFETY: `cuInit` takes no pointer.
    check(unsafe { sys::cuInit(0) }, "cuInit")?;
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer for the count.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    if n == 0 {
        return Err(GpuError::NoDevice);
    }
    (0..n)
        .map(|o| device_info(o).map_err(GpuError::from))
        .collect()
}

fn device_info(ordinal: i32) -> Result<DeviceInfo, CudaError> {
    let mut dev = 0;
    check(
        // SAFETY: `dev` is a valid out-pointer; the driver checks the ordinal.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    // SAFETY: `CUuuid` is plain bytes, so all-zero is a valid value.
    let mut u: sys::CUuuid = unsafe { std::mem::zeroed() };
    check(
        // SAFETY: `u` is a valid out-pointer; `dev` came from `cuDeviceGet`.
        unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) },
        "cuDeviceGetUuid",
    )?;
    let mut name = [0i8; 256];
    check(
        // SAFETY: the driver writes at most `name.len()` bytes, NUL included.
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) },
        "cuDeviceGetName",
    )?;
    // The driver NUL-terminates within the buffer; a last NUL makes sure.
    name[name.len() - 1] = 0;
    // SAFETY: `name` holds a NUL within its bounds (set just above).
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let attr = |a| {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer; `dev` is a device handle.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
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

/// The UUID of device `ordinal`.
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16], GpuError> {
    probe()?;
    Ok(device_info(ordinal)?.uuid)
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
// SAFETY: `&Context` only binds the context or reads `info`, both
// thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of the device with this UUID.
    pub fn by_uuid(uuid: &[u8; 16]) -> Result<Arc<Context>, GpuError> {
        let info = probe()?
            .into_iter()
            .find(|d| &d.uuid == uuid)
            .ok_or_else(|| GpuError::UnknownDevice(super::hex(uuid)))?;
        Ok(Self::retain(info)?)
    }

    /// Retains the primary context of device `ordinal`.
    pub fn by_ordinal(ordinal: i32) -> Result<Arc<Context>, GpuError> {
        probe()?;
        Ok(Self::retain(device_info(ordinal)?)?)
    }

    fn retain(info: DeviceInfo) -> Result<Arc<Context>, CudaError> {
        let mut dev = 0;
        check(
            // SAFETY: `dev` is a valid out-pointer.
            unsafe { sys::cuDeviceGet(&mut dev, info.ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx = std::ptr::null_mut();
        check(
            // SAFETY: `ctx` is a valid out-pointer; released in `Drop`.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Arc::new(Context { ctx, dev, info }))
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `self.ctx` is retained for as long as `self` lives.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// The device's free and total memory in bytes (`cuMemGetInfo`: every
    /// process's allocations count).
    pub fn memory_info(&self) -> Result<(u64, u64), CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        check(
            // SAFETY: two valid out-pointers.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free as u64, total as u64))
    }

    /// Binds this context and waits for all its work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `cuCtxSynchronize` takes no pointer.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `retain`, once.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}
