//! The pool pinned with the driver in segments, on a background thread.

use super::COPY_DEADLINE;
use crate::transfer::backend::CopyError;
use kvring::gpu::{Context, CudaError, HostRegistration};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes per pool registration (a copy never spans two).
pub const PIN_SEGMENT: u64 = 1 << 30;

/// Where one segment's registration stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum PinState {
    Pending = 0,
    Pinned = 1,
    Failed = 2,
}

impl PinState {
    fn from_u8(v: u8) -> PinState {
        match v {
            1 => PinState::Pinned,
            2 => PinState::Failed,
            _ => PinState::Pending,
        }
    }
}

/// The pool's segments and their registrations.
pub(super) struct PoolPin {
    state: Vec<AtomicU8>,
    error: Mutex<Option<CudaError>>,
    /// Kept for the pool's life: the registrations end with the backend,
    /// which the server drops before it unmaps the pool.
    registrations: Mutex<Vec<HostRegistration>>,
    base: usize,
    len: u64,
    /// Set when the backend goes: the pinning thread stops between
    /// segments (it must not register ranges of a pool about to be unmapped).
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl PoolPin {
    /// Starts pinning `[base, base + len)` (the pool mapping, which lives as
    /// long as the server) segment by segment with `ctx` bound.
    pub(super) fn start(ctx: Arc<Context>, base: usize, len: u64) -> std::io::Result<Arc<PoolPin>> {
        let segs = len.div_ceil(PIN_SEGMENT) as usize;
        let pin = Arc::new(PoolPin {
            state: (0..segs)
                .map(|_| AtomicU8::new(PinState::Pending as u8))
                .collect(),
            error: Mutex::new(None),
            registrations: Mutex::new(Vec::with_capacity(segs)),
            base,
            len,
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let p = pin.clone();
        let t = std::thread::Builder::new()
            .name("kvring-pin".into())
            .spawn(move || p.pin_all(&ctx))?;
        *pin.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(pin)
    }

    /// Stops the pinning thread after the segment it is on and waits for
    /// it. Called when the backend goes, before the pool is unmapped.
    pub(super) fn stop(&self) {
        // Relaxed: the join below orders everything the thread did.
        self.stop.store(true, Ordering::Relaxed);
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }

    fn pin_all(&self, ctx: &Arc<Context>) {
        for (i, st) in self.state.iter().enumerate() {
            // Relaxed: a stale read only pins one more segment, still
            // mapped until `stop` has joined this thread.
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let off = i as u64 * PIN_SEGMENT;
            let n = PIN_SEGMENT.min(self.len - off);
            // SAFETY: a range of the pool mapping, which stays mapped while
            // the backend lives: the backend stops and joins this thread
            // (`stop`) and drops the registrations before the server unmaps
            // the pool.
            let r = unsafe {
                HostRegistration::new(ctx, (self.base + off as usize) as *mut u8, n as usize)
            };
            let s = match r {
                Ok(reg) => {
                    self.registrations
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(reg);
                    PinState::Pinned
                }
                Err(e) => {
                    *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    PinState::Failed
                }
            };
            // Release pairs with `wait_pinned`'s Acquire load: the
            // registration (or the error) happened before.
            st.store(s as u8, Ordering::Release);
        }
    }

    /// Bytes of the pool pinned so far.
    pub(super) fn pinned_bytes(&self) -> u64 {
        self.state
            .iter()
            .enumerate()
            // Relaxed: a count for observers; copies use `wait_pinned`.
            .filter(|(_, st)| PinState::from_u8(st.load(Ordering::Relaxed)) == PinState::Pinned)
            .map(|(i, _)| PIN_SEGMENT.min(self.len - i as u64 * PIN_SEGMENT))
            .sum()
    }

    /// Waits until the pool segment holding `[off, off + len)` is pinned.
    pub(super) fn wait_pinned(&self, off: u64, len: u64) -> Result<(), CopyError> {
        let seg = (off / PIN_SEGMENT) as usize;
        if (off + len - 1) / PIN_SEGMENT != seg as u64 {
            return Err(CopyError::SpansPinSegments);
        }
        let deadline = Instant::now() + COPY_DEADLINE;
        loop {
            // Acquire pairs with the pinning thread's Release store.
            match PinState::from_u8(self.state[seg].load(Ordering::Acquire)) {
                PinState::Pinned => return Ok(()),
                PinState::Failed => {
                    let e = self.error.lock().unwrap_or_else(|e| e.into_inner());
                    return Err(CopyError::PinFailed(
                        e.map_or_else(|| "?".to_string(), |e| e.to_string()),
                    ));
                }
                PinState::Pending if Instant::now() > deadline => {
                    return Err(CopyError::PinTimeout)
                }
                PinState::Pending => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}
