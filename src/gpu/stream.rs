//! Streams and the asynchronous copies queued on them.

use super::{check, sys, Context, CudaError, Event, HostWord};
use std::ffi::c_void;
use std::sync::Arc;

/// A non-blocking stream (it does not synchronize with the legacy default
/// stream), drained and destroyed on drop.
pub struct Stream {
    ctx: Arc<Context>,
    stream: sys::CUstream,
    /// Created here (destroyed on drop), or another library's (a torch
    /// stream: only drained on drop).
    owned: bool,
}

// SAFETY: a stream handle may be used from any thread with its context
// bound (every method binds it first); the driver serializes queueing.
unsafe impl Send for Stream {}
// SAFETY: as for `Send`: queueing on one stream from several threads is
// thread-safe in the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream in `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream, CudaError> {
        ctx.bind()?;
        let mut stream = std::ptr::null_mut();
        check(
            // SAFETY: `stream` is a valid out-pointer; destroyed in `Drop`.
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )?;
        Ok(Stream {
            ctx: ctx.clone(),
            stream,
            owned: true,
        })
    }

    /// Another library's stream `raw` of `ctx` (a torch stream's
    /// `cuda_stream`), used here without being owned: dropping this drains
    /// it and leaves it to its owner.
    ///
    /// # Safety
    ///
    /// `raw` is a live stream of `ctx` (or 0, the legacy default stream)
    /// and outlives the returned value.
    pub unsafe fn borrowed(ctx: &Arc<Context>, raw: u64) -> Stream {
        Stream {
            ctx: ctx.clone(),
            stream: raw as sys::CUstream,
            owned: false,
        }
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.stream
    }

    /// Waits (on the host) for everything queued.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: a live stream of this context.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    /// Makes later work on this stream wait (on the device) for `event`'s
    /// last record, which may be another stream's or another process's.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: a live stream and a live event; waiting reads neither
        // memory nor the event's owner's state.
        check(
            unsafe { sys::cuStreamWaitEvent(self.stream, event.raw(), 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Makes later work on this stream wait (on the device) until `word`
    /// holds at least `at_least` (`cuStreamWaitValue32`, GEQ). Whoever
    /// holds the word can always end the wait by setting it from the host.
    ///
    /// # Safety
    /// `word` must stay allocated until the stream has passed the wait (set
    /// it, then synchronize, before dropping it).
    pub unsafe fn wait_word(&self, word: &HostWord, at_least: u32) -> Result<(), CudaError> {
        // SAFETY: the caller's contract, for the word's device address.
        unsafe { self.wait_value(word.device_ptr(), at_least) }
    }

    /// Makes later work on this stream wait (on the device) until the word
    /// at device address `word` holds at least `at_least`, compared
    /// cyclically (`cuStreamWaitValue32`, GEQ).
    ///
    /// # Safety
    /// `word` must be the device address of 4 bytes of device-mapped host
    /// memory that stay mapped and registered until the stream has passed
    /// the wait, and some party this process trusts must be able to set it.
    pub unsafe fn wait_value(&self, word: u64, at_least: u32) -> Result<(), CudaError> {
        self.ctx.bind()?;
        check(
            // SAFETY: a live stream; the word's device address stays valid
            // while the wait is pending (the caller's contract).
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    self.stream,
                    word,
                    at_least,
                    sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            },
            "cuStreamWaitValue32",
        )
    }

    /// Queues writing `value` to the word at device address `word`, after
    /// the work queued before it (`cuStreamWriteValue32`, with the default
    /// memory barrier: the earlier work's writes are visible first).
    ///
    /// # Safety
    /// `word` must be the device address of 4 bytes of device-mapped host
    /// (or device) memory that stay mapped until the write has run.
    pub unsafe fn write_value(&self, word: u64, value: u32) -> Result<(), CudaError> {
        self.ctx.bind()?;
        check(
            // SAFETY: a live stream; the address stays valid until the
            // write has run (the caller's contract).
            unsafe {
                sys::cuStreamWriteValue32_v2(
                    self.stream,
                    word,
                    value,
                    sys::CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            },
            "cuStreamWriteValue32",
        )
    }

    /// Queues a host -> device copy of `bytes` bytes.
    ///
    /// # Safety
    /// `dst` must address `bytes` bytes of device memory of this context,
    /// and `src` `bytes` readable host bytes; both must stay valid (and
    /// `src` unchanged) until the copy has finished on the stream. For an
    /// asynchronous copy `src` should be pinned: from pageable memory the
    /// call blocks until the copy can run.
    pub unsafe fn copy_htod_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, self.stream) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Queues a device -> host copy of `bytes` bytes.
    ///
    /// # Safety
    /// `src` must address `bytes` bytes of device memory of this context,
    /// and `dst` `bytes` writable host bytes that nothing else accesses
    /// until the copy has finished on the stream (pinned, or the call
    /// blocks until the copy can run).
    pub unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, self.stream) },
            "cuMemcpyDtoHAsync",
        )
    }

    /// Queues a device -> device copy of `bytes` bytes.
    ///
    /// # Safety
    /// `dst` and `src` must each address `bytes` bytes of device memory this
    /// context can access, valid until the copy has finished on the stream.
    pub unsafe fn copy_dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    /// Queues setting `bytes` bytes at `dst` to `byte`.
    ///
    /// # Safety
    /// `dst` must address `bytes` bytes of device memory of this context,
    /// valid until the fill has finished on the stream.
    pub unsafe fn memset_d8_async(
        &self,
        dst: u64,
        byte: u8,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        check(
            unsafe { sys::cuMemsetD8Async(dst, byte, bytes, self.stream) },
            "cuMemsetD8Async",
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: a live stream (`new`, or `borrowed`'s contract); one
        // created here is destroyed once, after what was queued on it
        // finished (its buffers may be freed right after).
        unsafe {
            let _ = sys::cuStreamSynchronize(self.stream);
            if self.owned {
                let _ = sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}
