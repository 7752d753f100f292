//! Shared (cross-process) futex calls on a 32-bit word in shared memory.
//!
//! `FUTEX_PRIVATE_FLAG` is never used: a private futex is keyed by the
//! caller's address space, a shared one by the backing page, which is what
//! makes a wait in one process wakeable from another.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// How a [`wait`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FutexWait {
    /// Woken (or spuriously returned): re-check the condition.
    Woken,
    /// The word no longer held the expected value: re-check the condition.
    Changed,
    /// The timeout elapsed.
    TimedOut,
}

/// Sleeps while `*word == expected`, for at most `timeout`.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) -> FutexWait {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the
    // call; FUTEX_WAIT only reads it. `ts` is a valid relative timeout.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r == 0 {
        return FutexWait::Woken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ETIMEDOUT) => FutexWait::TimedOut,
        Some(libc::EAGAIN) => FutexWait::Changed,
        _ => FutexWait::Woken, // EINTR and friends: the caller re-checks anyway.
    }
}

/// Wakes up to `n` waiters on `word`. Returns how many were woken.
pub fn wake(word: &AtomicU32, n: i32) -> usize {
    // SAFETY: `word` is a valid, aligned 32-bit word; FUTEX_WAKE does not
    // dereference the remaining arguments.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    r.max(0) as usize
}
