//! A 32-bit word of pinned host memory that streams can wait on and the
//! host can set: a gate on the device that the process holding the word can
//! always open, whatever another process does or fails to do.

use super::{check, sys, Context, CudaError};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// One word from `cuMemHostAlloc` (portable, device-mapped), freed on drop.
/// A stream waits for it with [`super::Stream::wait_word`]; the host sets it
/// with [`HostWord::set`].
pub struct HostWord {
    ctx: Arc<Context>,
    ptr: *mut u32,
    dev: u64,
}

// SAFETY: the word is only ever accessed atomically (through `word()`), and
// the driver handles may be used from any thread with the context bound.
unsafe impl Send for HostWord {}
// SAFETY: as above.
unsafe impl Sync for HostWord {}

impl HostWord {
    /// A word holding 0.
    pub fn new(ctx: &Arc<Context>) -> Result<HostWord, CudaError> {
        ctx.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        check(
            // SAFETY: `ptr` is a valid out-pointer; freed in `Drop`.
            unsafe {
                sys::cuMemHostAlloc(
                    &mut ptr,
                    64,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            },
            "cuMemHostAlloc",
        )?;
        // Owned from here: freed on drop if the next call fails.
        let mut word = HostWord {
            ctx: ctx.clone(),
            ptr: ptr as *mut u32,
            dev: 0,
        };
        // Relaxed: nobody else sees the word yet.
        word.word().store(0, Ordering::Relaxed);
        check(
            // SAFETY: `ptr` is device-mapped host memory of this context;
            // `word.dev` is a valid out-pointer.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut word.dev, ptr, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(word)
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: `ptr` is a live, 64-byte aligned allocation of at least 4
        // bytes, only ever accessed atomically (the device reads it).
        unsafe { &*(self.ptr as *const AtomicU32) }
    }

    /// Sets the word: a stream waiting for at least `value` goes on.
    pub fn set(&self, value: u32) {
        // Release: the host's writes before it are visible to work the
        // device runs after the wait.
        self.word().store(value, Ordering::Release);
    }

    pub fn get(&self) -> u32 {
        // Acquire pairs with the store in `set` (or the device's write).
        self.word().load(Ordering::Acquire)
    }

    /// The word's device address.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.dev
    }
}

impl Drop for HostWord {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees what `new` allocated, once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr as *mut c_void) };
    }
}
