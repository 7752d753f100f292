//! Events, and the handles that share them between processes.

use super::{check, sys, Context, CudaError, Stream};
use crate::device::IpcEventHandle;
use std::sync::Arc;

/// The driver's form of a handle.
fn to_sys(handle: &IpcEventHandle) -> sys::CUipcEventHandle {
    // SAFETY: `CUipcEventHandle` is 64 plain bytes; all-zero is valid.
    let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
    for (d, s) in h.reserved.iter_mut().zip(handle.as_bytes()) {
        *d = *s as _;
    }
    h
}

/// What an event is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Completion polling within this process (no timing).
    Local,
    /// Shareable with other processes (no timing, as the driver requires).
    Interprocess,
}

/// An event, destroyed on drop (for an opened interprocess event: this
/// process's reference to it).
pub struct Event {
    ctx: Arc<Context>,
    event: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread with its context
// bound (every method binds it first).
unsafe impl Send for Event {}
// SAFETY: recording, querying and waiting on one event from several
// threads is thread-safe in the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event in `ctx`.
    pub fn new(ctx: &Arc<Context>, kind: EventKind) -> Result<Event, CudaError> {
        ctx.bind()?;
        let flags = match kind {
            EventKind::Local => sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            EventKind::Interprocess => {
                sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
                    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            }
        };
        let mut event = std::ptr::null_mut();
        check(
            // SAFETY: `event` is a valid out-pointer; destroyed in `Drop`.
            unsafe { sys::cuEventCreate(&mut event, flags) },
            "cuEventCreate",
        )?;
        Ok(Event {
            ctx: ctx.clone(),
            event,
        })
    }

    /// Opens another process's interprocess event in `ctx`.
    pub fn open_ipc(ctx: &Arc<Context>, handle: &IpcEventHandle) -> Result<Event, CudaError> {
        ctx.bind()?;
        let mut event = std::ptr::null_mut();
        check(
            // SAFETY: `event` is a valid out-pointer; the handle is passed by
            // value and checked by the driver; destroyed in `Drop`.
            unsafe { sys::cuIpcOpenEventHandle(&mut event, to_sys(handle)) },
            "cuIpcOpenEventHandle",
        )?;
        Ok(Event {
            ctx: ctx.clone(),
            event,
        })
    }

    /// The handle other processes open this event with (an
    /// [`EventKind::Interprocess`] event only).
    pub fn ipc_handle(&self) -> Result<IpcEventHandle, CudaError> {
        self.ctx.bind()?;
        // SAFETY: `CUipcEventHandle` is 64 plain bytes; all-zero is valid.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: `h` is a valid out-pointer; the event is live.
            unsafe { sys::cuIpcGetEventHandle(&mut h, self.event) },
            "cuIpcGetEventHandle",
        )?;
        Ok(IpcEventHandle::from_bytes(h.reserved.map(|b| b as u8)))
    }

    /// Records the event on `stream`, after what is queued there.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: a live event and a live stream.
        check(
            unsafe { sys::cuEventRecord(self.event, stream.raw()) },
            "cuEventRecord",
        )
    }

    /// Whether the work before the last record has finished: `Ok(true)`
    /// done, `Ok(false)` not yet, `Err` it failed on the device. Does not
    /// bind the context (a query needs none, and polling stays ~30 ns).
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(CudaError {
                call: "cuEventQuery",
                code,
            }),
        }
    }

    pub(crate) fn raw(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the event created or opened in `new`/`open_ipc`,
        // destroyed once; the driver defers the release until pending
        // records have completed.
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}
