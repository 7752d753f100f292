//! The atomics every shared-memory algorithm uses, swapped for loom's under
//! `--cfg kvring_loom` so the same code is model-checked.
//!
//! Only the algorithm cores (`ring`, `jobs::slot`) are compiled under loom;
//! everything that maps real memory is `cfg(not(kvring_loom))`.

#[cfg(kvring_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64};
#[cfg(not(kvring_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

/// A busy-wait step: a CPU spin hint, or under loom a yield to the model's
/// scheduler, which is what makes spinning loops checkable.
#[inline(always)]
pub(crate) fn spin_hint() {
    #[cfg(kvring_loom)]
    loom::thread::yield_now();
    #[cfg(not(kvring_loom))]
    std::hint::spin_loop();
}
