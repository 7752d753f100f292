//! The atomics every shared-memory algorithm uses, swapped for loom's under
//! `--cfg loom` so the same code is model-checked.
//!
//! Only the algorithm cores (`ring`, `jobs::seqlock`, `jobs::slot`) are compiled
//! under loom; everything that maps real memory is `cfg(not(loom))`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64};

pub(crate) use std::sync::atomic::Ordering;

/// A busy-wait step in loom tests: yields to the model's scheduler, which is
/// what makes spinning loops checkable.
#[cfg(all(test, loom))]
#[inline(always)]
pub(crate) fn spin_hint() {
    loom::thread::yield_now();
}
