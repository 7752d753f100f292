//! The client's side of asynchronous jobs: submit, poll (a read of shared
//! memory, no round trip), wait (the futex path, with a deadline) and
//! release.

use super::{server_block, Client};
use crate::error::{Error, Result};
use crate::jobs::{JobId, JobInfo, JobStatus};
use crate::proto::{DelayJobRequest, Opcode};
use crate::wait::{self, Parking, WaitEnd};
use std::time::{Duration, Instant};

/// How often a status poll that reads a non-terminal state also checks that
/// the server is still there (a non-blocking poll of the bootstrap socket).
const ALIVE_CHECK_EVERY: Duration = Duration::from_millis(1);

impl Client {
    /// Starts a delay job (see [`DelayJobRequest`]) and returns its id.
    pub fn submit_delay_job(&mut self, req: &DelayJobRequest) -> Result<JobId> {
        req.validate().map_err(Error::Config)?;
        let reply = self.call(
            Opcode::DelayJob,
            bytemuck::bytes_of(req),
            self.opts.call_timeout,
        )?;
        if reply.len() != std::mem::size_of::<JobId>() {
            return Err(Error::Protocol(format!(
                "job submission answered {} bytes, expected a 16-byte job id",
                reply.len()
            )));
        }
        Ok(bytemuck::pod_read_unaligned(&reply))
    }

    /// The job's status, read from the job table in shared memory: no round
    /// trip, no syscall on a terminal answer. A non-terminal answer is only
    /// as good as the server's life, so at most every millisecond it also
    /// checks the server is still there (`Error::ServerGone` otherwise).
    #[inline]
    pub fn job_status(&self, id: JobId) -> Result<JobStatus> {
        let st = self.seg.mapping.job_reader().status(id)?;
        if !st.is_terminal() {
            self.check_alive()?;
        }
        Ok(st)
    }

    fn check_alive(&self) -> Result<()> {
        let now = Instant::now();
        if now.duration_since(self.alive_checked.get()) >= ALIVE_CHECK_EVERY {
            if self.conn.peer_closed() {
                return Err(Error::ServerGone);
            }
            self.alive_checked.set(now);
        }
        Ok(())
    }

    /// Everything the job table says of a job (kind, owner, progress,
    /// timestamps); `None` for an id this server never issued or whose slot
    /// was reused since.
    pub fn job_info(&self, id: JobId) -> Result<Option<JobInfo>> {
        Ok(self.seg.mapping.job_reader().info(id)?)
    }

    /// Waits until the job is terminal and returns its status. Ends with
    /// `Error::Timeout` at the deadline and `Error::ServerGone` as soon as
    /// the server's end of the connection closes. The server wakes the job's
    /// owner through its doorbell when the job ends; a job of another client
    /// is polled with a backoff up to 1 ms.
    pub fn wait_job(&mut self, id: JobId, deadline: Instant) -> Result<JobStatus> {
        self.touch();
        let reader = self.seg.mapping.job_reader();
        let st = reader.status(id)?;
        if st.is_terminal() {
            return Ok(st);
        }
        let mine = reader
            .info(id)?
            .is_some_and(|i| i.owner_slot == self.slot && i.owner_session == self.session);
        let start = Instant::now();
        let conn = &self.conn;
        let r = if mine {
            let seg = &self.seg;
            let parking = Parking {
                sleeping: &seg.block_rw().client_sleeping,
                doorbell: &server_block(seg, self.slot).client_doorbell,
            };
            wait::wait_until(
                &self.wait,
                parking,
                deadline,
                || match reader.status(id) {
                    Ok(s) if !s.is_terminal() => None,
                    other => Some(other),
                },
                || if conn.peer_closed() { Err(()) } else { Ok(()) },
            )
        } else {
            poll_until(deadline, || match reader.status(id) {
                Ok(s) if !s.is_terminal() => {
                    if conn.peer_closed() {
                        Some(Err(WaitEnd::Dead(())))
                    } else {
                        None
                    }
                }
                other => Some(Ok(other)),
            })
        };
        match r {
            Ok(s) => Ok(s?),
            Err(WaitEnd::Timeout) => Err(Error::Timeout(deadline.saturating_duration_since(start))),
            Err(WaitEnd::Dead(())) => Err(Error::ServerGone),
        }
    }

    /// Releases a finished job: its slot becomes a tombstone (the outcome
    /// stays readable) and may be reused later. Releasing twice is harmless;
    /// releasing an unfinished job fails with `JobNotFinished`.
    pub fn release_job(&mut self, id: JobId) -> Result<()> {
        self.call(
            Opcode::ReleaseJob,
            bytemuck::bytes_of(&id),
            self.opts.call_timeout,
        )?;
        Ok(())
    }
}

/// Polls `f` until it answers or the deadline passes: spins briefly, then
/// sleeps with a backoff up to 1 ms.
fn poll_until<T>(
    deadline: Instant,
    mut f: impl FnMut() -> Option<Result<T, WaitEnd<()>>>,
) -> Result<T, WaitEnd<()>> {
    let mut pause = Duration::from_micros(1);
    loop {
        if let Some(r) = f() {
            return r;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitEnd::Timeout);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}
