//! [`DiskIo`] without io_uring: `preadv`/`pwritev` on `depth` threads of
//! its own, so that as many transfers are in flight as on a ring.

use super::{DiskIo, Done, IoOp, Way};
use std::io;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A transfer handed to a worker.
struct Job(IoOp);

// SAFETY: the pointers in the transfer name buffers its submitter keeps,
// untouched by anyone else, until the end comes back (the contract of
// `DiskIo::submit`): the one worker that takes the job is their only user
// meanwhile.
unsafe impl Send for Job {}

/// `depth` workers, a queue of transfers to them and one of ends back.
pub struct ThreadIo {
    depth: usize,
    in_flight: usize,
    jobs: Option<Sender<Job>>,
    ends: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadIo {
    /// `depth` workers (`kvring-disk-io`).
    pub fn new(depth: usize) -> io::Result<ThreadIo> {
        let depth = depth.max(1);
        let (jobs, queue) = mpsc::channel::<Job>();
        let (done, ends) = mpsc::channel();
        let queue = Arc::new(Mutex::new(queue));
        let mut io = ThreadIo {
            depth,
            in_flight: 0,
            jobs: Some(jobs),
            ends,
            workers: Vec::with_capacity(depth),
        };
        for _ in 0..depth {
            let (queue, done) = (queue.clone(), done.clone());
            let w = std::thread::Builder::new()
                .name("kvring-disk-io".into())
                .spawn(move || work(&queue, &done))?;
            io.workers.push(w);
        }
        Ok(io)
    }
}

/// A worker: one transfer at a time until the queue closes.
fn work(queue: &Mutex<Receiver<Job>>, done: &Sender<Done>) {
    loop {
        let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(Job(op)) = job else { return };
        let result = transfer(&op);
        if done
            .send(Done {
                token: op.token,
                result,
            })
            .is_err()
        {
            return;
        }
    }
}

/// One `preadv`/`pwritev` call (retried when interrupted): the bytes it
/// moved.
fn transfer(op: &IoOp) -> io::Result<usize> {
    let iov = op.iovecs();
    loop {
        // SAFETY: `iov` names buffers the submitter keeps for this
        // transfer alone (see `Job`), `iov.len()` entries long.
        let n = unsafe {
            match op.way {
                Way::Read => libc::preadv(op.fd, iov.as_ptr(), iov.len() as i32, op.off as i64),
                Way::Write => libc::pwritev(op.fd, iov.as_ptr(), iov.len() as i32, op.off as i64),
            }
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl DiskIo for ThreadIo {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn submit(&mut self, op: IoOp) -> io::Result<()> {
        assert!(self.in_flight < self.depth, "a transfer past the depth");
        let jobs = self.jobs.as_ref().expect("open until dropped");
        jobs.send(Job(op))
            .map_err(|_| io::Error::other("the disk I/O threads are gone"))?;
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self) -> io::Result<Done> {
        assert!(self.in_flight > 0, "a wait with nothing in flight");
        let d = self
            .ends
            .recv()
            .map_err(|_| io::Error::other("the disk I/O threads are gone"))?;
        self.in_flight -= 1;
        Ok(d)
    }
}

impl Drop for ThreadIo {
    fn drop(&mut self) {
        super::drain(self);
        // Closing the queue ends each worker after its transfer.
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
