//! CUDA through the driver API, loaded at run time: kvring builds and runs
//! everywhere, and uses a GPU only where `libcuda` and a device exist
//! ([`probe`] says why not otherwise).
//!
//! This is the one place that calls the driver. Each type owns one driver
//! handle and releases it on drop, in the context that made it; both the
//! engine side (`client::cuda_cache`) and the server's CUDA backend use
//! them:
//!
//! * [`Context`]: a device's primary context, matched by UUID or ordinal,
//!   bound to the calling thread with [`Context::bind`];
//! * [`Stream`]: a non-blocking stream and the asynchronous copies queued on
//!   it;
//! * [`Event`] and [`IpcEventHandle`](crate::IpcEventHandle): events, interprocess ones included;
//! * [`DeviceBuffer`], [`PinnedHostBuffer`], [`HostRegistration`],
//!   [`ExportedVmm`]: memory the process allocates or pins;
//! * [`HostWord`]: a pinned host word a stream waits on and the host sets
//!   (a device-side wait its holder can always release);
//! * [`export_range`]: device memory the process already has (a torch
//!   tensor's), found from its address and exported (legacy IPC handle or
//!   VMM fds);
//! * [`OpenedMemory`]: another process's device memory
//!   opened here (legacy IPC handle, or a VMM allocation imported from a
//!   POSIX fd), closed when the last tensor using it goes;
//! * [`kernels`]: the KV copy kernels, compiled by NVRTC for the device and
//!   cached on disk, in a [`Module`].
//!
//! Driver failures are [`CudaError`]s (the call and its result code); what
//! keeps CUDA from being used at all is a [`GpuError`].

mod context;
mod event;
mod export;
pub mod kernels;
mod memory;
mod module;
mod stream;
mod word;

pub use context::{device_uuid, probe, Context, DeviceInfo};
pub use cudarc::driver::sys::CUresult;
pub use event::{Event, EventKind};
pub use export::{export_range, ExportedRange, RangeExport};
pub use memory::{DeviceBuffer, ExportedVmm, HostRegistration, OpenedMemory, PinnedHostBuffer};
pub use module::{Function, LaunchConfig, Module};
pub use stream::Stream;
pub use word::HostWord;

use cudarc::driver::sys;

/// A driver call that did not succeed: which call, and what it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {code:?}")]
pub struct CudaError {
    pub call: &'static str,
    pub code: CUresult,
}

/// `Err` naming `call` unless `code` is success.
pub(crate) fn check(code: CUresult, call: &'static str) -> Result<(), CudaError> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError { call, code })
    }
}

/// Why CUDA cannot be used, or a driver call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    #[error(transparent)]
    Driver(#[from] CudaError),
    #[error("libcuda.so (the NVIDIA driver library) is not installed")]
    NoDriver,
    #[error("the driver reports no CUDA device")]
    NoDevice,
    #[error("no CUDA device with UUID {0}")]
    UnknownDevice(String),
    /// The kernels could not be compiled or loaded.
    #[error("{0}")]
    Kernels(String),
    /// Device memory that cannot be shared with another process, and why.
    #[error("{0}")]
    NotExportable(String),
}

impl From<CudaError> for crate::Error {
    fn from(e: CudaError) -> Self {
        crate::Error::Cuda(e.to_string())
    }
}

impl From<GpuError> for crate::Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::NotExportable(m) => crate::Error::InvalidArgument(m),
            e => crate::Error::Cuda(e.to_string()),
        }
    }
}

/// Lower-case hex of a byte string.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
