//! [`DiskIo`] on io_uring: each transfer one `READV`/`WRITEV` entry,
//! `depth` in flight, ends reaped from the completion queue in the order
//! the disk finishes them.

use super::{DiskIo, Done, IoOp, Way, MAX_BUFS};
use io_uring::{opcode, types, IoUring};
use std::collections::HashMap;
use std::io;

/// An io_uring of `depth` entries and the transfers in it.
pub struct UringIo {
    ring: IoUring,
    depth: usize,
    /// Each transfer in flight's buffer list, by token: the kernel may
    /// read it as late as when the transfer runs (a transfer handed to a
    /// kernel worker), so it lives until the end is reaped.
    iovs: HashMap<u64, Box<[libc::iovec; MAX_BUFS]>>,
}

// SAFETY: the raw pointers in `iovs` point at buffers the submitter keeps
// for the transfer (the contract of `submit`) and at the boxes themselves,
// which move with the ring; nothing here is tied to the thread that made
// it (the ring is a file descriptor and two shared mappings).
unsafe impl Send for UringIo {}

impl UringIo {
    /// A ring for `depth` transfers in flight; an `Err` where the kernel
    /// refuses io_uring.
    pub fn new(depth: usize) -> io::Result<UringIo> {
        let depth = depth.max(1);
        let ring = IoUring::new(depth.next_power_of_two() as u32)?;
        Ok(UringIo {
            ring,
            depth,
            iovs: HashMap::with_capacity(depth),
        })
    }
}

impl DiskIo for UringIo {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.iovs.len()
    }

    unsafe fn submit(&mut self, op: IoOp) -> io::Result<()> {
        assert!(self.iovs.len() < self.depth, "a transfer past the depth");
        assert!(
            !self.iovs.contains_key(&op.token),
            "a token already in flight"
        );
        let iov = Box::new(op.iov);
        let (fd, n) = (types::Fd(op.fd), op.bufs as u32);
        let entry = match op.way {
            Way::Read => opcode::Readv::new(fd, iov.as_ptr(), n)
                .offset(op.off)
                .build(),
            Way::Write => opcode::Writev::new(fd, iov.as_ptr(), n)
                .offset(op.off)
                .build(),
        }
        .user_data(op.token);
        // SAFETY: the entry's buffer list is `iov`, kept in `iovs` until
        // this token's end is reaped; the buffers it names are the
        // caller's to keep as long (this function's contract).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            // The queue has room for `depth` (a power of two at least as
            // large), so this is a ring out of step with its count.
            return Err(io::Error::other("the io_uring submission queue is full"));
        }
        self.iovs.insert(op.token, iov);
        // Once queued it is in flight: an entry the kernel did not take
        // now (EBUSY: ends to reap first; EINTR) is taken by the enter of
        // the next `wait`, and its end comes from there.
        match self.ring.submit() {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EBUSY | libc::EINTR | libc::EAGAIN)
                ) => {}
            Err(e) => {
                tracing::warn!(error = %e, "disk tier: io_uring submit (retried at the next wait)")
            }
        }
        Ok(())
    }

    fn wait(&mut self) -> io::Result<Done> {
        assert!(!self.iovs.is_empty(), "a wait with nothing in flight");
        loop {
            if let Some(cqe) = self.ring.completion().next() {
                let token = cqe.user_data();
                self.iovs.remove(&token);
                let r = cqe.result();
                let result = if r < 0 {
                    Err(io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                };
                return Ok(Done { token, result });
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        super::drain(self);
    }
}
