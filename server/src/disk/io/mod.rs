//! The disk store's I/O: positioned reads and writes of whole blocks, a
//! few in flight at once, behind one seam ([`DiskIo`]) with two ways of
//! doing them: io_uring ([`UringIo`]), and, where the kernel refuses
//! io_uring (seccomp, `kernel.io_uring_disabled`, an old kernel), plain
//! `preadv`/`pwritev` on a few threads of its own ([`ThreadIo`]).
//!
//! The caller keeps every buffer of a transfer alive and untouched until
//! [`DiskIo::wait`] hands back its end: that is the contract of the one
//! unsafe call, [`DiskIo::submit`].

mod threads;
mod uring;

#[cfg(test)]
mod tests;

pub use threads::ThreadIo;
pub use uring::UringIo;

use std::io;
use std::os::fd::RawFd;

/// Buffers one transfer gathers or scatters at most.
pub const MAX_BUFS: usize = 3;

/// Which way a transfer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    Read,
    Write,
}

/// One positioned transfer: up to [`MAX_BUFS`] buffers, read or written
/// as one run of bytes at `off` of `fd`. Building one touches no memory;
/// it only records where the buffers are.
#[derive(Clone, Copy, Debug)]
pub struct IoOp {
    /// The caller's name for it, handed back with its end (unique among
    /// transfers in flight).
    pub token: u64,
    pub way: Way,
    pub fd: RawFd,
    pub off: u64,
    iov: [libc::iovec; MAX_BUFS],
    bufs: usize,
}

impl IoOp {
    /// A transfer of no buffers yet.
    pub fn new(token: u64, way: Way, fd: RawFd, off: u64) -> IoOp {
        let none = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        IoOp {
            token,
            way,
            fd,
            off,
            iov: [none; MAX_BUFS],
            bufs: 0,
        }
    }

    /// Adds `buf` (for a read: filled; for a write: its bytes written).
    pub fn buf(mut self, ptr: *const u8, len: usize) -> IoOp {
        assert!(
            self.bufs < MAX_BUFS,
            "at most {MAX_BUFS} buffers a transfer"
        );
        self.iov[self.bufs] = libc::iovec {
            iov_base: ptr as *mut libc::c_void,
            iov_len: len,
        };
        self.bufs += 1;
        self
    }

    /// Bytes the transfer moves when it is whole.
    pub fn bytes(&self) -> usize {
        self.iovecs().iter().map(|v| v.iov_len).sum()
    }

    pub(crate) fn iovecs(&self) -> &[libc::iovec] {
        &self.iov[..self.bufs]
    }
}

/// A transfer's end: its token and the bytes it moved (fewer than
/// [`IoOp::bytes`] at the end of a file), or why it failed.
#[derive(Debug)]
pub struct Done {
    pub token: u64,
    pub result: io::Result<usize>,
}

/// Positioned transfers, up to [`DiskIo::depth`] in flight.
pub trait DiskIo: Send {
    /// What it is, for logs and reports (`io_uring`, `threads`).
    fn name(&self) -> &'static str;

    /// Transfers in flight at most.
    fn depth(&self) -> usize;

    /// Transfers submitted whose end [`DiskIo::wait`] has not handed back.
    fn in_flight(&self) -> usize;

    /// Starts `op` (fewer than [`DiskIo::depth`] in flight). An `Err` here
    /// means it never started: nothing of it is in flight.
    ///
    /// # Safety
    ///
    /// Every buffer of `op` stays allocated, and is neither read nor
    /// written by anyone else (for a write: not written), until `wait`
    /// hands back the end of `op`'s token.
    unsafe fn submit(&mut self, op: IoOp) -> io::Result<()>;

    /// Waits for one transfer in flight to end, in any order (at least
    /// one is in flight).
    fn wait(&mut self) -> io::Result<Done>;
}

/// io_uring with `depth` transfers in flight, or, where the kernel
/// refuses it, plain positioned I/O on `depth` threads (said once).
pub fn open(depth: usize) -> io::Result<Box<dyn DiskIo>> {
    match UringIo::new(depth) {
        Ok(u) => Ok(Box::new(u)),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    error = %e,
                    "disk tier: no io_uring here; reads and writes use preadv/pwritev on {depth} threads"
                )
            });
            Ok(Box::new(ThreadIo::new(depth)?))
        }
    }
}

/// Waits for every transfer in flight of `io` (so their buffers may go):
/// what a handle does before it lets go of the memory they use.
fn drain(io: &mut dyn DiskIo) {
    while io.in_flight() > 0 {
        if io.wait().is_err() {
            // Nothing more can be learnt of them; leaking is not possible
            // to do safely from here either, so stop asking.
            break;
        }
    }
}
