//! The atomics every shared-memory algorithm uses, swapped for loom's under
//! `--cfg loom` so the same code is model-checked.
//!
//! Only the algorithm cores (`ring`, `jobs::slot`) are compiled under loom;
//! everything that maps real memory is `cfg(not(loom))`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

/// A busy-wait step: a CPU spin hint, or under loom a yield to the model's
/// scheduler, which is what makes spinning loops checkable.
#[inline(always)]
pub(crate) fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
